"""Model runner: SchedulerOutput -> inputs + attention metadata -> model -> sampled tokens.

It keeps each live request's tokens and block table (the scheduler sends only diffs), orders
every batch decodes first (DESIGN.md §5), builds the metadata once per step and samples. Every
TP rank samples and feeds its own samples back; engine/rank_agreement.py says why and checks it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from attention.metadata import MLAMetadata, build_mla_metadata
from common import distributed as pd
from engine.rank_agreement import RankAgreement
from engine.logprobs import DeviceLogprobs, prompt_logprobs_chunked
from engine.sampler import Sampler, SamplingBatch, make_generator
from common.sampling_params import SamplingParams
from common.transfer import to_device, to_host
from engine.mtp_drafter import mtp_propose
from engine.spec_decode import SpeculativeConfig, accepted_prefix, ngram_propose
from models.config import ModelConfig
from models.deepseek import DeepseekForCausalLM
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from scheduler.prompt_logprobs import PromptLogprobs

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None = None
    prompt_logprobs: list = field(default_factory=list)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]


@dataclass
class StepBatch:
    """One step's inputs, rows ordered decodes first."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: MLAMetadata
    order: list[str]  # request ids in row order
    query_lens: list[int]
    context_lens: list[int]


class ModelRunner:
    def __init__(self, model: DeepseekForCausalLM, cfg: ModelConfig, kv_caches: list[torch.Tensor],
                 block_size: int, device: torch.device, eos_token_ids: list[int],
                 context_chunk_tokens: int = 8192, rank_check_interval: int = 0,
                 speculative_config: SpeculativeConfig | None = None,
                 mtp_kv_caches: list[torch.Tensor] | None = None, argmax=None):
        self.model, self.cfg, self.kv_caches = model, cfg, kv_caches
        self.block_size, self.device = block_size, device
        self.eos_token_ids = eos_token_ids
        self.context_chunk_tokens = context_chunk_tokens
        self.spec = speculative_config
        self.mtp_kv_caches = mtp_kv_caches or []  # with {"method": "mtp"}: the MTP layer's cache
        self.decode_threshold = 1 if self.spec is None else self.spec.decode_threshold  # 1 + k drafts
        self.sampler = Sampler(argmax)  # argmax: the plan's greedy argmax (None: torch's)
        self.requests: dict[str, RequestState] = {}
        self.graphs = None  # engine.cuda_graph.DecodeGraphs, set by the worker on CUDA
        self.mtp_graphs = None  # the MTP drafter's DecodeGraphs, with {"method": "mtp"} on CUDA
        self.piecewise = None  # engine.piecewise_graph.PiecewiseGraphs: the other steps, on CUDA
        self._last: PendingStep | None = None  # the latest launched step, until finished
        self.agreement = RankAgreement(rank_check_interval)  # ranks sample alike (rank_agreement.py)

    # ---- the low-level entry the tests drive directly ----

    def prepare(self, token_ids: list[list[int]], context_lens: list[int],
                block_ids: list[list[int]], req_ids: list[str] | None = None) -> StepBatch:
        """Inputs for requests computing `token_ids[i]` after `context_lens[i]` cached tokens.

        Requests may come in any order; rows are reordered decodes first (stable): the decodes
        are the requests of at most `decode_threshold` tokens.
        """
        n = len(token_ids)
        req_ids = req_ids or [str(i) for i in range(n)]
        order = sorted(range(n), key=lambda i: len(token_ids[i]) > self.decode_threshold)  # stable
        q = [len(token_ids[i]) for i in order]
        ctx = [context_lens[i] for i in order]
        ids = np.fromiter((t for i in order for t in token_ids[i]), dtype=np.int64, count=sum(q))
        pos = np.concatenate([np.arange(c, c + k) for c, k in zip(ctx, q)]) if n else np.zeros(0, np.int64)
        dcp = pd.dcp()
        meta = build_mla_metadata(q, ctx, [block_ids[i] for i in order], self.block_size, self.device,
                                  dcp_size=dcp.size, dcp_rank=dcp.rank, decode_threshold=self.decode_threshold,
                                  context_chunk_tokens=self.context_chunk_tokens)
        return StepBatch(input_ids=to_device(ids, torch.int64, self.device),
                         positions=to_device(pos, torch.int64, self.device), meta=meta,
                         order=[req_ids[i] for i in order], query_lens=q, context_lens=ctx)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states `[T, hidden]` of every row of the batch."""
        m, rows = batch.meta, pd.dp_rows()
        if (self.graphs is not None and m.prefill is None and m.decode is not None
                and m.decode.row_index is None):
            b = self.graphs.bucket_for(m.num_decodes, m.decode.q_len)
            if rows:  # data parallelism: only the graph whose MoE gathers the step's rows per DP rank
                fits = b is not None and rows >= b and rows in self.graphs.buckets and m.decode.q_len == 1
                b = rows if fits else None
            if b:
                return self.graphs.run(batch.input_ids, batch.positions, m, bucket=b)
        if self.piecewise is not None:
            size = self.piecewise.size_for(batch.input_ids.shape[0])
            if rows:
                size = rows if size is not None and rows in self.piecewise.sizes else None
            if size:
                return self.piecewise.run(batch.input_ids, batch.positions, m, size=size)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, m)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return self.model.compute_logits(hidden, fp32)

    # ---- the engine's entry ----

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_req_ids:
            self.requests.pop(rid, None)
        for r in so.scheduled_new_reqs:
            p = r.sampling_params
            gen = None
            if p.seed is not None:
                gen = make_generator(p.seed, self.device)
                if not p.greedy:
                    # Resumed after preemption: replay the draws of the tokens it already has
                    # (one Exponential(1) vector per sampled token) so the stream continues.
                    for _ in r.output_token_ids:
                        torch.empty(self.cfg.vocab_size, device=self.device).exponential_(generator=gen)
            self.requests[r.req_id] = RequestState(
                r.req_id, list(r.prompt_token_ids) + list(r.output_token_ids),
                len(r.prompt_token_ids), p, list(r.block_ids), r.num_computed_tokens, gen)
        for r in so.scheduled_cached_reqs:
            st = self.requests[r.req_id]
            st.block_ids.extend(r.new_block_ids)
            st.num_computed_tokens = r.num_computed_tokens

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step and wait for its sampled tokens."""
        return self.finish(self.launch(so))

    @torch.inference_mode()
    def launch(self, so: SchedulerOutput) -> PendingStep | None:
        """Queue one step's GPU work and return without waiting for it (None: nothing to run).

        With async scheduling the previous step may still be in flight: a request whose next input
        is the token that step samples gets it on the device, from that step's sampled ids.
        """
        self._update_states(so)
        pd.set_dp_rows(so.dp_rows)
        if so.is_empty:
            if so.dp_rows:  # data parallelism: the other DP ranks' MoE layers need this rank
                mtp = self.spec is not None and self.spec.method == "mtp"
                self.model.dp_idle_step(mtp_passes=self.spec.num_speculative_tokens if mtp else 0)
            return None
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        spec = so.scheduled_spec_decode_tokens
        chunks, fill, index = [], [], None
        for s in states:
            drafts = spec.get(s.req_id, [])
            n = so.num_scheduled_tokens[s.req_id] - len(drafts)
            toks = s.token_ids[s.num_computed_tokens: s.num_computed_tokens + n]
            if len(toks) < n:  # its last input was sampled by the step in flight
                if index is None:  # sampler row of each request in that step
                    index = {} if self._last is None else {rid: i for i, rid in enumerate(self._last.req_ids)}
                if n - len(toks) != 1 or s.req_id not in index:
                    raise RuntimeError(f"{s.req_id}: {n} tokens scheduled from {s.num_computed_tokens}, "
                                       f"{len(s.token_ids)} known and no step in flight sampled the rest")
                if s.params.reads_history:
                    raise RuntimeError(f"{s.req_id}: penalties need the token in flight on the host")
                toks = toks + [0]
                fill.append(s.req_id)
            chunks.append(toks + drafts)
        batch = self.prepare(chunks, [s.num_computed_tokens for s in states], [s.block_ids for s in states],
                             [s.req_id for s in states])
        if fill:  # decode rows (1 token each) whose input is the previous step's sample
            starts = dict(zip(batch.order, np.cumsum([0] + batch.query_lens[:-1]).tolist()))
            dst = to_device([starts[r] for r in fill], torch.int64, self.device)
            src = to_device([index[r] for r in fill], torch.int64, self.device)
            batch.input_ids[dst] = self._last.token_ids[src]
        hidden = self.forward(batch)
        mtp_inputs = (batch, hidden) if self.spec is not None and self.spec.method == "mtp" else None

        # Rows whose logits are needed: the last row of each request that reaches the end of its
        # known tokens (it samples), with the rows of its drafts before it (each samples the
        # token after its input: spec_decode.py), and prompt rows of requests that want prompt
        # logprobs.
        sample_rows, sample_states, prompt_jobs = [], [], []
        row_drafts: list[list[int]] = []  # per sampled row: the drafts before its position
        row = 0
        for rid, n, ctx in zip(batch.order, batch.query_lens, batch.context_lens):
            st = self.requests[rid]
            drafts = spec.get(rid, [])
            if st.params.prompt_logprobs is not None and ctx < st.num_prompt_tokens:
                # predictions for prompt tokens ctx+1 .. min(ctx+n, P-1)
                k = min(ctx + n, st.num_prompt_tokens - 1) - ctx
                prompt_jobs.append((st, ctx, row, max(k, 0)))
            if ctx + n - len(drafts) >= len(st.token_ids):  # > when its last input is a placeholder
                for j in range(len(drafts) + 1):
                    sample_rows.append(row + n - 1 - len(drafts) + j)
                    sample_states.append(st)
                    row_drafts.append(drafts[:j])
            row += n
        pending = PendingStep(ModelRunnerOutput([], [], []), [s.req_id for s in sample_states])
        pending.drafts = {rid: d for rid, d in spec.items() if rid in self.requests}
        pending.mtp_inputs = mtp_inputs
        for st, ctx, r0, k in prompt_jobs:
            lps = []
            if k:  # in row chunks: the logits of a whole step's prompt would not fit beside the cache
                nxt = to_device(st.token_ids[ctx + 1: ctx + 1 + k], torch.int64, hidden.device)
                lps = prompt_logprobs_chunked(self.logits, hidden[r0:r0 + k], nxt, st.params.prompt_logprobs,
                                              self.cfg.vocab_size)
            pending.prompt_jobs.append((st.req_id, ctx == 0, lps))
        if sample_rows:
            logits = self.logits(hidden[to_device(sample_rows, torch.int64, hidden.device)], fp32=False)
            params = [s.params for s in sample_states]
            # Token histories only when a penalty or min_tokens reads them: slicing every
            # request's prompt each step would put O(context) list copies on the hot path.
            if any(p.reads_history for p in params):
                prompts = [s.prompt_token_ids for s in sample_states]
                outputs = [s.output_token_ids + d for s, d in zip(sample_states, row_drafts)]
            else:
                prompts = outputs = [[] for _ in sample_states]
            sb = SamplingBatch.from_params(params, prompts, outputs,
                                           [s.generator for s in sample_states],
                                           self.eos_token_ids, self.device)
            if so.grammar_req_ids:
                self._add_bitmask(sb, so, [s.req_id for s in sample_states])
            for rid in pending.drafts:
                # a seeded request's stream must advance by the tokens it outputs, not by the rows
                # it samples: keep the state to replay from once the accepted count is known
                st = self.requests[rid]
                if st.generator is not None and not st.params.greedy:
                    pending.generator_states[rid] = st.generator.get_state()
            so_ = self.sampler(logits, sb)
            pending.token_ids = so_.token_ids
            pending.logprobs = so_.logprobs
            pending.num_logprobs = [s.params.logprobs for s in sample_states]
        # Start every copy back now; finish() waits for this step's event, not for the stream.
        for _, _, lps in pending.prompt_jobs:
            if lps:
                lps.copy_to_host()
        if pending.logprobs is not None:
            pending.logprobs.copy_to_host()
        if pending.token_ids is not None:
            pending.host_ids = to_host(pending.token_ids)
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()
        self._last = pending
        return pending

    def _row_logprobs(self, pending: PendingStep, row: int) -> TokenLogprobs | None:
        n = pending.num_logprobs[row]
        if n is None or pending.logprobs is None:
            return None
        lp = pending.logprobs[row]
        return TokenLogprobs(lp.token_id, lp.logprob, lp.rank, lp.top[:n])

    def _replay_draws(self, st: RequestState, state: torch.Tensor, num_tokens: int) -> None:
        """Rewind a seeded request's generator to before this step and draw once per token it
        output, as a plain decode of those tokens would have (one Exponential(1) vector each)."""
        st.generator.set_state(state)
        for _ in range(num_tokens):
            torch.empty(self.cfg.vocab_size, device=self.device).exponential_(generator=st.generator)

    def _propose(self, st: RequestState) -> list[int]:
        """Drafts for a request's next step (none for a constrained request: its grammar must see
        each token before the next is allowed)."""
        if st.params.structured_outputs is not None:
            return []
        s = self.spec
        return ngram_propose(st.token_ids, s.prompt_lookup_min, s.prompt_lookup_max, s.num_speculative_tokens)

    def _add_bitmask(self, sb: SamplingBatch, so: SchedulerOutput, sample_ids: list[str]) -> None:
        """Attach the step's grammar bitmask rows to the sampler rows they constrain (one
        non-blocking copy)."""
        row_of = {rid: i for i, rid in enumerate(sample_ids)}
        missing = [rid for rid in so.grammar_req_ids if rid not in row_of]
        if missing:
            raise RuntimeError(f"{missing}: a grammar bitmask for requests that do not sample")
        sb.token_bitmask = to_device(so.grammar_bitmask, torch.int32, self.device)
        sb.bitmask_rows = to_device([row_of[rid] for rid in so.grammar_req_ids], torch.int64,
                                    self.device)

    @torch.inference_mode()
    def finish(self, pending: PendingStep | None) -> ModelRunnerOutput:
        """Wait for a launched step's results (the one host sync per step) and record them."""
        if pending is None:
            return ModelRunnerOutput([], [], [])
        if pending.event is not None:
            pending.event.synchronize()
        out = pending.out
        for rid, first, lps in pending.prompt_jobs:  # columns, no object a token (scheduler/prompt_logprobs.py)
            out.prompt_logprobs[rid] = lps.prompt_run(first) if len(lps) else PromptLogprobs.empty(first)
        accepted: dict[str, int] = {}  # req_id -> drafts accepted, for the requests that sampled
        if pending.token_ids is not None:
            self.agreement.record(pending.host_ids.numpy())
            ids = pending.host_ids.tolist()
            row = 0
            while row < len(ids):
                rid = pending.req_ids[row]
                drafts = pending.drafts.get(rid, [])
                rows = ids[row: row + len(drafts) + 1]  # the target's token at each position
                a = accepted_prefix(rows, drafts)
                st = self.requests.get(rid)
                if st is not None:  # else finished, aborted or preempted since the launch
                    st.token_ids.extend(rows[: a + 1])
                    accepted[rid] = a
                    if rid in pending.generator_states:
                        self._replay_draws(st, pending.generator_states[rid], a + 1)
                    if self.spec is not None and self.spec.method == "ngram":
                        out.draft_token_ids[rid] = self._propose(st)
                out.req_ids.append(rid)
                out.sampled_token_ids.append(rows[a])
                lps = [self._row_logprobs(pending, row + j) for j in range(a + 1)]
                out.logprobs.append(lps[-1])
                if drafts:
                    out.spec_token_ids[rid] = rows[:a]
                    if any(lp is not None for lp in lps):
                        out.spec_logprobs[rid] = lps[:-1]
                row += len(drafts) + 1
        if pending.mtp_inputs is not None:  # also in steps that sample nothing: the prompt rows' MTP cache
            out.draft_token_ids.update(mtp_propose(self, pending, accepted))
        if self._last is pending:
            self._last = None
        return out


@dataclass
class PendingStep:
    """A launched step: its output so far, and its sampled ids on the device and (soon) the host."""

    out: ModelRunnerOutput
    req_ids: list[str]  # the request of each sampler row (k + 1 rows for one verifying k drafts)
    token_ids: torch.Tensor | None = None  # [len(req_ids)] on the device
    host_ids: torch.Tensor | None = None  # pinned copy, valid once `event` has completed
    logprobs: DeviceLogprobs | None = None  # of the sampled rows, when any row wants them
    num_logprobs: list[int | None] = field(default_factory=list)  # per sampled row: its top-N
    prompt_jobs: list = field(default_factory=list)  # (req_id, starts the prompt, DeviceLogprobs)
    drafts: dict[str, list[int]] = field(default_factory=dict)  # req_id -> drafts it verifies
    generator_states: dict[str, torch.Tensor] = field(default_factory=dict)  # seeded spec requests
    mtp_inputs: tuple | None = None  # (StepBatch, hidden [T, D]) for the MTP drafter
    event: object | None = None  # torch.cuda.Event on CUDA: everything above has landed
