"""Grammars compiled off the engine's step loop: the tokenizer built while the model loads, a new
constraint compiled while its request waits (every other request keeps running), compiles shared
and cached, failures a 400 naming the request's field."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from common.sampling_params import StructuredOutputs
from tests.server_fixtures import TINY_MODEL, metric, tiny_engine_server

PROMPT = "Question: Tom has 3 apples and buys 5 more. How many apples does he have?\nAnswer:"


@pytest.fixture(scope="module")
def server():
    with tiny_engine_server(num_kv_blocks=256) as s:
        yield s


@pytest.fixture
def held_compiles(monkeypatch):
    """GrammarCompiler._build blocked until `release` is set (the engine core runs in this
    process: the patch reaches it); `started` counts the compiles that began."""
    from engine.structured_outputs import GrammarCompiler
    real, release, started = GrammarCompiler._build, threading.Event(), []

    def build(self, so):
        started.append(so.spec)
        assert release.wait(60), "the test never released the compile"
        return real(self, so)

    monkeypatch.setattr(GrammarCompiler, "_build", build)
    yield release, started
    release.set()


def _post(server, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=timeout,
                      json={"model": server.model, "prompt": PROMPT, "temperature": 0, **body})


def _metrics(server) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_other_requests_run_while_a_grammar_compiles(server, held_compiles):
    release, started = held_compiles
    box = {}
    waiting = threading.Thread(target=lambda: box.update(r=_post(server, {
        "max_tokens": 8, "guided_regex": "(yes|no) sir"})))
    waiting.start()
    _wait(lambda: started, "the compile to start")
    # the compile holds: plain requests still complete, the constrained one counts as waiting
    for _ in range(3):
        r = _post(server, {"max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 6
    assert metric(_metrics(server), "mla_serve_num_requests_waiting") == 1
    assert waiting.is_alive()
    release.set()
    waiting.join(60)
    assert box["r"].status_code == 200, box["r"].text
    assert box["r"].json()["choices"][0]["text"] in ("yes sir", "no sir")
    _wait(lambda: metric(_metrics(server), "mla_serve_num_requests_waiting") == 0, "waiting to drain")


def test_one_compile_for_many_requests_and_none_once_cached(server, held_compiles):
    release, started = held_compiles
    body = {"max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 5, "guided_choice": ["alpha", "beta", "gamma"]}
    box = {}
    t = threading.Thread(target=lambda: box.update(r=_post(server, body)))
    t.start()
    _wait(lambda: started, "the compile to start")
    time.sleep(0.2)  # the other two samples' requests arrive meanwhile
    release.set()
    t.join(60)
    assert box["r"].status_code == 200 and len(started) == 1, (box["r"].text, started)
    assert {c["text"] for c in box["r"].json()["choices"]} <= {"alpha", "beta", "gamma"}
    assert _post(server, body).status_code == 200 and len(started) == 1  # cached: not compiled again


def test_a_failed_compile_is_a_400_naming_the_field(server, monkeypatch):
    from engine.structured_outputs import GrammarCompiler

    def fail(self, so):
        raise ValueError(f"the {so.kind} constraint does not compile: too big")

    monkeypatch.setattr(GrammarCompiler, "_build", fail)
    for body, field in (({"guided_regex": "fails1"}, "guided_regex"),
                        ({"structured_outputs": {"regex": "fails2"}}, "structured_outputs.regex"),
                        ({"response_format": {"type": "json_schema", "json_schema": {
                            "name": "x", "schema": {"type": "object", "title": "fails3"}}}},
                         "response_format.json_schema.schema")):
        for stream in (False, True):
            r = _post(server, {"max_tokens": 4, "stream": stream, **body})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == field and "does not compile: too big" in err["message"], err
    assert _post(server, {"max_tokens": 3}).status_code == 200


def test_a_request_aborted_while_its_grammar_compiles(server, held_compiles):
    release, started = held_compiles
    with pytest.raises(httpx.ReadTimeout):  # the client gives up while the compile holds
        _post(server, {"max_tokens": 8, "guided_regex": "(abc|def)"}, timeout=1.0)
    assert started
    _wait(lambda: metric(_metrics(server), "mla_serve_num_requests_waiting") == 0, "the abort")
    release.set()
    r = _post(server, {"max_tokens": 8, "guided_regex": "(abc|def)"})  # the compile finished meanwhile
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("abc", "def")
    assert started == ["(abc|def)"]  # into the LRU: not compiled again
    assert _post(server, {"max_tokens": 3}).status_code == 200


def test_a_compile_nobody_waits_for_is_skipped(server, held_compiles):
    """Both compile workers held; a third constraint's request leaves before a worker takes its
    compile: the compile is cancelled, not run for no one."""
    release, started = held_compiles
    answers = []
    held = [threading.Thread(target=lambda rx=rx: answers.append(_post(server, {"max_tokens": 4, "guided_regex": rx})))
            for rx in ("(aa|bb)", "(cc|dd)")]
    for t in held:
        t.start()
    _wait(lambda: len(started) == 2, "both workers to hold a compile")
    with pytest.raises(httpx.ReadTimeout):
        _post(server, {"max_tokens": 4, "guided_regex": "(ee|ff)"}, timeout=1.0)
    _wait(lambda: metric(_metrics(server), "mla_serve_num_requests_waiting") == 2, "the abort")
    release.set()
    for t in held:
        t.join(60)
    assert [r.status_code for r in answers] == [200, 200]
    # queued after the cancelled one: by the time it has run, a worker has dropped (ee|ff)
    assert _post(server, {"max_tokens": 4, "guided_regex": "(gg|hh)"}).status_code == 200
    assert "(ee|ff)" not in started and "(gg|hh)" in started, started
    r = _post(server, {"max_tokens": 4, "guided_regex": "(ee|ff)"})  # asked again: compiled now
    assert r.status_code == 200 and started.count("(ee|ff)") == 1


def test_a_library_panic_fails_its_request_not_the_engine(server, monkeypatch):
    from engine.structured_outputs import GrammarCompiler

    class Panic(BaseException):  # as pyo3's PanicException: not an Exception
        pass

    def panic(self, so):
        raise Panic("assertion failed: something in the library")

    monkeypatch.setattr(GrammarCompiler, "_build", panic)
    r = _post(server, {"max_tokens": 4, "guided_regex": "(pp|qq)"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "guided_regex" and "Panic: assertion failed" in err["message"], err
    assert _post(server, {"max_tokens": 3}).status_code == 200


def test_a_parked_request_is_checked_by_the_scheduler_first():
    """A request that waits for its grammar is refused at once for what the scheduler would refuse
    (an id in use, a prompt past the context), not when its compile ends."""
    from common.args import EngineArgs
    from common.sampling_params import SamplingParams
    from engine.core import EngineCore
    from engine.llm import load_front_end
    args = EngineArgs(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64)
    cfg, inputs, _ = load_front_end(args)
    core = EngineCore(args, cfg, inputs.eos_token_id, serving=True)
    try:
        regex = SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs("regex", "(xx|yy)"))
        core.add_request("R", [5, 6, 7], SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="already in use"):
            core.add_request("R", [5, 6], regex)
        with pytest.raises(ValueError, match="more than max_model_len"):
            core.add_request("S", [5] * 65, regex)
        assert core.num_compiling == 0
        core.add_request("T", [5, 6], regex)
        assert core.num_compiling == 1
        _wait(lambda: core.admit_compiled() == [] and core.num_compiling == 0, "T's compile")
        assert "T" in core.scheduler.requests
    finally:
        core.shutdown()


def test_a_compile_past_the_timeout_fails_its_requests_and_the_queue_moves(monkeypatch):
    """Compiles that run past HELD_COMPILE_S (held here) do not hold the queue: a third worker
    starts and compiles the next constraint; past COMPILE_TIMEOUT_S the requests that wait for the
    held ones fail, each alone with its field named."""
    from common.args import EngineArgs
    from common.sampling_params import SamplingParams
    from engine import structured_outputs as so_mod
    from engine.core import EngineCore
    from engine.llm import load_front_end
    real, release, started = so_mod.GrammarCompiler._build, threading.Event(), []

    def build(self, so):
        started.append(so.spec)
        if so.spec != "(ok|fine)":
            assert release.wait(60), "the test never released the compile"
        return real(self, so)

    monkeypatch.setattr(so_mod.GrammarCompiler, "_build", build)
    monkeypatch.setattr(so_mod, "HELD_COMPILE_S", 0.1)
    monkeypatch.setattr(so_mod, "COMPILE_TIMEOUT_S", 1.0)
    args = EngineArgs(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=64, max_model_len=64)
    cfg, inputs, _ = load_front_end(args)
    core = EngineCore(args, cfg, inputs.eos_token_id, serving=True)

    def params(kind, spec, source):
        return SamplingParams(max_tokens=2, structured_outputs=StructuredOutputs(kind, spec, source=source))
    try:
        core.add_request("A", [5, 6], params("regex", "(aa|bb)", "guided_regex"))
        core.add_request("B", [5, 6], params("grammar", 'start: "x" | "y"', "guided_grammar"))
        _wait(lambda: len(started) == 2, "both workers to hold a compile")
        core.add_request("C", [5, 6], params("regex", "(ok|fine)", "guided_regex"))
        assert core.admit_compiled() == [] and len(core.grammars._workers) == 2
        time.sleep(0.15)  # both workers held past HELD_COMPILE_S, C's compile queued behind them
        _wait(lambda: core.admit_compiled() == [] and core.num_compiling == 2, "C's compile on a third worker")
        assert len(core.grammars._workers) == 3 and "C" in core.scheduler.requests
        refused = {}
        _wait(lambda: refused.update(core.admit_compiled()) or len(refused) == 2, "A and B to time out")
        assert refused == {"A": "guided_regex: the regex constraint did not compile within 1 s",
                           "B": "guided_grammar: the grammar constraint did not compile within 1 s"}
        assert core.num_compiling == 0 and len(core.grammars._workers) == 3
    finally:
        release.set()
        core.shutdown()


def test_library_panics_read_as_a_limit():
    from engine.structured_outputs import _first_lines
    msg = ("panic: assertion failed: grammar.symbols.len() < u16::MAX as usize - 10\n<backtrace>\n"
           "0: <unknown>\n1: <unknown>")
    assert _first_lines(msg) == ("it is past one of the grammar library's limits (panic: assertion failed: "
                                 "grammar.symbols.len() < u16::MAX as usize - 10)")
    assert _first_lines("line one\n  line two\n") == "line one line two"


# ---- the compiler ----

def test_compiled_grammars_are_cached_and_matchers_independent():
    from engine.structured_outputs import GrammarCompiler
    gc = GrammarCompiler(str(TINY_MODEL), 512)
    so = StructuredOutputs("choice", json.dumps(["yes", "no"]))
    a, b = gc.compile(so), gc.compile(so)
    assert len(gc._cache) == 1 and a.matcher is not b.matcher
    c = gc.compile(StructuredOutputs("regex", "[0-9]+"))
    tok = gc._ll_tokenizer()
    for t in tok.tokenize_str("ye"):
        a.accept(t)
    rows = gc.fill_bitmask([a, b, c])  # several rows: filled in parallel
    for i, g in enumerate([a, b, c]):
        one = gc.fill_bitmask([g])
        assert (one[0] == rows[i]).all()
    assert not (rows[0] == rows[1]).all()  # a has moved on, b has not
    for t in tok.tokenize_str("s"):
        a.accept(t)
    assert a.terminated and not b.terminated


def test_tokenizer_built_once_in_background(monkeypatch):
    """The serving core builds llguidance's tokenizer on a thread of its own; a compile that comes
    while it builds waits for that build instead of starting a second one."""
    import llguidance.hf
    from engine.structured_outputs import GrammarCompiler
    real, calls = llguidance.hf.from_tokenizer, []

    def slow(*args, **kw):
        calls.append(threading.current_thread().name)
        time.sleep(0.3)
        return real(*args, **kw)

    monkeypatch.setattr(llguidance.hf, "from_tokenizer", slow)
    gc = GrammarCompiler(str(TINY_MODEL), 512)
    thread = gc.prepare_in_background()
    _wait(lambda: calls, "the background build")
    g = gc.compile(StructuredOutputs("regex", "[0-9]+"))
    thread.join()
    assert calls == ["grammar-tokenizer"] and not g.terminated
    assert gc.prepare_in_background() is None  # built: nothing left to do
    assert GrammarCompiler(None, 512).prepare_in_background() is None  # no tokenizer


def test_serving_core_prepares_the_tokenizer(caplog):
    """The engine core the server runs builds it at start-up, before any structured request."""
    from common.args import EngineArgs
    from engine.async_llm import AsyncLLM
    caplog.set_level("INFO", logger="engine.structured_outputs")
    engine = AsyncLLM(EngineArgs(str(TINY_MODEL), device="cpu", dtype="float32", num_kv_blocks=64,
                                 max_model_len=256), core_in_thread=True)
    try:
        deadline = time.monotonic() + 30
        while "tokenizer of 512 tokens" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "tokenizer of 512 tokens" in caplog.text
    finally:
        engine.shutdown()


def test_compile_async_shares_one_compile_and_reports_failures():
    from engine.structured_outputs import GrammarCompiler
    gc = GrammarCompiler(str(TINY_MODEL), 512)
    so = StructuredOutputs("regex", "[0-9]{2}", source="guided_regex")
    assert gc.cached(so) is None
    f1, f2 = gc.compile_async(so), gc.compile_async(StructuredOutputs("regex", "[0-9]{2}"))
    assert f1 is f2  # the same constraint, whatever field it came from
    f1.result(30)
    a, b = gc.matcher_for(so, f1), gc.cached(so)
    assert a.matcher is not b.matcher and not a.terminated
    assert gc.compile_async(so).done()  # cached since: no second compile
    for spec in ('"abc"', "[1, 2]", "{}"):  # a choice spec is a list of strings
        with pytest.raises(ValueError, match="a choice constraint is a JSON list of strings"):
            gc.compile(StructuredOutputs("choice", spec))
    bad = StructuredOutputs("grammar", "start: missing_rule", source="guided_grammar")
    future = gc.compile_async(bad)
    with pytest.raises(ValueError, match=r"the grammar constraint does not compile"):
        future.result(30)
    # each request that shared the compile is told of the field it used
    for source in ("guided_grammar", "structured_outputs.grammar"):
        with pytest.raises(ValueError, match=rf"^{source}: the grammar constraint does not compile"):
            gc.matcher_for(StructuredOutputs("grammar", bad.spec, source=source), future)
    with pytest.raises(ValueError, match=r"^guided_grammar: the grammar constraint does not compile"):
        gc.compile(bad)  # the offline path's message alike
    assert gc.cached(bad) is None


@pytest.mark.parametrize("lo, hi", [(-2**63 + 1, -2**63 + 2), (-2**63, -2**63), (-1e19, -1e19), (None, 2**63)])
def test_schema_bounds_past_2_62_are_refused_before_the_library(lo, hi):
    """Integer ranges near -2^63 crashed llguidance (a segfault of the whole process): such bounds
    are a 400 naming the field, found anywhere in a schema or in a Lark grammar's %json."""
    from engine.structured_outputs import validate
    bounds = {k: v for k, v in (("minimum", lo), ("maximum", hi)) if v is not None}
    schema = {"type": "object", "properties": {"n": {"type": "integer", **bounds}}, "required": ["n"]}
    with pytest.raises(ValueError, match=r"^guided_json: the schema's (minimum|maximum) .* outside \[-2\^62, 2\^62\]"):
        validate(StructuredOutputs("json", json.dumps(schema)), "guided_json")
    with pytest.raises(ValueError, match=r"^guided_grammar: the schema's .* outside"):
        validate(StructuredOutputs("grammar", f"start: %json {json.dumps(schema)}"), "guided_grammar")


def test_schema_bounds_within_2_62_compile():
    from engine.structured_outputs import GrammarCompiler
    gc = GrammarCompiler(str(TINY_MODEL), 512)
    schema = {"type": "integer", "minimum": -2**62, "maximum": 2**62}
    assert not gc.compile(StructuredOutputs("json", json.dumps(schema))).terminated


def test_validation_verdicts_are_remembered(monkeypatch):
    """A constraint sent again is not checked again; its verdict names each request's own field."""
    import engine.structured_outputs as so_mod
    real, checked = so_mod._why_invalid, []
    monkeypatch.setattr(so_mod, "_why_invalid", lambda so: checked.append(so.spec) or real(so))
    good, bad = "(remember|me)", "(unclosed"
    for field in ("guided_regex", "structured_outputs.regex"):
        so_mod.validate(StructuredOutputs("regex", good), field)
        with pytest.raises(ValueError, match=rf"^{field}: .*unclosed"):
            so_mod.validate(StructuredOutputs("regex", bad), field)
    assert checked == [good, bad]


def test_constraint_checks_have_their_own_lanes():
    import asyncio
    from common.offload import LARGE_CONSTRAINT_CHARS, check_off_loop

    def lane():
        return threading.current_thread().name.rsplit("_", 1)[0]
    assert asyncio.run(check_off_loop(10, lane)) == "constraint"
    assert asyncio.run(check_off_loop(LARGE_CONSTRAINT_CHARS + 1, lane)) == "constraint-large"


def test_the_compiled_lru_is_bounded_by_characters(monkeypatch):
    import engine.structured_outputs as so_mod
    monkeypatch.setattr(so_mod, "MAX_CACHED_GRAMMAR_CHARS", 25)
    gc = so_mod.GrammarCompiler(str(TINY_MODEL), 512)
    specs = ["(aaaa|bbbb)", "(cccc|dddd)", "(eeee|ffff)", "(g|h)" * 6]  # 11, 11, 11 and 30 characters
    for spec in specs[:3]:
        gc.compile(StructuredOutputs("regex", spec))
    assert [k[1] for k in gc._cache] == specs[1:3] and gc._cache_chars == 22
    gc.compile(StructuredOutputs("regex", specs[3]))  # past the budget alone: kept alone
    assert [k[1] for k in gc._cache] == specs[3:] and gc._cache_chars == 30


def test_the_lexer_is_built_with_the_compile_for_every_copy():
    """llguidance builds a grammar's lexer with its first mask. The compile (off the step loop)
    computes that mask on the cached template, so every request's copy starts from the built
    lexer: with nested repeats, a copy that built it first left the next copies failing ("too
    many expressions constructed") on their first mask."""
    from engine.structured_outputs import GrammarCompiler
    from models.config import ModelConfig
    compiler = GrammarCompiler(str(TINY_MODEL), ModelConfig.from_pretrained(str(TINY_MODEL)).vocab_size)
    so = StructuredOutputs("regex", "((a{211}){200}){100}")
    grammars = [compiler.compile(so) for _ in range(3)]  # the first compiles, the others are cached copies
    compiler.fill_bitmask(grammars[:1])
    masks = compiler.fill_bitmask(grammars[1:])
    assert not any(g.failed for g in grammars), [g.error() for g in grammars if g.failed]
    assert (masks != 0).any(axis=1).all()  # each copy allows a next token ("a")
