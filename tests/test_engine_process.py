"""The engine core in its own process: wire format, tokenizer-less streaming, start-up errors,
death of the core and shutdown, against the real `serve` on the tiny model."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from engine.core_proc import decode_outputs, encode_outputs
from scheduler.outputs import EngineCoreOutput, TokenLogprobs
from tests.server_fixtures import OFFLINE_ENV, REPO, ServeProcess, tiny_model_dir

SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "2048",
         "--num-kv-blocks", "256", "--served-model-name", "tiny"]


def _spawned(pid: int) -> list[int]:
    """Children of `pid` started by multiprocessing's spawn (not its resource tracker)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    spawned = []
    for c in children:
        with open(f"/proc/{c}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                spawned.append(c)
    return spawned


def _core_pid(pid: int) -> int:
    """The engine-core child of `serve`."""
    (core,) = _spawned(pid)
    return core


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[-1][0] != "Z"  # a zombie is dead, only not reaped
    except FileNotFoundError:
        return False


def _sse(r: httpx.Response) -> list[dict]:
    chunks = []
    for line in r.iter_lines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            chunks.append(json.loads(line[5:]))
    return chunks


def test_wire_format_round_trips_every_field():
    outs = [EngineCoreOutput("a#0", [5, 6], [TokenLogprobs(5, -0.5, 1, [(5, -0.5)]), None],
                             [None, TokenLogprobs(7, -1.0, 2, [])], "stop", 6, 32),
            EngineCoreOutput("b#0", [])]
    assert decode_outputs(encode_outputs(outs)) == outs


@pytest.mark.slow
def test_tokenizer_less_stream_sends_one_chunk_per_step(tmp_path_factory):
    n = 12
    with ServeProcess("--model", tiny_model_dir(tmp_path_factory), "--skip-tokenizer-init",
                      *SERVE) as s:
        body = {"model": "tiny", "prompt": [11, 12, 13, 14, 15], "max_tokens": n,
                "temperature": 0, "ignore_eos": True}
        with httpx.Client(timeout=60) as c:
            with c.stream("POST", f"{s.url}/v1/completions", json={
                    **body, "stream": True, "stream_options": {"include_usage": True}}) as r:
                assert r.status_code == 200
                chunks = _sse(r)
            whole = c.post(f"{s.url}/v1/completions", json=body).json()
            token_chunks = [ch for ch in chunks if ch["choices"]]
            # one step decodes one token of a lone request: a chunk for each
            assert [len(ch["choices"][0]["token_ids"]) for ch in token_chunks] == [1] * n
            assert all(ch["choices"][0]["text"] == "" for ch in token_chunks)
            streamed = [t for ch in token_chunks for t in ch["choices"][0]["token_ids"]]
            assert streamed == whole["choices"][0]["token_ids"] and len(streamed) == n
            assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
            assert chunks[-1]["usage"]["completion_tokens"] == n
            assert c.get(f"{s.url}/v1/models").json()["data"][0]["vocab_size"] > 0
            for method, path, payload in (("GET", "/tokenizer_info", None),
                                          ("POST", "/tokenize", {"prompt": "hi"}),
                                          ("POST", "/detokenize", {"tokens": [1, 2]})):
                r = c.request(method, f"{s.url}{path}", json=payload)
                assert r.status_code == 400 and "no tokenizer" in r.json()["error"]["message"]
            r = c.post(f"{s.url}/v1/completions", json={**body, "prompt": "text"})
            assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]


@pytest.mark.slow
def test_start_up_error_in_the_core_is_one_line_and_exits(tmp_path_factory):
    # --max-model-len is checked against the model when the core builds the engine
    cmd = [sys.executable, "-m", "server", "--model", tiny_model_dir(tmp_path_factory),
           *SERVE[:4], "--max-model-len", "99999", "--port", "1"]
    t0 = time.time()
    out = subprocess.run(cmd, cwd=REPO, env={**os.environ, **OFFLINE_ENV}, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1, out.stderr[-2000:]
    assert "serve: error: --max-model-len 99999 exceeds" in out.stderr
    assert time.time() - t0 < 100


def _kill_mid_stream(s, pid: int) -> None:
    """Start a long streamed completion, SIGKILL `pid` after its first chunk, and check that
    the stream ends with an in-band error at once, then /health and new requests get 503."""
    with httpx.Client(timeout=60) as c:
        assert c.get(f"{s.url}/health").status_code == 200
        with c.stream("POST", f"{s.url}/v1/completions", json={
                # long enough (~5 s at -tp 1 on a 2-core CPU) that the kill lands mid-stream
                "model": "tiny", "prompt": "Hello", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": True}) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            while not next(lines).startswith("data:"):
                pass
            os.kill(pid, signal.SIGKILL)
            t0 = time.time()
            rest = [json.loads(line[5:]) for line in lines
                    if line.startswith("data:") and line[5:].strip() != "[DONE]"]
        assert not any(c["choices"][0]["finish_reason"] for c in rest if "choices" in c), \
            "the request finished before the kill"
        assert "error" in rest[-1] and time.time() - t0 < 10
        assert c.get(f"{s.url}/health").status_code == 503
        r = c.post(f"{s.url}/v1/completions", json={"model": "tiny", "prompt": "Hi"})
        assert r.status_code == 503


@pytest.mark.slow
def test_dead_worker_under_the_core_fails_fast(tmp_path_factory):
    with ServeProcess("--model", tiny_model_dir(tmp_path_factory), *SERVE, "-tp", "2") as s:
        core = _core_pid(s.proc.pid)
        workers = _spawned(core)  # under -tp the core is the workers' parent
        assert len(workers) == 2
        _kill_mid_stream(s, workers[1])
    assert s.proc.returncode == 0 and not _alive(core) and not any(map(_alive, workers))


@pytest.mark.slow
def test_dead_core_fails_fast_and_serve_still_exits_cleanly(tmp_path_factory):
    # (a shutdown that joins a live core, after a request: test_server_cli.py's signal tests)
    with ServeProcess("--model", tiny_model_dir(tmp_path_factory), *SERVE) as s:
        _kill_mid_stream(s, _core_pid(s.proc.pid))  # uvicorn runs in serve; the core is its child
    assert s.proc.returncode == 0


@pytest.mark.slow
def test_core_in_a_thread_or_a_process_gives_the_same_outputs(tmp_path_factory):
    import asyncio

    from common.args import EngineArgs
    from engine.async_llm import AsyncLLM
    from common.sampling_params import SamplingParams

    args = EngineArgs(model=tiny_model_dir(tmp_path_factory), device="cpu", dtype="float32",
                      max_model_len=512, num_kv_blocks=256)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2, n=2)

    async def run(in_thread: bool):
        engine = AsyncLLM(args, core_in_thread=in_thread)
        try:
            async def one(i, prompt):
                deltas, last = [], None
                async for out in engine.generate(prompt, params, f"r{i}"):
                    deltas.append([o.delta_token_ids for o in out.outputs])
                    last = out
                return deltas, [(o.token_ids, o.text, [lp.token_id for lp in o.logprobs])
                                for o in last.outputs]
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(
                ["Emma has", [5, 6, 7, 8], "Question: Mia has 7 apples."])))
            stats = engine.stats()
            assert stats.generation_tokens_total == 3 * 2 * 6 and stats.num_running == 0
            return results
        finally:
            engine.shutdown()

    threaded, spawned = asyncio.run(run(True)), asyncio.run(run(False))
    assert threaded == spawned
    for deltas, final in spawned:
        for k, (ids, _, lp_ids) in enumerate(final):
            assert ids == [t for step in deltas for t in step[k]] == lp_ids and len(ids) == 6


def test_token_id_prompt_reaches_the_core_before_its_stream_is_read(tmp_path_factory, caplog):
    """generate() hands a token-id prompt to the core at once: it runs while nobody reads the
    stream (a burst of requests starts on the core while the rest are still being parsed), and a
    stream never read but aborted leaves no request behind (and, with --enable-log-requests, an
    "Aborted request" line, as vLLM's)."""
    import asyncio

    from common.args import EngineArgs
    from common.sampling_params import SamplingParams
    from engine.async_llm import AsyncLLM

    args = EngineArgs(model=tiny_model_dir(tmp_path_factory), device="cpu", dtype="float32",
                      max_model_len=512, num_kv_blocks=256, enable_log_requests=True)

    async def run():
        engine = AsyncLLM(args, core_in_thread=True)
        try:
            params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
            stream = engine.generate([5, 6, 7], params, "eager")  # not read yet
            deadline = time.monotonic() + 60
            while engine.stats().generation_tokens_total < 4:
                assert time.monotonic() < deadline, "the core did not run the unread request"
                await asyncio.sleep(0.01)
            outs = [o async for o in stream]
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
            with pytest.raises(ValueError, match="outside the vocabulary"):
                engine.generate([5, 10**6], params, "bad")
            engine.generate([5, 6, 7], SamplingParams(max_tokens=400, ignore_eos=True), "dropped")
            assert engine.has_unfinished_requests()
            await engine.abort("dropped")
            assert not engine.has_unfinished_requests() and engine.stalled_for() == 0.0
            while engine.stats().num_running:  # the core frees it
                assert time.monotonic() < deadline, "the aborted request still runs"
                await asyncio.sleep(0.01)
        finally:
            engine.shutdown()

    with caplog.at_level(logging.INFO, logger="engine.async_llm"):
        asyncio.run(run())
    aborted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Aborted request")]
    assert aborted == ["Aborted request dropped."]  # not the finished "eager" one


def test_core_receiver_never_blocks_the_loop_on_a_partly_written_message():
    """The core's step loop takes commands from the receiver thread's queue: a message whose
    bytes are only partly in the pipe (the front end's writer thread lost the GIL mid-write)
    leaves the loop free to step; once complete it arrives whole, and a closed pipe is its
    client's leaving (commands None)."""
    import multiprocessing as mp
    import pickle
    import queue
    import struct

    from engine.core_proc import _Receiver

    r, w = mp.Pipe(duplex=False)
    receiver = _Receiver([r])
    payload = pickle.dumps([("abort", ["a", "b"])])
    os.write(w.fileno(), struct.pack("!i", len(payload)) + payload[:5])
    t0 = time.monotonic()
    with pytest.raises(queue.Empty):
        receiver.get(0)
    with pytest.raises(queue.Empty):
        receiver.get(0.2)
    assert time.monotonic() - t0 < 5
    os.write(w.fileno(), payload[5:])
    assert receiver.get(10) == (0, [("abort", ["a", "b"])])
    w.close()
    assert receiver.get(10) == (0, None)
    with pytest.raises(queue.Empty):  # said once
        receiver.get(0.1)
