"""Soak / chaos client: a random mixed concurrent load against a running server, then invariants.

    OMP_NUM_THREADS=1 python -m server --device cpu --dtype float32 --max-model-len 512 \
        --num-kv-blocks 256 --port 8400 [--api-server-count 2] &
    python scripts/soak.py --url http://127.0.0.1:8400 --seconds 480 --concurrency 32 --rounds 4

Each round runs `--concurrency` workers for `seconds / rounds` seconds, each sending a random mix:
completions and chat, streamed or not, n 1-4, logprobs / echo / prompt_logprobs, stop strings,
structured outputs, clients that drop a stream or time out before the answer, invalid bodies that
must be 4xx, /tokenize, /v1/responses, /reset_prefix_cache; every answer's shape is checked
(choices = prompts x n, a stream ends with [DONE] after every choice's finish_reason, no stop
string in the output, structured output obeys its constraint). After each round it waits for the
server to go idle and checks on /metrics that nothing runs or waits and every KV block came back
(kv_cache_usage_perc == 0), that /health is 200, and samples the RSS of the server's processes
(`serve`, found by the port it listens on, and all its children). Prints a table; exits 1 on any
5xx, malformed answer, broken invariant, or RSS growing more than --rss-growth-pct from the end of
round 1 to the end of the last round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import time
from collections import Counter, defaultdict

import aiohttp

PROMPT = "Question: What is {a} {op} {b}?\nAnswer:"
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
CHOICES = ["yes", "no", "seven", "eleven"]
REGEX = r"[0-9]{1,3}"
HI = [{"role": "user", "content": "hi"}]
INVALID = [  # (path, body) that must be answered 4xx
    ("/v1/completions", {"prompt": "hi", "n": 0}), ("/v1/completions", {"prompt": "hi", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}), ("/v1/completions", {"prompt": "hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 100000}), ("/v1/completions", {"prompt": [[1, 2, 999999]]}),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "("}), ("/v1/completions", {"prompt": "hi", "priority": 1}),
    ("/v1/completions", {"prompt": "hi", "guided_regex": "a", "guided_choice": ["a"]}),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 17}), ("/v1/completions", {"prompt": "\ud800"}),
    ("/v1/completions", {"prompt": "hi", "model": "no-such-model"}),
    ("/v1/completions", {"prompt": "hi", "suffix": "x"}),
    ("/v1/completions", b"{not json"), ("/v1/chat/completions", {"messages": "not a list"}),
    ("/v1/chat/completions", {"messages": HI, "stream": True, "prompt_logprobs": 2}),
    ("/v1/chat/completions", {"messages": HI, "logprobs": True, "top_logprobs": 30}),
    ("/v1/chat/completions", {"messages": HI, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}),
]
WEIGHTS = {"cmpl": 20, "cmpl_stream": 20, "chat": 12, "chat_stream": 12, "structured": 10,
           "disconnect": 6, "cancel": 6, "invalid": 6, "tokenize": 4, "responses": 3, "reset": 1}
KEEP = r"request_success_total|http_requests_total|(prompt|generation)_tokens_total|preemptions_total"


class Bad(Exception):
    """A malformed answer."""


def prompt(rng):
    return PROMPT.format(a=rng.randint(0, 20), b=rng.randint(0, 20), op=rng.choice(["plus", "minus", "times"]))


def make_request(rng, cat):
    """(path, body, meta) for category `cat`; meta holds what the answer is checked against."""
    if cat == "tokenize":
        return "/tokenize", {"prompt": prompt(rng)}, {}
    if cat == "responses":
        return "/v1/responses", {"input": prompt(rng), "max_output_tokens": rng.randint(1, 32)}, {}
    if cat == "reset":
        return "/reset_prefix_cache", None, {}
    if cat == "invalid":
        path, body = rng.choice(INVALID)
        return path, body, {"invalid": True}
    chat = cat.startswith("chat") or (cat in ("structured", "disconnect", "cancel") and rng.random() < 0.5)
    stream = cat.endswith("stream") or cat == "disconnect"
    body = {"stream": stream, "max_tokens": rng.randint(1, 64), "n": rng.randint(1, 4), "temperature": 0}
    if rng.random() < 0.5:
        body.update(temperature=0.8, seed=rng.randint(0, 2**31))
    if rng.random() < 0.3 and cat != "structured":
        body["stop"] = rng.sample(["\n", ".", " has", "Question"], rng.randint(1, 2))
    meta = {"n": body["n"], "prompts": 1, "stream": stream, "chat": chat, "stop": body.get("stop")}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt(rng)[len("Question: "):-len("\nAnswer:")]}]
        if rng.random() < 0.3:
            body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        if not stream and rng.random() < 0.2:
            body["prompt_logprobs"] = rng.randint(0, 3)
    else:
        prompts = [prompt(rng) for _ in range(rng.randint(1, 3))]
        body["prompt"] = prompts[0] if len(prompts) == 1 and rng.random() < 0.5 else prompts
        meta["prompts"] = len(prompts)
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.2:
            body["echo"], meta["echo"] = True, prompts
        if rng.random() < 0.2:
            body["prompt_logprobs"] = rng.randint(0, 3)
    if cat == "structured":
        meta["structured"] = kind = rng.choice(["choice", "regex", "json"])
        body.update({"choice": {"guided_choice": CHOICES}, "regex": {"guided_regex": REGEX}, "json": {
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}}}[kind])
    return "/v1/chat/completions" if chat else "/v1/completions", body, meta


def check_text(meta, idx, text, finish):
    """No stop string in the output; structured output obeys its constraint when it stopped."""
    if meta.get("echo"):
        p = meta["echo"][idx // meta["n"]]
        if not text.startswith(p):
            raise Bad(f"echo: choice {idx} does not start with its prompt")
        text = text[len(p):]
    for s in meta["stop"] or ():
        if s in text:
            raise Bad(f"stop string {s!r} in output {text!r}")
    kind = meta.get("structured")
    if finish == "stop" and kind:
        ok = (text in CHOICES if kind == "choice" else re.fullmatch(REGEX, text) if kind == "regex"
              else isinstance(json.loads(text).get("answer"), int))
        if not ok:
            raise Bad(f"{kind} constraint broken: {text!r}")


def check_whole(meta, data):
    choices, want = data.get("choices"), meta["prompts"] * meta["n"]
    if not isinstance(choices, list) or sorted(c["index"] for c in choices) != list(range(want)):
        raise Bad(f"choices {[c.get('index') for c in choices or []]} != {want} (prompts x n)")
    for c in choices:
        if c.get("finish_reason") not in ("stop", "length"):
            raise Bad(f"finish_reason {c.get('finish_reason')!r}")
        check_text(meta, c["index"], (c["message"]["content"] if meta["chat"] else c["text"]) or "", c["finish_reason"])
    if "usage" not in data:
        raise Bad("no usage")


def check_stream(meta, events):
    if not events or events[-1] != "[DONE]":
        raise Bad(f"stream without [DONE] (last event {events[-1] if events else None!r})")
    texts, finish = defaultdict(str), {}
    for data in map(json.loads, events[:-1]):
        if "error" in data:
            raise Bad(f"in-band error {data['error']}")
        for c in data.get("choices", []):
            if c["index"] in finish:
                raise Bad(f"choice {c['index']} has output after its finish_reason")
            texts[c["index"]] += (c.get("delta", {}).get("content") or "") if meta["chat"] else c.get("text", "")
            if c.get("finish_reason"):
                finish[c["index"]] = c["finish_reason"]
    if sorted(finish) != list(range(meta["prompts"] * meta["n"])):
        raise Bad(f"stream finished choices {sorted(finish)} != {meta['prompts'] * meta['n']} (prompts x n)")
    for i, t in texts.items():
        check_text(meta, i, t, finish[i])


async def read_stream(r, cut):
    """The SSE events' data; with `cut`, drops the connection after that many events."""
    buf, events = b"", []
    async for chunk in r.content.iter_any():
        *done, buf = (buf + chunk).split(b"\n\n")
        events += [e.decode()[len("data: "):] for e in done if e.startswith(b"data: ")]
        if cut is not None and len(events) >= cut:
            r.close()
            break
    return events


async def one(session, url, rng, cat, stats):
    path, body, meta = make_request(rng, cat)
    kw = {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    t0, status = time.perf_counter(), "-"
    try:
        if cat == "cancel":  # gives up before (most) answers come: the server must abort the request
            async with asyncio.timeout(rng.uniform(0.02, 1.0)):
                async with session.post(url + path, **kw) as r:
                    status = r.status
                    await r.read()
        else:
            async with session.post(url + path, **kw) as r:
                status = r.status
                if meta.get("invalid"):
                    text = await r.text()
                    if not 400 <= r.status < 500 or "error" not in json.loads(text):
                        raise Bad(f"invalid request answered {r.status}: {text[:200]}")
                elif r.status != 200:
                    raise Bad(f"{r.status}: {(await r.text())[:300]}")
                elif meta.get("stream"):
                    cut = rng.randint(1, 4) if cat == "disconnect" else None
                    events = await read_stream(r, cut)
                    if cut is None or len(events) < cut:
                        check_stream(meta, events)
                else:
                    data = await r.json(content_type=None)
                    if "n" in meta:
                        check_whole(meta, data)
                    elif cat == "tokenize" and data["count"] != len(data["tokens"]):
                        raise Bad("tokenize: count != len(tokens)")
                    elif cat == "responses" and data.get("status") != "completed" and not data.get("output"):
                        raise Bad(f"responses: {json.dumps(data)[:200]}")
    except TimeoutError:
        status = "timeout" if cat == "cancel" else "timeout!"
        if cat != "cancel":
            stats["bad"].append((cat, path, body, "client timeout (120 s)"))
    except Bad as e:
        stats["bad"].append((cat, path, body, str(e)))
    except (aiohttp.ClientError, json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        status = type(e).__name__
        stats["bad"].append((cat, path, body, f"{type(e).__name__}: {e}"))
    stats["lat"][cat].append(time.perf_counter() - t0)
    stats["status"][cat][status] += 1


async def worker(session, url, rng, deadline, stats):
    cats, weights = list(WEIGHTS), list(WEIGHTS.values())
    while time.monotonic() < deadline:
        await one(session, url, rng, rng.choices(cats, weights)[0], stats)


def metrics(text):
    """vllm:* gauges (max over series) and the counters of KEEP (summed per label set, engine aside)."""
    out = defaultdict(float)
    for line in text.splitlines():
        m = re.match(r'^(vllm:[a-z_]+|http_requests_total)(\{[^}]*\})? ([0-9.e+-]+)$', line)
        if m and (m[1].endswith("total") or m[1] in GAUGES):
            key = m[1] + re.sub(r'(engine|model_name)="[^"]*",?', "", m[2] or "").replace(",}", "}")
            out[key] = out[key] + float(m[3]) if m[1].endswith("total") else max(out[key], float(m[3]))
    return out


GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


async def wait_idle(session, url, timeout=60.0):
    """Polls /metrics until nothing runs or waits and no KV block is used: (idle, figures, seconds)."""
    t0 = time.monotonic()
    while True:
        async with session.get(url + "/metrics") as r:
            m = metrics(await r.text())
        idle = all(m.get(g + "{}") == 0 for g in GAUGES)
        if idle or time.monotonic() - t0 > timeout:
            return idle, m, time.monotonic() - t0
        await asyncio.sleep(0.5)


def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


def server_pids(port):
    """`serve` (the process listening on `port`, or under --api-server-count their parent) and all
    its descendants."""
    inodes, holders, parent = set(), set(), {}
    for f in ("/proc/net/tcp", "/proc/net/tcp6"):
        for p in (line.split() for line in open(f).readlines()[1:]):
            if int(p[1].rsplit(":", 1)[1], 16) == port and p[3] == "0A":  # 0A: LISTEN
                inodes.add(p[9])
    for pid in map(int, filter(str.isdigit, os.listdir("/proc"))):
        try:
            parent[pid] = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            if any(os.readlink(f"/proc/{pid}/fd/{fd}")[8:-1] in inodes for fd in os.listdir(f"/proc/{pid}/fd")):
                holders.add(pid)
        except OSError:
            continue
    tree = set()
    for p in holders:
        while "python" in cmdline(parent.get(p, 0)) and "server" in cmdline(parent[p]):
            p = parent[p]
        tree.add(p)
    while new := {p for p, pp in parent.items() if pp in tree} - tree:
        tree |= new
    return sorted(tree)


def rss_mb(pids):
    out = {}
    for p in pids:
        try:
            out[p] = int(next(s for s in open(f"/proc/{p}/status") if s.startswith("VmRSS")).split()[1]) / 1024
        except (OSError, StopIteration):
            out[p] = 0.0
    return out


def pct(xs, q):
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


async def main(args):
    url, port = args.url.rstrip("/"), int(args.url.rsplit(":", 1)[1].split("/")[0])
    stats = {"lat": defaultdict(list), "status": defaultdict(Counter), "bad": []}
    failures, rss = [], []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=args.concurrency + 8),
                                     timeout=aiohttp.ClientTimeout(total=120)) as s:
        _, m0, _ = await wait_idle(s, url)
        pids = server_pids(port)
        print(f"server processes: {pids}", flush=True)
        for rnd in range(1, args.rounds + 1):
            before = sum(rss_mb(pids).values())
            deadline = time.monotonic() + args.seconds / args.rounds
            await asyncio.gather(*(worker(s, url, random.Random(f"{args.seed}-{rnd}-{i}"), deadline, stats)
                                   for i in range(args.concurrency)))
            idle, m, waited = await wait_idle(s, url)
            async with s.get(url + "/health") as r:
                health = r.status
            now = server_pids(port)
            after = rss_mb(now)
            rss.append((before, sum(after.values())))
            gauges = " ".join(f"{g[5:]}={m[g + '{}']:g}" for g in GAUGES)
            print(f"round {rnd}: idle={idle} after {waited:.1f} s, {gauges}, health={health}, RSS {before:.0f} -> "
                  f"{rss[-1][1]:.0f} MB ({', '.join(f'{p}: {v:.0f}' for p, v in after.items())})", flush=True)
            failures += [f"round {rnd}: not idle 60 s after the load ({gauges})"] * (not idle)
            failures += [f"round {rnd}: /health {health}"] * (health != 200)
            failures += [f"round {rnd}: server processes changed {pids} -> {now}"] * (now != pids)
    print(f"\n{'category':<12}{'count':>7}  {'statuses':<44}{'p50 s':>8}{'p99 s':>8}")
    for cat in WEIGHTS:
        st, lat = stats["status"][cat], stats["lat"][cat]
        print(f"{cat:<12}{sum(st.values()):>7}  {', '.join(f'{k}: {v}' for k, v in sorted(st.items(), key=str)):<44}"
              f"{pct(lat, 0.5):>8.3f}{pct(lat, 0.99):>8.3f}")
    deltas = {k: m[k] - m0[k] for k in m if re.search(KEEP, k) and m[k] != m0[k]}
    print("\ncounter deltas on /metrics:\n  " + "\n  ".join(f"{k} {v:.0f}" for k, v in sorted(deltas.items())))
    print("RSS per round (MB, all server processes, start -> end): "
          + "; ".join(f"r{i}: {a:.0f} -> {b:.0f}" for i, (a, b) in enumerate(rss, 1)))
    growth = 100 * (rss[-1][1] / rss[0][1] - 1)
    if growth > args.rss_growth_pct:
        failures.append(f"RSS grew {growth:.1f}% from the end of round 1 to the end of the last")
    failures += ["http_requests_total counts 5xx answers"] * any('status="5xx"' in k for k in deltas)
    for cat, path, body, why in stats["bad"]:
        print(f"BAD {cat} {path}: {why}\n    body: {body if isinstance(body, bytes) else json.dumps(body)}"[:1500])
    failures += [f"{len(stats['bad'])} bad answers (5xx, malformed, or a 2xx where a 4xx was due)"] * bool(stats["bad"])
    print("\n" + ("\n".join("FAIL " + f for f in failures) if failures else "all invariants held"))
    return 1 if failures else 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    ap.add_argument("--seconds", type=float, default=120, help="total load time, split over the rounds")
    ap.add_argument("--concurrency", type=int, default=32, help="workers, each with one request in flight")
    ap.add_argument("--rounds", type=int, default=4, help="load rounds; idle, /health and RSS are checked after each")
    ap.add_argument("--seed", type=int, default=0, help="seeds every worker's choices")
    ap.add_argument("--rss-growth-pct", type=float, default=20.0,
                    help="fail when the server's RSS grows more than this from round 1's end to the last round's")
    raise SystemExit(asyncio.run(main(ap.parse_args())))
