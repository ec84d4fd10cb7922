"""Structured outputs: grammars that constrain sampling, through llguidance.

A request's constraint travels as plain data (`StructuredOutputs`: a kind and its spec, in
common/sampling_params.py). The front end validates it without a tokenizer (`validate`), so that a
bad schema or regex is a 400 naming the field. The engine core compiles it once per distinct
(kind, spec) against the model's tokenizer (`GrammarCompiler`, an LRU of compiled matchers) and
gives each request its own copy (`RequestGrammar`). The core advances that matcher with every
token the request samples (scheduler.update_from_output) and, before each step, fills one bitmask
row per constrained request that samples in it (`fill_bitmask`); the bitmask travels in the
SchedulerOutput to every rank, whose sampler masks the logits with it. llguidance is imported
only when a request asks for structure: a server without it serves everything else.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import queue
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import numpy as np

from common.sampling_params import StructuredOutputs

log = logging.getLogger(__name__)

PACKAGE = "llguidance"
# The compiled-grammar LRU, bounded in entries and in characters: a matcher's memory follows its
# grammar's size (a 900 KB Lark grammar's took ~60 MB); 8M characters is ~0.5 GB of matchers.
MAX_CACHED_GRAMMARS, MAX_CACHED_GRAMMAR_CHARS = 256, 8_000_000
MAX_ERROR_CHARS = 300  # of a matcher's error, as a request's answer carries it
# threads that compute the bitmask rows of one step in parallel (llguidance's LLExecutor)
MASK_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
COMPILE_THREADS = 2  # compiles at once off the step loop: one huge grammar holds no other behind it
# A request waits at most COMPILE_TIMEOUT_S for its constraint's compile, then fails alone (a 400
# naming its field; EngineCore.admit_compiled). The compile itself cannot be stopped (a thread in
# the library) and runs on. A worker on one compile for longer than HELD_COMPILE_S no longer
# counts: while compiles queue, another is started (`keep_up`), up to MAX_COMPILE_THREADS in all,
# so the requests behind a grammar the library takes minutes over still get most of their wait.
COMPILE_TIMEOUT_S, HELD_COMPILE_S, MAX_COMPILE_THREADS = 60.0, 10.0, 6

# JSON is generated compact, as json.dumps writes it ('{"a": 1}'): free whitespace lets a model pad
# its output with newlines until max_tokens. `whitespace_pattern` allows more; `disable_any_whitespace` none.
_JSON_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_JSON_TIGHT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def _import():
    try:
        import llguidance
    except ImportError:
        raise ValueError(f"structured outputs need the '{PACKAGE}' package, which this server "
                         f"does not have (pip install {PACKAGE})") from None
    return llguidance


# JSON-schema bounds (minimum, maximum, exclusive*) past this magnitude are refused before
# llguidance sees them: an integer range with both ends within a few units of -2^63 crashed
# llguidance 1.9.1 (a segfault, the whole server process with it); 2^62 leaves every such range out.
MAX_SCHEMA_BOUND = 2**62
_BOUND_KEYS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def check_schema_bounds(schema) -> None:
    """ValueError naming the first numeric bound of `schema` (a parsed JSON schema, searched
    whole) past ±MAX_SCHEMA_BOUND."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key in _BOUND_KEYS:
                v = node.get(key)
                number = isinstance(v, (int, float)) and not isinstance(v, bool)
                if number and not -MAX_SCHEMA_BOUND <= v <= MAX_SCHEMA_BOUND:
                    raise ValueError(f"the schema's {key} {v} is outside [-2^62, 2^62], which the grammar "
                                     f"library cannot compile safely")
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def _check_lark_json_bounds(grammar: str) -> None:
    """check_schema_bounds for every `%json { ... }` schema inside a Lark grammar (one that does
    not parse as JSON is left to llguidance to refuse)."""
    decoder = json.JSONDecoder()
    for m in re.finditer(r"%json\s*", grammar):
        try:
            schema, _ = decoder.raw_decode(grammar, m.end())
        except ValueError:
            continue
        check_schema_bounds(schema)


def grammar_text(so: StructuredOutputs) -> str:
    """The llguidance grammar of a constraint; ValueError when it cannot even be built."""
    llg = _import()
    from llguidance._grammar_from import grammar_from
    if so.kind == "grammar":
        _check_lark_json_bounds(so.spec)
    if so.kind in ("json", "json_object"):
        schema = so.spec if so.kind == "json" else '{"type": "object"}'
        if so.kind == "json":
            try:
                check_schema_bounds(json.loads(schema))
            except RecursionError:
                raise ValueError("the schema is nested too deeply to check") from None
        if so.whitespace_pattern is not None:
            opts = {"whitespace_flexible": True, "whitespace_pattern": so.whitespace_pattern}
        else:
            opts = _JSON_TIGHT if so.disable_any_whitespace else _JSON_COMPACT
        if so.disable_additional_properties:
            schema = json.dumps(_no_additional_properties(json.loads(schema)))
        try:
            return llg.LLMatcher.grammar_from_json_schema(schema, defaults=opts)
        except (ValueError, TypeError) as e:
            raise ValueError(str(e)) from None
    if so.kind == "choice":  # one regex alternation: llguidance's choice grammar takes at most 1999
        choices = json.loads(so.spec)
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ValueError("a choice constraint is a JSON list of strings")
        return grammar_from("regex", "(" + "|".join(map(_regex_literal, choices)) + ")")
    return grammar_from(so.kind, so.spec)  # "regex", "grammar" (Lark or GBNF)


def _regex_literal(text: str) -> str:
    """`text` as a regex that matches exactly it: ASCII letters, digits, _ and every non-ASCII
    character as they are (the regex syntax's special characters are all ASCII), every other
    ASCII character (punctuation, space, controls) as a hex escape, \\x{..}."""
    return "".join(c if c.isalnum() or c == "_" or not c.isascii() else f"\\x{{{ord(c):x}}}" for c in text)


def _no_additional_properties(schema):
    """The schema with additionalProperties: false on every object that does not set it."""
    if isinstance(schema, dict):
        out = {k: _no_additional_properties(v) for k, v in schema.items()}
        if out.get("type") == "object" or "properties" in out:
            out.setdefault("additionalProperties", False)
        return out
    if isinstance(schema, list):
        return [_no_additional_properties(v) for v in schema]
    return schema


# validate's verdicts by a digest of the constraint: a constraint sent again (every request of
# a client with one schema) is not checked again (a 900 KB grammar took 1.4 s each time)
MAX_VALIDATED = 4096
_validated: OrderedDict = OrderedDict()  # digest -> None (valid) or why not
_validated_lock = threading.Lock()


def validate(so: StructuredOutputs, field: str) -> None:
    """ValueError starting with `field` when the constraint does not compile (no tokenizer
    needed: the front end runs it before anything reaches the engine)."""
    try:
        _import()  # a missing package is this server's state, not the constraint's: not cached
    except ValueError as e:
        raise ValueError(f"{field}: {e}") from None
    key = hashlib.sha256(repr(GrammarCompiler._key(so)).encode("utf-8", "surrogatepass")).digest()
    with _validated_lock:
        known = key in _validated
        why = _validated.get(key)
        if known:
            _validated.move_to_end(key)
    if not known:
        why = _why_invalid(so)
        with _validated_lock:
            _validated[key] = why
            while len(_validated) > MAX_VALIDATED:
                _validated.popitem(last=False)
    if why is not None:
        raise ValueError(f"{field}: {why}")


def _why_invalid(so: StructuredOutputs) -> str | None:
    """Why the constraint does not compile, or None."""
    try:
        text = grammar_text(so)
        error = _import().LLMatcher.validate_grammar(text)
    except ValueError as e:
        return str(e)
    return f"the {so.kind} constraint does not compile: {_first_lines(error)}" if error else None


def _first_lines(message: str, n: int = 4) -> str:
    """A library message as one short line: its first lines, without a panic's backtrace, a
    panic (an assertion on one of llguidance's size limits) said to be one."""
    text = " ".join(line.strip() for line in message.split("<backtrace>")[0].strip().splitlines()[:n])
    if text.startswith("panic:"):
        text = f"it is past one of the grammar library's limits ({text})"
    return text


def failure(so: StructuredOutputs, error: BaseException) -> ValueError:
    """A compile's failure as the request's error, led by the field the constraint came from."""
    why = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    return ValueError(f"{so.source}: {why}")


class RequestGrammar:
    """One request's matcher: which tokens may come next, advanced by each sampled token. With
    `start_after` (StructuredOutputs.start_after: a reasoning model's `</think>`) the matcher is
    inactive, and every token free, until that token has been sampled; the tokens after it are
    the constrained output."""

    def __init__(self, matcher, start_after: int | None = None):
        self.matcher, self.start_after = matcher, start_after  # matcher: llguidance.LLMatcher
        self.active = start_after is None

    def accept(self, token_id: int) -> None:
        if not self.active:
            self.active = token_id == self.start_after
            return
        # a refusal puts the matcher in its error state: `failed`, which ends the request
        self.matcher.consume_token(token_id)

    @property
    def failed(self) -> bool:
        """The matcher is in its error state (a limit hit while generating, e.g. ParserTooComplex,
        or a token it did not allow): the request ends in an error."""
        return self.active and self.matcher.is_error()

    def error(self) -> str:
        """The matcher's error: its first lines, at most MAX_ERROR_CHARS (it can quote the grammar)."""
        message = _first_lines(self.matcher.get_error() or "unknown error")
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "..."
        # capitalised: not a field name, which the HTTP error's param would take it for
        return (f"Structured output: the constraint could not be followed while generating "
                f"({message}); a simpler grammar, fewer choices or a smaller schema avoids it")

    @property
    def terminated(self) -> bool:
        """Nothing but the end may follow: the request stops."""
        return self.active and self.matcher.is_stopped()

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """bitmask[row] <- the allowed next tokens (bit t % 32 of int32 word t // 32)."""
        v = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)


class GrammarCompiler:
    """Compiles constraints against the model's tokenizer (loaded on first use from
    `tokenizer_path`), caching compiled matchers by (kind, spec)."""

    def __init__(self, tokenizer_path: str | None, vocab_size: int):
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self._tokenizer = None
        self._tokenizer_lock = threading.Lock()  # one build, whichever thread asks first
        self._cache: OrderedDict = OrderedDict()
        self._cache_chars = 0  # of the cached constraints' specs
        self._cache_lock = threading.Lock()  # the cache and the compiles under way, across threads
        self._compiling: dict[tuple, Future] = {}  # compile_async's, by constraint
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # (constraint, future) for the workers
        self._workers: list[threading.Thread] = []  # started by the first compile_async
        self._busy_since: dict[int, float] = {}  # worker thread id -> monotonic start of its compile
        self._executor = None
        self.prepare_thread: threading.Thread | None = None  # prepare_in_background's

    def prepare_in_background(self) -> threading.Thread | None:
        """Build llguidance's view of the tokenizer on a daemon thread (the thread, or None when
        there is nothing to build: no tokenizer, or llguidance not installed). For a 100k-token
        vocabulary the build takes ~1 s, which the first structured request would otherwise
        spend on the engine loop, stalling every running request. A failure here is only
        logged: the first structured request retries the build and reports it."""
        if self.tokenizer_path is None or self._tokenizer is not None or importlib.util.find_spec(PACKAGE) is None:
            return None

        def build():
            try:
                self._ll_tokenizer()
            except BaseException as e:  # noqa: BLE001 - reported by the first request that needs it (a pyo3 panic too)
                log.debug("structured outputs: building the tokenizer in the background failed: %s", e)

        self.prepare_thread = threading.Thread(target=build, name="grammar-tokenizer", daemon=True)
        self.prepare_thread.start()
        return self.prepare_thread

    @property
    def words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def _ll_tokenizer(self):
        if self._tokenizer is not None:
            return self._tokenizer
        if self.tokenizer_path is None:
            raise ValueError("structured outputs need a tokenizer; this server runs "
                             "without one (--skip-tokenizer-init)")
        with self._tokenizer_lock:  # a build under way on the other thread: wait for it
            if self._tokenizer is None:
                t0 = time.perf_counter()
                llg = _import()
                import llguidance.hf
                from engine.input_processor import load_tokenizer
                hf = load_tokenizer(self.tokenizer_path, required=True)
                self._tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab_size)
                log.info("structured outputs: %s %s, tokenizer of %d tokens (built in %.2f s)", PACKAGE,
                         getattr(llg, "__version__", ""), self.vocab_size, time.perf_counter() - t0)
        return self._tokenizer

    @staticmethod
    def _key(so: StructuredOutputs) -> tuple:
        return (so.kind, so.spec, so.whitespace_pattern, so.disable_any_whitespace, so.disable_additional_properties)

    def cached(self, so: StructuredOutputs) -> RequestGrammar | None:
        """A fresh matcher for one request when its constraint has been compiled, else None."""
        key = self._key(so)
        with self._cache_lock:
            template = self._cache.get(key)
            if template is None:
                return None
            self._cache.move_to_end(key)
        return RequestGrammar(template.deep_copy(), so.start_after)

    def _build(self, so: StructuredOutputs):
        """Compile a constraint (the slow part: llguidance's work, without the GIL) and cache it;
        ValueError saying why when it does not compile (`failure` names the request's field)."""
        llg = _import()
        # log_level 0: llguidance's own warnings (which can quote the whole grammar) stay
        # off stderr; its errors reach the request (RequestGrammar.error)
        template = llg.LLMatcher(self._ll_tokenizer(), grammar_text(so), log_level=0)
        if template.is_error():
            raise ValueError(f"the {so.kind} constraint does not compile: {_first_lines(template.get_error())}")
        # the lexer is built with the first mask (nested repeats: ~1 s): here, off the step loop, on the
        # template, whose copies start from it (~0.1 s each; a copy that built it left later ones failing)
        row = np.zeros(self.words, dtype=np.int32)
        template.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if template.is_error():
            raise ValueError(f"the {so.kind} constraint does not compile: {_first_lines(template.get_error())}")
        key = self._key(so)
        with self._cache_lock:
            if key not in self._cache:
                self._cache_chars += len(so.spec)
            self._cache[key] = template
            self._cache.move_to_end(key)
            # the newest always stays, whatever its size
            while len(self._cache) > 1 and (len(self._cache) > MAX_CACHED_GRAMMARS
                                            or self._cache_chars > MAX_CACHED_GRAMMAR_CHARS):
                old_key, _ = self._cache.popitem(last=False)
                self._cache_chars -= len(old_key[1])
        return template

    def compile(self, so: StructuredOutputs) -> RequestGrammar:
        """A fresh matcher for one request, compiled here if need be; ValueError naming the
        request's field when it does not compile."""
        grammar = self.cached(so)
        if grammar is not None:
            return grammar
        try:
            return RequestGrammar(self._build(so).deep_copy(), so.start_after)
        except ValueError as e:
            raise failure(so, e) from None

    def compile_async(self, so: StructuredOutputs) -> Future:
        """A Future of the compiled constraint (`matcher_for` makes a request's matcher of it),
        compiled by COMPILE_THREADS daemon workers: a large grammar takes seconds (200,000
        alternatives: ~15 s), which on the engine's step loop stalled every running request.
        Requests with the same constraint share one compile; one already cached is a done
        Future. Cancelling the Future before a worker takes it skips the compile (`cancel`)."""
        key = self._key(so)
        with self._cache_lock:
            future = self._compiling.get(key)
            if future is not None:
                return future
            future = Future()
            template = self._cache.get(key)
            if template is not None:  # compiled since the caller's cached() looked
                future.set_result(template)
                return future
            self._compiling[key] = future
            if not self._workers:
                for _ in range(COMPILE_THREADS):
                    self._start_worker()
        # a cancelled compile leaves no entry behind for the next request with this constraint
        future.add_done_callback(lambda f: self._forget(key, f))
        self._queue.put((so, future))
        return future

    def _start_worker(self) -> None:
        worker = threading.Thread(target=self._compile_worker, name="grammar-compile", daemon=True)
        self._workers.append(worker)
        worker.start()

    def keep_up(self) -> None:
        """While compiles queue and fewer than COMPILE_THREADS workers are free of a compile older
        than HELD_COMPILE_S (grammars the library takes minutes over), start one more worker, up
        to MAX_COMPILE_THREADS: the held ones cannot be stopped, the queue behind them must move."""
        now = time.monotonic()
        with self._cache_lock:
            held = sum(now - t0 > HELD_COMPILE_S for t0 in self._busy_since.values())
            if (not self._workers or self._queue.empty() or len(self._workers) - held >= COMPILE_THREADS
                    or len(self._workers) >= MAX_COMPILE_THREADS):
                return
            self._start_worker()
            log.warning("%d grammar compiles have run for over %g s; started compile worker %d of at most %d",
                        held, HELD_COMPILE_S, len(self._workers), MAX_COMPILE_THREADS)

    def _forget(self, key: tuple, future: Future) -> None:
        with self._cache_lock:
            if self._compiling.get(key) is future:
                del self._compiling[key]

    def _compile_worker(self) -> None:
        while True:
            so, future = self._queue.get()
            if not future.set_running_or_notify_cancel():
                continue  # every request that waited for it has gone
            me = threading.get_ident()
            with self._cache_lock:
                self._busy_since[me] = time.monotonic()
            try:
                future.set_result(self._build(so))
            except BaseException as e:  # noqa: BLE001 - the requests that wait report it (a 400)
                # a pyo3 panic is a BaseException: as an Exception, so that it fails the requests
                # that wait for it, not the engine loop that reads the result
                future.set_exception(e if isinstance(e, Exception) else RuntimeError(f"{type(e).__name__}: {e}"))
            finally:
                with self._cache_lock:
                    del self._busy_since[me]

    @staticmethod
    def matcher_for(so: StructuredOutputs, future: Future) -> RequestGrammar:
        """A request's own matcher of its constraint's compile (compile_async's future, done);
        ValueError naming the request's field when it did not compile (requests that share a
        compile may have come through different fields)."""
        try:
            template = future.result()
        except Exception as e:  # noqa: BLE001 - a library failure of any kind: the request's 400
            raise failure(so, e) from None
        return RequestGrammar(template.deep_copy(), so.start_after)

    def fill_bitmask(self, grammars: list[RequestGrammar]) -> np.ndarray:
        """[len(grammars), words] int32: row i allows the tokens grammars[i] allows next."""
        bitmask = np.zeros((len(grammars), self.words), dtype=np.int32)
        if len(grammars) == 1:
            grammars[0].fill(bitmask, 0)
            return bitmask
        if self._executor is None:
            self._executor = _import().LLExecutor(num_threads=MASK_THREADS)
        self._executor.unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(grammars)],
                                               bitmask.ctypes.data, self.words * 4, len(grammars))
        return bitmask
