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

Clients: one front end (serve's HTTP process), or under --api-server-count N one per API server
process (server/api_servers.py), each with its own pipe pair, receiver and sender thread. Each
client's engine request ids are unique across clients (engine/core_client.py prefixes them), and
each request's outputs and refusals go to the client that added it; every client gets the
scheduler's counters with every message (its gauges and stall watchdog read them). A client's
`shutdown`, or the end of its pipe, is its leaving: its requests are aborted and the others go on;
the loop stops when every client has left.

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
import sys
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


def core_main(args: EngineArgs, cfg: ModelConfig, eos_token_id: int | None, cmd_conns: list,
              out_conns: list, own_process: bool = True, log_level: int = logging.INFO) -> None:
    """Entry point of the engine-core process (or thread): build the core, then step until every
    client (one pipe pair each: `cmd_conns[i]`, `out_conns[i]`) has left."""
    if own_process:
        # Ctrl-C, and a SIGTERM to the whole group (systemd's stop, `timeout`), reach the core
        # too; the front end decides when it stops, after draining (a shutdown command, or the end
        # of its pipes), and the workers it spawns inherit the ignore, so they too wait to be told.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # serve --api-server-count starts it with them blocked (server/api_servers.py); ignored now
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        logging.basicConfig(level=log_level,
                            format="%(asctime)s engine-core %(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore(args, cfg, eos_token_id, serving=True)
    except BaseException as e:  # noqa: BLE001 - any start-up failure goes to the user as one line
        log.debug("engine core failed to start", exc_info=True)
        message = f"{e}" if isinstance(e, (ValueError, OSError)) else f"{type(e).__name__}: {e}"
        for conn in out_conns:
            try:
                _send(conn, ("error", message))
            except OSError:
                pass
        if own_process:
            sys.exit(1)
        return
    clients = None
    try:
        info = CoreInfo(core.max_model_len, core.scheduler.config.capacity_tokens,
                        core.scheduler.stats.num_total_blocks, len(core.scheduler.schedulers))
        for conn in out_conns:
            try:
                _send(conn, ("ready", info))
            except OSError:
                pass  # that client is gone already: its command pipe's end says so
        clients = _Clients(out_conns)
        _loop(core, _Receiver(cmd_conns), clients)
    except BaseException as e:  # noqa: BLE001 - report any fault; the front ends fail their requests
        log.exception("engine core died")
        if clients is not None:
            clients.broadcast(("dead", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if clients is not None:
            clients.close()
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
                break  # the front end is gone
        self._conn.close()  # the front end's reader sees the end

    def close(self, wait: bool = True) -> None:
        self._queue.put(None)
        if wait:
            self._thread.join(10.0)


class _Receiver:
    """Reads and unpickles command messages on one thread per client, so that the step loop never
    waits on a pipe: a message a front end's writer thread has only partly written (it shares its
    GIL with the busy event loop) would otherwise hold the loop in a read."""

    def __init__(self, conns: list):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = [threading.Thread(target=self._run, args=(c, conn), daemon=True,
                                          name=f"engine-core-receiver-{c}")
                         for c, conn in enumerate(conns)]
        for t in self._threads:
            t.start()

    def _run(self, client: int, conn) -> None:
        try:
            while True:
                commands = pickle.loads(conn.recv_bytes())
                self._queue.put((client, commands))
                if any(kind == "shutdown" for kind, _ in commands):
                    return
        except (EOFError, OSError):
            self._queue.put((client, None))  # that front end is gone
        except BaseException as e:  # noqa: BLE001 - an undecodable message: the loop raises it
            self._queue.put((client, e))

    def get(self, timeout: float) -> tuple[int, list | None]:
        """The next message: (client, its commands), or (client, None) once that client's pipe
        has ended; waits up to `timeout` s (0: not at all) and raises queue.Empty when none came."""
        client, commands = self._queue.get(timeout=timeout) if timeout > 0 else self._queue.get_nowait()
        if isinstance(commands, BaseException):
            raise commands
        return client, commands


class _Clients:
    """The front ends the core serves, each with its sender thread; routes each request's outputs
    and refusals to the client that added it (with one client, all go to it unexamined)."""

    def __init__(self, out_conns: list):
        self._senders = [_Sender(conn) for conn in out_conns]
        self.multi = len(out_conns) > 1
        self.present = set(range(len(out_conns)))
        self._owner: dict[str, int] = {}  # engine request id -> client (multi only)

    def added(self, client: int, req_id: str) -> None:
        if self.multi:
            self._owner[req_id] = client

    def to(self, client: int, msg) -> None:
        if client in self.present:
            self._senders[client].put(msg)

    def broadcast(self, msg) -> None:
        for c in self.present:
            self._senders[c].put(msg)

    def outputs(self, outs: list[EngineCoreOutput], stats: CoreStats) -> None:
        if not self.multi:
            self._senders[0].put(("outputs", (outs, stats)))
            return
        parts: list[list] = [[] for _ in self._senders]
        owner = self._owner
        for o in outs:
            c = owner.pop(o.req_id, None) if o.finish_reason is not None else owner.get(o.req_id)
            if c is not None:  # None: its client has left
                parts[c].append(o)
        for c in self.present:
            self._senders[c].put(("outputs", (parts[c], stats)))

    def refused_later(self, refused: list[tuple[str, str]]) -> None:
        """Requests taken, then refused (their grammar failed to compile): each to its client."""
        if not self.multi:
            self._senders[0].put(("refused", refused))
            return
        parts: dict[int, list] = {}
        for rid, message in refused:
            c = self._owner.pop(rid, None)
            if c is not None:
                parts.setdefault(c, []).append((rid, message))
        for c, part in parts.items():
            self.to(c, ("refused", part))

    def leave(self, client: int) -> list[str]:
        """The client is gone: stop writing to it (what was queued is still sent); returns its
        requests' ids, to abort."""
        if client not in self.present:
            return []
        self.present.discard(client)
        self._senders[client].close(wait=not self.present)  # the step loop waits only at the end
        mine = [rid for rid, c in self._owner.items() if c == client]
        for rid in mine:
            del self._owner[rid]
        return mine

    def close(self) -> None:
        for c in sorted(self.present):
            self._senders[c].close()
        self.present.clear()


def _loop(core, receiver: _Receiver, clients: _Clients) -> None:
    steps = 0
    last_report = time.monotonic()
    while True:
        # Idle: wait for work (polling often while grammars compile). Busy: take the commands
        # that arrived, then step.
        busy = core.has_unfinished_requests()
        got = _take_commands(core, receiver, clients,
                             0 if busy else _COMPILE_POLL_S if core.num_compiling else _IDLE_POLL_S)
        if got is None:
            return  # shutdown
        outs, changed = got
        if core.num_compiling:
            refused = core.admit_compiled()
            if refused:
                clients.refused_later(refused)
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
            _report(core, clients, outs, steps, step_tokens)
            last_report = time.monotonic()


def _take_commands(core, receiver: _Receiver, clients: _Clients,
                   timeout: float) -> tuple[list[EngineCoreOutput], bool] | None:
    """Apply the commands that arrived (waiting up to `timeout` for the first): a bounded number
    of messages, so that a flood of arrivals cannot hold the step back. Returns the outputs of
    aborts and whether anything arrived, or None once every client has left."""
    outs: list[EngineCoreOutput] = []
    changed = False
    for _ in range(_MAX_MESSAGES_PER_STEP):
        try:
            client, commands = receiver.get(timeout)
        except queue.Empty:
            break
        if commands is None or any(kind == "shutdown" for kind, _ in commands):
            if _leave(core, clients, client, outs):
                return None
            changed, timeout = True, 0
            continue
        for kind, payload in commands:
            if kind == "add":
                refused = []
                for req_id, prompt_ids, params in payload:
                    try:
                        core.add_request(req_id, prompt_ids, params)
                    except ValueError as e:  # this request's own fault: it fails alone
                        refused.append((req_id, str(e)))  # (an id in use keeps its owner)
                    else:
                        clients.added(client, req_id)
                if refused:
                    clients.to(client, ("refused", refused))
            elif kind == "abort":
                outs += core.abort_requests(payload)
            elif kind == "reset_prefix_cache":  # before any request sent after it is admitted
                core.reset_prefix_cache()
            elif kind == "profile":  # (control id, "start" | "stop"): answered ("control", (id, error, traces))
                cid, action = payload
                try:
                    traces = core.profile.start() if action == "start" else core.profile.stop()
                    clients.to(client, ("control", (cid, None, traces)))
                except ValueError as e:  # misuse (not configured, already running, not running)
                    clients.to(client, ("control", (cid, str(e), None)))
        changed, timeout = True, 0
    return outs, changed


def _leave(core, clients: _Clients, client: int, outs: list[EngineCoreOutput]) -> bool:
    """A client sent `shutdown` or its pipe ended: abort its requests (their outputs go nowhere);
    True when it was the last one (the loop then stops, the requests with it)."""
    mine = clients.leave(client)
    if not clients.present:
        return True
    if mine:
        log.info("API server %d left: %d of its engine requests aborted", client, len(mine))
        core.abort_requests(mine)
    return False


def _report(core, clients: _Clients, outs: list[EngineCoreOutput], steps: int,
            step_tokens: int) -> None:
    """Queue one output message: the outputs and the scheduler's counters (the sender thread
    encodes and writes it)."""
    sched = core.scheduler
    if not isinstance(sched, DataParallelScheduler):
        clients.outputs(outs, _core_stats(sched.stats, core.num_compiling, steps, step_tokens))
        return
    # each DP rank's counts, read once, and their sum
    parts = sched.stats_per_engine
    step_parts = core.step_tokens_per_engine if step_tokens else None
    stats = _core_stats(summed_stats(parts), core.num_compiling, steps, step_tokens)
    stats.per_engine = [_core_stats(s, core.num_compiling if d == 0 else 0, steps, step_parts[d] if step_parts else 0)
                        for d, s in enumerate(parts)]
    clients.outputs(outs, stats)


def _core_stats(s, compiling: int, steps: int, step_tokens: int) -> CoreStats:
    return CoreStats(s.num_running, s.num_waiting + compiling, s.num_free_blocks, s.num_total_blocks,
                     s.kv_cache_usage, s.num_preemptions, s.prefix_cache_queries, s.prefix_cache_hits,
                     steps, step_tokens, copy.deepcopy(s.spec), s.prompt_tokens, s.generation_tokens)
