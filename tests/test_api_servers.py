"""`serve --api-server-count N`: one engine core serving several API server processes."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from common.args import EngineArgs
from common.sampling_params import SamplingParams
from engine.core_client import CoreClient, CoreLink
from engine.core_proc import core_main
from engine.llm import load_front_end
from server.cli import build_parser
from server.responses_store import ResponseStore
from tests.server_fixtures import OFFLINE_ENV, REPO, TINY_MODEL, ServeProcess, free_port, metric, side_by_side
from tests.test_engine_process import _alive, _spawned

SERVE = ["--device", "cpu", "--dtype", "float32", "--max-model-len", "512", "--num-kv-blocks", "256",
         "--api-server-count", "2"]
PROMPTS = ["Question: What is 3 plus 4?\nAnswer:", "Question: Who has the most toys?\nAnswer:"]


class _Client:
    """One attached CoreClient and what reached it, by engine request id."""

    def __init__(self, args, cfg, eos, link: CoreLink):
        self.tokens: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}
        self.refused: list[tuple[str, str]] = []
        self.done = threading.Condition()
        self.core = CoreClient(args, cfg, eos, self._on_outputs, lambda message: None, link=link,
                               on_refused=self.refused.extend)

    def _on_outputs(self, outs, stats) -> None:
        with self.done:
            for o in outs:
                self.tokens.setdefault(o.req_id, []).extend(o.new_token_ids)
                if o.finish_reason is not None:
                    self.finished[o.req_id] = o.finish_reason
            self.done.notify_all()

    def wait(self, req_id: str) -> str:
        with self.done:
            assert self.done.wait_for(lambda: req_id in self.finished, timeout=60), req_id
            return self.finished[req_id]


def test_one_core_keeps_two_clients_apart():
    """Two clients attached to one core, using the same engine request ids: each gets its own
    requests' outputs only; one leaving with a request running aborts that request, not the
    other's; the core stops once both have left."""
    args = EngineArgs(model=str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=256,
                      max_model_len=512)
    cfg, inputs, _ = load_front_end(args)
    inputs.max_model_len = inputs.capacity_tokens = 512  # the core's, which AsyncLLM would set
    cmd = [mp.Pipe(duplex=False) for _ in range(2)]
    out = [mp.Pipe(duplex=False) for _ in range(2)]
    core = threading.Thread(target=core_main, daemon=True,
                            args=(args, cfg, inputs.eos_token_id, [r for r, _ in cmd], [w for _, w in out], False))
    core.start()
    a, b = (_Client(args, cfg, inputs.eos_token_id, CoreLink(cmd[i][1], out[i][0], i)) for i in range(2))
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    ids = [inputs.process(p, greedy)[1] for p in PROMPTS]
    # the same ids from both clients, with the prompts crossed over in the second round
    a.core.add([("r#0", ids[0], greedy)])
    b.core.add([("r#0", ids[1], greedy)])
    b.core.add([("s#0", ids[0], greedy)])
    a.core.add([("s#0", ids[1], greedy)])
    for c in (a, b):
        assert c.wait("r#0") == c.wait("s#0") == "length"
    assert a.tokens["r#0"] == b.tokens["s#0"] and b.tokens["r#0"] == a.tokens["s#0"]
    assert a.tokens["r#0"] != b.tokens["r#0"]  # the prompts answer differently: a mix-up would show
    assert set(a.tokens) == set(b.tokens) == {"r#0", "s#0"}
    # an id the client already has running is refused, naming it as the client knows it, and
    # the running request's outputs still reach the client
    b.core.add([("dup#0", ids[0], greedy), ("dup#0", ids[0], greedy)])
    assert b.wait("dup#0") == "length" and b.tokens["dup#0"] == a.tokens["r#0"]
    assert len(b.refused) == 1 and b.refused[0][0] == "dup#0" and "'dup#0'" in b.refused[0][1], b.refused
    # b leaves with a long request running: it is aborted; a's goes on and a new one runs
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    b.core.add([("long#0", ids[0], long)])
    a.core.add([("long#0", ids[1], long)])
    with b.done:
        assert b.done.wait_for(lambda: b.tokens.get("long#0"), timeout=60)
    b.core.shutdown(timeout=10)
    assert "long#0" not in b.finished
    assert a.wait("long#0") == "length" and len(a.tokens["long#0"]) == 400
    a.core.add([("t#0", ids[0], greedy)])
    assert a.wait("t#0") == "length" and a.tokens["t#0"] == a.tokens["r#0"]
    assert core.is_alive()
    a.core.shutdown(timeout=10)
    core.join(30)
    assert not core.is_alive()


@pytest.fixture(scope="module")
def two_serves(tmp_path_factory):
    """Two `serve --api-server-count 2`, started side by side, their metrics files in one
    directory: (that directory, the one drained, the one whose API server is killed)."""
    path = tmp_path_factory.mktemp("prometheus")
    old = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(path)  # read by the ServeProcesses as they start
    try:
        with side_by_side(*(ServeProcess("--model", str(TINY_MODEL), *SERVE) for _ in range(2))) as (a, b):
            if old is None:
                os.environ.pop("PROMETHEUS_MULTIPROC_DIR")
            else:
                os.environ["PROMETHEUS_MULTIPROC_DIR"] = old
            yield path, a, b
    finally:
        if old is None:
            os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)


def test_several_api_servers_serve_count_and_drain(two_serves):
    """Both API servers answer requests on the one port, /metrics counts every process's
    requests, the Responses store is off, and SIGTERM drains a running stream before serve exits
    0 with every process gone."""
    tmp_path, s, _ = two_serves
    servers = _spawned(s.proc.pid)
    assert len(servers) == 3  # the core and two API servers
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
    texts, sent = set(), 0
    for _ in range(6):  # waves of new connections until both processes have answered some
        with ThreadPoolExecutor(16) as pool:
            rs = list(pool.map(lambda _: httpx.post(f"{s.url}/v1/completions", json=body, timeout=60),
                               range(16)))
        sent += 16
        assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200]
        texts |= {r.json()["choices"][0]["text"] for r in rs}
        per_pid = {p: n for p, n in _finished_per_pid(tmp_path).items() if p in servers}
        if len([n for n in per_pid.values() if n > 0]) == 2:
            break
    assert len(texts) == 1
    assert len(per_pid) == 2 and set(per_pid) < set(servers), (per_pid, servers)
    assert all(n > 0 for n in per_pid.values()), per_pid
    assert sum(per_pid.values()) == sent
    for _ in range(4):  # whichever process answers, /metrics counts them all
        m = httpx.get(f"{s.url}/metrics", timeout=10).text
        assert metric(m.replace('{finished_reason="length"}', "_length"),
                      "mla_serve_request_success_total_length") == sent
    r = httpx.post(f"{s.url}/v1/responses", json={"input": "hi", "previous_response_id": "resp_x"}, timeout=30)
    assert r.status_code == 400 and "--api-server-count 2" in r.json()["error"]["message"]
    # a stream running when SIGTERM comes is finished, then everything stops
    # (and a new connection is refused at once: no process keeps the port open meanwhile)
    long = {"prompt": PROMPTS[1], "max_tokens": 480, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{s.url}/v1/completions", json=long, timeout=120) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data:")
        s.proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{s.url}/health", timeout=5)
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest)
    assert s.proc.wait(timeout=60) == 0
    assert not any(_alive(p) for p in servers)


def test_an_api_server_dying_stops_serve(two_serves):
    """A killed API server stops serve (exit 1) and the rest: nothing is left running."""
    _, _, s = two_serves
    servers = _spawned(s.proc.pid)
    os.kill(max(servers), signal.SIGKILL)  # an API server: started after the core
    assert s.proc.wait(timeout=60) == 1
    deadline = time.monotonic() + 30
    while any(_alive(p) for p in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in servers)


def test_start_up_errors_and_signals_under_several_api_servers():
    """The core's start-up error is serve's one error line (exit 1); a SIGTERM while the API
    servers are still starting stops everything cleanly (exit 0, no traceback)."""
    def start(*flags: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-m", "server", "--model", str(TINY_MODEL), *SERVE,
                                 "--port", str(free_port()), *flags], cwd=REPO, env={**os.environ, **OFFLINE_ENV},
                                stderr=subprocess.PIPE, text=True)

    early, bad = start(), start("--max-model-len", "100000")  # side by side
    deadline = time.monotonic() + 120
    # SIGTERM once serve has started the core and both API servers, which are then importing
    # (before serve's own handlers, a SIGTERM ends it as any process: nothing is started yet)
    while len(_spawned(early.pid)) < 3 and early.poll() is None:
        assert time.monotonic() < deadline, "serve never started its processes"
        time.sleep(0.02)
    early.send_signal(signal.SIGTERM)
    _, err = early.communicate(timeout=90)
    assert early.returncode == 0 and "Traceback" not in err, err[-3000:]
    _, err = bad.communicate(timeout=120)
    assert bad.returncode == 1 and "serve: error: --max-model-len 100000" in err, err[-2000:]
    assert "Traceback" not in err and "stopping serve" not in err


def test_store_flags_under_several_api_servers():
    parse = build_parser().parse_args
    assert ResponseStore.from_args(parse(["--api-server-count", "2"])).max_entries == 0
    assert ResponseStore.from_args(parse([])).max_entries > 0
    with pytest.raises(ValueError, match="--responses-store-size 8 and --api-server-count 2"):
        ResponseStore.from_args(parse(["--api-server-count", "2", "--responses-store-size", "8"]))
    assert ResponseStore.from_args(parse(["--api-server-count", "2", "--responses-store-size", "0"])).max_entries == 0


def _finished_per_pid(path) -> dict[int, float]:
    """Finished choices counted by each process, from its own multiprocess-mode files."""
    counts = {}
    for f in glob.glob(str(path / "counter_*.db")):
        pid = int(os.path.basename(f)[len("counter_"):-len(".db")])
        one = path / f"one_{pid}"
        one.mkdir(exist_ok=True)
        shutil.copy(f, one)
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(one))
        text = generate_latest(registry).decode().replace('{finished_reason="length"}', "_length")
        counts[pid] = metric(text, "mla_serve_request_success_total_length")
        shutil.rmtree(one)
    return counts


def test_metrics_dir_sweeps_dead_serves_only(tmp_path, monkeypatch):
    """A serve that was SIGKILLed leaves its metrics directory; the next one removes it, and keeps
    those of serves still running and anything not named as its own."""
    from server import api_servers

    monkeypatch.setattr(api_servers.tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    stale = tmp_path / f"mla-serve-metrics-{gone.pid}-ab12"
    live = tmp_path / f"mla-serve-metrics-{os.getppid()}-cd34"
    other = tmp_path / "mla-serve-metrics-notapid"
    for d in (stale, live, other):
        d.mkdir()
        (d / "counter_1.db").write_bytes(b"x")
    made = api_servers._metrics_dir()
    assert not stale.exists() and live.exists() and other.exists()
    assert os.path.basename(made).startswith(f"mla-serve-metrics-{os.getpid()}-") and os.path.isdir(made)
