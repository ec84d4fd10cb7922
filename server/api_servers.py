"""`serve --api-server-count N`: N HTTP server processes on one listening socket, one engine core.

One API server process spends ~2.5 ms of a core on each of lm_eval's loglikelihood requests (an
echoed prompt's logprobs: parse, tokenize, build the answer); with the prefix cache the engine
answers them faster than that, so one event loop is the bound (RESULTS.md). Several processes share
that work, as vLLM's --api-server-count does:

- this process (serve's parent) binds the socket, loads the config and tokenizer, starts the engine
  core with one pipe pair per API server (engine/core_proc.py serves them all), then starts the N
  API server processes, each with the socket and its pipe pair (engine/core_client.py CoreLink);
  the kernel hands each new connection to one of the processes waiting in accept();
- each API server is `serve`'s whole HTTP front end (server/cli.py `serve_app`): tokenizer,
  detokenizer, validation, streaming, its own requests' metrics, written for /metrics in
  prometheus_client's multiprocess mode (server/metrics.py) so that any process's /metrics counts
  them all;
- SIGTERM or SIGINT here drains: each API server gets SIGUSR1, finishes its requests within
  --shutdown-timeout and leaves the core, which stops once all have left; a second signal stops
  the API servers at once. The API servers ignore SIGINT and SIGTERM themselves: Ctrl-C reaches the
  whole process group, and so does systemd's stop, and a signal counted twice would skip the
  drain. An API server whose parent is gone (killed) drains and stops by itself. If any process
  exits on its own (a crash, a start-up error), the others are stopped the same way and `serve`
  exits 1.

The Responses API's store is off under N > 1 (server/responses_store.py): it is each process's
memory, and the request that names a stored response would reach another process as often.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from common.args import EngineArgs

if TYPE_CHECKING:  # engine.core_client imports torch: `serve --help` reads this module's flags
    from engine.core_client import CoreLink

logger = logging.getLogger("server")

_CORE_STOP_S = 40.0  # the core joins its workers (5 s each) once the last API server has left
DRAIN = signal.SIGUSR1  # parent -> API server: drain and stop (a second one: stop now)
_STARTUP_BLOCKED = {signal.SIGINT, signal.SIGTERM, DRAIN}
_PARENT_POLL_S = 1.0
# A core that exited: its API servers report its error and exit, once they have finished their
# imports; on a busy 2-core machine, from a fresh checkout (no bytecode cached), that took over 10 s.
# A healthy API server exits as soon as it reads the error, so this bounds only a stuck one.
_SERVERS_SEE_CORE_S = 60.0
_stop_asked: list[int] = []  # in an API server: DRAIN signals that came before uvicorn took over


def stop_asked() -> bool:
    """In an API server: whether the parent asked it to stop while it was starting."""
    return bool(_stop_asked)


def add_api_server_flags(g) -> None:
    g.add_argument("--api-server-count", type=int, default=1, metavar="N",
                   help="HTTP server processes sharing the port and one engine core (vLLM's flag): "
                        "each parses, tokenizes and answers its own requests on its own CPU core, "
                        "for request rates one process cannot keep up with (many short requests, "
                        "echoed prompt logprobs). The Responses API keeps no responses when N > 1")


def check_api_server_count(ns: argparse.Namespace) -> None:
    n = getattr(ns, "api_server_count", 1)
    if not 1 <= n <= 64:
        raise ValueError(f"--api-server-count must be in [1, 64], got {n}")


def serve_multi(ns: argparse.Namespace, engine_args: EngineArgs, sock: socket.socket) -> int:
    """Run the engine core and ns.api_server_count API server processes until a signal, or until
    one of them exits; returns serve's exit status."""
    from engine.core_client import CoreLink
    from engine.core_proc import core_main
    from engine.llm import load_front_end

    n = ns.api_server_count
    own_dir = "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    if own_dir:  # inherited by the spawned processes, read when they import prometheus_client
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = _metrics_dir()
    ctx = mp.get_context("spawn")
    procs: list = []
    core = None
    try:
        try:
            cfg, inputs, _ = load_front_end(engine_args)
        except (ValueError, FileNotFoundError, OSError) as e:
            print(f"serve: error: {e}", file=sys.stderr)
            return 1
        cmd = [ctx.Pipe(duplex=False) for _ in range(n)]  # (core's read end, API server's write end)
        out = [ctx.Pipe(duplex=False) for _ in range(n)]  # (API server's read end, core's write end)
        # Not a daemon: the core spawns the worker processes under -tp.
        core = ctx.Process(target=core_main, name="engine-core",
                           args=(engine_args, cfg, inputs.eos_token_id, [r for r, _ in cmd],
                                 [w for _, w in out], True, logging.getLogger().getEffectiveLevel()))
        _start_blocked(core)
        for r, _ in cmd:
            r.close()
        for _, w in out:
            w.close()
        for i in range(n):
            procs.append(ctx.Process(target=_api_server_main, name=f"api-server-{i}",
                                     args=(i, ns, engine_args, sock, CoreLink(cmd[i][1], out[i][0], i))))
            _start_blocked(procs[-1])
            cmd[i][1].close()  # this process's copies: an API server's death ends its pipes
            out[i][0].close()
        # and its copy of the socket: a draining API server closes its own, and then nothing
        # should be listening for new connections that nobody would answer
        sock.close()
        logger.info("started the engine core (pid %d) and %d API server processes", core.pid, n)
        return _supervise(procs, core, ns.shutdown_timeout)
    finally:  # after _supervise these have all exited; after an exception (Ctrl-C at start-up) not
        for p in procs:
            if p.is_alive():
                p.kill()
        if core is not None and core.is_alive():
            core.kill()
            core.join(10.0)
        if own_dir:
            shutil.rmtree(os.environ.pop("PROMETHEUS_MULTIPROC_DIR"), ignore_errors=True)


_METRICS_PREFIX = "mla-serve-metrics-"


def _metrics_dir() -> str:
    """A new temporary directory for the processes' metric files, named with this process's pid.
    The `finally` of serve_multi removes it; a serve that was SIGKILLed could not, so the
    directories of this user's serves that no longer run are removed here first."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        pid = name[len(_METRICS_PREFIX):].split("-", 1)[0]
        if not name.startswith(_METRICS_PREFIX) or not pid.isdigit():
            continue
        path = os.path.join(tmp, name)
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
            os.kill(int(pid), 0)  # a process of ours has that pid: that serve may still run, keep it
        except (ProcessLookupError, PermissionError):  # no process, or another user's: that serve is gone
            shutil.rmtree(path, ignore_errors=True)
        except OSError:  # the directory went away meanwhile
            pass
    return tempfile.mkdtemp(prefix=f"{_METRICS_PREFIX}{os.getpid()}-")


def _start_blocked(proc) -> None:
    """Start a process with SIGINT, SIGTERM and DRAIN blocked (the mask is inherited): until it
    has its handlers (core_main, _api_server_main), a signal waits instead of killing it
    mid-import."""
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STARTUP_BLOCKED)
    try:
        proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)


def _supervise(servers: list, core, shutdown_timeout: float) -> int:
    """Wait for a signal or for a process to exit, then stop them all (API servers first: they
    drain and leave the core, which then stops)."""
    signals: list[int] = []

    def on_signal(sig, frame):
        signals.append(sig)
        if len(signals) == 1:
            logger.info("%s: draining requests in %d API server processes, then stopping",
                        signal.Signals(sig).name, len(servers))
        for p in servers:  # the first drains, a second stops at once (server/cli.py)
            if p.is_alive():
                os.kill(p.pid, DRAIN)

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        procs = {p.sentinel: p for p in [*servers, core]}
        ended: list = []
        while not signals and not ended:
            ended = mp.connection.wait(list(procs), timeout=1.0)
        if not signals:
            gone = procs[ended[0]]
            gone.join(5.0)
            if gone is core:  # its API servers read its start-up error, or its pipes' end, first
                until = time.monotonic() + _SERVERS_SEE_CORE_S
                for p in servers:
                    p.join(max(0.0, until - time.monotonic()))
            if gone is not core or gone.exitcode != 1 or any(p.is_alive() for p in servers):
                logger.error("%s exited (code %s): stopping serve", gone.name, gone.exitcode)
            for p in servers:
                if p.is_alive():
                    os.kill(p.pid, DRAIN)
        end = time.monotonic() + shutdown_timeout + _CORE_STOP_S
        for p in servers:
            p.join(max(0.0, end - time.monotonic()))
        core.join(max(0.0, end + _CORE_STOP_S - time.monotonic()))
        if core.is_alive():
            logger.warning("engine core did not stop; killing it")
            core.kill()  # it ignores SIGTERM (engine/core_proc.py)
            core.join()
        clean = signals and all(p.exitcode == 0 for p in servers) and core.exitcode == 0
        return 0 if clean else 1
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _api_server_main(index: int, ns: argparse.Namespace, engine_args: EngineArgs, sock: socket.socket,
                     link: CoreLink) -> None:
    """One API server process: serve's front end on the shared socket, attached to the core."""
    import threading

    from server.cli import serve_app

    # The parent turns SIGINT and SIGTERM into one DRAIN for each API server (module docstring);
    # they came blocked, and are unblocked once the handlers are in place.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(DRAIN, lambda sig, frame: _stop_asked.append(sig))  # uvicorn's handler replaces it
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STARTUP_BLOCKED)
    logging.basicConfig(level=ns.log_level.upper(),
                        format=f"%(asctime)s api-server-{index} %(levelname)s %(name)s: %(message)s")
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        logger.warning("serve's parent process is gone: draining and stopping")
        os.kill(os.getpid(), DRAIN)

    threading.Thread(target=watch_parent, name="parent-watch", daemon=True).start()
    sys.exit(asyncio.run(serve_app(ns, engine_args, sock, link)))
