"""Host time of one decode step without the model: schedule, inputs and metadata, sampling glue,
stop checks. What async scheduling can hide behind the GPU, at most, per step.

The real Scheduler and ModelRunner run on the CPU with a stub model (zero hidden states, zero
logits over a 64-token vocabulary, so that the sampler's tensor math, which runs on the GPU in
real use, costs next to nothing here), for B requests decoding after 1000-token prompts. The
model's own launch cost (a CUDA-graph replay, or eager kernels) is not in it.

    python scripts/bench_host_step.py [--batch-sizes 1 8 32 128 256] [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from engine.model_runner import ModelRunner  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from models.config import ModelConfig  # noqa: E402
from scheduler.config import SchedulerConfig  # noqa: E402
from scheduler.request import Request  # noqa: E402
from scheduler.scheduler import Scheduler  # noqa: E402


class StubModel:
    """Stands in for DeepseekForCausalLM: instant, shape-correct outputs."""

    def __init__(self, vocab: int):
        self.vocab = vocab

    def __call__(self, input_ids, positions, kv_caches, meta):
        return torch.zeros(input_ids.shape[0], 8)

    def compute_logits(self, hidden):
        return torch.zeros(hidden.shape[0], self.vocab)


def time_steps(batch: int, steps: int, prompt_len: int, cfg: ModelConfig) -> float:
    """Mean seconds per decode step (schedule -> launch -> finish -> update) at `batch`."""
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=8192, max_num_seqs=256, max_model_len=4096,
                                      block_size=16, num_blocks=batch * ((prompt_len + steps) // 16 + 4)))
    runner = ModelRunner(StubModel(64), cfg, [], 16, torch.device("cpu"), [])
    g = torch.Generator().manual_seed(0)
    for i in range(batch):
        ids = torch.randint(2, 64, (prompt_len,), generator=g).tolist()
        sched.add_request(Request(str(i), ids, SamplingParams(temperature=0, max_tokens=steps + 50,
                                                              ignore_eos=True), None))
    while any(r.num_output_tokens == 0 for r in sched.requests.values()):  # prefills
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    start = time.perf_counter()
    for _ in range(steps):
        so = sched.schedule()
        sched.update_from_output(so, runner.execute(so))
    return (time.perf_counter() - start) / steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--steps", type=int, default=200, help="timed decode steps per batch size")
    p.add_argument("--prompt-len", type=int, default=1000)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = ModelConfig.from_pretrained("configs/models/DeepSeek-V2-Lite")
    print("| batch | host µs per decode step |\n|---|---|")
    for b in a.batch_sizes:
        print(f"| {b} | {time_steps(b, a.steps, a.prompt_len, cfg) * 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
