"""One bad request must never kill, freeze or wedge the server: bounds at the edge, text that is
not Unicode, body / header / body-time limits, per-request limits, and the smaller contract
points around them, on a fake engine in-process. Tokenizing off the event loop, per-request
failures in the real engine and the stall check of /health: tests/test_server_liveness.py.
"""

from __future__ import annotations

import logging
import shutil
import socket
import subprocess
import threading
import time

import httpx
import pytest
import torch
import transformers

from common.args import EngineArgs
from engine.input_processor import InputProcessor, load_tokenizer
from engine.sampler import Sampler, SamplingBatch
from common.sampling_params import SamplingParams
from models.config import ModelConfig
from server.api_server import ServerState, build_app
from server.cli import build_parser, uvicorn_config
from server.errors import APIError
from server.tls import check_ssl
from tests.server_fixtures import (TINY_MODEL, FakeEngine, InProcessServer, aborted_choices, assert_error,
                                   bound_socket, post)


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def fake(tok):
    engine = FakeEngine(tok, max_model_len=128)
    with InProcessServer(build_app(engine)) as s:
        s.engine = engine
        yield s


# ---- bounds of every integer field (values torch would refuse in the engine thread) ----

OUT_OF_RANGE = [
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"seed": 2**63 - 1, "n": 2}, "seed"),  # sample 1 would use seed + 1
    ({"seed": 2**64 - 1, "n": 2}, "seed"),
    ({"top_k": 2**63}, "top_k"),
    ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ({"min_tokens": 2**64}, "min_tokens"),
    ({"max_tokens": 2**64}, "max_tokens"),
    ({"logprobs": 2**64}, "logprobs"),
    ({"n": 2**64}, "n"),
    ({"repetition_penalty": 1e300}, "repetition_penalty"),
]


@pytest.mark.parametrize("fields,param", OUT_OF_RANGE, ids=[str(f) for f, _ in OUT_OF_RANGE])
def test_integer_fields_are_bounded_with_the_range_in_the_message(fake, fields, param):
    err = assert_error(post(fake, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields}),
                       400, param)
    if param not in ("repetition_penalty",):
        assert "[" in err["message"] and "]" in err["message"], err  # the range
    r = post(fake, "/v1/chat/completions",
             {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})
    assert_error(r, 400, param)


def test_token_id_prompts_beyond_int64_are_400(fake):
    assert_error(post(fake, "/v1/completions", {"prompt": [[2**64]]}), 400, "prompt")
    assert_error(post(fake, "/detokenize", {"tokens": [2**64]}), 400, "tokens")


def test_detokenize_is_bounded_by_the_context(fake):
    """/detokenize takes at most max_model_len ids (vLLM checks them as a prompt); past that a
    400 names the field and the limit, before the tokenizer's decode holds the GIL."""
    ok = post(fake, "/detokenize", {"tokens": [5] * 128})
    assert ok.status_code == 200 and ok.json()["prompt"], ok.text
    err = assert_error(post(fake, "/detokenize", {"tokens": [5] * 129}), 400, "tokens")
    assert "129 ids" in err["message"] and "128" in err["message"] and "--max-model-len" in err["message"], err


def test_sampling_params_bounds():
    for kw in ({"seed": 2**64}, {"seed": -(2**63) - 1}, {"seed": 2**63 - 1, "n": 2},
               {"top_k": 2**63}, {"stop_token_ids": [2**63]}, {"n": True}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    assert SamplingParams(seed=2**63 - 2, n=2).seed == 2**63 - 2


# ---- near-zero temperature is greedy ----

def test_near_zero_temperature_samples_greedily():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    params = [SamplingParams(temperature=t) for t in (1e-38, 1e-30, 1e-6, 0.0)]
    assert all(p.greedy for p in params)
    batch = SamplingBatch.from_params(params, [[1]] * 4, [[]] * 4, [None] * 4, [], "cpu")
    out = Sampler()(logits, batch)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    # a seeded row too (a generator is built but greedy never draws)
    p = SamplingParams(temperature=1e-38, seed=3)
    gen = torch.Generator().manual_seed(3)
    out = Sampler()(logits[:1], SamplingBatch.from_params([p], [[1]], [[]], [gen], [], "cpu"))
    assert out.token_ids.tolist() == logits[:1].argmax(-1).tolist()


# ---- text that is not valid Unicode ----

SURROGATES = [
    ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": "ok", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": '
                             '[{"type": "text", "text": "\\udc80"}]}]}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/completions", '{"prompt": "ok", "logit_bias": {"\\ud800": 1}}', "logit_bias"),  # a key
]


@pytest.mark.parametrize("path,raw,param", SURROGATES, ids=[f"{p}-{f}" for p, _, f in SURROGATES])
def test_lone_surrogates_are_400_naming_the_field(fake, path, raw, param):
    assert_error(post(fake, path, raw), 400, param)
    assert post(fake, "/v1/completions", {"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_a_lone_surrogate_in_a_field_name_says_it_is_a_key(fake):
    err = assert_error(post(fake, "/v1/completions", '{"prompt": "ok", "\\ud800": 1}'), 400, "request")
    assert "a key is not valid Unicode text" in err["message"], err


def test_bodies_that_are_not_utf8_are_400(fake):
    for raw in (b'{"prompt": "\xff"}', b'\xff\xfe{', b'{"prompt": "a", "stop": "\xc3"}'):
        err = assert_error(post(fake, "/v1/completions", raw), 400)
        assert "UTF-8" in err["message"]
    # an encoded surrogate decodes (JSON allows it) but is refused as text
    assert_error(post(fake, "/v1/completions", b'{"prompt": "\xed\xa0\x80"}'), 400, "prompt")


def test_tokenizer_failures_are_value_errors(tok):
    cfg = ModelConfig.from_pretrained(str(TINY_MODEL))
    inputs = InputProcessor(tok, cfg, 64)
    with pytest.raises(ValueError, match="prompt"):
        inputs.process("\ud800", SamplingParams(max_tokens=1))


# ---- request limits ----

LIMITS = [
    ({"prompt": ["a"] * 257}, "prompt"),
    ({"prompt": ["a"] * 5, "n": 128}, "n"),
    ({"prompt": "a", "stop": [f"s{i}" for i in range(17)]}, "stop"),
    ({"prompt": "a", "stop": "x" * 129}, "stop"),
]


@pytest.mark.parametrize("body,param", LIMITS, ids=[p for _, p in LIMITS])
def test_per_request_limits(fake, body, param):
    err = assert_error(post(fake, "/v1/completions", {"max_tokens": 1, **body}), 400, param)
    assert "--max-" in err["message"]  # the flag that sets the limit


def test_per_request_limits_admit_their_edge(fake):
    for body in ({"prompt": ["a"] * 256}, {"prompt": ["a"] * 4, "n": 128},
                 {"prompt": "a", "stop": [f"s{i}" for i in range(16)]},
                 {"prompt": "a", "stop": "x" * 128}):
        r = post(fake, "/v1/completions", {"max_tokens": 1, **body})
        assert r.status_code == 200, r.text


def test_limits_follow_flags(tok):
    ns = build_parser().parse_args(["--max-prompts-per-request", "2", "--max-seqs-per-request",
                                    "4", "--max-stop-strings", "1", "--max-stop-str-len", "3"])
    with InProcessServer(build_app(FakeEngine(tok), ns)) as s:
        assert_error(post(s, "/v1/completions", {"prompt": ["a"] * 3}), 400, "prompt")
        assert_error(post(s, "/v1/completions", {"prompt": ["a"] * 2, "n": 3}), 400, "n")
        assert_error(post(s, "/v1/chat/completions", {
            "messages": [{"role": "user", "content": "x"}], "n": 5}), 400, "n")
        assert_error(post(s, "/v1/completions", {"prompt": "a", "stop": ["a", "b"]}), 400, "stop")
        assert_error(post(s, "/v1/completions", {"prompt": "a", "stop": "abcd"}), 400, "stop")
        ok = post(s, "/v1/completions", {"prompt": ["a"] * 2, "n": 2, "stop": "abc",
                                          "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 4


# ---- body size, slow bodies and slow headers ----

def test_body_limit_413(tok):
    ns = build_parser().parse_args(["--max-request-body-bytes", "1000"])
    with InProcessServer(build_app(FakeEngine(tok), ns)) as s:
        big = {"prompt": "x" * 2000, "max_tokens": 1}
        assert_error(post(s, "/v1/completions", big), 413)
        assert_error(post(s, "/tokenize", {"prompt": "x" * 2000}), 413)

        def chunks():  # no Content-Length: the limit holds while reading
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 200
            yield b'"}'
        r = httpx.post(f"{s.url}/v1/completions", content=chunks(),
                       headers={"content-type": "application/json"})
        assert_error(r, 413)
        ok = post(s, "/v1/completions", {"prompt": "x" * 100, "max_tokens": 1})
        assert ok.status_code == 200


class _UvicornThread:
    """`serve`'s own uvicorn config (protocol, timeouts) around an app, in a thread."""

    def __init__(self, app, ns) -> None:
        import uvicorn

        self.sock = bound_socket()
        ns.host, ns.port = "127.0.0.1", self.sock.getsockname()[1]
        self.port = ns.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn_config(app, ns))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 20
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive()
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


def _closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """What the server sent before closing the socket, or None if it is still open."""
    sock.settimeout(seconds)
    data = b""
    try:
        while True:
            chunk = sock.recv(4096)
            if not chunk:
                return data
            data += chunk
    except socket.timeout:
        return None


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.paths: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.paths.append(record.args[2])


@pytest.mark.parametrize("flags,logged", [
    (["--log-level", "debug"], ["/health", "/metrics?x=1", "/version"]),
    (["--log-level", "debug", "--disable-access-log-for-endpoints", "/health,/metrics"], ["/version"]),
    (["--log-level", "debug", "--disable-uvicorn-access-log"], []),
    # uvicorn logs the path behind --root-path; the flag's paths are the routes' own
    (["--log-level", "debug", "--root-path", "/llm", "--disable-access-log-for-endpoints", "/health,/metrics"],
     ["/llm/version"]),
    (["--log-level", "debug", "--root-path", "/llm/", "--disable-access-log-for-endpoints", "/health,/metrics"],
     ["/llm//version"]),
    (["--log-level", "info"], []),  # the access log is written at debug level only
])
def test_access_log_flags(tok, flags, logged):
    ns = build_parser().parse_args(flags)
    records, access = _Records(), logging.getLogger("uvicorn.access")
    with _UvicornThread(build_app(FakeEngine(tok), ns), ns) as s:
        # uvicorn turns its access log off by leaving the logger without handlers
        assert access.hasHandlers() == bool(logged)
        if logged:
            access.addHandler(records)
        try:
            for path in ("/health", "/metrics?x=1", "/version"):
                assert httpx.get(s.url + path, timeout=30).status_code == 200
        finally:
            access.removeHandler(records)
    assert records.paths == logged


def test_https_and_root_path(tok, tmp_path):
    """--ssl-keyfile / --ssl-certfile serve HTTPS (a self-signed certificate made with the
    openssl command); --root-path is the prefix FastAPI's OpenAPI schema names."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    ns = build_parser().parse_args(["--ssl-keyfile", str(key), "--ssl-certfile", str(cert),
                                    "--root-path", "/llm", "--log-level", "warning"])
    check_ssl(ns)  # a real certificate and its key pass the start-up check
    # an encrypted key is refused by name, without a pass phrase prompt
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-aes256", "-pass", "pass:pw",
                    "-out", str(tmp_path / "enc.pem")], check=True, capture_output=True)
    enc = build_parser().parse_args(["--ssl-keyfile", str(tmp_path / "enc.pem"), "--ssl-certfile", str(cert)])
    with pytest.raises(ValueError, match="an encrypted private key"):
        check_ssl(enc)
    with _UvicornThread(build_app(FakeEngine(tok), ns), ns) as s:
        https = s.url.replace("http://", "https://")
        assert httpx.get(f"{https}/health", verify=False, timeout=30).status_code == 200
        r = httpx.post(f"{https}/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                       verify=False, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert httpx.get(f"{https}/openapi.json", verify=False, timeout=30).json()["servers"] == [{"url": "/llm"}]
        with pytest.raises(httpx.HTTPError):  # plain HTTP is not served
            httpx.get(f"{s.url}/health", timeout=5)


def test_slow_headers_and_slow_bodies_are_cut_off(tok):
    ns = build_parser().parse_args(["--http-header-timeout", "0.5", "--http-body-timeout", "0.5",
                                    "--http-keep-alive-timeout", "5", "--log-level", "warning"])
    with _UvicornThread(build_app(FakeEngine(tok), ns), ns) as s:
        silent = socket.create_connection(("127.0.0.1", s.port))
        partial = socket.create_connection(("127.0.0.1", s.port))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        slow_body = socket.create_connection(("127.0.0.1", s.port))
        slow_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        assert _closed_within(silent, 3) == b""
        assert _closed_within(partial, 3) == b""
        reply = _closed_within(slow_body, 3)
        assert reply is not None and reply.startswith(b"HTTP/1.1 408"), reply
        # a kept-alive connection still works, and its next request's headers are timed again
        with httpx.Client(base_url=s.url) as c:
            assert c.get("/health").status_code == 200
            time.sleep(1.0)
            assert c.get("/health").status_code == 200
        for sock in (silent, partial, slow_body):
            sock.close()


# ---- metrics, vocabulary, names, tokenizer files ----

def _aborts(fake) -> float:
    return aborted_choices(httpx.get(f"{fake.url}/metrics").text)


def test_aborted_requests_are_counted(fake):
    def aborts() -> float:
        return _aborts(fake)

    before = aborts()
    fake.engine.step_delay = 0.02
    try:
        with httpx.stream("POST", f"{fake.url}/v1/completions", json={
                "prompt": "hi", "max_tokens": 100, "n": 2, "stream": True}) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i == 2:
                    break
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{fake.url}/v1/completions", json={"prompt": "hi", "max_tokens": 100},
                       timeout=httpx.Timeout(10, read=0.2))
    finally:
        fake.engine.step_delay = 0.0
    deadline = time.time() + 5
    while aborts() < before + 3 and time.time() < deadline:
        time.sleep(0.05)
    assert aborts() == before + 3


def test_a_client_gone_before_its_first_token_is_counted_aborted(fake):
    """Gone while its prompts were still being accepted (a long prefill): aborted in the engine
    and counted, like one gone mid-stream."""
    before = _aborts(fake)
    fake.engine.step_delay = 1.0  # the first output (the end of the "prefill") after 1 s
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{fake.url}/v1/completions", json={"prompt": "hi", "max_tokens": 5, "n": 2},
                       timeout=httpx.Timeout(10, read=0.2))
        deadline = time.time() + 5
        while _aborts(fake) < before + 2 and time.time() < deadline:
            time.sleep(0.05)
    finally:
        fake.engine.step_delay = 0.0
    assert _aborts(fake) == before + 2


def test_prompt_ids_are_limited_to_what_the_tokenizer_decodes(tok):
    cfg = ModelConfig.from_pretrained(str(TINY_MODEL))
    assert cfg.vocab_size > len(tok)  # the bundled model's config pads its vocabulary
    inputs = InputProcessor(tok, cfg, 64)
    inputs.process([len(tok) - 1], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match=f"\\[0, {len(tok)}\\)"):
        inputs.process([len(tok)], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="stop_token_ids"):
        inputs.process([5], SamplingParams(max_tokens=1, stop_token_ids=[len(tok)]))


def test_model_is_served_by_name_not_path(tok):
    args = EngineArgs(model="/srv/secret/models/my-model", load_format="dummy")
    assert args.model_name == "my-model"
    assert EngineArgs(model="/srv/secret/models/my-model/", load_format="dummy").model_name == "my-model"
    engine = FakeEngine(tok)
    engine.model_name, engine.args = args.model_name, args
    state = ServerState(engine)
    state.check_model("my-model")
    state.check_model("/srv/secret/models/my-model")  # the path is still accepted
    with pytest.raises(APIError) as e:
        state.check_model("other")
    assert "/srv/secret" not in e.value.message and "my-model" in e.value.message


def test_directory_without_tokenizer_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="no tokenizer files in .* \\(use --tokenizer or "
                                         "token-id prompts\\)"):
        load_tokenizer(str(tmp_path))
    assert load_tokenizer(str(tmp_path), required=False) is None
