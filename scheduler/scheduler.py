"""Token-budget scheduler (DESIGN.md §3): each step decides {req_id: num_tokens}, no phases.

Step protocol: `schedule()` -> runner -> `update_from_output()`, strictly alternating; with
`async_scheduling`, step N+1 may be scheduled before step N's `update_from_output()` (one step in
flight): a request whose step-N tokens reach its end holds an output placeholder, and its next
step computes that (device-side) token.
`schedule()` advances each scheduled request's `num_computed_tokens` by its n at once (as vLLM V1
does): from then on the tokens count as "being computed", which is what the next step's
`CachedRequestData.num_computed_tokens` must say. Blocks are registered in the prefix cache only in
`update_from_output()`, once the runner has really written them.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Iterable

from common.sampling_params import nothing_to_sample
from scheduler.block_manager import BlockManager
from scheduler.config import SchedulerConfig
from scheduler.outputs import (CachedRequestData, EngineCoreOutput, ModelRunnerOutput,
                               NewRequestData, SchedulerOutput)
from scheduler.policy import choose_victim, enqueue
from scheduler.prefix_reuse import PrefixReuse
from scheduler.prompt_logprobs import PromptLogprobs
from scheduler.request import Request, RequestStatus
from scheduler.stats import SchedulerStats, SpecDecodeStats

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the request queues and the KV block pool; talks to the runner only through outputs.py."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.block_manager = BlockManager(config.num_blocks, config.virtual_block_size,
                                          config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self._finished_req_ids: set[str] = set()  # for the next SchedulerOutput
        self._num_preemptions = 0
        self._structured: set[str] = set()  # unfinished requests with a grammar
        self._prefix_queries = 0
        self._prefix_hits = 0
        self._prompt_tokens = self._generation_tokens = 0
        self.prefix = PrefixReuse(self.block_manager, config.enable_prefix_caching)
        self.engine_index = 0  # this scheduler's DP rank (engine/data_parallel.py sets it)
        k = config.num_speculative_tokens
        self._spec = SpecDecodeStats(accepted_per_pos=[0] * k) if k else None

    # ---- intake ----

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if its prompt can never be served."""
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        enqueue(self.waiting, request, self.config.scheduling_policy)
        if request.grammar is not None:
            self._structured.add(request.request_id)

    def check_request(self, request: Request) -> None:
        """add_request's refusals (ValueError), without queueing: an id in use, a prompt that can
        never be served."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        self.check_priority(request.sampling_params)
        n = request.num_prompt_tokens
        if n > self.config.max_model_len:
            raise ValueError(f"prompt has {n} tokens, more than max_model_len "
                             f"({self.config.max_model_len})")
        if n > self.config.capacity_tokens:
            raise ValueError(f"prompt has {n} tokens, more than the KV cache capacity of "
                             f"{self.config.capacity_tokens} tokens ({self.config.num_blocks} blocks "
                             f"of {self.config.virtual_block_size})")

    def check_priority(self, params) -> None:
        """ValueError for a priority the policy does not read (vLLM refuses it too)."""
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority: {params.priority} needs --scheduling-policy priority (this "
                             "server schedules first come, first served; only 0)")

    def abort_requests(self, request_ids: Iterable[str]) -> list[EngineCoreOutput]:
        """Finish the given requests with "abort" and free their blocks; unknown ids are ignored."""
        outputs = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
                self._finished_req_ids.add(req_id)  # the runner holds its state
            else:
                self.waiting.remove(request)  # a preempted one was already dropped by the runner
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request)
            del self.requests[req_id]
            self._structured.discard(req_id)
            outputs.append(EngineCoreOutput(req_id, [], finish_reason="abort",
                                            num_cached_tokens=max(request.num_cached_tokens, 0),
                                            engine_index=self.engine_index))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def schedulers(self) -> list[Scheduler]:
        """Each DP rank's scheduler: this one alone (engine/data_parallel.py's has one a rank)."""
        return [self]

    @property
    def stats(self) -> SchedulerStats:
        bm = self.block_manager
        return SchedulerStats(len(self.running), len(self.waiting), bm.num_free_blocks,
                              bm.num_total_blocks, bm.usage, self._num_preemptions,
                              self._prefix_queries, self._prefix_hits, self._spec,
                              self._prompt_tokens, self._generation_tokens)

    # ---- scheduling ----

    def schedule(self) -> SchedulerOutput:
        """Pick this step's {req_id: n} under the token and request budgets, allocating KV first."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        spec_tokens: dict[str, list[int]] = {}
        preempted_now = False
        # prompt blocks this step computes (not cached yet: scheduler/prefix_reuse.py) -> the most
        # alternatives a prompt-logprob request computing it wants (NO_LOGPROBS: none)
        computing: dict[bytes, int] = {}

        # Running requests, oldest first. Under fcfs victims come from the end of the list, i.e.
        # from those not yet scheduled this step; under priority the lowest in priority order,
        # whose tokens, if it was scheduled earlier in this step, are taken back.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            n = min(self._chunk(request.num_tokens + request.num_output_placeholders
                                - request.num_computed_tokens), budget)
            if n <= 0 or (request.num_output_placeholders and self._ends_with_placeholder(request)):
                i += 1
                continue
            drafts = self._drafts_to_verify(request, n, budget)
            if drafts:
                new_block_ids = self._allocate(request, 1 + len(drafts))
                if new_block_ids is None:
                    drafts = []  # the pool is short: decode without drafts before preempting anyone
            request.spec_token_ids = []
            n += len(drafts)
            while not drafts:
                new_block_ids = self._allocate(request, n)
                if new_block_ids is not None:
                    break
                victim = choose_victim(self.running, self.config.scheduling_policy)
                if self.running.index(victim) < i:  # priority only: earlier in the list this step,
                    # scheduled, or skipped (async scheduling: its token in flight ends it)
                    budget += num_scheduled.pop(victim.request_id, 0)
                    spec_tokens.pop(victim.request_id, None)
                    cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    i -= 1
                self._preempt(victim)
                preempted_now = True
                if victim is request:
                    break
            if new_block_ids is None:
                break  # the request preempted itself; it was the last one
            cached_reqs.append(CachedRequestData(request.request_id, new_block_ids,
                                                 request.num_computed_tokens))
            self.prefix.mark(computing, request, request.num_computed_tokens, n)
            num_scheduled[request.request_id] = n
            if drafts:
                spec_tokens[request.request_id] = drafts
            budget -= n
            i += 1

        # Waiting requests, in queue order (scheduler/policy.py). None are admitted in a step that had to
        # preempt: the pool is short, and a victim must not come straight back in the same step.
        deferred: list[Request] = []
        while (self.waiting and budget > 0 and not preempted_now
               and len(self.running) < self.config.max_num_seqs):
            request = self.waiting[0]
            hit_blocks, hit_logprobs = self.prefix.hit(request)
            if self.prefix.waits(request, len(hit_blocks), computing):
                deferred.append(self.waiting.popleft())
                if len(deferred) >= self.config.max_num_seqs:
                    break  # the scan's host time stays bounded behind a crowd sharing one prefix
                continue
            num_hit = len(hit_blocks) * self.block_manager.tokens_per_block
            request.num_computed_tokens = num_hit
            n = min(self._chunk(request.num_tokens - num_hit), budget)
            if self._allocate(request, n, hit_blocks) is None:
                request.num_computed_tokens = 0
                break  # waits; only running requests may preempt
            self.waiting.popleft()
            if hit_logprobs:
                request.prompt_logprobs = hit_logprobs  # the runner reports the rest, from num_hit + 1 on
            if self.config.enable_prefix_caching:
                self._prefix_queries += request.num_tokens
                self._prefix_hits += num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
                request.queue_time = time.monotonic() - request.arrival_time
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            new_reqs.append(NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=list(self.block_manager.get_block_ids(request.request_id)),
                num_computed_tokens=num_hit,
            ))
            num_scheduled[request.request_id] = n
            self.prefix.mark(computing, request, num_hit, n)
            budget -= n
        self.waiting.extendleft(reversed(deferred))  # back at the head, in their order
        self.prefix.prev = computing

        for req_id, n in num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if (self.config.async_scheduling
                    and request.num_computed_tokens == request.num_tokens + request.num_output_placeholders):
                request.num_output_placeholders += 1  # this step samples; the token comes later
        finished, self._finished_req_ids = self._finished_req_ids, set()
        total = sum(num_scheduled.values())
        assert total <= self.config.max_num_batched_tokens and len(num_scheduled) <= self.config.max_num_seqs
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled, total, finished,
                               scheduled_spec_decode_tokens=spec_tokens)

    def _chunk(self, n: int) -> int:
        """A request's `n` remaining tokens, cut to long_prefill_token_threshold when set (a
        decode's one token never is)."""
        cap = self.config.long_prefill_token_threshold
        return cap if 0 < cap < n else n

    def _allocate(self, request: Request, n: int, hit_blocks: list[int] | None = None) -> list[int] | None:
        """Blocks for `n` more tokens, and the lookahead slots after them up to max_model_len."""
        ahead = min(self.config.num_lookahead_tokens,
                    min(self.config.max_model_len, self.config.capacity_tokens) - request.num_computed_tokens - n)
        return self.block_manager.allocate(request, n + max(ahead, 0), hit_blocks)

    def _drafts_to_verify(self, request: Request, n: int, budget: int) -> list[int]:
        """The drafts a decode verifies this step: its proposed ones, as many as the token budget,
        max_model_len, the pool and max_tokens leave room for (a step outputs up to 1 + drafts)."""
        if not request.spec_token_ids or n != 1 or request.num_output_placeholders:
            return []
        num_tokens = request.num_tokens
        room = min(len(request.spec_token_ids), budget - 1, self.config.max_model_len - num_tokens,
                   self.config.capacity_tokens - num_tokens)
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return request.spec_token_ids[:max(room, 0)]

    def _ends_with_placeholder(self, request: Request) -> bool:
        """True if the token a step in flight samples for `request` must end it whatever its value
        (max_tokens, max_model_len, pool size): then nothing more is scheduled for it."""
        num_out = request.num_output_tokens + request.num_output_placeholders
        num_tokens = request.num_tokens + request.num_output_placeholders
        max_tokens = request.sampling_params.max_tokens
        return ((max_tokens is not None and num_out >= max_tokens)
                or num_tokens >= self.config.max_model_len or num_tokens > self.config.capacity_tokens)

    def parts(self, so: SchedulerOutput) -> list[tuple[Scheduler, SchedulerOutput]]:
        """(scheduler, its step) of each DP rank in `so`: this one alone (engine/data_parallel.py)."""
        return [(self, so)]

    def needs_sync(self) -> bool:
        """True if a running request reads its own output history when sampling (penalties,
        min_tokens), or any request has a grammar (its next bitmask needs every token it has
        sampled): async scheduling must then let the step in flight finish first."""
        return bool(self._structured) or any(r.sampling_params.reads_history for r in self.running)

    def grammar_rows(self, so: SchedulerOutput) -> list[Request]:
        """The constrained requests that sample in `so` (their scheduled tokens reach their end),
        in no particular order; empty at no cost when no request has a grammar. A grammar not yet
        active (its start token not sampled: the reasoning) constrains nothing: no row."""
        if not self._structured:
            return []
        out = []
        for req_id in so.num_scheduled_tokens:
            r = self.requests[req_id]
            if r.grammar is not None and r.grammar.active and r.num_computed_tokens >= r.num_tokens:
                out.append(r)
        return out

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self._free(request)
        request.num_output_placeholders = 0  # a token in flight for it is dropped and recomputed
        request.spec_token_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        if request.wants_prompt_logprobs:
            request.prompt_logprobs = PromptLogprobs.empty()  # the runner reports them again from the start
        enqueue(self.waiting, request, self.config.scheduling_policy, preempted=True)
        self._finished_req_ids.add(request.request_id)
        self._num_preemptions += 1
        logger.debug("preempted %s (pool has %d free blocks)", request.request_id,
                     self.block_manager.num_free_blocks)

    def _free(self, request: Request) -> None:
        self.block_manager.free(request.request_id)

    # ---- results ----

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stops, free finished requests; return news per request."""
        # The step's tokens are now in the KV cache: their full blocks may be shared.
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                self.block_manager.cache_full_blocks(request)

        for req_id, chunk in runner_output.prompt_logprobs.items():
            request = self.requests.get(req_id)
            # Not RUNNING: preempted after this step was launched (async scheduling); its prompt
            # is computed again from the start, and so are its prompt logprobs.
            if request is not None and request.status == RequestStatus.RUNNING and request.wants_prompt_logprobs:
                request.prompt_logprobs = request.prompt_logprobs + chunk
                self.block_manager.record_prompt_logprobs(request)

        outputs = []
        spec = scheduler_output.scheduled_spec_decode_tokens
        for req_id, token_id, logprobs in zip(runner_output.req_ids, runner_output.sampled_token_ids,
                                              runner_output.logprobs):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted, preempted or finished while the step ran
            if request.num_output_placeholders:
                request.num_output_placeholders -= 1
            tokens, lps = [token_id], [logprobs]
            drafts = spec.get(req_id)
            if drafts:
                accepted = runner_output.spec_token_ids.get(req_id, [])
                # KV of the rejected drafts is stale: those slots are written again by the next
                # tokens (the blocks stay the request's, so the pool's accounting is unchanged)
                request.num_computed_tokens -= len(drafts) - len(accepted)
                tokens = accepted + tokens
                lps = runner_output.spec_logprobs.get(req_id, [None] * len(accepted)) + lps
                if self._spec is not None:
                    self._spec.record(len(drafts), len(accepted))
            first = request.num_output_tokens == 0
            out = EngineCoreOutput(req_id, [], [], engine_index=self.engine_index)
            for tok, lp in zip(tokens, lps):
                if request.no_allowed_token is None:  # else sampled from a row its masks left empty: not output
                    request.append_output_token(tok)
                    out.new_token_ids.append(tok)
                    out.new_logprobs.append(lp)
                if self._check_stop(request, tok):
                    out.finish_reason = request.finish_reason
                    out.stop_reason = request.stop_reason
                    out.grammar_ended = request.ended_by_grammar
                    self.running.remove(request)
                    self._finish(request)
                    break
            self._generation_tokens += len(out.new_token_ids)
            if first:
                out.num_cached_tokens = max(request.num_cached_tokens, 0)
                out.queue_time = request.queue_time
                self._prompt_tokens += request.num_prompt_tokens
            if request.wants_prompt_logprobs:
                out.prompt_logprobs = request.prompt_logprobs  # never changed in place: shared
                request.prompt_logprobs_emitted = True
            if not out.finished:
                request.spec_token_ids = runner_output.draft_token_ids.get(req_id, [])
            outputs.append(out)
        return outputs

    def _check_stop(self, request: Request, token_id: int) -> bool:
        """Set the finished status if token_id ends the request; stop tokens wait for min_tokens."""
        sp = request.sampling_params
        if request.no_allowed_token is not None:  # the step sampled from a row with nothing allowed
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = request.no_allowed_token
            return True
        # checked first: a matcher that failed while computing its mask allows only EOS, which
        # must not read as a normal stop
        if request.grammar is not None and request.grammar.failed:
            # the matcher gave up (a grammar past llguidance's limits, found only while
            # generating): an error the client is told of, never an output that breaks its
            # constraint passed off as "stop"
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = request.grammar.error()
            return True
        if request.num_output_tokens >= sp.min_tokens:
            if token_id in sp.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = token_id
                return True
            if not sp.ignore_eos and request.eos_token_id is not None and token_id == request.eos_token_id:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
        if request.grammar is not None and request.grammar.terminated:
            # the grammar allows nothing more: the end of the output, whatever min_tokens says
            request.status = RequestStatus.FINISHED_STOPPED
            request.ended_by_grammar = True
            return True
        if sp.max_tokens is not None and request.num_output_tokens >= sp.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        # The next step would compute token num_tokens-1, needing num_tokens KV slots: past the
        # pool that could never run (it would preempt itself forever), so it ends like max_model_len.
        if (request.num_tokens >= self.config.max_model_len
                or request.num_tokens > self.config.capacity_tokens):
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        # allowed_token_ids all banned next (by a bad word the output now ends with, or below
        # min_tokens): the sampler would take a token off the list, so the request ends in an error
        if (sp.allowed_token_ids is not None and (sp.bad_words_token_ids or sp.min_tokens)
                and nothing_to_sample(sp, request.output_token_ids, request.eos_token_id)):
            request.status = RequestStatus.FINISHED_ERROR
            request.stop_reason = (f"allowed_token_ids: after {request.num_output_tokens} output tokens every "
                                   "listed token is banned next (by bad_words, the output ending with a bad "
                                   "word's first tokens, or below min_tokens), so nothing can be sampled")
            return True
        return False

    def _finish(self, request: Request) -> None:
        self._free(request)
        del self.requests[request.request_id]
        self._structured.discard(request.request_id)
        self._finished_req_ids.add(request.request_id)

