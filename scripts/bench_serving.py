"""Online serving benchmark: load a running `serve` over its OpenAI completions API.

Random prompts of --input-len token ids (sent as id lists: no tokenizer needed here), --output-len
tokens each with ignore_eos, every request streamed. Per request: TTFT (send -> first chunk with a
choice), ITL (gaps between such chunks), TPOT ((e2e - TTFT) / (output tokens - 1)), e2e latency.
Load is Poisson arrivals at --request-rate (inf: all at once), capped by --max-concurrency.

    serve &                                             # the bundled tiny model on 127.0.0.1:8000
    python scripts/bench_serving.py --num-prompts 200 --input-len 1000 --output-len 100 --max-concurrency 16
    python scripts/bench_serving.py --sweep-concurrency 1 4 16 64 --json sweep.json   # + sweep.png
    python scripts/bench_serving.py --sweep-rate 1 2 4 8 --plot rates.png

Each sweep level uses fresh random prompts, so that prefix caching never sees a repeat. A chunk
can carry more than one token (the server holds back text that may still become a stop string or
an incomplete character), so ITL is per chunk, as in vLLM's benchmark; TPOT uses the server's
token count from the final usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import logging
import math
import os
import random
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from bench_common import environment, random_prompts, write_json

logger = logging.getLogger("bench_serving")

STAT_KEYS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    """Timings of one streamed request, in seconds; `error` is set when it failed."""

    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class Target:
    """Where and what to send: completions URL, headers, model name and request shape."""

    url: str
    headers: dict
    model: str
    output_len: int
    temperature: float
    timeout_s: float


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


def summarize(results: list[RequestResult], duration_s: float, output_len: int) -> dict:
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


def request_body(t: Target, prompt: list[int]) -> bytes:
    """The JSON body of one streamed completion of `prompt`."""
    return json.dumps({"model": t.model, "prompt": prompt, "max_tokens": t.output_len, "ignore_eos": True,
                       "temperature": t.temperature, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()


async def send_one(client: httpx.AsyncClient, t: Target, prompt: list[int] | bytes) -> RequestResult:
    """Stream one completion (of a prompt, or a request_body made beforehand) and time its
    chunks; never raises (failures go into `error`)."""
    res = RequestResult()
    payload = prompt if isinstance(prompt, bytes) else request_body(t, prompt)
    start = time.perf_counter()
    try:
        await asyncio.wait_for(_stream(client, t, payload, start, res), t.timeout_s)
    except asyncio.TimeoutError:
        res.error = f"timed out after {t.timeout_s} s (--request-timeout)"
    except (httpx.HTTPError, OSError, ValueError) as e:  # ValueError: a malformed SSE line
        res.error = f"{type(e).__name__}: {e}"
    if res.ok and res.ttft == 0.0:
        res.error = "stream ended without a token chunk"
    return res


async def _stream(client: httpx.AsyncClient, t: Target, payload: bytes, start: float,
                  res: RequestResult) -> None:
    last = start
    headers = {**t.headers, "Content-Type": "application/json"}
    async with client.stream("POST", t.url, content=payload, headers=headers) as r:
        if r.status_code != 200:
            body = (await r.aread()).decode(errors="replace")[:300]
            res.error = f"HTTP {r.status_code}: {body}"
            return
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue  # blank separators, comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                res.error = f"in-stream error: {chunk['error'].get('message')}"
                return
            now = time.perf_counter()
            if chunk.get("choices"):
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
            if chunk.get("usage"):
                res.output_tokens = chunk["usage"]["completion_tokens"]
                res.prompt_tokens = chunk["usage"]["prompt_tokens"]
    res.e2e = time.perf_counter() - start


class ClientShards:
    """Several httpx clients that share the requests out (request i goes to client i % n).

    httpx's connection pool looks at each of its connections for every request it places or
    finishes, so one pool serving N requests at once does O(N^2) work: 1000 streamed requests
    against a trivial server spent 2.6 of 7.6 s under cProfile in the pool's placement, and
    2.5-2.9 s of client CPU unprofiled against 2.1-2.5 s with the requests over 8 to 1000
    clients (2-core CPU). The clients share one SSL context (making one per client costs
    ~27 ms)."""

    def __init__(self, n: int, limits: httpx.Limits, timeout: httpx.Timeout):
        ctx = ssl.create_default_context()
        # trust_env=False: no proxy from the environment may sit between us and a loopback server
        self.clients = [httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False, verify=ctx)
                        for _ in range(max(1, n))]

    def __getitem__(self, i: int) -> httpx.AsyncClient:
        return self.clients[i % len(self.clients)]

    async def __aenter__(self) -> ClientShards:
        return self

    async def __aexit__(self, *exc) -> None:
        for c in self.clients:
            await c.aclose()


def shard_count(num_requests: int, per_shard: int = 32) -> int:
    """Clients for `num_requests` in flight at once: about `per_shard` requests each."""
    return max(1, -(-num_requests // per_shard))


async def run_load(clients: ClientShards | httpx.AsyncClient, t: Target, prompts: list[list[int]],
                   rate: float, concurrency: int | None, seed: int) -> tuple[list[RequestResult], float]:
    """Send every prompt (Poisson arrivals at `rate`, at most `concurrency` in flight); prompt i
    goes through clients[i] (ClientShards) or the one client given.

    The request bodies are encoded before the clock starts. At rate inf each request is started
    in a loop turn of its own, so that it goes out while the next ones are being made: started
    all in one turn, none would reach the server before the client had done the setup work of
    every one of them (1000 requests: ~1 s of client CPU before the first byte on a 2-core CPU)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    pick = clients.__getitem__ if isinstance(clients, ClientShards) else (lambda i: clients)
    bodies = [request_body(t, p) for p in prompts]

    async def one(i: int, body: bytes) -> RequestResult:
        if gate is None:
            return await send_one(pick(i), t, body)
        async with gate:
            return await send_one(pick(i), t, body)

    t0 = time.perf_counter()
    tasks = []
    for i, body in enumerate(bodies):
        tasks.append(asyncio.create_task(one(i, body)))
        if math.isfinite(rate) and i + 1 < len(prompts):
            await asyncio.sleep(rng.expovariate(rate))
        else:
            await asyncio.sleep(0)
    results = await asyncio.gather(*tasks)
    return list(results), time.perf_counter() - t0


def is_loopback(base_url: str) -> bool:
    """True when the URL's host is localhost or a loopback address."""
    host = urlsplit(base_url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def discover(client: httpx.AsyncClient, base_url: str, headers: dict) -> dict:
    """The served model card from GET /v1/models, with vocab_size from /tokenizer_info if absent."""
    r = await client.get(f"{base_url}/models", headers=headers)
    r.raise_for_status()
    card = dict(r.json()["data"][0])
    if "vocab_size" not in card:
        # /tokenizer_info is at the server root, next to /v1; optional (other servers lack it)
        root = base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url
        try:
            info = await client.get(f"{root}/tokenizer_info", headers=headers)
            if info.status_code == 200 and "vocab_size" in info.json():
                card["vocab_size"] = info.json()["vocab_size"]
        except (httpx.HTTPError, ValueError):
            pass
    return card


def check_args(a: argparse.Namespace) -> None:
    """Raise ValueError naming the flag and its limit."""
    for name in ("num_prompts", "input_len", "output_len", "warmup_requests"):
        if getattr(a, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    rates = a.sweep_rate or [a.request_rate]
    if any(not r > 0 for r in rates):  # also rejects nan
        raise ValueError(f"request rates must be > 0 (inf for all at once), got {rates}")
    concs = a.sweep_concurrency or ([a.max_concurrency] if a.max_concurrency is not None else [])
    if any(c < 1 for c in concs):
        raise ValueError(f"concurrencies must be >= 1, got {concs}")
    if a.sweep_rate and a.sweep_concurrency:
        raise ValueError("give --sweep-rate or --sweep-concurrency, not both")
    if a.request_timeout <= 0:
        raise ValueError(f"--request-timeout must be > 0, got {a.request_timeout}")
    if not is_loopback(a.base_url) and not a.allow_remote:
        raise ValueError(f"--base-url {a.base_url} is not a loopback address; pass --allow-remote "
                         "to load a server on another host")


def resolve_vocab(card: dict, flag: int | None, input_len: int, output_len: int) -> int:
    """Vocab size for random prompts (server's, else --vocab-size); checks the context length."""
    vocab = card.get("vocab_size") or flag
    if vocab is None:
        raise ValueError("the server reports no vocab_size: pass --vocab-size")
    if flag is not None and flag != vocab:
        logger.warning("--vocab-size %d ignored: the server reports %d", flag, vocab)
    if vocab <= 200:  # random_prompts draws ids from [100, vocab - 100)
        raise ValueError(f"vocab_size must be > 200 for random prompts, got {vocab}")
    max_len = card.get("max_model_len")
    if max_len is not None and input_len + output_len > max_len:
        raise ValueError(f"--input-len + --output-len = {input_len + output_len} exceeds the "
                         f"server's max_model_len {max_len}")
    return vocab


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


async def engine_steps(client, root: str, headers: dict) -> tuple[int, int] | None:
    """(steps, tokens) so far from the server's `vllm:iteration_tokens_total` histogram (the engine
    steps that scheduled tokens; vLLM exports it too), or None where /metrics lacks it."""
    try:
        text = (await client.get(f"{root}/metrics", headers=headers)).text
    except httpx.HTTPError:
        return None
    got = {}
    for line in text.splitlines():
        for key in ("count", "sum"):
            if line.startswith(f"vllm:iteration_tokens_total_{key}{{"):
                got[key] = int(float(line.rsplit(" ", 1)[1]))
    return (got["count"], got["sum"]) if len(got) == 2 else None


async def bench(a: argparse.Namespace) -> dict:
    """Warm up, then run every load level; returns the JSON payload."""
    headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
    if a.sweep_concurrency:
        levels = [(a.request_rate, c) for c in a.sweep_concurrency]
    elif a.sweep_rate:
        levels = [(r, a.max_concurrency) for r in a.sweep_rate]
    else:
        levels = [(a.request_rate, a.max_concurrency)]
    most = max((c or a.num_prompts) for _, c in levels)
    limits = httpx.Limits(max_connections=most + 1, max_keepalive_connections=most + 1)
    timeout = httpx.Timeout(a.request_timeout, connect=10.0)
    async with ClientShards(shard_count(most), limits, timeout) as clients:
        client = clients[0]
        card = await discover(client, a.base_url.rstrip("/"), headers)
        vocab = resolve_vocab(card, a.vocab_size, a.input_len, a.output_len)
        t = Target(f"{a.base_url.rstrip('/')}/completions", headers, a.model or card["id"],
                   a.output_len, a.temperature, a.request_timeout)
        # as bench_throughput.py warms the offline engine: --warmup-requests prompts at once
        warm = await asyncio.gather(*(send_one(clients[i], t, p) for i, p in enumerate(random_prompts(
            a.warmup_requests, a.input_len, vocab, seed=a.seed - 1))))
        bad = next((w for w in warm if not w.ok), None)
        if bad is not None:
            raise RuntimeError(f"warm-up request failed: {bad.error}")
        rows = []
        for k, (rate, conc) in enumerate(levels):
            prompts = random_prompts(a.num_prompts, a.input_len, vocab, seed=a.seed + k)
            root = a.base_url.rstrip("/").removesuffix("/v1")
            before = await engine_steps(client, root, headers)
            results, dt = await run_load(clients, t, prompts, rate, conc, seed=a.seed + k)
            s = summarize(results, dt, a.output_len)
            after = await engine_steps(client, root, headers)
            # the engine's steps during this level's run (its warm-up's excluded)
            s["engine_steps"], s["engine_step_tokens"] = ((after[0] - before[0], after[1] - before[1])
                                                          if before and after else (None, None))
            if s["failed"]:
                logger.warning("%d of %d requests failed, e.g. %s", s["failed"], len(results),
                               s["errors"][0])
            if s["wrong_output_len"]:
                logger.warning("%d requests returned a token count other than --output-len %d",
                               s["wrong_output_len"], a.output_len)
            load = f"rate {rate:g}" + (f", conc {conc}" if conc else "")
            x = conc if a.sweep_concurrency else rate
            rows.append({"load": load, "request_rate": rate, "max_concurrency": conc, "x": x,
                         "title": f"{t.model}: {a.num_prompts} x ({a.input_len} in, "
                                  f"{a.output_len} out)", "summary": s})
            logger.info("%s: %d ok, %.2f req/s", load, s["completed"], s["request_throughput"])
    return {"bench": "serving", "env": environment(), "server": card, "args": vars(a),
            "results": rows}


def _finite_json(obj):
    """A copy with inf/nan floats as strings, so that the file is strict JSON."""
    if isinstance(obj, dict):
        return {k: _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_json(v) for v in obj]
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    return obj


def parse_args(argv=None) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The benchmark's flags."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="the server's /v1 URL")
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a --base-url that is not a loopback address")
    p.add_argument("--model", default=None, help="model name to send; default: the served one")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for a server started with --api-key (default: $OPENAI_API_KEY)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="vocab size for random prompt ids, used when the server does not report one")
    p.add_argument("--num-prompts", type=int, default=200, help="requests per load level")
    p.add_argument("--input-len", type=int, default=1000, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=100, help="generated tokens per request (ignore_eos)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrival rate in requests/s; inf sends all at once")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    p.add_argument("--sweep-rate", type=float, nargs="+", default=None,
                   help="run one level per request rate (with --max-concurrency as a cap)")
    p.add_argument("--sweep-concurrency", type=int, nargs="+", default=None,
                   help="run one level per max concurrency (with --request-rate)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds before one request counts as failed")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts and arrival times")
    p.add_argument("--warmup-requests", type=int, default=8,
                   help="requests sent at once before measuring (bench_throughput.py warms up with 8)")
    p.add_argument("--json", default=None, help="write results here")
    p.add_argument("--plot", default=None,
                   help="sweep plot PNG; default: --json's path with .png, else bench_serving_sweep.png")
    return p, p.parse_args(argv)


def main(argv=None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    p, a = parse_args(argv)
    try:
        check_args(a)
        payload = asyncio.run(bench(a))
    except ValueError as e:
        p.error(str(e))
    except (RuntimeError, httpx.HTTPError, OSError) as e:
        raise SystemExit(f"bench_serving: error: {e} (--base-url {a.base_url})") from None
    print(table(payload["results"]))
    write_json(a.json, _finite_json(payload))
    if a.sweep_rate or a.sweep_concurrency:
        path = a.plot or (str(Path(a.json).with_suffix(".png")) if a.json else "bench_serving_sweep.png")
        xlabel = "max concurrency" if a.sweep_concurrency else "request rate (req/s)"
        if plot(payload["results"], xlabel, path):
            logger.info("plot written to %s", path)


if __name__ == "__main__":
    main()
