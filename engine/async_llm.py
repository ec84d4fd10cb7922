"""Async front end for the HTTP server: the engine core steps in its own thread, the event loop
tokenizes, detokenizes and streams. Only plain data crosses between the two (a command queue one
way, lists of EngineCoreOutput the other), so a slow client never stalls a step and a step never
blocks HTTP handling.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from engine.args import EngineArgs
from engine.llm import build_engine
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from scheduler.outputs import EngineCoreOutput

log = logging.getLogger(__name__)


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


class EngineDeadError(RuntimeError):
    pass


class AsyncLLM:
    def __init__(self, args: EngineArgs):
        self.args = args
        self.core, self.inputs, self.outputs = build_engine(args)
        self.tokenizer = self.outputs.tokenizer
        self.model_config = self.core.cfg
        self.max_model_len = self.core.max_model_len
        self.model_name = args.model_name
        self.model_names = args.model_names  # all accepted as `model`; model_name is the first
        self._queues: dict[str, asyncio.Queue] = {}
        self._commands: queue.Queue = queue.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._error: BaseException | None = None
        self._stop = threading.Event()
        self._prompt_tokens = self._generation_tokens = self._steps = 0
        self._heartbeat = time.monotonic()  # the engine thread's last loop turn (step or idle poll)
        self._thread = threading.Thread(target=self._run, name="engine-core", daemon=True)
        self._thread.start()

    # ---- engine thread ----

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._heartbeat = time.monotonic()
                idle = not self.core.has_unfinished_requests()
                try:
                    cmd = self._commands.get(timeout=0.05) if idle else self._commands.get_nowait()
                except queue.Empty:
                    cmd = None
                while cmd is not None:
                    self._apply(cmd)
                    try:
                        cmd = self._commands.get_nowait()
                    except queue.Empty:
                        cmd = None
                if self.core.has_unfinished_requests():
                    outs = self.core.step()
                    self._steps += 1
                    if outs:
                        self._deliver(outs)
        except BaseException as e:  # noqa: BLE001 - any fault kills the engine; report it to everyone
            log.exception("engine core died")
            self._error = e
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self._fail_all)

    def _apply(self, cmd) -> None:
        kind, payload = cmd
        if kind == "add":
            request_id, children = payload
            for i, (cid, ids, params) in enumerate(children):
                try:
                    self.core.add_request(cid, ids, params)
                except Exception as e:  # noqa: BLE001 - this request's own fault: fail it alone
                    log.warning("request %s refused by the engine core: %s", request_id, e)
                    self.core.abort_requests([c for c, _, _ in children[:i]])  # its siblings
                    self._loop.call_soon_threadsafe(self._fail_request, request_id, e)
                    return
        else:
            outs = self.core.abort_requests(payload)
            if outs:
                self._deliver(outs)

    def _deliver(self, outs: list[EngineCoreOutput]) -> None:
        self._loop.call_soon_threadsafe(self._on_outputs, outs)

    # ---- event-loop side ----

    def _on_outputs(self, outs: list[EngineCoreOutput]) -> None:
        for o in outs:
            self._generation_tokens += len(o.new_token_ids)
        results, to_abort = self.outputs.process(outs)
        if to_abort:
            self._commands.put(("abort", to_abort))
        for r in results:
            q = self._queues.get(r.request_id)
            if q is not None:
                q.put_nowait(r)

    def _fail_request(self, request_id: str, exc: Exception) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(exc)

    def _fail_all(self) -> None:
        for q in self._queues.values():
            q.put_nowait(EngineDeadError(f"engine core died: {self._error!r}"))

    def stalled_for(self) -> float:
        """Seconds the engine has held unfinished requests without completing a step (0 while
        idle or progressing): a wedged worker or collective shows here while the thread lives."""
        if not self._queues:
            return 0.0
        return max(0.0, time.monotonic() - self._heartbeat)

    @property
    def errored(self) -> bool:
        return self._error is not None or not self._thread.is_alive()

    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutputs until finished; see /work notes in engine/outputs.py for fields."""
        if self.errored:
            raise EngineDeadError("engine core is not running")
        self._loop = self._loop or asyncio.get_running_loop()
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        # Tokenizing a long prompt takes a while: off the event loop, so other requests and
        # /health are served meanwhile.
        text, ids, params = await asyncio.to_thread(self.inputs.process, prompt, params)
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} is already in use")
        children = self.outputs.add_request(request_id, text, ids, params)
        if self.args.enable_log_requests:
            log.info("request %s: %d prompt tokens, %s", request_id, len(ids), params)
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        self._prompt_tokens += len(ids)
        self._commands.put(("add", (request_id, [(cid, ids, p) for cid, p in children])))
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
            self._queues.pop(request_id, None)
            if not finished:  # client went away (cancelled / closed the generator): free its blocks
                await self.abort(request_id)

    async def abort(self, request_id: str) -> None:
        children = self.outputs.child_ids(request_id)
        self.outputs.abort(request_id)
        if children:
            self._commands.put(("abort", children))

    def stats(self) -> EngineStats:
        s = self.core.scheduler.stats
        return EngineStats(s.num_running, s.num_waiting, s.num_free_blocks, s.num_total_blocks,
                           s.kv_cache_usage, s.num_preemptions, self._prompt_tokens,
                           self._generation_tokens, s.prefix_cache_queries, s.prefix_cache_hits,
                           self._steps)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)
        self.core.shutdown()

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """Block until the engine holds no request (for tests and graceful shutdown)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self._commands.empty() and not self.core.has_unfinished_requests():
                return True
            time.sleep(0.01)
        return False
