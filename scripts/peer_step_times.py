"""Where peer_bench's TPOT goes, step by step: its method (t1 = generate(max_tokens=1),
t2 = generate(max_tokens=1+S) on other fresh prompts, TPOT = (t2 - t1) / S) with the wall time of
every engine step of both runs recorded, so that what (t2 - t1) / S holds beyond the steady
decode step (the first steps after the prefill, the drain, the runs' fixed costs) is visible.

    python scripts/peer_step_times.py [--batches 8 128] [--steps 100] [--load-format dummy]
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench_common import V2_LITE, random_prompts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=V2_LITE)
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--batches", type=int, nargs="+", default=[8, 128])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--kernels", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    a = p.parse_args()
    from engine import LLM, SamplingParams
    llm = LLM(model=a.model, load_format=a.load_format, dtype="bfloat16", max_model_len=a.max_model_len,
              max_num_batched_tokens=8192, max_num_seqs=256, gpu_memory_utilization=0.9,
              enable_prefix_caching=False, skip_tokenizer_init=True, kernels=a.kernels)
    core = llm.engine
    stamps: list[tuple[float, int, int]] = []  # (end time, tokens scheduled, outputs)
    real_step = core.step

    def step():
        out = real_step()
        stamps.append((time.perf_counter(), core.step_tokens, len(out)))
        return out
    core.step = step
    vocab = core.cfg.vocab_size

    def run(ps, n_out):
        stamps.clear()
        t0 = time.perf_counter()
        llm.generate(ps, SamplingParams(temperature=0, max_tokens=n_out, ignore_eos=True))
        t = time.perf_counter() - t0
        gaps = [(s[0] - (stamps[i - 1][0] if i else t0)) * 1e3 for i, s in enumerate(stamps)]
        return t, gaps, list(stamps)

    run(random_prompts(8, 1000, vocab, 999), 16)
    seed = 0
    for b in a.batches:
        for rep in range(2):
            seed += 2
            t1, g1, s1 = run(random_prompts(b, 1000, vocab, seed), 1)
            t2, g2, s2 = run(random_prompts(b, 1000, vocab, seed + 1), 1 + a.steps)
            tpot = (t2 - t1) / a.steps * 1e3
            mid = statistics.median(g2[len(g2) // 3: 2 * len(g2) // 3])
            print(f"batch {b} rep {rep}: TPOT (peer) {tpot:.3f} ms; steady step {mid:.3f} ms; "
                  f"t1 {t1 * 1e3:.1f} ms in {len(g1)} steps, t2 {t2 * 1e3:.1f} ms in {len(g2)} steps")
            print("  t1 steps (ms, tokens, outputs): " + ", ".join(
                f"{g:.2f}/{s[1]}/{s[2]}" for g, s in zip(g1, s1)))
            print("  t2 first 8: " + ", ".join(f"{g:.2f}/{s[1]}/{s[2]}" for g, s in zip(g2[:8], s2[:8])))
            print("  t2 last 5: " + ", ".join(f"{g:.2f}/{s[1]}/{s[2]}" for g, s in zip(g2[-5:], s2[-5:])))
            excess = t2 * 1e3 - t1 * 1e3 - a.steps * mid
            print(f"  (t2 - t1) - steps x steady = {excess:.1f} ms ({excess / a.steps:.3f} ms a token); "
                  f"t2 after its last step {(t2 - (s2[-1][0] - s2[0][0]) - g2[0] / 1e3) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
