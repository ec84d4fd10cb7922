"""Engine core: the step loop, `schedule -> execute -> update`, over token ids only."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import numpy as np

from common.args import EngineArgs
from common.gc_tuning import freeze_startup_objects, thaw_frozen_objects
from engine.data_parallel import DataParallelScheduler
from engine.executor import make_executor
from engine.profiler import ProfileControl
from engine.sampler import check_sampling_params
from common.sampling_params import SamplingParams, banned_next, check_token_ids
from engine import structured_outputs
from engine.structured_outputs import GrammarCompiler
from engine.worker import resolve_device
from models.config import ModelConfig
from scheduler.config import SchedulerConfig
from scheduler.outputs import EngineCoreOutput, SchedulerOutput
from scheduler.request import Request
from scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def allowed_bits(row: np.ndarray, ids: list[int]) -> np.ndarray:
    """The bits of token `ids` in a grammar bitmask row (int32 words, bit t % 32 of word t // 32)."""
    t = np.asarray(ids, dtype=np.int64)
    return (row[t >> 5].view(np.uint32) >> (t & 31).astype(np.uint32)) & 1


class EngineCore:
    def __init__(self, args: EngineArgs, cfg: ModelConfig, eos_token_id: int | None,
                 serving: bool = False):
        """`serving` (the server's core process): the grammar library's tokenizer is built on a
        background thread while the model loads, and a new constraint is compiled off the step
        loop while its request waits (`admit_compiled`), so that neither stalls the running
        requests; the offline LLM compiles in add_request, which then raises on a bad one. The
        speculative-decoding acceptance line is the offline LLM's: a server logs it in its stats
        line (server/stats_log.py, off under --disable-log-stats)."""
        self.args, self.cfg = args, cfg
        self.eos_token_id = eos_token_id
        self.max_model_len = args.resolve_max_model_len(cfg)
        # compiles each distinct constraint once, on its first request (llguidance)
        self.grammars = GrammarCompiler(None if args.skip_tokenizer_init else args.tokenizer_path,
                                        cfg.vocab_size)
        self.serving = serving
        # requests waiting for their grammar: (request, its compile, the monotonic time it gives up)
        self._compiling: dict[str, tuple[Request, Future, float]] = {}
        if serving:
            self.grammars.prepare_in_background()
        self.executor = make_executor(args, cfg, [] if eos_token_id is None else [eos_token_id])
        num_blocks = self.executor.num_blocks
        fitted = args.fit_max_model_len(cfg, num_blocks * args.block_size * args.decode_context_parallel_size)
        if fitted < self.max_model_len:
            log.warning("--max-model-len auto: %d tokens, what the KV cache holds (the model's "
                        "max_position_embeddings is %d)", fitted, self.max_model_len)
            self.max_model_len = fitted
        self.async_scheduling = (resolve_device(args).type == "cuda" if args.async_scheduling is None
                                 else args.async_scheduling)  # auto: overlap only pays with a GPU
        spec = args.speculative_config
        if spec is not None and self.async_scheduling:  # only when auto chose it (args refuse both)
            log.info("speculative decoding (--speculative-config) turns async scheduling off: the "
                     "next step's inputs depend on how many drafts this step accepts")
            self.async_scheduling = False
        if spec is not None:
            log.info("speculative decoding: %s, up to %d draft tokens per decode", spec.method,
                     spec.num_speculative_tokens)
        self._in_flight = None  # (SchedulerOutput, PendingStep) of the step launched last
        self._early: list[EngineCoreOutput] = []  # drained outside step(), reported by the next one
        self.step_tokens = 0  # tokens the last step() scheduled (0: it only drained)
        self.step_tokens_per_engine: list[int] | None = None  # each DP rank's, under -dp
        self._spec_logged = (time.monotonic(), 0, 0, 0)  # time, drafts, draft tokens, accepted
        sched_config = SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len, block_size=args.block_size, num_blocks=num_blocks,
            enable_prefix_caching=args.enable_prefix_caching,
            dcp_size=args.decode_context_parallel_size, async_scheduling=self.async_scheduling,
            num_speculative_tokens=0 if spec is None else spec.num_speculative_tokens,
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            scheduling_policy=args.scheduling_policy,
            num_lookahead_tokens=spec.num_speculative_tokens - 1 if spec is not None and spec.method == "mtp" else 0)
        dp = args.data_parallel_size
        self.scheduler = (Scheduler(sched_config) if dp == 1 else
                          DataParallelScheduler(sched_config, dp, self.executor.graph_sizes))
        log.info("KV cache (%s): %d blocks of %d tokens%s: capacity %d tokens%s",
                 args.kv_cache_dtype, num_blocks, args.block_size,
                 f" x dcp {args.decode_context_parallel_size}" if args.decode_context_parallel_size > 1 else "",
                 self.scheduler.config.capacity_tokens,
                 f" on each of {dp} DP ranks ({dp * self.scheduler.config.capacity_tokens} in all)" if dp > 1 else "")
        self.profile = ProfileControl(args.profiler_config, self.executor)  # /start_profile, /stop_profile
        freeze_startup_objects()  # full collections while serving walk only the requests' objects

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Queue a request; ValueError (nothing queued) when one of its values could not run,
        so that a bad request fails alone before it ever joins a batch. In the serving core a
        constraint not yet compiled is compiled off the loop, and its failure comes later, from
        `admit_compiled`."""
        check_sampling_params(params)
        V = self.cfg.vocab_size
        if prompt_token_ids and not 0 <= min(prompt_token_ids) <= max(prompt_token_ids) < V:
            raise ValueError(f"prompt: token ids must be in [0, {V})")
        check_token_ids(params, V, self.eos_token_id)
        if self._in_flight is not None and request_id in self._in_flight[0].num_scheduled_tokens:
            # The id of a request that has ended but still has a step in flight: results are
            # matched by id, so that step must land before the new request can exist.
            self._early += self._drain()
        request = Request(request_id, prompt_token_ids, params, self.eos_token_id)
        if request_id in self._compiling:
            raise ValueError(f"request id {request_id!r} is already waiting for its grammar")
        so = params.structured_outputs
        if so is not None:
            if self.serving:
                request.grammar = self.grammars.cached(so)
                if request.grammar is None:  # joins the scheduler once compiled (admit_compiled)
                    self.scheduler.check_request(request)  # its other refusals come now, not then
                    self._compiling[request_id] = (request, self.grammars.compile_async(so),
                                                   time.monotonic() + structured_outputs.COMPILE_TIMEOUT_S)
                    return
            else:
                request.grammar = self.grammars.compile(so)
        self.scheduler.add_request(request)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their grammar to compile (not yet in the scheduler)."""
        return len(self._compiling)

    def admit_compiled(self) -> list[tuple[str, str]]:
        """Requests whose grammar has compiled join the scheduler (in arrival order); returns
        (request id, why) for those whose grammar did not compile, or did not within
        COMPILE_TIMEOUT_S of their arrival, which are dropped."""
        refused = []
        now = time.monotonic()
        self.grammars.keep_up()
        for rid, (request, future, deadline) in list(self._compiling.items()):
            so = request.sampling_params.structured_outputs
            if not future.done():
                if now > deadline:  # it fails alone; the compile runs on for any other waiter
                    del self._compiling[rid]
                    self._drop_compile(future)
                    late = ValueError(f"the {so.kind} constraint did not compile within "
                                      f"{structured_outputs.COMPILE_TIMEOUT_S:g} s")
                    refused.append((rid, str(structured_outputs.failure(so, late))))
                continue
            del self._compiling[rid]
            try:
                request.grammar = self.grammars.matcher_for(so, future)
                self.scheduler.add_request(request)
            except ValueError as e:  # the request's own grammar or prompt: it fails alone
                refused.append((rid, str(e)))
        return refused

    def _drop_compile(self, future: Future) -> None:
        """Cancel a compile no parked request waits for any more (skipped unless already running)."""
        if all(f is not future for _, f, _ in self._compiling.values()):
            future.cancel()

    def abort_requests(self, request_ids) -> list[EngineCoreOutput]:
        request_ids = list(request_ids)
        outputs = []
        for rid in request_ids:
            parked = self._compiling.pop(rid, None)
            if parked is not None:
                outputs.append(EngineCoreOutput(rid, [], finish_reason="abort"))
                self._drop_compile(parked[1])
        outputs += self.scheduler.abort_requests(request_ids)
        if self._in_flight is not None and not self.scheduler.has_unfinished_requests():
            outputs += self._drain()  # idle from now on: nothing should stay in flight
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def reset_prefix_cache(self) -> int:
        """Forget every DP rank's cached blocks (scheduler/block_manager.py); returns how many."""
        n = sum(s.block_manager.reset_prefix_cache() for s in self.scheduler.schedulers)
        log.info("prefix cache reset: %d cached blocks forgotten", n)
        return n

    def step(self) -> list[EngineCoreOutput]:
        outputs = self._step()
        self.profile.after_step()
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        if not self.serving:  # offline: no stats line logs the acceptance
            self._log_spec_decode()
        self.step_tokens, self.step_tokens_per_engine = 0, None
        if self._early:
            early, self._early = self._early, []
            return early + self._step()
        if not self.async_scheduling:
            so = self._schedule()
            self._count_tokens(so)
            out = self.executor.execute(so)
            return self.scheduler.update_from_output(so, out)
        # Async: schedule and launch step N+1, then wait for step N and report it. The host work
        # of both (scheduling, input preparation, stop checks) overlaps the GPU running step N.
        if self._in_flight is not None and self.scheduler.needs_sync():
            return self._drain()  # a request samples with its full history: no token may be in flight
        so = self._schedule()
        self._count_tokens(so)
        launched = self.executor.launch(so)
        outputs = self._drain()
        if launched is not None:
            self._in_flight = (so, launched)
            if not self.scheduler.has_unfinished_requests():
                outputs += self._drain()  # every request ended with step N: nothing to wait for
        return outputs

    def _count_tokens(self, so) -> None:
        """The step's scheduled tokens, and each DP rank's under data parallelism."""
        self.step_tokens = so.total_num_scheduled_tokens
        parts = getattr(so, "parts", None)  # engine/data_parallel.DPSchedulerOutput
        self.step_tokens_per_engine = None if parts is None else [p.total_num_scheduled_tokens for p in parts]

    def _log_spec_decode(self, interval: float = 10.0) -> None:
        """Every `interval` seconds with drafts verified: the mean acceptance length (tokens one
        verifying step yields per request) and the acceptance rate over that interval."""
        spec = self.scheduler.stats.spec
        if spec is None:
            return
        t0, d0, n0, a0 = self._spec_logged
        now = time.monotonic()
        if now - t0 < interval or spec.num_drafts == d0:
            return
        drafts, tokens, accepted = spec.num_drafts - d0, spec.num_draft_tokens - n0, spec.num_accepted_tokens - a0
        log.info("speculative decoding: mean acceptance length %.2f, %d of %d draft tokens accepted "
                 "(%.1f%%) in %d drafts over %.0f s; accepted per position so far: %s",
                 1 + accepted / drafts, accepted, tokens, 100 * accepted / max(tokens, 1), drafts, now - t0,
                 spec.accepted_per_pos)
        self._spec_logged = (now, spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)

    def _schedule(self):
        """The next step, with the bitmask of its constrained rows (needs_sync() guarantees that
        no step in flight holds tokens of theirs)."""
        so = self.scheduler.schedule()
        for sched, part in self.scheduler.parts(so):
            self._fill_bitmask(sched, part)
        return so

    def _fill_bitmask(self, sched: Scheduler, so: SchedulerOutput) -> None:
        """One DP rank's step `so` (of `sched`): its constrained rows' bitmask."""
        rows = sched.grammar_rows(so)
        if rows:
            so.grammar_req_ids = [r.request_id for r in rows]
            so.grammar_bitmask = self.grammars.fill_bitmask([r.grammar for r in rows])
            for row, r in enumerate(rows):  # a constraint that allows none of allowed_token_ids next
                sp = r.sampling_params
                if sp.allowed_token_ids is None:
                    continue
                banned = banned_next(sp, r.output_token_ids, r.eos_token_id)  # bad words, min_tokens
                left = [t for t in sp.allowed_token_ids if t not in banned]
                if not left or not allowed_bits(so.grammar_bitmask[row], left).any():
                    r.no_allowed_token = ("allowed_token_ids: the structured-output constraint allows none of "
                                          f"the listed tokens{' not banned (bad_words, min_tokens)' if banned else ''} "
                                          f"after {r.num_output_tokens} output tokens")

    def _drain(self) -> list[EngineCoreOutput]:
        """Wait for the step in flight, if any, and apply its output."""
        if self._in_flight is None:
            return []
        so, pending = self._in_flight
        self._in_flight = None
        return self.scheduler.update_from_output(so, self.executor.finish(pending))

    def shutdown(self) -> None:
        self._in_flight = None  # its results no longer matter (and the engine thread may still run)
        self.executor.shutdown()
        thaw_frozen_objects()  # a process that builds another engine can collect this one's cycles
