"""The engine core's own process: the step loop, fed and drained over two pipes.

Transport: two one-way `multiprocessing` pipes carrying pickled plain tuples (stdlib only, so it
runs on any machine without extra packages). Front end -> core: a list of commands per message,
`("add", [(engine_req_id, prompt_token_ids, params), ...])`, `("abort", [engine_req_id, ...])`,
`("shutdown", None)`. Core -> front end: `("ready", CoreInfo)` or `("error", message)` once at
start-up, then `("outputs", (rows, stats))` after every loop turn that changed something,
`("refused", [(engine_req_id, message), ...])` for requests `EngineCore.add_request` refused
(a ValueError: that request's own values could not run; the engine goes on) or whose grammar,
compiled off the loop, failed (`EngineCore.admit_compiled`: later, before any output of theirs), and
`("dead", message)` if the loop fails. A row is one EngineCoreOutput as the tuple of its fields in
declaration order (a field added to the dataclass travels without touching this file): a step
of 256 decodes is ~15 KB, encoded and pickled in ~0.13 ms on the CPU, a third of the time
pickling the dataclasses takes. Only new tokens cross, never cumulative lists.

Two threads of the core process do the pipe work, so that the step loop never waits on the
front end: a receiver reads and unpickles commands into a queue the loop drains between steps,
a sender encodes, pickles and writes output messages.

The core process builds the executor itself, so under -tp it is the parent of the worker
processes (engine/multiproc.py); rank 0's output comes back to it as before.
"""

from __future__ import annotations

import copy

import dataclasses
import logging
import operator
import pickle
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass

from common.args import EngineArgs
from engine.core import EngineCore
from engine.data_parallel import DataParallelScheduler, summed_stats
from models.config import ModelConfig
from scheduler.outputs import EngineCoreOutput

log = logging.getLogger(__name__)

_FIELDS = tuple(f.name for f in dataclasses.fields(EngineCoreOutput))
_row = operator.attrgetter(*_FIELDS)  # EngineCoreOutput -> tuple of its fields, in C
_IDLE_POLL_S = 1.0
_COMPILE_POLL_S = 0.002  # while only grammars compile: how soon a compiled request starts
_MAX_MESSAGES_PER_STEP = 64  # each message is every command the front end had queued


@dataclass
class CoreInfo:
    """What the front end needs from the built core to validate requests."""

    max_model_len: int
    capacity_tokens: int
    num_blocks: int  # every DP rank's
    num_engines: int = 1  # DP ranks (each its own scheduler and KV cache)


@dataclass
class CoreStats:
    """Scheduler counters, sent with every output message (a few ints)."""

    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_steps: int = 0
    step_tokens: int = 0  # tokens scheduled by the step this message reports (0: none)
    spec: object = None  # scheduler.scheduler.SpecDecodeStats (a copy) with speculative decoding
    prompt_tokens: int = 0  # cumulative: each request's prompt as its first output comes
    generation_tokens: int = 0  # cumulative: tokens output
    # under -dp, each DP rank's own (CoreStats with per_engine None; requests whose grammar is
    # still compiling, not yet given to a rank, wait on rank 0's); else None
    per_engine: list | None = None


def encode_outputs(outs: list[EngineCoreOutput]) -> list[tuple]:
    return [_row(o) for o in outs]


def decode_outputs(rows: list[tuple]) -> list[EngineCoreOutput]:
    return [EngineCoreOutput(*r) for r in rows]


def _send(conn, msg) -> None:
    conn.send_bytes(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL))


def core_main(args: EngineArgs, cfg: ModelConfig, eos_token_id: int | None, cmd_conn, out_conn,
              own_process: bool = True, log_level: int = logging.INFO) -> None:
    """Entry point of the engine-core process (or thread): build the core, then step until told
    to stop or the front end goes away."""
    if own_process:
        # Ctrl-C reaches the whole process group; the front end decides when the core stops
        # (and the workers it spawns inherit the ignore, so they too wait to be told).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        logging.basicConfig(level=log_level,
                            format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore(args, cfg, eos_token_id, serving=True)
    except BaseException as e:  # noqa: BLE001 - any start-up failure goes to the user as one line
        log.debug("engine core failed to start", exc_info=True)
        try:
            _send(out_conn, ("error", f"{e}" if isinstance(e, (ValueError, OSError))
                             else f"{type(e).__name__}: {e}"))
        except OSError:
            pass
        return
    sender = None
    try:
        _send(out_conn, ("ready", CoreInfo(core.max_model_len,
                                           core.scheduler.config.capacity_tokens,
                                           core.scheduler.stats.num_total_blocks,
                                           len(core.scheduler.schedulers))))
        sender = _Sender(out_conn)
        _loop(core, _Receiver(cmd_conn), sender)
    except (EOFError, BrokenPipeError):
        pass  # the front end is gone: nobody to report to
    except BaseException as e:  # noqa: BLE001 - report any fault; the front end fails its requests
        log.exception("engine core died")
        if sender is not None:
            sender.put(("dead", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if sender is not None:
            sender.close()
        core.shutdown()


class _Sender:
    """Encodes, pickles and writes output messages on its own thread, so the step loop never
    waits on a full pipe (a front end busy with HTTP work drains it late) and the encoding
    overlaps the next step (the loop releases the GIL while the device runs)."""

    def __init__(self, conn):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core-sender", daemon=True)
        self._thread.start()

    def put(self, msg) -> None:
        self._queue.put(msg)

    def _run(self) -> None:
        while (msg := self._queue.get()) is not None:
            kind, payload = msg
            if kind == "outputs":
                outs, stats = payload
                msg = (kind, (encode_outputs(outs), stats))
            try:
                _send(self._conn, msg)
            except OSError:
                return  # the front end is gone

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(10.0)


class _Receiver:
    """Reads and unpickles command messages on its own thread, so that the step loop never
    waits on the pipe: a message the front end's writer thread has only partly written (it
    shares its GIL with the busy event loop) would otherwise hold the loop in a read."""

    _EOF = object()

    def __init__(self, conn):
        self._conn = conn
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine-core-receiver", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                commands = pickle.loads(self._conn.recv_bytes())
                self._queue.put(commands)
                if any(kind == "shutdown" for kind, _ in commands):
                    return
        except (EOFError, OSError):
            self._queue.put(self._EOF)  # the front end is gone
        except BaseException as e:  # noqa: BLE001 - an undecodable message: the loop raises it
            self._queue.put(e)

    def get(self, timeout: float) -> list:
        """The next message's commands, waiting up to `timeout` s (0: not at all); raises
        queue.Empty when none came, EOFError once the front end has gone."""
        commands = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        if commands is self._EOF:
            self._queue.put(self._EOF)
            raise EOFError("the front end closed the command pipe")
        if isinstance(commands, BaseException):
            raise commands
        return commands


def _loop(core, receiver: _Receiver, sender: _Sender) -> None:
    steps = 0
    last_report = time.monotonic()
    while True:
        # Idle: wait for work (polling often while grammars compile). Busy: take the commands
        # that arrived, then step.
        busy = core.has_unfinished_requests()
        got = _take_commands(core, receiver, sender,
                             0 if busy else _COMPILE_POLL_S if core.num_compiling else _IDLE_POLL_S)
        if got is None:
            return  # shutdown
        outs, changed = got
        if core.num_compiling:
            refused = core.admit_compiled()
            if refused:
                sender.put(("refused", refused))
            # a long compile with nothing else to run: report anyway, so that the front end's
            # stall watchdog sees the core alive
            changed = changed or time.monotonic() - last_report > _IDLE_POLL_S
        step_tokens = 0
        if core.has_unfinished_requests():
            outs += core.step()
            steps += 1
            step_tokens = core.step_tokens
            changed = True
        if changed:
            _report(core, sender, outs, steps, step_tokens)
            last_report = time.monotonic()


def _take_commands(core, receiver: _Receiver, sender: _Sender,
                   timeout: float) -> tuple[list[EngineCoreOutput], bool] | None:
    """Apply the commands that arrived (waiting up to `timeout` for the first): a bounded number
    of messages, so that a flood of arrivals cannot hold the step back. Returns the outputs of
    aborts and whether anything arrived, or None on shutdown."""
    outs: list[EngineCoreOutput] = []
    changed = False
    for _ in range(_MAX_MESSAGES_PER_STEP):
        try:
            commands = receiver.get(timeout)
        except queue.Empty:
            break
        for kind, payload in commands:
            if kind == "add":
                refused = []
                for req_id, prompt_ids, params in payload:
                    try:
                        core.add_request(req_id, prompt_ids, params)
                    except ValueError as e:  # this request's own fault: it fails alone
                        refused.append((req_id, str(e)))
                if refused:
                    sender.put(("refused", refused))
            elif kind == "abort":
                outs += core.abort_requests(payload)
            elif kind == "reset_prefix_cache":  # before any request sent after it is admitted
                core.reset_prefix_cache()
            elif kind == "profile":  # (control id, "start" | "stop"): answered ("control", (id, error, traces))
                cid, action = payload
                try:
                    traces = core.profile.start() if action == "start" else core.profile.stop()
                    sender.put(("control", (cid, None, traces)))
                except ValueError as e:  # misuse (not configured, already running, not running)
                    sender.put(("control", (cid, str(e), None)))
            elif kind == "shutdown":
                return None
        changed, timeout = True, 0
    return outs, changed


def _report(core, sender: _Sender, outs: list[EngineCoreOutput], steps: int,
            step_tokens: int) -> None:
    """Queue one output message: the outputs and the scheduler's counters (the sender thread
    encodes and writes it)."""
    sched = core.scheduler
    if not isinstance(sched, DataParallelScheduler):
        sender.put(("outputs", (outs, _core_stats(sched.stats, core.num_compiling, steps, step_tokens))))
        return
    # each DP rank's counts, read once, and their sum
    parts = sched.stats_per_engine
    step_parts = core.step_tokens_per_engine if step_tokens else None
    stats = _core_stats(summed_stats(parts), core.num_compiling, steps, step_tokens)
    stats.per_engine = [_core_stats(s, core.num_compiling if d == 0 else 0, steps, step_parts[d] if step_parts else 0)
                        for d, s in enumerate(parts)]
    sender.put(("outputs", (outs, stats)))


def _core_stats(s, compiling: int, steps: int, step_tokens: int) -> CoreStats:
    return CoreStats(s.num_running, s.num_waiting + compiling, s.num_free_blocks, s.num_total_blocks,
                     s.kv_cache_usage, s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits,
                     steps, step_tokens, copy.deepcopy(s.spec), s.prompt_tokens, s.generation_tokens)
