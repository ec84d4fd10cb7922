"""CPU cost of the front end's per-step output work at a fixed batch, against output length.

Feeds the OutputProcessor one decode step at a time for `--num-requests` requests (one new token
each, with logprobs if asked), with the engine-core wire format in between (encode, pickle,
unpickle, decode: what crosses the process boundary each step), and prints the mean time per
step over windows of steps. With outputs as deltas our work per step stays flat as the outputs
grow. With --logprobs the front end keeps every TokenLogprobs of a request until it finishes, and
Python's cyclic garbage collector walks those live objects: its passes take longer as they pile
up (--no-gc shows the figures without it).

    python scripts/bench_output_processing.py                      # 256 requests, 2000 steps, no tokenizer
    python scripts/bench_output_processing.py --tokenizer          # with the tiny model's detokenizer
    python scripts/bench_output_processing.py --logprobs 5
"""

from __future__ import annotations

import argparse
import gc
import pickle
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.args import DEFAULT_MODEL  # noqa: E402
from engine.core_proc import decode_outputs, encode_outputs  # noqa: E402
from engine.output_processor import OutputProcessor  # noqa: E402
from common.sampling_params import SamplingParams  # noqa: E402
from scheduler.outputs import EngineCoreOutput, TokenLogprobs  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--steps", type=int, default=2000, help="decode steps (= output tokens per request)")
    p.add_argument("--window", type=int, default=100, help="steps per reported mean")
    p.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token")
    p.add_argument("--tokenizer", action="store_true", help="detokenize with the tiny model's tokenizer")
    p.add_argument("--no-gc", action="store_true", help="turn the cyclic garbage collector off")
    a = p.parse_args()
    if a.no_gc:
        gc.disable()

    tok = None
    if a.tokenizer:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    vocab = len(tok) if tok is not None else 32000
    proc = OutputProcessor(tok)
    params = SamplingParams(max_tokens=a.steps, ignore_eos=True, logprobs=a.logprobs)
    rng = random.Random(0)
    ids = []
    for r in range(a.num_requests):
        for cid, _ in proc.add_request(str(r), None, [rng.randrange(5, vocab) for _ in range(64)], params):
            ids.append(cid)
    tokens = [rng.randrange(5, vocab) for _ in range(4096)]
    windows, t_win, t_wire = [], 0.0, 0.0
    for step in range(a.steps):
        last = step == a.steps - 1
        outs = []
        for k, cid in enumerate(ids):
            t = tokens[(step * 31 + k) % len(tokens)]
            lp = [TokenLogprobs(t, -0.5, 1, [(t, -0.5)] * a.logprobs)] if a.logprobs else []
            outs.append(EngineCoreOutput(cid, [t], lp, finish_reason="length" if last else None))
        t0 = time.perf_counter()
        wire = pickle.dumps(("outputs", (encode_outputs(outs), None)), protocol=pickle.HIGHEST_PROTOCOL)
        received = decode_outputs(pickle.loads(wire)[1][0])
        t1 = time.perf_counter()
        results, _ = proc.process(received)
        t2 = time.perf_counter()
        assert len(results) == a.num_requests
        t_wire += t1 - t0
        t_win += t2 - t1
        if (step + 1) % a.window == 0:
            windows.append((step + 1 - a.window, step + 1, t_wire / a.window, t_win / a.window, len(wire)))
            t_win = t_wire = 0.0
    assert all(len(r.outputs[0].token_ids) == a.steps for r in results)
    print(f"{a.num_requests} requests, 1 token per step, logprobs={a.logprobs}, "
          f"tokenizer={'tiny' if tok is not None else 'none'}")
    print(f"{'steps':>12} {'wire ms/step':>13} {'process ms/step':>16} {'message bytes':>14}")
    for lo, hi, w, pr, nbytes in windows:
        print(f"{lo:>5}-{hi:<6} {w * 1e3:>13.3f} {pr * 1e3:>16.3f} {nbytes:>14}")


if __name__ == "__main__":
    main()
