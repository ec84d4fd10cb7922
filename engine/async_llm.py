"""Async front end for the HTTP server: the engine core runs in its own process (CoreClient);
this side tokenizes, detokenizes and streams on the event loop. Only plain data crosses (commands
one way, per-step EngineCoreOutput deltas the other), so HTTP work never stalls a step and a step
never blocks HTTP handling.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from common.args import EngineArgs
from common.offload import off_loop
from engine.core_client import CoreClient, CoreLink, EngineStartError
from engine.core_proc import CoreStats
from engine.llm import load_front_end
from engine.outputs import RequestOutput
from common.sampling_params import SamplingParams
from scheduler.outputs import EngineCoreOutput

log = logging.getLogger(__name__)

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStartError", "EngineStats"]


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_steps: int
    # tokens per engine step: (bucket upper bounds, steps per bucket with one more for +Inf,
    # sum of tokens); vLLM's iteration_tokens_total histogram
    iteration_tokens: tuple[tuple[int, ...], list[int], int] | None = None
    spec: object = None  # scheduler.scheduler.SpecDecodeStats with speculative decoding, else None
    engine_index: int = 0
    # under -dp, each DP rank's own (EngineStats with per_engine None); else None
    per_engine: list | None = None


def iteration_buckets(max_num_batched_tokens: int) -> tuple[int, ...]:
    """1, 8, 16, 32, ... up to the step's token budget."""
    out, b = [1, 8], 16
    while b < max_num_batched_tokens:
        out.append(b)
        b *= 2
    return tuple(x for x in out if x < max_num_batched_tokens) + (max_num_batched_tokens,)


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    """`core_in_thread=True` runs the engine core in a thread of this process instead (same
    protocol; for tests and debugging); `core_link` attaches to a core another process started
    (one of several API server processes: server/api_servers.py)."""

    def __init__(self, args: EngineArgs, core_in_thread: bool = False, core_link: CoreLink | None = None):
        self.args = args
        self.model_config, self.inputs, self.outputs = load_front_end(args)
        self.tokenizer = self.outputs.tokenizer
        self.model_name = args.model_name
        self.model_names = args.model_names  # all accepted as `model`; model_name is the first
        # the token ids prompts may hold (the model's vocabulary, cut to the tokenizer's where the
        # config's is padded past it): what /v1/models reports
        self.vocab_size = self.inputs.vocab_size
        self._queues: dict[str, asyncio.Queue] = {}
        try:
            self._loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            self._loop = None  # bound by the first generate()
        self._error: str | None = None
        self._core_stats = CoreStats()
        self._iter_buckets = iteration_buckets(args.max_num_batched_tokens)
        # tokens per step (written by the reader thread): [counts per bucket and +Inf, sum], of
        # the whole engine and then of each DP rank under -dp
        self._iter = [[[0] * (len(self._iter_buckets) + 1), 0] for _ in range(1 + args.data_parallel_size)]
        # Stall detection (/health): the core reports after every step, outputs or not.
        self._last_core_message = self._busy_since = time.monotonic()
        self._parent: dict[str, str] = {}  # engine (child) request id -> request id
        self._children: dict[str, list[str]] = {}  # request id -> its engine request ids
        self._submitted: set[str] = set()  # requests handed to the core and not yet over
        self._controls: dict[int, asyncio.Future] = {}  # control id -> its answer (/start_profile ...)
        self._control_ids = itertools.count()
        self.core = CoreClient(args, self.model_config, self.inputs.eos_token_id,
                               self._on_core_outputs, self._on_core_death, self._on_refused,
                               in_thread=core_in_thread, on_control=self._on_control, link=core_link)
        n, dp = self.core.info.num_blocks, self.core.info.num_engines
        per = [CoreStats(num_free_blocks=n // dp, num_total_blocks=n // dp) for _ in range(dp)] if dp > 1 else None
        self._core_stats = CoreStats(num_free_blocks=n, num_total_blocks=n, per_engine=per)
        self.max_model_len = self.core.info.max_model_len
        self.inputs.max_model_len = self.core.info.max_model_len
        self.inputs.capacity_tokens = self.core.info.capacity_tokens

    # ---- reader thread ----

    def _on_core_outputs(self, outs: list[EngineCoreOutput], stats: CoreStats) -> None:
        self._last_core_message = time.monotonic()
        if stats.num_steps > self._core_stats.num_steps and stats.step_tokens > 0:
            for hist, tokens in zip(self._iter, [stats] + (stats.per_engine or [])):
                if tokens.step_tokens:
                    hist[0][bisect.bisect_left(self._iter_buckets, tokens.step_tokens)] += 1
                    hist[1] += tokens.step_tokens
        self._core_stats = stats
        if outs and self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_outputs, outs)

    def _on_refused(self, refused: list[tuple[str, str]]) -> None:
        """The core refused these engine requests (their own values could not run): each fails
        its request alone, with a ValueError (a 400 before any output); its generator's cleanup
        aborts the siblings the core did take."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_refused, refused)

    def _fail_refused(self, refused: list[tuple[str, str]]) -> None:
        for cid, message in refused:
            # the client's error (answered 400 naming the field), not the server's: INFO, so that a
            # client repeating it cannot fill the log with warnings
            log.info("request %s refused by the engine core: %s", cid, message)
            q = self._queues.get(self._parent.get(cid, cid))
            if q is not None:
                q.put_nowait(ValueError(message))

    def _on_core_death(self, message: str) -> None:
        self._error = message
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._fail_all)

    # ---- event-loop side ----

    def _on_outputs(self, outs: list[EngineCoreOutput]) -> None:
        results, to_abort = self.outputs.process(outs)
        if to_abort:
            self.core.abort(to_abort)
        for r in results:
            q = self._queues.get(r.request_id)
            if q is not None:
                q.put_nowait(r)

    def _fail_all(self) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(self._error or "the engine core stopped"))
        for fut in self._controls.values():
            if not fut.done():
                fut.set_exception(EngineDeadError(self._error or "the engine core stopped"))

    def _on_control(self, answer: tuple) -> None:  # reader thread
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._resolve_control, *answer)

    def _resolve_control(self, cid: int, error: str | None, result) -> None:
        fut = self._controls.pop(cid, None)
        if fut is None or fut.done():
            return
        if error is not None:
            fut.set_exception(ValueError(error))
        else:
            fut.set_result(result)

    async def start_profile(self) -> None:
        """Start every rank's profiler (--profiler-config); ValueError when it is off or running."""
        await self._control("start")

    async def stop_profile(self) -> list[str]:
        """Stop it and wait for the traces to be written; returns their paths."""
        return await self._control("stop")

    async def _control(self, action: str):
        if self.errored:
            raise EngineDeadError(self._error or "the engine core stopped")
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        cid = next(self._control_ids)
        fut = self._controls[cid] = self._loop.create_future()
        self.core.profile(cid, action)
        try:
            return await fut
        finally:
            self._controls.pop(cid, None)

    @property
    def errored(self) -> bool:
        return self._error is not None or not self.core.alive

    def has_unfinished_requests(self) -> bool:
        """Whether any request awaits outputs."""
        return bool(self._queues)

    def stalled_for(self) -> float:
        """Seconds the engine has held requests without reporting a step (0 while idle or
        progressing): a wedged worker or collective shows here while the core process lives."""
        if not self._submitted:
            return 0.0
        return max(0.0, time.monotonic() - max(self._last_core_message, self._busy_since))

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs (per-step deltas; engine/outputs.py) until finished.

        A token-id prompt is checked and handed to the engine core before this returns (a bad
        one raises ValueError here): when many requests arrive at once, the event loop parses
        them one after the other, and each reaches the core as soon as it is parsed rather than
        when its stream is first read, after all the others. A text prompt is tokenized off the
        event loop once the stream is read."""
        if isinstance(prompt, str):
            return self._stream(request_id, None, prompt, params)
        q = self._open(request_id)
        try:
            self._submit(request_id, self.inputs.process(prompt, params))
        except BaseException:
            self._queues.pop(request_id, None)
            raise
        return self._stream(request_id, q, None, None)

    def _open(self, request_id: str) -> asyncio.Queue:
        """Take the request id and the queue its outputs go to."""
        if self.errored:
            raise EngineDeadError("engine core is not running")
        self._loop = self._loop or asyncio.get_running_loop()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q  # the id is taken from here on
        return q

    def _submit(self, request_id: str, processed: tuple) -> None:
        """Register a checked request with the output processor and send it to the core."""
        text, ids, params = processed
        children = self.outputs.add_request(request_id, text, ids, params)
        if self.args.enable_log_requests:
            log.info("request %s: %d prompt tokens, %s", request_id, len(ids), params)
        self._children[request_id] = [cid for cid, _ in children]
        for cid, _ in children:
            self._parent[cid] = request_id
        if not self._submitted:
            self._busy_since = time.monotonic()  # the stall clock starts with the core's first request
        self._submitted.add(request_id)
        self.core.add([(cid, ids, p) for cid, p in children])

    def _release(self, request_id: str) -> None:
        """Forget a request's queue and ids (idempotent)."""
        self._queues.pop(request_id, None)
        self._submitted.discard(request_id)
        for cid in self._children.pop(request_id, ()):
            self._parent.pop(cid, None)

    async def _stream(self, request_id: str, q: asyncio.Queue | None, prompt: str | None,
                      params: SamplingParams | None) -> AsyncIterator[RequestOutput]:
        if q is None:  # a text prompt: tokenizing is the slow part, off the event loop
            q = self._open(request_id)
            try:
                self._submit(request_id, await off_loop(len(prompt), self.inputs.process, prompt, params))
            except BaseException:
                self._queues.pop(request_id, None)
                raise
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._release(request_id)
            if not finished:  # client went away (cancelled / closed the generator): free its blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        """Stop a request: in the output processor and the core; its queue and ids are released
        (also for a stream that was never read)."""
        children = self.outputs.child_ids(request_id)
        self.outputs.abort(request_id)
        self._release(request_id)
        if children:
            if self.args.enable_log_requests:
                log.info("Aborted request %s.", request_id)
            self.core.abort(children)

    def reset_prefix_cache(self) -> None:
        """Forget the prefix cache's blocks (every DP rank's). The core applies it in command
        order: every request submitted after this call is admitted after the reset."""
        self.core.reset_prefix_cache()

    def stats(self) -> EngineStats:
        """Scheduler counters as of the core's last message, and the steps' token counts: the
        whole engine's, with each DP rank's under -dp."""
        s = self._core_stats
        out = self._engine_stats(s, self._iter[0])
        if s.per_engine:
            out.per_engine = [self._engine_stats(p, h) for p, h in zip(s.per_engine, self._iter[1:])]
            for d, p in enumerate(out.per_engine):
                p.engine_index = d
        return out

    def _engine_stats(self, s: CoreStats, hist: list) -> EngineStats:
        return EngineStats(s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks,
                           s.kv_cache_usage, s.num_preemptions, s.prompt_tokens, s.generation_tokens,
                           s.prefix_cache_queries, s.prefix_cache_hits, s.num_steps,
                           (self._iter_buckets, list(hist[0]), hist[1]), s.spec)

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the engine core and its workers, and wait for them."""
        self.core.shutdown(timeout)
