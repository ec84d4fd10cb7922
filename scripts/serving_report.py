"""bench_serving.py's results: per-request latencies summarized (mean, p50, p99), a text table per
load level, a sweep plot, strict JSON."""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("bench_serving")

STAT_KEYS = ("ttft", "tpot", "itl", "e2e")


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks; None when empty."""
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats_ms(values: list[float]) -> dict:
    if not values:
        return {"mean_ms": None, "p50_ms": None, "p99_ms": None}
    return {"mean_ms": 1e3 * sum(values) / len(values), "p50_ms": 1e3 * percentile(values, 50),
            "p99_ms": 1e3 * percentile(values, 99)}


def summarize(results: list, duration_s: float, output_len: int) -> dict:
    """Throughputs and mean/p50/p99 of TTFT, TPOT, ITL and e2e (ms) over the successful requests."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    per = {"ttft": [r.ttft for r in ok], "e2e": [r.e2e for r in ok],
           "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
           "itl": [g for r in ok for g in r.itl]}
    errors = sorted({r.error for r in results if not r.ok})
    return {"completed": len(ok), "failed": len(results) - len(ok),
            "wrong_output_len": sum(r.output_tokens != output_len for r in ok),
            "duration_s": duration_s, "request_throughput": len(ok) / duration_s,
            "output_throughput": out_tokens / duration_s,
            "total_token_throughput": (out_tokens + sum(r.prompt_tokens for r in ok)) / duration_s,
            "total_output_tokens": out_tokens,
            **{k: _stats_ms(per[k]) for k in STAT_KEYS}, "errors": errors[:5]}


def _cell(v: float | None, fmt: str = ".1f") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[dict]) -> str:
    """A fixed-width text table, one row per load level."""
    head = ["load", "ok", "fail", "req/s", "out tok/s"] + [
        f"{k.upper()} {s}" for k in STAT_KEYS for s in ("mean", "p50", "p99")]
    lines = [head]
    for r in rows:
        s = r["summary"]
        lines.append([r["load"], str(s["completed"]), str(s["failed"]),
                      _cell(s["request_throughput"], ".2f"), _cell(s["output_throughput"])] +
                     [_cell(s[k][f"{st}_ms"]) for k in STAT_KEYS for st in ("mean", "p50", "p99")])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
    return "\n".join([out[0], "-" * len(out[0])] + out[1:] + ["(latencies in ms)"])


def plot(rows: list[dict], xlabel: str, path: str) -> bool:
    """Latency (TTFT p50/p99, TPOT p50) and output throughput vs load as a PNG; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logger.warning("matplotlib is not importable: no plot written (pip install matplotlib)")
        return False
    xs = [r["x"] for r in rows]
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for key, st, style in (("ttft", "p50", "o-"), ("ttft", "p99", "o--"), ("tpot", "p50", "s-")):
        ys = [r["summary"][key][f"{st}_ms"] for r in rows]
        ax.plot(xs, [math.nan if y is None else y for y in ys], style, label=f"{key.upper()} {st}")
    ax2.plot(xs, [r["summary"]["output_throughput"] for r in rows], "o-")
    for a_, ylabel in ((ax, "latency (ms)"), (ax2, "output tokens/s")):
        if all(math.isfinite(x) and x > 0 for x in xs) and max(xs) / min(xs) >= 8:
            a_.set_xscale("log", base=2)
        a_.set_xlabel(xlabel)
        a_.set_ylabel(ylabel)
        a_.grid(True, alpha=0.3)
    ax.set_yscale("log")
    ax.legend()
    fig.suptitle(rows[0]["title"])
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def finite_json(obj):
    """A copy with inf/nan floats as strings, so that the file is strict JSON."""
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj
