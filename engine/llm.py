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
from engine.sampler import check_sampling_params
from common.sampling_params import SamplingParams
from engine.structured_outputs import validate as validate_structured
from models.config import ModelConfig, check_parallel_layout

log = logging.getLogger(__name__)


def load_front_end(args: EngineArgs) -> tuple[ModelConfig, InputProcessor, OutputProcessor]:
    """Config, tokenizer and the front-end processors (the engine core is built separately)."""
    cfg = ModelConfig.from_pretrained(args.model, args.hf_overrides, args.quantization)
    check_parallel_layout(cfg, args.tensor_parallel_size, args.decode_context_parallel_size,
                          args.enable_expert_parallel, args.data_parallel_size)
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

    def start_profile(self) -> None:
        """Start every rank's profiler (needs profiler_config; engine/profiler.py), as vLLM's LLM."""
        self.engine.profile.start()

    def stop_profile(self) -> list[str]:
        """Stop it; returns the traces written."""
        return self.engine.profile.stop()

    def reset_prefix_cache(self) -> int:
        """Forget the prefix cache's blocks (vLLM's LLM.reset_prefix_cache); returns how many."""
        return self.engine.reset_prefix_cache()

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
        for sp in {id(sp): sp for sp in params}.values():
            check_sampling_params(sp)  # the engine core's own check, before anything is submitted
            self.engine.scheduler.check_priority(sp)
            if sp.structured_outputs is not None:
                validate_structured(sp.structured_outputs, "structured_outputs")
        order = [str(next(self._ids)) for _ in checked]
        # The requests join the engine as it runs: before each step enough of them wait that the
        # scheduler, which admits at most max_num_seqs in a step and in arrival order, makes the
        # choices it would with all of them queued; the rest are added between steps, while the
        # GPU runs the step just launched, instead of all before the first step.
        # Under the priority policy every request is queued before the first step, so that a
        # late prompt of a high priority is not held back behind the feed.
        feed = iter(zip(order, checked))
        keep = (len(order) if self.args.scheduling_policy == "priority" else
                self.args.max_num_seqs * self.args.data_parallel_size)  # each DP rank admits max_num_seqs
        waiting = self.engine.scheduler.waiting
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), desc="Generating", disable=not use_tqdm)
        while len(done) < len(order):
            while len(waiting) < keep:
                item = next(feed, None)
                if item is None:
                    break
                rid, (text, ids, sp) = item
                for cid, cp in self.outputs.add_request(rid, text, ids, sp):
                    self.engine.add_request(cid, ids, cp)
            results, to_abort = self.outputs.process(self.engine.step())
            if to_abort:
                self.engine.abort_requests(to_abort)
            for r in results:
                if r.finished:
                    done[r.request_id] = r
                    bar.update(1)
        bar.close()
        return [done[rid] for rid in order]
