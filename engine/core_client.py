"""The front end's handle on the engine core: starts it (its own process by default), sends it
commands, hands its outputs to a callback, and reports its death.

Two threads of the front end's process keep the pipes moving, so neither the event loop nor the
core ever waits on the other: a writer thread batches queued commands into one message, a reader
thread receives output messages and passes them on. See engine/core_proc.py for the protocol.

Under --api-server-count N (server/api_servers.py) serve's parent process starts the core with N
pipe pairs and each API server process attaches to its own (`CoreLink`): its engine request ids
carry the server's index, so that ids chosen by different servers (a client's X-Request-Id) never
meet in the core.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import pickle
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from common.args import EngineArgs
from engine.core_proc import CoreInfo, CoreStats, core_main, decode_outputs
from models.config import ModelConfig
from scheduler.outputs import EngineCoreOutput

log = logging.getLogger(__name__)

_START_POLL_S = 0.5
# The reader thread sees the core's death as the end of its pipe; `alive` polls the process too,
# as a backstop, at most this often: each poll is a waitpid system call, which hands the GIL to
# whichever thread waits for it (one poll a request was ~11% of the HTTP process's busy time in
# bench_core_overhead.py --echo-logprobs 1, the event loop waiting to get the GIL back).
_ALIVE_POLL_S = 0.25
_JOIN_S = 30.0  # the core joins its workers (5 s each) before it exits


class EngineStartError(RuntimeError):
    """The engine core failed to start (bad model directory, flag, out of memory...)."""


@dataclass
class CoreLink:
    """An API server's pipe pair to a core started by another process (server/api_servers.py)."""

    cmd: object  # multiprocessing Connection, written
    out: object  # multiprocessing Connection, read
    index: int  # the API server's index: its engine request ids' prefix

    @property
    def prefix(self) -> str:
        return f"{self.index}|"


class CoreClient:
    """Starts the engine core and talks to it.

    `on_outputs(outputs, stats)` runs on the reader thread for every output message;
    `on_refused([(engine_req_id, message)])` there for requests the core would not take (their
    own values could not run); `on_control((id, error, result))` there for the answer to a
    `profile` command; `on_death(message)` there once if the core dies.
    `in_thread=True` runs the same loop in a thread of this process (same protocol), for tests
    and debugging; the default is a spawned process (CUDA-safe, its own GIL). `link` attaches to a
    core another process started instead (one of several API servers).
    """

    def __init__(self, args: EngineArgs, cfg: ModelConfig, eos_token_id: int | None,
                 on_outputs: Callable[[list[EngineCoreOutput], CoreStats], None],
                 on_death: Callable[[str], None],
                 on_refused: Callable[[list[tuple[str, str]]], None] | None = None,
                 in_thread: bool = False, on_control: Callable[[tuple], None] | None = None,
                 link: CoreLink | None = None):
        self._on_outputs, self._on_death = on_outputs, on_death
        self._on_refused = on_refused or (lambda refused: None)
        self._on_control = on_control or (lambda answer: None)
        self.error: str | None = None
        self._closing = False
        self._polled_at, self._was_alive = float("-inf"), True
        self._commands: queue.Queue = queue.Queue()
        self._prefix = link.prefix if link is not None else ""
        self._proc = self._runner = None
        if link is not None:
            self._cmd, self._out = link.cmd, link.out
        else:
            self._start(args, cfg, eos_token_id, in_thread)
        try:
            self.info = self._wait_ready()
        except EngineStartError:
            self._kill(grace_s=10.0)  # it reported its error and is on its way out
            raise
        except BaseException:  # Ctrl-C while loading
            self._kill()
            raise
        self._reader = threading.Thread(target=self._read, name="engine-core-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="engine-core-writer", daemon=True)
        self._reader.start()
        self._writer.start()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref().shutdown())

    def _start(self, args: EngineArgs, cfg: ModelConfig, eos_token_id: int | None,
               in_thread: bool) -> None:
        ctx = mp.get_context("spawn")
        cmd_r, self._cmd = ctx.Pipe(duplex=False)
        self._out, out_w = ctx.Pipe(duplex=False)
        core_args = (args, cfg, eos_token_id, [cmd_r], [out_w], not in_thread,
                     logging.getLogger().getEffectiveLevel())
        if in_thread:
            self._runner = threading.Thread(target=core_main, args=core_args, name="engine-core",
                                            daemon=True)
            self._runner.start()
        else:
            # Not a daemon: the core spawns the worker processes under -tp.
            self._proc = ctx.Process(target=core_main, args=core_args, name="engine-core")
            self._proc.start()
            cmd_r.close()
            out_w.close()

    def _alive(self) -> bool:
        """The core process or thread runs; attached (another process's child), the end of the
        output pipe is the only sign of its death, and the reader reports it."""
        if self._proc is not None:
            return self._proc.is_alive()
        return self._runner.is_alive() if self._runner is not None else self.error is None

    def _wait_ready(self) -> CoreInfo:
        while not self._out.poll(_START_POLL_S):
            if not self._alive():
                break
        try:
            kind, payload = pickle.loads(self._out.recv_bytes()) if self._out.poll(0) else (None, None)
        except EOFError:
            kind, payload = None, None
        if kind == "ready":
            return payload
        if kind == "error":
            raise EngineStartError(payload)
        code = self._proc.exitcode if self._proc is not None else None
        raise EngineStartError(f"the engine core exited during start-up (exit code {code}); "
                               "see the log above")

    @property
    def alive(self) -> bool:
        """False once the reader has reported the core's death, or a poll (at most one per
        _ALIVE_POLL_S; a dead core stays dead) found it gone."""
        if self.error is not None or not self._was_alive:
            return False
        now = time.monotonic()
        if now - self._polled_at >= _ALIVE_POLL_S:
            self._polled_at, self._was_alive = now, self._alive()
        return self._was_alive

    # ---- commands (any thread; never blocks) ----

    def add(self, requests: list[tuple[str, list[int], object]]) -> None:
        if self._prefix:
            requests = [(self._prefix + rid, ids, p) for rid, ids, p in requests]
        self._commands.put(("add", requests))

    def abort(self, req_ids: list[str]) -> None:
        if self._prefix:
            req_ids = [self._prefix + rid for rid in req_ids]
        self._commands.put(("abort", req_ids))

    def reset_prefix_cache(self) -> None:
        self._commands.put(("reset_prefix_cache", None))

    def profile(self, control_id: int, action: str) -> None:
        self._commands.put(("profile", (control_id, action)))

    # ---- pipe threads ----

    def _write(self) -> None:
        while True:
            batch = [self._commands.get()]
            while True:
                try:
                    batch.append(self._commands.get_nowait())
                except queue.Empty:
                    break
            try:
                self._cmd.send_bytes(pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL))
            except OSError:
                return  # the core is gone; the reader reports it
            if any(kind == "shutdown" for kind, _ in batch):
                return

    def _read(self) -> None:
        try:
            while True:
                kind, payload = pickle.loads(self._out.recv_bytes())
                if kind == "outputs":
                    rows, stats = payload
                    if self._prefix:
                        n = len(self._prefix)
                        rows = [(r[0][n:], *r[1:]) for r in rows]  # req_id is the first field
                    self._on_outputs(decode_outputs(rows), stats)
                elif kind == "refused":
                    if self._prefix:  # the message may name the id: as the front end knows it
                        payload = [(rid[len(self._prefix):], m.replace(rid, rid[len(self._prefix):]))
                                   for rid, m in payload]
                    self._on_refused(payload)
                elif kind == "control":
                    self._on_control(payload)
                elif kind == "dead":
                    self._die(f"engine core died: {payload}")
                    return
        except (EOFError, OSError):
            if not self._closing:
                code = self._proc.exitcode if self._proc is not None else None
                self._die(f"engine core process exited unexpectedly (exit code {code})")

    def _die(self, message: str) -> None:
        if self.error is None:
            self.error = message.splitlines()[0]
            log.error("%s", message)
            self._on_death(self.error)

    # ---- shutdown ----

    def shutdown(self, timeout: float = _JOIN_S) -> None:
        """Stop the core (it stops its workers) and wait for it; idempotent."""
        if self._closing:
            return
        self._closing = True
        self._commands.put(("shutdown", None))
        end = time.monotonic() + timeout
        self._writer.join(max(0.0, end - time.monotonic()))
        if self._proc is not None:
            self._proc.join(max(0.0, end - time.monotonic()))
            if self._proc.is_alive():
                log.warning("engine core did not stop in %.0f s; killing it", timeout)
                self._kill()
        elif self._runner is not None:
            self._runner.join(max(0.0, end - time.monotonic()))
        # attached, the core closes this server's output pipe once it has read the shutdown: the
        # outputs it sent before arrive first
        self._reader.join(1.0 if self._prefix == "" else 5.0)

    def _kill(self, grace_s: float = 0.0) -> None:
        self._closing = True
        if self._proc is not None and grace_s:
            self._proc.join(grace_s)
        if self._proc is not None and self._proc.is_alive():
            self._proc.terminate()
            self._proc.join(5)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join()
