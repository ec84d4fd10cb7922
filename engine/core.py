"""Engine core: the step loop, `schedule -> execute -> update`, over token ids only."""

from __future__ import annotations

import logging

from engine.args import EngineArgs
from engine.executor import make_executor
from engine.sampling_params import SamplingParams
from models.config import ModelConfig
from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineCoreOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, eos_token_id: int | None):
        self.args, self.cfg = args, cfg
        self.eos_token_id = eos_token_id
        self.max_model_len = args.resolve_max_model_len(cfg)
        self.executor = make_executor(args, cfg, [] if eos_token_id is None else [eos_token_id])
        num_blocks = self.executor.num_blocks
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, block_size=args.block_size, num_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            dcp_size=args.decode_context_parallel_size))
        log.info("KV cache: %d blocks of %d tokens%s: capacity %d tokens",
                 num_blocks, args.block_size,
                 f" x dcp {args.decode_context_parallel_size}" if args.decode_context_parallel_size > 1 else "",
                 self.scheduler.config.capacity_tokens)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(Request(request_id, prompt_token_ids, params, self.eos_token_id))

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> list[EngineCoreOutput]:
        so = self.scheduler.schedule()
        out = self.executor.execute(so)
        return self.scheduler.update_from_output(so, out)

    def shutdown(self) -> None:
        self.executor.shutdown()
