"""Cost of shipping one step's SchedulerOutput to every rank (pipe to rank 0 + gloo broadcast).

    python scripts/bench_control_plane.py --ranks 2 --requests 256
"""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from scheduler.outputs import CachedRequestData, SchedulerOutput  # noqa: E402


def make_output(n: int) -> SchedulerOutput:
    cached = [CachedRequestData(f"req-{i}", [i], 1000 + i) for i in range(n)]
    return SchedulerOutput([], cached, {c.req_id: 1 for c in cached}, n, set())


def _rank(rank: int, world: int, port: int, iters: int, n: int, conn) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    box = [None]
    for i in range(iters + 10):
        if rank == 0:
            box[0] = conn.recv()
        dist.broadcast_object_list(box, src=0)
        if rank == 0:
            conn.send(1)
    dist.destroy_process_group()


def _pipe_rank(conn, iters: int) -> None:
    for _ in range(iters + 10):
        pickle.loads(conn.recv_bytes())
        conn.send_bytes(b"1")


def pipes(so, ranks: int, iters: int) -> float:
    """Alternative: the engine pickles once and writes the bytes to one pipe per rank."""
    ctx = mp.get_context("spawn")
    ends = [ctx.Pipe() for _ in range(ranks)]
    procs = [ctx.Process(target=_pipe_rank, args=(c, iters)) for _, c in ends]
    for pr in procs:
        pr.start()
    t0 = 0.0
    for i in range(iters + 10):
        if i == 10:
            t0 = time.perf_counter()
        data = pickle.dumps(so)
        for e, _ in ends:
            e.send_bytes(data)
        for e, _ in ends:
            e.recv_bytes()
    dt = (time.perf_counter() - t0) / iters
    for pr in procs:
        pr.join()
    return dt


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--iters", type=int, default=300)
    a = p.parse_args()
    so = make_output(a.requests)
    print(f"SchedulerOutput with {a.requests} decodes: {len(pickle.dumps(so))} bytes pickled")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    port = 29000 + os.getpid() % 1000
    procs = [ctx.Process(target=_rank, args=(r, a.ranks, port, a.iters, a.requests, child if r == 0 else None))
             for r in range(a.ranks)]
    for pr in procs:
        pr.start()
    for _ in range(10):
        parent.send(so)
        parent.recv()
    t0 = time.perf_counter()
    for _ in range(a.iters):
        parent.send(so)
        parent.recv()
    dt = (time.perf_counter() - t0) / a.iters
    for pr in procs:
        pr.join()
    print(f"engine -> rank 0 pipe -> gloo broadcast to {a.ranks} ranks -> ack: {dt * 1e6:.0f} us per step")
    print(f"engine -> one pipe per rank (pickled once) -> acks: {pipes(so, a.ranks, a.iters) * 1e6:.0f} us per step")


if __name__ == "__main__":
    main()
