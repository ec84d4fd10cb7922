"""Executors: run each step's SchedulerOutput on every rank and return rank 0's output."""

from __future__ import annotations

import logging

from common.args import EngineArgs
from engine.profiler import RankProfiler
from engine.worker import Worker
from models.config import ModelConfig
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)


class UniProcExecutor:
    """One rank, in the engine's own process."""

    def __init__(self, args: EngineArgs, cfg: ModelConfig, eos_token_ids: list[int]):
        self.worker = Worker(args, cfg)
        self.num_blocks = self.worker.determine_num_blocks(args.max_num_batched_tokens)
        self.worker.init_kv_cache(self.num_blocks, eos_token_ids, args.resolve_max_model_len(cfg))
        self.graph_sizes = self.worker.graph_sizes()
        cfg = args.profiler_config
        self.profiler = None if cfg is None else RankProfiler(cfg, 0, self.worker.device)

    def profile(self, action: str) -> list[str | None]:
        """Start or stop the rank's profiler (engine/profiler.py); a stop returns its trace."""
        return [self.profiler.apply(action)]

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.runner.execute(so)

    # Async scheduling: launch a step without waiting, finish it after the next one is launched.
    def launch(self, so: SchedulerOutput):
        return self.worker.runner.launch(so)

    def finish(self, pending) -> ModelRunnerOutput:
        return self.worker.runner.finish(pending)

    def shutdown(self) -> None:
        pass


def make_executor(args: EngineArgs, cfg: ModelConfig, eos_token_ids: list[int]):
    if args.data_parallel_size > 1:
        from engine.multiproc import DataParallelExecutor
        return DataParallelExecutor(args, cfg, eos_token_ids)
    if args.tensor_parallel_size == 1:
        return UniProcExecutor(args, cfg, eos_token_ids)
    from engine.multiproc import MultiProcExecutor
    return MultiProcExecutor(args, cfg, eos_token_ids)
