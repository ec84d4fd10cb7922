"""Streaming responses when the front end falls behind the engine: outputs that queued up go out
together (EngineStreams.batches, one write of several SSE events in handler._events), in the same
order and with the same events as one at a time."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from common.sampling_params import SamplingParams
from engine.outputs import CompletionOutput, RequestOutput
from server.handler import _events
from server.streams import EngineStreams


def _out(rid: str, k: int, last: bool) -> RequestOutput:
    return RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[1, 2],
                         outputs=[CompletionOutput(index=0, delta_token_ids=[k],
                                                   finish_reason="length" if last else None)],
                         finished=last)


class QueuedEngine:
    """generate() streams `n` outputs per prompt; with `gate`, each waits for gate.set() (a
    front end that keeps up), else all are there at once (a front end behind the engine)."""

    def __init__(self, n: int, gate: asyncio.Event | None = None, fail_after: int | None = None):
        self.n, self.gate, self.fail_after = n, gate, fail_after

    def generate(self, prompt, params, request_id):
        async def stream():
            for k in range(self.n):
                if self.fail_after is not None and k == self.fail_after:
                    raise ValueError("engine refused the request")
                if self.gate is not None:
                    await self.gate.wait()
                    self.gate.clear()
                yield _out(request_id, k, k == self.n - 1)
        return stream()

    async def abort(self, request_id):
        pass


def _streams(engine, prompts=1) -> EngineStreams:
    return EngineStreams(engine, [[1, 2]] * prompts, SamplingParams(max_tokens=4), "cmpl-x", set())


async def _all_batches(streams: EngineStreams) -> list[list]:
    return [[(i, o.outputs[0].delta_token_ids[0]) for i, o in b] async for b in streams.batches()]


def test_batches_take_every_output_already_queued():
    async def main():
        streams = _streams(QueuedEngine(5), prompts=2)
        await asyncio.sleep(0)  # the pump tasks run: every output is queued
        return await _all_batches(streams)
    batches = asyncio.run(main())
    assert len(batches) == 1
    assert sorted(batches[0]) == [(i, k) for i in range(2) for k in range(5)]
    for i in range(2):  # each prompt's outputs in engine order
        assert [k for j, k in batches[0] if j == i] == list(range(5))


def test_batches_are_single_outputs_when_the_consumer_keeps_up():
    async def main():
        gate = asyncio.Event()
        streams = _streams(QueuedEngine(4, gate))
        seen = []

        async def feed():
            for _ in range(4):
                gate.set()
                while gate.is_set():
                    await asyncio.sleep(0)
                await asyncio.sleep(0.01)  # the consumer takes each before the next

        feeder = asyncio.create_task(feed())
        seen = await _all_batches(streams)
        await feeder
        return seen
    assert asyncio.run(main()) == [[(0, 0)], [(0, 1)], [(0, 2)], [(0, 3)]]


class TickingEngine:
    """generate() yields an output every `period` seconds for as long as it is read; abort() is
    recorded."""

    def __init__(self, period: float):
        self.period, self.aborted = period, []

    def generate(self, prompt, params, request_id):
        async def stream():
            k = 0
            while True:
                await asyncio.sleep(self.period)
                yield _out(request_id, k, False)
                k += 1
        return stream()

    async def abort(self, request_id):
        self.aborted.append(request_id)


def test_a_stream_whose_client_stops_reading_is_aborted_and_its_backlog_dropped():
    """Outputs that waited unread past stall_timeout: the prompts are aborted, what waited is
    dropped (the front end's memory stays bounded), and the consumer, back, gets StreamStalled.
    A consumer that keeps reading, however slowly, is never stopped."""
    from server.streams import StreamStalled

    async def main():
        engine = TickingEngine(0.005)
        streams = _streams(engine, prompts=2)
        streams.stall_timeout = 1.0  # generous: a busy machine's pauses must not look like a stall
        got, loop = [], asyncio.get_running_loop()
        start = loop.time()
        async for b in streams.batches():  # a client reading slowly, for 1.5x stall_timeout: kept
            got += b
            if loop.time() - start > 1.5:
                break
            await asyncio.sleep(0.02)
        await asyncio.sleep(2.5)  # then not reading at all
        waiting = streams._queue.qsize()
        with pytest.raises(StreamStalled, match="--stream-stall-timeout"):
            async for _ in streams.batches():
                pass
        await asyncio.sleep(0.05)  # the abort runs in a background task
        return got, waiting, sorted(engine.aborted), streams.stalled

    got, waiting, aborted, stalled = asyncio.run(main())
    assert len(got) >= 60 and stalled and waiting == 1  # only the StreamStalled item is left
    assert aborted == ["cmpl-x-0", "cmpl-x-1"]


def test_batches_yield_what_came_before_a_failure_then_raise():
    async def main():
        streams = _streams(QueuedEngine(5, fail_after=3))
        await asyncio.sleep(0)
        got = []
        with pytest.raises(ValueError, match="refused"):
            async for b in streams.batches():
                got.append([o.outputs[0].delta_token_ids[0] for _, o in b])
        return got
    assert asyncio.run(main()) == [[0, 1, 2]]


class _Builder:
    def chunks(self, i, out):
        o = out.outputs[0]
        yield {"index": i, "token_ids": o.delta_token_ids, "finish_reason": o.finish_reason}, {}, {}

    def usage(self, finals):
        return {"completion_tokens": len(finals)}


class _Tracker:
    def __init__(self):
        self.observed = []

    def observe(self, i, out):
        self.observed.append((i, out.outputs[0].delta_token_ids[0]))

    def close(self, n):
        pass


class _Req:
    continuous_usage, include_usage = False, True


def _events_of(writes: list[str]) -> list:
    text = "".join(writes)
    assert text.endswith("\n\n")
    return [e.removeprefix("data: ") for e in text[:-2].split("\n\n")]


@pytest.mark.parametrize("fail_after", [None, 2])
def test_sse_events_of_queued_outputs_go_out_in_one_write(fail_after):
    async def main():
        streams = _streams(QueuedEngine(4, fail_after=fail_after))
        await asyncio.sleep(0)
        tracker = _Tracker()
        writes = [w async for w in _events(streams, _Builder(), {"id": "cmpl-x"}, tracker, _Req(), 1)]
        return writes, tracker.observed
    writes, observed = asyncio.run(main())
    # everything was queued: one write, [DONE] included; a failure goes out in a write of its own
    assert len(writes) == (1 if fail_after is None else 2)
    events = _events_of(writes)
    assert events[-1] == "[DONE]"
    n = 4 if fail_after is None else fail_after
    chunks = [json.loads(e) for e in events[:n]]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[k] for k in range(n)]
    assert observed == [(0, k) for k in range(n)]
    tail = json.loads(events[n])
    if fail_after is None:
        assert tail["usage"] == {"completion_tokens": 1} and tail["choices"] == []
    else:  # the failure in-band after the chunks that came before it
        assert tail["error"]["type"] == "invalid_request_error" and "refused" in tail["error"]["message"]
    assert len(events) == n + 2


def test_sse_events_go_out_one_write_per_output_when_the_client_keeps_up():
    async def main():
        gate = asyncio.Event()
        streams = _streams(QueuedEngine(3, gate))
        writes = []
        gen = _events(streams, _Builder(), {"id": "cmpl-x"}, _Tracker(), _Req(), 1)
        for _ in range(3):
            gate.set()
            writes.append(await gen.__anext__())
        async for w in gen:
            writes.append(w)
        return writes
    writes = asyncio.run(main())
    # the last output's chunk goes out with the usage and [DONE]
    assert [len(_events_of([w])) for w in writes] == [1, 1, 3]


@pytest.mark.skipif(not hasattr(asyncio, "timeout"), reason="asyncio.timeout is Python 3.11+")
def test_a_burst_of_requests_each_reaches_the_app_without_waiting_for_the_others():
    """BodyLimitMiddleware reads a body that is already in without giving up the event loop, so
    each request of a burst goes on to the app (and the engine) at once, not after every other
    request of the burst has read its body."""
    from server.http_limits import BodyLimitMiddleware

    events = []

    async def inner(scope, receive, send):
        body = (await receive())["body"]
        events.append(("app", body))

    mw = BodyLimitMiddleware(inner, max_body_bytes=1 << 20, body_timeout=5.0)

    def request(i: int):
        async def receive():
            events.append(("read", i))
            return {"type": "http.request", "body": b"%d" % i, "more_body": False}
        return mw({"type": "http", "headers": []}, receive, None)

    async def main():
        await asyncio.gather(*(request(i) for i in range(4)))
    asyncio.run(main())
    assert events == [e for i in range(4) for e in (("read", i), ("app", b"%d" % i))]


def test_a_slow_body_still_times_out():
    from server.http_limits import BodyLimitMiddleware

    sent = []

    async def inner(scope, receive, send):
        raise AssertionError("the app must not run")

    async def receive():
        await asyncio.sleep(10)

    async def send(message):
        sent.append(message)

    mw = BodyLimitMiddleware(inner, max_body_bytes=1 << 20, body_timeout=0.05)
    asyncio.run(mw({"type": "http", "headers": []}, receive, send))
    assert sent[0]["status"] == 408 and b"--http-body-timeout" in sent[1]["body"]


def test_bodies_read_at_once_are_bounded_together():
    """Each body is bounded alone; those being read at once together (--max-inflight-body-bytes):
    a slow sender holds its bytes, so a body that would pass the sum is a 503, and the bytes of a
    body read to its end or refused are given back. A body in one message holds nothing."""
    from server.http_limits import BodyLimitMiddleware

    async def inner(scope, receive, send):
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(body)).encode()})

    def chunks(*parts, hold: asyncio.Event | None = None):
        async def receive():
            if not parts_left:
                await hold.wait()
                return {"type": "http.disconnect"}
            part = parts_left.pop(0)
            return {"type": "http.request", "body": part, "more_body": bool(parts_left) or hold is not None}
        parts_left = list(parts)
        return receive

    async def main():
        mw = BodyLimitMiddleware(inner, max_body_bytes=1000, body_timeout=5, max_inflight_bytes=1500)
        out = {}

        def run(name, receive):
            sent = out.setdefault(name, [])

            async def send(m):
                sent.append(m)
            return asyncio.create_task(mw({"type": "http", "headers": []}, receive, send))
        hold = asyncio.Event()
        slow = run("slow", chunks(b"a" * 900, hold=hold))  # 900 bytes held, more to come
        await asyncio.sleep(0.01)
        assert mw.inflight == 900
        await run("busy", chunks(b"b" * 400, b"b" * 400))  # 900 + 800 > 1500
        await run("fits", chunks(b"c" * 300, b"c" * 300))  # 900 + 600
        await run("whole", chunks(b"d" * 1000))  # one message: held by nothing here
        hold.set()
        await slow  # the slow sender leaves: its bytes are given back
        return out, mw.inflight

    out, left = asyncio.run(main())
    assert out["busy"][0]["status"] == 503 and b"--max-inflight-body-bytes" in out["busy"][1]["body"]
    assert out["fits"][1]["body"] == b"600" and out["whole"][1]["body"] == b"1000"
    assert out["slow"] == [] and left == 0


@pytest.mark.slow
def test_serve_freezes_the_start_up_objects_of_both_processes(tmp_path_factory, tmp_path, monkeypatch):
    """The HTTP process, like the engine core, moves its start-up objects out of garbage
    collection before it serves, and both space full collections out: they then walk only what
    requests allocate, ten times less often."""
    from tests.server_fixtures import ServeProcess, tiny_model_dir

    log = tmp_path / "serve.log"
    monkeypatch.setenv("SERVE_TEST_LOG", str(log))
    monkeypatch.setenv("VLLM_LOG_STATS_INTERVAL", "0.25")  # vLLM's periodic stats line, tested here too
    with ServeProcess("--model", tiny_model_dir(tmp_path_factory), "--skip-tokenizer-init",
                      "--device", "cpu", "--dtype", "float32", "--max-model-len", "256",
                      "--num-kv-blocks", "64") as s:
        r = httpx.post(f"{s.url}/v1/completions", timeout=60,
                       json={"prompt": [5, 6, 7, 8], "max_tokens": 40, "ignore_eos": True})
        assert r.status_code == 200
        time.sleep(0.6)
    text = log.read_text()
    stats = [line for line in text.splitlines() if "INFO server.stats: Engine 000: Avg prompt throughput" in line]
    assert stats and any("Avg generation throughput: 0.0 " not in line for line in stats), text[-2000:]
    assert all(" reqs, GPU KV cache usage: " in line and "Prefix cache hit rate: " in line for line in stats)
    frozen = [line for line in text.splitlines() if "start-up objects frozen" in line]
    assert any("engine-core" in line for line in frozen), text[-2000:]
    front = [line for line in frozen if "engine-core" not in line]
    assert front, text[-2000:]
    assert text.index(front[0]) < text.index("serving ")  # before the first request can come
    assert all("a full collection after every 100 of the middle generation" in line for line in frozen)
