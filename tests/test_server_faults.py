"""Fault injection: `serve` on the tiny model under a burst of bad requests mixed with good ones.

Every bad request must get a 4xx with an OpenAI error body, every good one its reference answer
(greedy and seeded outputs equal a run on the idle server), /health must stay 200 and answer
within 1 s throughout, idle slow-header sockets must be closed, and every KV block must come back.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from tests.server_fixtures import OFFLINE_ENV, ServeProcess, health_until, metric, side_by_side, tiny_model_dir

pytestmark = pytest.mark.slow

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
FLAGS = ["--served-model-name", "tiny", "--device", "cpu", "--dtype", "float32",
         "--max-model-len", str(MAX_MODEL_LEN), "--num-kv-blocks", str(NUM_BLOCKS),
         "--max-request-body-bytes", "65536", "--max-prompts-per-request", "8",
         "--max-seqs-per-request", "16", "--max-stop-strings", "4", "--max-stop-str-len", "32",
         "--http-header-timeout", "1", "--engine-stall-timeout", "5"]

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "Mia has 7 apples."}]

# (path, body: dict or raw JSON text, expected status)
BAD = [
    (CMPL, {"prompt": "hi", "seed": 2**64}, 400),
    (CMPL, {"prompt": "hi", "seed": -(2**63) - 1}, 400),
    (CMPL, {"prompt": "hi", "seed": 2**64 - 1, "n": 2}, 400),
    (CMPL, {"prompt": "hi", "seed": 2**63 - 1, "n": 2}, 400),
    (CMPL, {"prompt": "hi", "top_k": 2**63}, 400),
    (CMPL, {"prompt": "hi", "stop_token_ids": [2**64]}, 400),
    (CMPL, {"prompt": [[2**64]]}, 400),
    (CMPL, {"prompt": [[510]]}, 400),  # in the config's padded vocab, not the tokenizer's
    (CMPL, {"prompt": "hi", "max_tokens": 2**64}, 400),
    (CMPL, {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400),
    (CMPL, {"prompt": "hi", "repetition_penalty": 1e300}, 400),
    (CMPL, {"prompt": "hi", "logprobs": 99}, 400),
    (CMPL, '{"prompt": "\\ud800"}', 400),
    (CMPL, '{"prompt": "hi", "stop": ["\\udfff"]}', 400),
    (CHAT, '{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
    ("/tokenize", '{"prompt": "a\\ud800"}', 400),
    (CMPL, {"prompt": ["a"] * 9}, 400),
    (CMPL, {"prompt": ["a", "b"], "n": 9}, 400),
    (CMPL, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400),
    (CMPL, {"prompt": "hi", "stop": "x" * 33}, 400),
    (CMPL, {"prompt": "ab " * 10_000}, 400),  # over the context before tokenizing
    (CHAT, {"messages": [{"role": "user", "content": "ab " * 10_000}]}, 400),
    (CMPL, {"prompt": "x" * 70_000}, 413),
    (CMPL, "{not json", 400),
    (CMPL, {"prompt": "hi", "model": "no-such-model"}, 404),
    (CHAT, {"messages": []}, 400),
]

GOOD = [
    (CMPL, {"prompt": "Question: Mia has 7 apples. Leo has 3 pens.", "max_tokens": 8,
            "temperature": 0, "ignore_eos": True}),
    (CMPL, {"prompt": "Answer: 7 + 3 =", "max_tokens": 8, "temperature": 0}),
    (CMPL, {"prompt": "Emma has", "max_tokens": 8, "temperature": 1e-38, "seed": 1}),
    (CMPL, {"prompt": ["Hi", "Emma has"], "max_tokens": 6, "temperature": 0, "n": 2}),
    (CMPL, {"prompt": "Leo has", "max_tokens": 8, "temperature": 1.0, "seed": 7, "n": 2,
            "ignore_eos": True}),
    (CHAT, {"messages": USER, "max_tokens": 8, "temperature": 0}),
]


def _texts(body: dict) -> list[str]:
    return [c["text"] if "text" in c else c["message"]["content"]
            for c in sorted(body["choices"], key=lambda c: c["index"])]


async def _send(client: httpx.AsyncClient, path: str, body) -> httpx.Response:
    content = body if isinstance(body, str) else json.dumps({"model": "tiny", **body}
                                                             if "model" not in body else body)
    return await client.post(path, content=content, headers={"content-type": "application/json"})


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """The burst's server and the stopped worker's (-tp 2), started side by side."""
    os.environ.update(OFFLINE_ENV)
    model = tiny_model_dir(tmp_path_factory)
    with side_by_side(ServeProcess("--model", model, *FLAGS),
                      ServeProcess("--model", model, "--device", "cpu", "--dtype", "float32", "-tp", "2",
                                   "--num-kv-blocks", "64", "--max-model-len", "256",
                                   "--engine-stall-timeout", "1")) as (burst, tp2):
        yield {"burst": burst, "tp2": tp2}


def test_burst_of_bad_requests_among_good_ones(servers):
    s = servers["burst"]
    asyncio.run(_burst(s.url, s.port))


async def _burst(url: str, port: int) -> None:
    limits = httpx.Limits(max_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        reference = []
        for path, body in GOOD:  # on the idle server, one at a time
            r = await _send(client, path, body)
            assert r.status_code == 200, r.text
            reference.append(_texts(r.json()))

        health: list[tuple[int, float]] = []
        done = asyncio.Event()

        async def watch_health():
            async with httpx.AsyncClient(base_url=url, timeout=5) as h:
                while not done.is_set():
                    t0 = time.perf_counter()
                    r = await h.get("/health")
                    health.append((r.status_code, time.perf_counter() - t0))
                    await asyncio.sleep(0.05)

        # idle sockets that never finish their headers: closed after --http-header-timeout
        loop = asyncio.get_running_loop()
        slow = [socket.create_connection(("127.0.0.1", port)) for _ in range(20)]
        for sock in slow:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            sock.setblocking(False)

        watcher = asyncio.ensure_future(watch_health())
        # bad and good interleaved, each good request twice
        jobs = []
        for i, (path, body, status) in enumerate(BAD):
            jobs.append(("bad", i, path, body, status))
            if i % 4 == 0:
                g = (i // 4) % len(GOOD)
                jobs.append(("good", g, *GOOD[g], 200))
        for g in range(len(GOOD)):
            jobs.append(("good", g, *GOOD[g], 200))
        t0 = time.perf_counter()
        responses = await asyncio.gather(*(_send(client, p, b) for _, _, p, b, _ in jobs))
        burst_s = time.perf_counter() - t0
        await asyncio.sleep(0.2)
        done.set()
        await watcher

        for (kind, i, path, body, status), r in zip(jobs, responses):
            assert r.status_code == status, (kind, path, str(body)[:80], r.text[:300])
            if kind == "bad":
                err = r.json()["error"]
                assert set(err) == {"message", "type", "param", "code"} and err["message"]
                assert "Traceback" not in r.text
            else:
                assert _texts(r.json()) == reference[i], (path, body)

        assert health and all(code == 200 for code, _ in health), health
        assert max(t for _, t in health) < 1.0, max(t for _, t in health)
        assert burst_s < 60

        for sock in slow:  # each was closed by the server: recv gives b"" (not "would block")
            data = await asyncio.wait_for(loop.sock_recv(sock, 1024), timeout=5)
            assert data == b""
            sock.close()

        deadline = time.time() + 20
        while True:
            m = (await client.get("/metrics")).text
            used = metric(m, "mla_serve_kv_cache_blocks_used")
            running = metric(m, "mla_serve_num_requests_running")
            if (used, running) == (0, 0) or time.time() > deadline:
                break
            await asyncio.sleep(0.1)
        assert (used, running) == (0, 0)
        assert metric(m, "mla_serve_kv_cache_blocks_total") == NUM_BLOCKS
        assert (await client.get("/health")).status_code == 200


def _children(pid: int) -> list[int]:
    kids = set()
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids |= {int(k) for k in f.read().split()}
    return sorted(kids)


def _spawned(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return b"spawn_main" in f.read()


def _worker_pids(pid: int) -> list[int]:
    """The rank processes under `serve`: children of the engine-core process (which `serve`
    spawned), one per rank, not multiprocessing's resource trackers."""
    cores = [k for k in _children(pid) if _spawned(k)]
    assert len(cores) == 1, cores
    return [k for k in _children(cores[0]) if _spawned(k)]


def test_health_sees_a_stopped_worker(servers):
    s = servers["tp2"]
    ranks = _worker_pids(s.proc.pid)
    assert len(ranks) == 2
    body = {"prompt": "Mia has", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    ref = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
    result = {}
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        t = threading.Thread(target=lambda: result.setdefault(
            "r", httpx.post(f"{s.url}/v1/completions", json=body, timeout=60)))
        t.start()
        r = health_until(s.url, 503, within=15)
        assert r.status_code == 503, r.text
        assert "no progress" in r.json()["error"]["message"]
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    t.join(60)
    assert result["r"].json()["choices"] == ref["choices"]  # it resumes where it stopped
    assert httpx.get(f"{s.url}/health", timeout=2).status_code == 200
