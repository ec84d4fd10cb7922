"""Live servers for the server tests: a fake engine in-process, or `serve` in a subprocess.

The fake engine has AsyncLLM's interface (see notes/async_llm_contract.md) and makes up tokens
deterministically, so HTTP contract tests (formats, errors, disconnects) run in milliseconds.
The acceptance tests run the real `serve` on the tiny model.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import httpx

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from common.sampling_params import SamplingParams
from scheduler.outputs import TokenLogprobs

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO / "configs" / "models" / "tiny-deepseek-v3"
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
NUM_SPECIAL = 5  # ids 0..4 of the tiny tokenizer are special; the fake never samples them


@dataclass
class FakeStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_cache_usage: float
    num_preemptions: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


class FakeEngine:
    """AsyncLLM look-alike: token t+1 is a function of the context (greedy) or of the seed."""

    def __init__(self, tokenizer, max_model_len: int = 128, step_delay: float = 0.0,
                 total_blocks: int = 1024, block_size: int = 16) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.model_name = "fake-model"
        self.max_model_len = max_model_len
        self.step_delay = step_delay
        self.total_blocks, self.block_size = total_blocks, block_size
        self.errored = False
        self.blocks: dict[str, int] = {}  # request id -> blocks held
        self.aborted: set[str] = set()
        self.prompt_tokens = self.generation_tokens = 0

    def stats(self) -> FakeStats:
        used = sum(self.blocks.values())
        return FakeStats(len(self.blocks), 0, self.total_blocks - used, self.total_blocks,
                         used / self.total_blocks, prompt_tokens_total=self.prompt_tokens,
                         generation_tokens_total=self.generation_tokens)

    async def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def shutdown(self) -> None:
        pass

    def _next(self, ctx: list[int], params: SamplingParams, rng: random.Random) -> int:
        span = self.vocab_size - NUM_SPECIAL
        # top_k=1, min_p=1 and a tiny top_p keep only the argmax, as in the real sampler
        if params.greedy or params.top_k == 1 or params.min_p >= 1 or params.top_p < 1e-3:
            return NUM_SPECIAL + (sum(ctx) * 7 + len(ctx)) % span
        return NUM_SPECIAL + rng.randrange(span)

    def _lp(self, tid: int, k: int) -> TokenLogprobs:
        lp = -0.25 - (tid % 4) * 0.5
        top = [(tid, lp)] + [(NUM_SPECIAL + (tid + j) % (self.vocab_size - NUM_SPECIAL), lp - j)
                             for j in range(1, k)]
        return TokenLogprobs(tid, lp, 1, top[:k])

    async def generate(self, prompt, params: SamplingParams, request_id: str):
        ids = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt: token id {bad} is outside [0, {self.vocab_size})")
        bad = next((t for t in params.logit_bias or {} if t >= self.vocab_size), None)
        if bad is not None:  # as InputProcessor
            raise ValueError(f"logit_bias: token id {bad} is outside [0, {self.vocab_size})")
        max_tokens = params.max_tokens or self.max_model_len - len(ids)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                             f"the context length {self.max_model_len}")
        self.prompt_tokens += len(ids)
        self.blocks[request_id] = -(-(len(ids) + max_tokens) // self.block_size)
        plps = None
        if params.prompt_logprobs is not None:
            plps = [None] + [self._lp(t, params.prompt_logprobs) for t in ids[1:]]
        outs = [CompletionOutput(index=i, logprobs=[] if params.logprobs is not None else None)
                for i in range(params.n)]
        detoks = [IncrementalDetokenizer(self.tokenizer, ids, params) for _ in outs]
        rngs = [random.Random(hash((params.seed, i)) if params.seed is not None else None)
                for i in range(params.n)]
        try:
            while not all(o.finished for o in outs):
                await asyncio.sleep(self.step_delay)
                for o, d, rng in zip(outs, detoks, rngs):
                    o.delta_text, o.delta_token_ids = "", []
                    o.delta_logprobs = None if o.logprobs is None else []
                    if o.finished:
                        continue
                    if request_id in self.aborted:
                        o.finish_reason = "abort"
                        continue
                    tid = self._next(ids + o.token_ids, params, rng)
                    self.generation_tokens += 1
                    o.token_ids.append(tid)
                    o.delta_token_ids = [tid]
                    if o.logprobs is not None:
                        o.logprobs.append(self._lp(tid, params.logprobs))
                        o.delta_logprobs = o.logprobs[-1:]
                    stop_id = tid in params.stop_token_ids
                    stop = d.update([tid], stop_terminated=stop_id)
                    if stop_id:
                        o.finish_reason, o.stop_reason = "stop", tid
                        d.finish()
                    elif stop is not None:
                        o.finish_reason, o.stop_reason = "stop", stop
                    elif len(o.token_ids) >= max_tokens:
                        o.finish_reason = "length"
                        d.finish()
                    o.text = d.output_text
                    o.delta_text = d.get_delta()
                finished = all(o.finished for o in outs)
                yield RequestOutput(request_id, prompt if isinstance(prompt, str) else None, ids,
                                    [_copy(o) for o in outs], prompt_logprobs=plps,
                                    finished=finished)
        finally:
            self.blocks.pop(request_id, None)


class ScriptedEngine(FakeEngine):
    """The fake engine writing `script` token by token (one stream chunk each), then EOS (id 1),
    or with `cycle` the script again; `last_prompt` and `last_params` are the last request's."""

    def __init__(self, tokenizer, script=(), max_model_len: int = 128, cycle: bool = False) -> None:
        super().__init__(tokenizer, max_model_len=max_model_len)
        self.script, self.cycle = list(script), cycle
        self.last_prompt: list[int] = []
        self.last_params: SamplingParams | None = None

    async def generate(self, prompt, params, request_id):
        self.last_prompt = self.tokenizer(prompt)["input_ids"] if isinstance(prompt, str) else list(prompt)
        self.last_params = params
        async for out in super().generate(prompt, params, request_id):
            yield out

    def _next(self, ctx, params, rng) -> int:
        i = len(ctx) - len(self.last_prompt)
        if self.cycle:
            return self.script[i % len(self.script)]
        return self.script[i] if i < len(self.script) else 1


def _copy(o: CompletionOutput) -> CompletionOutput:
    return CompletionOutput(o.index, o.text, list(o.token_ids),
                            None if o.logprobs is None else list(o.logprobs), o.finish_reason,
                            o.stop_reason, o.delta_text, list(o.delta_token_ids),
                            None if o.delta_logprobs is None else list(o.delta_logprobs))


def tiny_model_dir(tmp_path_factory) -> str:
    """The trained tiny model, or a random tiny DeepSeek-V3 with its tokenizer until it exists."""
    if (TINY_MODEL / "config.json").exists():
        return str(TINY_MODEL)
    import shutil

    import transformers

    from tests.tiny_models import build, v3_config

    path = tmp_path_factory.mktemp("tiny-random-v3")
    tok = transformers.AutoTokenizer.from_pretrained(TINY_MODEL)
    build(v3_config(vocab_size=len(tok), max_position_embeddings=2048), path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TINY_MODEL / name, path / name)
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bound_socket() -> socket.socket:
    """A loopback socket bound to a free port and kept: no other bind can take the port
    between choosing it and serving on it (free_port's window)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


class InProcessServer:
    """uvicorn on a loopback port in a background thread (its own event loop)."""

    def __init__(self, app) -> None:
        import uvicorn

        self._sock = bound_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                     log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        daemon=True)

    def __enter__(self) -> InProcessServer:
        self._thread.start()
        deadline = time.time() + 20
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


@contextlib.contextmanager
def tiny_engine_server(num_kv_blocks: int = 256, max_model_len: int = 512, model: str | None = None):
    """A real engine (CPU, fp32, its core on a thread of this process) of the bundled tiny model,
    or of `model`, behind an InProcessServer; `.model` is the served name."""
    from common.args import EngineArgs
    from engine.async_llm import AsyncLLM
    from server.api_server import build_app
    engine = AsyncLLM(EngineArgs(model or str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks,
                                 max_model_len=max_model_len), core_in_thread=True)
    try:
        with InProcessServer(build_app(engine)) as s:
            s.model = engine.model_name
            yield s
    finally:
        engine.shutdown()


class ServeProcess:
    """`python -m server ...` on a free loopback port; waits for /health."""

    def __init__(self, *flags: str, startup_timeout: float = 240.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.flags = [*flags, "--host", "127.0.0.1", "--port", str(self.port)]
        self.startup_timeout = startup_timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        env = {**os.environ, **OFFLINE_ENV}
        self.log = open(os.environ.get("SERVE_TEST_LOG", os.devnull), "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "server", *self.flags], cwd=REPO,
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + self.startup_timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode} during startup")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"serve did not become healthy in {self.startup_timeout} s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@contextlib.contextmanager
def side_by_side(*servers: ServeProcess):
    """Enter the ServeProcesses `servers` at once and exit them at once (those still running):
    start-up is mostly one process at a time importing and loading, so two starting together
    take little more than one, and a stop is mostly waiting."""
    with ThreadPoolExecutor(len(servers)) as pool:
        try:
            starts = [pool.submit(s.__enter__) for s in servers]
            wait(starts)
            for started in starts:
                started.result()
            yield servers
        finally:
            list(pool.map(lambda s: s.proc is not None and s.__exit__(), servers))


def metric(text: str, name: str) -> float:
    """The value of an unlabelled series in a Prometheus text exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def aborted_choices(text: str) -> float:
    """mla_serve_request_success_total{finished_reason="abort"}, 0 before the first abort."""
    try:
        return metric(text.replace('{finished_reason="abort"}', "_abort"), "mla_serve_request_success_total_abort")
    except KeyError:
        return 0.0


def post(server, path: str, body, **kw) -> httpx.Response:
    """POST a JSON body (a dict, or bytes / str sent as they are) to an InProcessServer."""
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content, timeout=30,
                      headers={"content-type": "application/json"}, **kw)


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    """r is an OpenAI-style error of `status` naming `param` (in its param and its message)."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"], err
    if param is not None:
        assert (err["param"] or "").startswith(param) and param in err["message"], err
    return err


def health_until(url: str, status: int, within: float, poll: float = 0.05) -> httpx.Response:
    """GET {url}/health until it answers `status` or `within` seconds pass; the last answer."""
    deadline = time.time() + within
    while True:
        r = httpx.get(f"{url}/health", timeout=2)
        if r.status_code == status or time.time() > deadline:
            return r
        time.sleep(poll)
