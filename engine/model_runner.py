"""Model runner: SchedulerOutput -> inputs + attention metadata -> model -> sampled tokens.

It keeps each live request's tokens and block table (the scheduler sends only diffs), orders
every batch decodes first (DESIGN.md §5), builds the metadata once per step and samples.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch

from attention.metadata import MLAMetadata, build_mla_metadata
from engine import distributed as pd
from engine.sampler import Sampler, SamplingBatch, compute_prompt_logprobs, make_generator
from engine.sampling_params import SamplingParams
from models.config import ModelConfig
from models.deepseek import DeepseekForCausalLM
from scheduler.outputs import ModelRunnerOutput, SchedulerOutput, TokenLogprobs

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
                 context_chunk_tokens: int = 8192):
        self.model, self.cfg, self.kv_caches = model, cfg, kv_caches
        self.block_size, self.device = block_size, device
        self.eos_token_ids = eos_token_ids
        self.context_chunk_tokens = context_chunk_tokens
        self.sampler = Sampler()
        self.requests: dict[str, RequestState] = {}
        self.graphs = None  # engine.cuda_graph.DecodeGraphs, set by the worker on CUDA

    # ---- the low-level entry the tests drive directly ----

    def prepare(self, token_ids: list[list[int]], context_lens: list[int],
                block_ids: list[list[int]], req_ids: list[str] | None = None) -> StepBatch:
        """Inputs for requests computing `token_ids[i]` after `context_lens[i]` cached tokens.

        Requests may come in any order; rows are reordered decodes first (stable).
        """
        n = len(token_ids)
        req_ids = req_ids or [str(i) for i in range(n)]
        order = sorted(range(n), key=lambda i: len(token_ids[i]) > 1)  # stable: decodes first
        q = [len(token_ids[i]) for i in order]
        ctx = [context_lens[i] for i in order]
        ids = np.fromiter((t for i in order for t in token_ids[i]), dtype=np.int64, count=sum(q))
        pos = np.concatenate([np.arange(c, c + k) for c, k in zip(ctx, q)]) if n else np.zeros(0, np.int64)
        dcp = pd.dcp()
        meta = build_mla_metadata(q, ctx, [block_ids[i] for i in order], self.block_size, self.device,
                                  dcp_size=dcp.size, dcp_rank=dcp.rank,
                                  context_chunk_tokens=self.context_chunk_tokens)
        return StepBatch(input_ids=torch.from_numpy(ids).to(self.device),
                         positions=torch.from_numpy(pos).to(self.device), meta=meta,
                         order=[req_ids[i] for i in order], query_lens=q, context_lens=ctx)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """Hidden states `[T, hidden]` of every row of the batch."""
        m = batch.meta
        if self.graphs is not None and m.prefill is None and self.graphs.bucket_for(m.num_decodes):
            return self.graphs.run(batch.input_ids, batch.positions, m)
        return self.model(batch.input_ids, batch.positions, self.kv_caches, m)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

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

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(so)
        if so.is_empty:
            return ModelRunnerOutput([], [], [])
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        batch = self.prepare(
            [s.token_ids[s.num_computed_tokens: s.num_computed_tokens + so.num_scheduled_tokens[s.req_id]]
             for s in states],
            [s.num_computed_tokens for s in states], [s.block_ids for s in states],
            [s.req_id for s in states])
        hidden = self.forward(batch)

        # Rows whose logits are needed: the last row of each request that reaches the end of its
        # known tokens (it samples), and prompt rows of requests that want prompt logprobs.
        sample_rows, sample_states, prompt_jobs = [], [], []
        row = 0
        for rid, n, ctx in zip(batch.order, batch.query_lens, batch.context_lens):
            st = self.requests[rid]
            if st.params.prompt_logprobs is not None and ctx < st.num_prompt_tokens:
                # predictions for prompt tokens ctx+1 .. min(ctx+n, P-1)
                k = min(ctx + n, st.num_prompt_tokens - 1) - ctx
                prompt_jobs.append((st, ctx, row, max(k, 0)))
            if ctx + n == len(st.token_ids):
                sample_rows.append(row + n - 1)
                sample_states.append(st)
            row += n
        out = ModelRunnerOutput([], [], [])
        for st, ctx, r0, k in prompt_jobs:
            lps: list[TokenLogprobs | None] = [None] if ctx == 0 else []
            if k:
                lg = self.logits(hidden[r0:r0 + k])
                nxt = torch.tensor(st.token_ids[ctx + 1: ctx + 1 + k], device=lg.device)
                lps += compute_prompt_logprobs(lg, nxt, st.params.prompt_logprobs)
            out.prompt_logprobs[st.req_id] = lps
        if sample_rows:
            logits = self.logits(hidden[torch.tensor(sample_rows, device=hidden.device)])
            params = [s.params for s in sample_states]
            # Token histories only when a penalty or min_tokens reads them: slicing every
            # request's prompt each step would put O(context) list copies on the hot path.
            if any(p.needs_penalties or p.min_tokens for p in params):
                prompts = [s.prompt_token_ids for s in sample_states]
                outputs = [s.output_token_ids for s in sample_states]
            else:
                prompts = outputs = [[] for _ in sample_states]
            sb = SamplingBatch.from_params(params, prompts, outputs,
                                           [s.generator for s in sample_states],
                                           self.eos_token_ids, self.device)
            so_ = self.sampler(logits, sb)
            ids = so_.token_ids.tolist()  # the one host sync per step
            for i, (st, tok) in enumerate(zip(sample_states, ids)):
                st.token_ids.append(tok)
                lp = None
                if st.params.logprobs is not None:
                    lp = so_.logprobs[i]
                    lp = TokenLogprobs(lp.token_id, lp.logprob, lp.rank, lp.top[: st.params.logprobs])
                out.req_ids.append(st.req_id)
                out.sampled_token_ids.append(tok)
                out.logprobs.append(lp)
        return out
