"""`serve`: start the engine and the OpenAI-compatible HTTP server (flag names follow vLLM)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
import sys

from common.args import EngineArgs
from common.gc_tuning import freeze_startup_objects, thaw_frozen_objects
from server.flags import api_key_from, build_parser, engine_args_from
from server.frontend_options import filter_access_log
from server.stats_log import stats_interval

logger = logging.getLogger("server")


def bind_socket(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads so that a port in use fails at once
    (not after minutes of loading and the GPU memory it took); OSError names the address."""
    sock = None
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(2048)
    except OSError as e:
        if sock is not None:
            sock.close()
        # a name that does not resolve is the host's fault; anything else (in use, denied) the port's
        flag = f"--host {host}" if isinstance(e, socket.gaierror) else f"--port {port}"
        raise OSError(f"{flag}: cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def _draining_server(config, signals=(signal.SIGINT, signal.SIGTERM), asked=lambda: False):
    """uvicorn's Server, but SIGTERM and SIGINT both drain and return so that the engine and its
    workers are stopped (uvicorn re-raises the signal after its shutdown, and a re-raised SIGTERM
    ends the process on the spot). A second signal stops at once. One of several API servers
    takes its parent's SIGUSR1 instead (server/api_servers.py), and `asked()` says whether one
    came before these handlers were in place."""
    import contextlib

    import uvicorn

    class DrainingServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            def on_signal(sig, frame):
                self.force_exit = self.should_exit
                self.should_exit = True
                logger.info("%s: draining requests, then stopping", signal.Signals(sig).name)

            old = {sig: signal.signal(sig, on_signal) for sig in signals}
            if asked():
                self.should_exit = True
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    return DrainingServer(config)


def uvicorn_config(app, ns: argparse.Namespace):
    """uvicorn's settings for `serve`: timeouts for idle, slow-header and draining connections."""
    import uvicorn

    from server.http_limits import header_timeout_protocol

    config = uvicorn.Config(app, host=ns.host, port=ns.port,
                            log_level=getattr(ns, "uvicorn_log_level", None) or ns.log_level,
                            access_log=(ns.log_level == "debug"
                                        and not getattr(ns, "disable_uvicorn_access_log", False)),
                            timeout_keep_alive=ns.http_keep_alive_timeout,
                            backlog=2048, timeout_graceful_shutdown=ns.shutdown_timeout,
                            http=header_timeout_protocol(ns.http_header_timeout),
                            ssl_keyfile=getattr(ns, "ssl_keyfile", None),
                            ssl_certfile=getattr(ns, "ssl_certfile", None),
                            ssl_ca_certs=getattr(ns, "ssl_ca_certs", None),
                            ssl_cert_reqs=getattr(ns, "ssl_cert_reqs", 0),
                            root_path=getattr(ns, "root_path", None) or "")
    # after the Config, which sets uvicorn's loggers up
    filter_access_log(getattr(ns, "disable_access_log_for_endpoints", None), getattr(ns, "root_path", None) or "")
    return config


def _tune_gc() -> None:
    """Garbage collection in the HTTP process, whose event loop every stream waits on: its
    start-up objects (torch, transformers, the tokenizer, FastAPI, the app: over 200k after the
    imports alone) frozen out of collection and full collections spaced out, as the engine core
    does (common/gc_tuning.py). With 1000 streams at once (scripts/bench_core_overhead.py, a busy
    2-core CPU) the run saw 9 full collections, 5.9 s in all and the longest 0.9 s; with the
    freeze 8, 2.0 s, the longest 0.58 s; with both none."""
    freeze_startup_objects()


async def serve_app(ns: argparse.Namespace, engine_args: EngineArgs, sock: socket.socket,
                    core_link=None) -> int:
    """The HTTP front end on `sock` until a signal drains it: with its own engine core, or attached
    to one through `core_link` (an engine.core_client.CoreLink: one of several API servers)."""
    from engine.async_llm import AsyncLLM, EngineStartError
    from server.api_server import build_app

    first = core_link is None or core_link.index == 0  # the one that logs what all would
    # Built inside the running loop, so that the engine binds its output queues to this loop.
    try:
        engine = AsyncLLM(engine_args, core_link=core_link)
    except (ValueError, FileNotFoundError, OSError, EngineStartError) as e:
        if first:
            print(f"serve: error: {e}", file=sys.stderr)
        return 1
    try:
        try:
            app = build_app(engine, ns)  # its checks that need the engine (the served tokenizer)
        except ValueError as e:
            print(f"serve: error: {e}", file=sys.stderr)
            return 1
        if core_link is None:
            server = _draining_server(uvicorn_config(app, ns))
        else:
            from server.api_servers import DRAIN, stop_asked

            if stop_asked():  # told to stop while starting: nothing to drain
                return 0
            server = _draining_server(uvicorn_config(app, ns), (DRAIN,), stop_asked)
        _tune_gc()
        stats_task = None
        if first:
            logger.info("serving %s on %s://%s:%d/v1", engine.model_name,
                        "https" if ns.ssl_certfile else "http", ns.host, ns.port)
            if getattr(ns, "stats_interval", None):  # vLLM's periodic stats line
                from server.stats_log import log_stats_every
                stats_task = asyncio.create_task(log_stats_every(engine, ns.stats_interval))
        try:
            await server.serve(sockets=[sock])
        finally:
            if stats_task is not None:
                stats_task.cancel()
        return 0 if server.started else 1
    finally:
        engine.shutdown()
        thaw_frozen_objects()
        logger.info("engine stopped")


def _worker_node(args: EngineArgs) -> int:
    """A node other than 0: its ranks only, until node 0's engine stops them."""
    from engine.multiproc import run_worker_node
    from models.config import ModelConfig, check_parallel_layout

    try:
        cfg = ModelConfig.from_pretrained(args.model, args.hf_overrides, args.quantization)
        check_parallel_layout(cfg, args.tensor_parallel_size, args.decode_context_parallel_size,
                              args.enable_expert_parallel, args.data_parallel_size)
        run_worker_node(args, cfg, cfg.eos_token_ids[:1])
    except (ValueError, RuntimeError) as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def _interrupt(sig, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `serve` console script and `python -m server`."""
    ns = build_parser().parse_args(argv)
    ns.api_key = api_key_from(ns.api_key)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from(ns)
        ns.stats_interval = None if ns.disable_log_stats else stats_interval()
    except ValueError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    if ns.trust_remote_code:
        logger.info("--trust-remote-code is accepted for vLLM compatibility and changes nothing: "
                    "the model code is built in, no code from %s is run", engine_args.model)
    # Until uvicorn takes the signals over: SIGTERM unwinds like Ctrl-C, so that a stop during
    # the model load still ends the worker processes (multiprocessing's exit handler).
    signal.signal(signal.SIGTERM, _interrupt)
    if engine_args.node_rank > 0:
        try:
            return _worker_node(engine_args)
        except KeyboardInterrupt:
            return 0
    try:
        sock = bind_socket(ns.host, ns.port)
    except OSError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 1
    try:
        if ns.api_server_count > 1:
            from server.api_servers import serve_multi

            return serve_multi(ns, engine_args, sock)
        return asyncio.run(serve_app(ns, engine_args, sock))
    except KeyboardInterrupt:
        return 0
    finally:
        sock.close()
