"""Multi-process executor: one spawned worker process per rank, torch.distributed between them.

The engine sends each step's SchedulerOutput to every rank over a pipe (pickled plain
dataclasses); every rank runs the step (collectives inside the model keep them in lockstep) and
rank 0 sends back the ModelRunnerOutput. A worker that dies or raises fails the engine at once
with its error instead of hanging.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import traceback

import torch

from engine.args import EngineArgs
from models.config import ModelConfig
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput

log = logging.getLogger(__name__)

_POLL_S = 1.0


class WorkerDiedError(RuntimeError):
    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, args: EngineArgs, cfg: ModelConfig, eos_token_ids: list[int],
                 init_method: str, conn) -> None:
    """Entry point of one rank's process."""
    logging.basicConfig(level=logging.getLogger().level or logging.INFO,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    try:
        import torch.distributed as dist

        from engine import distributed as pd
        from engine.worker import Worker, resolve_device

        device = resolve_device(args, rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.tensor_parallel_size))
        pd.init_parallel(args.tensor_parallel_size, args.decode_context_parallel_size, rank,
                         init_method, backend)
        worker = Worker(args, cfg, local_rank=rank)
        n = torch.tensor([worker.determine_num_blocks(args.max_num_batched_tokens)])
        dist.all_reduce(n, op=dist.ReduceOp.MIN, group=pd.cpu_group())  # every rank the same pool
        worker.init_kv_cache(int(n), eos_token_ids)
        conn.send(("ready", int(n)))
        while True:
            msg = conn.recv()
            if msg is None:
                break
            out = worker.runner.execute(msg)
            conn.send(("out", out if rank == 0 else None))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException as e:  # noqa: BLE001 - report any failure to the engine
        try:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:  # noqa: BLE001
            pass
    finally:
        from engine import distributed as pd
        pd.destroy_parallel()


class MultiProcExecutor:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, eos_token_ids: list[int]):
        n = args.tensor_parallel_size
        if args.device != "cpu" and torch.cuda.is_available() and torch.cuda.device_count() < n:
            raise ValueError(f"--tensor-parallel-size {n} needs {n} GPUs, found {torch.cuda.device_count()}")
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.conns, self.procs = [], []
        for rank in range(n):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"worker-{rank}", daemon=True,
                            args=(rank, args, cfg, eos_token_ids, init_method, child))
            p.start()
            child.close()
            self.conns.append(parent)
            self.procs.append(p)
        blocks = [self._recv(r, "ready") for r in range(n)]
        self.num_blocks = blocks[0]
        log.info("started %d worker processes (tp %d, dcp %d)", n, n, args.decode_context_parallel_size)

    def _recv(self, rank: int, kind: str):
        conn, proc = self.conns[rank], self.procs[rank]
        while not conn.poll(_POLL_S):
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs) if not p.is_alive()]
            if dead:
                self.shutdown()
                raise WorkerDiedError(f"worker process died: {', '.join(dead)}")
        try:
            tag, payload = conn.recv()
        except EOFError:
            self.shutdown()
            raise WorkerDiedError(f"worker rank {rank} closed its pipe (exit code {proc.exitcode})") from None
        if tag == "error":
            self.shutdown()
            raise WorkerDiedError(f"worker failed: {payload}")
        assert tag == kind, (tag, kind)
        return payload

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        for conn in self.conns:
            conn.send(so)
        outs = [self._recv(r, "out") for r in range(len(self.conns))]
        return outs[0]

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
        self.conns, self.procs = [], []
