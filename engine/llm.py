"""Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

from __future__ import annotations

import itertools
import logging

from tqdm import tqdm

from common.args import EngineArgs
from engine.core import EngineCore
from engine.input_processor import InputProcessor, load_tokenizer
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from common.sampling_params import SamplingParams
from engine.structured_outputs import validate as validate_structured
from models.config import ModelConfig, check_parallel_layout

log = logging.getLogger(__name__)


def load_front_end(args: EngineArgs) -> tuple[ModelConfig, InputProcessor, OutputProcessor]:
    """Config, tokenizer and the front-end processors (the engine core is built separately)."""
    cfg = ModelConfig.from_pretrained(args.model, args.hf_overrides)
    check_parallel_layout(cfg, args.tensor_parallel_size, args.decode_context_parallel_size)
    tokenizer = None if args.skip_tokenizer_init else \
        load_tokenizer(args.tokenizer_path, required=args.load_format != "dummy")
    return cfg, InputProcessor(tokenizer, cfg, 0), OutputProcessor(tokenizer)


def build_engine(args: EngineArgs) -> tuple[EngineCore, InputProcessor, OutputProcessor]:
    """Front-end processors and an engine core in this process (the offline LLM)."""
    cfg, inputs, outputs = load_front_end(args)
    core = EngineCore(args, cfg, inputs.eos_token_id)
    inputs.max_model_len = core.max_model_len
    inputs.capacity_tokens = core.scheduler.config.capacity_tokens
    return core, inputs, outputs


class LLM:
    def __init__(self, model: str | None = None, **kwargs):
        args = EngineArgs(**({"model": model} if model else {}), **kwargs)
        self.args = args
        self.engine, self.inputs, self.outputs = build_engine(args)
        self.tokenizer = self.outputs.tokenizer
        self._ids = itertools.count()

    @property
    def scheduler(self):
        return self.engine.scheduler

    def generate(self, prompts: str | list[int] | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts (strings or token-id lists) to completion; outputs in prompt order.

        Every prompt is validated before any is submitted, so a bad one raises ValueError and
        leaves the engine untouched.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling params for {len(prompts)} prompts")
        checked = [self.inputs.process(p, sp) for p, sp in zip(prompts, params)]
        for sp in {id(sp): sp for sp in params if sp.structured_outputs is not None}.values():
            validate_structured(sp.structured_outputs, "structured_outputs")
        order = []
        for text, ids, sp in checked:
            rid = str(next(self._ids))
            order.append(rid)
            for cid, cp in self.outputs.add_request(rid, text, ids, sp):
                self.engine.add_request(cid, ids, cp)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        while len(done) < len(order):
            results, to_abort = self.outputs.process(self.engine.step())
            if to_abort:
                self.engine.abort_requests(to_abort)
            for r in results:
                if r.finished:
                    done[r.request_id] = r
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in order]
