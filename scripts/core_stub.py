"""The stub model and the probes scripts/bench_core_overhead.py installs in the processes it
measures (the offline engine, the `serve` process and its engine-core child): the imaginary
device and the host cost per step, the phase timers of the engine core, per-thread CPU time, run
queue waits, garbage collections, and the front end's message and response lags. Its docstring
says what each figure means."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

STUB_ENV = "BENCH_CORE_OVERHEAD_STUB"  # JSON settings of the stub for the server and its children
PHASES = ("schedule", "launch", "device wait", "finish", "update", "step other", "add_request",
          "commands", "report", "idle", "loop other")


class Timers:
    """Seconds and calls per phase over one busy period of the engine core."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.t = {}
        self.n = {}
        self.steps = self.tokens = 0
        # per launched step: (launch start, tokens, requests, eager, launch blocked off CPU: GIL)
        self.step_log: list[tuple] = []
        self.finished: dict[str, float] = {}  # HTTP request id -> when the core reported its end
        self.start = self.end = None
        self.first_add = self.last_add = None  # when the first and the last request were added
        self.cpu0 = time.process_time()
        self.threads0 = thread_cpu()
        self.runqueue0 = runqueue_wait()  # of the thread that resets: the step loop's

    def add(self, name: str, dt: float) -> None:
        self.t[name] = self.t.get(name, 0.0) + dt
        self.n[name] = self.n.get(name, 0) + 1

    def snapshot(self) -> dict:
        return {"t": dict(self.t), "n": dict(self.n), "steps": self.steps, "tokens": self.tokens,
                "wall": (self.end or time.perf_counter()) - (self.start or time.perf_counter()),
                "start": self.start, "end": self.end, "first_add": self.first_add, "last_add": self.last_add,
                "cpu": time.process_time() - self.cpu0, "step_log": list(self.step_log), "gc": list(GC_LOG),
                "runqueue": runqueue_wait() - self.runqueue0,
                "finished": dict(self.finished),
                "thread_cpu": {k: v - self.threads0.get(k, 0.0) for k, v in thread_cpu().items()}}


THREADS: dict[str, int] = {}  # name -> threading ident of the threads whose CPU time is reported


def thread_cpu() -> dict[str, float]:
    """CPU seconds so far of each thread in THREADS (those of this process)."""
    out = {}
    for name, ident in list(THREADS.items()):
        try:
            out[name] = time.clock_gettime(time.pthread_getcpuclockid(ident))
        except (OSError, ProcessLookupError):
            pass  # the thread has ended
    return out


GC_LOG: list[tuple[float, int, float]] = []  # garbage collections: (start, generation, seconds)


def _gc_callback(phase: str, info: dict, _start=[0.0]) -> None:
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        GC_LOG.append((_start[0], info["generation"], time.perf_counter() - _start[0]))


def gc_summary(log: list, t0: float, t1: float) -> str:
    """Collections in [t0, t1] per generation: count, total and longest pause."""
    parts = []
    for g in range(3):
        xs = [d for t, gen, d in log if gen == g and t0 <= t <= t1]
        if xs:
            parts.append(f"gen{g} {len(xs)} x, {sum(xs) * 1e3:.0f} ms (longest {max(xs) * 1e3:.1f})")
    return "; ".join(parts) or "none"


def runqueue_wait() -> float:
    """Seconds this thread has waited for a core so far (Linux schedstat; 0 where absent)."""
    try:
        return int(Path("/proc/thread-self/schedstat").read_text().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _track_thread(name: str, fn):
    """Wrap a thread's target so that THREADS knows it."""
    def run(*args, **kwargs):
        THREADS[name] = threading.get_ident()
        return fn(*args, **kwargs)
    return run


TIMERS = Timers()


def _timed(name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMERS.add(name, time.perf_counter() - t0)
    wrapper.__wrapped__ = fn
    return wrapper


def install_stub(settings: dict) -> None:
    """Patch the model runner (stub model, imaginary device) and time the engine core's phases."""
    from multiprocessing import connection

    import torch

    import engine.core_proc as cp
    from engine.core import EngineCore
    from engine.model_runner import ModelRunner
    from scheduler.scheduler import Scheduler

    device_s, per_token_s = settings["device_ms"] / 1e3, settings["device_us_per_token"] / 1e6
    host_s, host_per_token_s = settings.get("host_ms", 0.0) / 1e3, settings.get("host_us_per_token", 0.0) / 1e6
    prefill_host_s = settings.get("prefill_host_ms", 0.0) / 1e3
    vocab = settings["vocab"]
    if settings.get("switch_interval_ms"):
        sys.setswitchinterval(settings["switch_interval_ms"] / 1e3)
    if settings.get("front_gc_threshold") and "--serve-child" in sys.argv:
        import gc
        gc.set_threshold(*settings["front_gc_threshold"])
    busy_until = [0.0]
    gil_release = torch.zeros(1)

    def forward(self, batch):
        return torch.zeros(batch.input_ids.shape[0], 8)

    def logits(self, hidden, fp32=True):  # the runner asks for bf16 logits with fp32=False; zeros either way
        return torch.zeros(hidden.shape[0], vocab)

    launch, finish = ModelRunner.launch, ModelRunner.finish

    def host_work(seconds: float) -> None:
        """`seconds` of this thread's CPU time in pure Python, as kernel launches spend it: slices
        of ~70 us that hold the GIL, each ended by a tiny torch op, whose dispatch releases the
        GIL as every torch op does. Counted in thread CPU time, so time spent waiting for the
        GIL (another thread holds it) or for a core stretches the step as on the GPU host."""
        end = time.thread_time() + seconds
        while (now := time.thread_time()) < end:
            stop = min(end, now + 70e-6)
            while time.thread_time() < stop:
                pass
            torch.add(gil_release, 1.0, out=gil_release)

    def timed_launch(self, so):
        t0, c0, q0 = time.perf_counter(), time.thread_time(), runqueue_wait()
        pending = launch(self, so)
        tokens = so.total_num_scheduled_tokens
        eager = tokens > len(so.num_scheduled_tokens)  # a prompt chunk: no CUDA graph on a GPU
        if pending is not None and (host_s or host_per_token_s or prefill_host_s):
            host_work(host_s + host_per_token_s * tokens + (prefill_host_s if eager else 0.0))
        now = time.perf_counter()
        TIMERS.add("launch", now - t0)
        off_cpu, queued = now - t0 - (time.thread_time() - c0), runqueue_wait() - q0
        TIMERS.add("launch off-CPU", off_cpu)
        TIMERS.add("launch runqueue", queued)
        if pending is not None:
            # blocked = off CPU less run-queue waits; the two clocks differ by a little (>= 0)
            TIMERS.step_log.append((t0, tokens, len(so.num_scheduled_tokens), eager, max(0.0, off_cpu - queued)))
        if pending is not None:
            # The device runs kernels as they are launched: the step is done device time after it
            # started (once the previous step is done), and not before its last launch.
            start = max(busy_until[0], t0)
            busy_until[0] = max(now, start + device_s + per_token_s * tokens)
            pending.ready_at = busy_until[0]
        return pending

    def timed_finish(self, pending):
        t0 = time.perf_counter()
        if pending is not None and getattr(pending, "ready_at", 0.0) > t0:
            time.sleep(pending.ready_at - t0)
        t1 = time.perf_counter()
        TIMERS.add("device wait", t1 - t0)
        try:
            return finish(self, pending)
        finally:
            TIMERS.add("finish", time.perf_counter() - t1)

    ModelRunner.forward, ModelRunner.logits = forward, logits
    ModelRunner.launch, ModelRunner.finish = timed_launch, timed_finish
    Scheduler.schedule = _timed("schedule", Scheduler.schedule)
    Scheduler.update_from_output = _timed("update", Scheduler.update_from_output)
    add_request = _timed("add_request", EngineCore.add_request)

    def timed_add(self, *args, **kwargs):
        TIMERS.last_add = time.perf_counter()
        TIMERS.first_add = TIMERS.first_add or TIMERS.last_add
        return add_request(self, *args, **kwargs)

    EngineCore.add_request = timed_add
    step = EngineCore.step

    def timed_step(self):
        t0 = time.perf_counter()
        try:
            return step(self)
        finally:
            TIMERS.add("step", time.perf_counter() - t0)
            TIMERS.steps += 1
            TIMERS.tokens += self.step_tokens
            TIMERS.end = time.perf_counter()

    EngineCore.step = timed_step

    # ---- the engine-core process's loop (engine/core_proc.py) ----
    get = cp._Receiver.get
    last_idle = [0.0, 0.0]  # (end, length) of the latest idle wait

    def timed_get(self, timeout):
        if timeout == 0:
            return get(self, timeout)
        t0 = time.perf_counter()
        try:
            return get(self, timeout)
        finally:
            last_idle[:] = time.perf_counter(), time.perf_counter() - t0
            TIMERS.add("idle", last_idle[1])

    cp._Receiver.get = timed_get
    take = cp._take_commands
    periods: list[dict] = []
    out_path = settings.get("out")

    def close_period() -> None:
        if TIMERS.steps:
            periods.append(TIMERS.snapshot())
            if out_path:
                Path(out_path).write_text(json.dumps(periods))
        TIMERS.reset()

    def timed_take(core, conn, sender, timeout):
        if timeout > 0 and TIMERS.steps:
            close_period()  # idle again: the busy period is over
        if TIMERS.start is None:
            TIMERS.reset()  # waiting for work: nothing counts yet
        t0 = time.perf_counter()
        got = take(core, conn, sender, timeout)
        TIMERS.add("commands", time.perf_counter() - t0)
        if got is None:
            close_period()
        elif got[1] and TIMERS.start is None:
            # the period starts when the first command arrived: the wait before it is not in it
            TIMERS.start = last_idle[0] if timeout > 0 else t0
            if timeout > 0:
                for k in ("idle", "commands"):
                    TIMERS.t[k] -= last_idle[1]
        return got

    cp._take_commands = timed_take
    report_ = _timed("report", cp._report)

    def logged_report(core, sender, outs, *args):
        now = time.perf_counter()
        for o in outs:
            if o.finish_reason is not None:  # engine id "cmpl-<hex>-<prompt>#<sample>"
                TIMERS.finished[o.req_id.rsplit("-", 1)[0]] = now
        return report_(core, sender, outs, *args)

    cp._report = logged_report
    cp.encode_outputs = _timed("sender encode", cp.encode_outputs)
    dumps, send_bytes = cp.pickle.dumps, connection.Connection.send_bytes
    cp.pickle.dumps = _timed("sender pickle", dumps)  # the front end's pickling is timed too, unread
    connection.Connection.send_bytes = _timed("pipe write", send_bytes)
    THREADS["main"] = threading.get_ident()  # the step loop (core process), the event loop (server)
    import gc
    gc.callbacks.append(_gc_callback)
    cp._Receiver._run = _track_thread("receiver", cp._Receiver._run)
    cp._Sender._run = _track_thread("sender", cp._Sender._run)
    put = cp._Sender.put

    def stamped_put(self, msg):
        if msg[0] == "outputs":
            msg[1][1].sent_at = time.perf_counter()  # travels with the stats (pickled __dict__)
        return put(self, msg)

    cp._Sender.put = stamped_put
    if out_path and "--serve-child" in sys.argv:  # the server process, not its engine-core child
        install_front_end_probe(out_path + ".front.json")


def install_front_end_probe(path: str) -> None:
    """In the server process: when each output message was read (reader thread) and processed
    (event loop), and the CPU time of the front end's threads then; written at exit."""
    import atexit

    from engine import core_client
    from engine.async_llm import AsyncLLM

    core_client.CoreClient._read = _track_thread("reader", core_client.CoreClient._read)
    core_client.CoreClient._write = _track_thread("writer", core_client.CoreClient._write)
    rows: list[list] = []  # [sent_at, read_at, processed_at, outputs, step, thread CPU at processing]
    pending: dict[int, list] = {}
    on_core, on_loop = AsyncLLM._on_core_outputs, AsyncLLM._on_outputs

    def probed_on_core(self, outs, stats):
        row = [getattr(stats, "sent_at", None), time.perf_counter(), None, len(outs), stats.num_steps, None]
        rows.append(row)
        if outs:
            pending[id(outs)] = row
        return on_core(self, outs, stats)

    def probed_on_loop(self, outs):
        row = pending.pop(id(outs), None)
        try:
            return on_loop(self, outs)
        finally:
            if row is not None:
                row[2], row[5] = time.perf_counter(), thread_cpu()

    AsyncLLM._on_core_outputs, AsyncLLM._on_outputs = probed_on_core, probed_on_loop

    # when connections were accepted, requests reached the app, and were handed to the core
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from server.http_limits import BodyLimitMiddleware
    marks: dict[str, list[float]] = {"accepted": [], "app": [], "submitted": []}

    def marked(name, fn, is_async=False):
        if is_async:
            async def wrapper(*args, **kwargs):
                marks[name].append(time.perf_counter())
                return await fn(*args, **kwargs)
        else:
            def wrapper(*args, **kwargs):
                marks[name].append(time.perf_counter())
                return fn(*args, **kwargs)
        return wrapper

    H11Protocol.connection_made = marked("accepted", H11Protocol.connection_made)
    BodyLimitMiddleware.__call__ = marked("app", BodyLimitMiddleware.__call__, is_async=True)
    AsyncLLM._submit = marked("submitted", AsyncLLM._submit)
    atexit.register(lambda: Path(path).write_text(json.dumps({"rows": rows, "marks": marks, "gc": GC_LOG})))
