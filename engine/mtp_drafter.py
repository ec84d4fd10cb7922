"""The MTP drafter's step (`{"method": "mtp"}`): after the model runner has verified a step, run
the checkpoint's MTP layer (models/mtp.py) over the step's rows and draft each sampling request's
next tokens.

On CUDA (unless --enforce-eager) the layer's decode-shaped runs replay CUDA graphs
(`runner.mtp_graphs`, engine/cuda_graph.py), one per (batch bucket, rows per request): after a
verification step each request has 1 + accepted rows, so the rows are padded to the step's
longest (padding rows write no cache slot and see no key) and the real rows are taken back out.
Runs with prompt rows (the first drafts after a prefill) or beyond the largest bucket run eagerly.
"""

from __future__ import annotations

import dataclasses

import torch

from common import distributed as pd
from common.transfer import to_device


class MTPStep:
    """The MTP layer as `DecodeGraphs` calls a model: (input_ids, positions, kv_cache, meta,
    hidden) -> the layer's output rows."""

    def __init__(self, layer, rotary):
        self.layer, self.rotary = layer, rotary

    def __call__(self, input_ids, positions, kv_cache, meta, hidden):
        return self.layer(input_ids, self.rotary.at(positions), hidden, kv_cache, meta)


def _run_layer(runner, batch, hidden: torch.Tensor) -> torch.Tensor:
    """The MTP layer over a prepared batch (`ModelRunner.prepare`) with one hidden row per input
    row -> output rows in the batch's row order: a CUDA graph where one fits, else eager."""
    m, graphs = batch.meta, runner.mtp_graphs
    d = m.decode
    # under data parallelism eager: its MoE gathers the step's dp_rows rows, which no graph of the
    # layer's buckets need be (models/data_parallel_moe.py)
    if (graphs is None or pd.dp_rows() or m.prefill is not None or d is None
            or graphs.bucket_for(m.num_decodes, d.q_len) is None):
        step = MTPStep(runner.model.mtp[0], runner.model.model.rotary_emb)  # what the graphs replay
        return step(batch.input_ids, batch.positions, runner.mtp_kv_caches[0], m, hidden)
    if d.row_index is None:  # every request has d.q_len rows
        return graphs.run(batch.input_ids, batch.positions, m, hidden=hidden)
    # pad each request to d.q_len rows: no cache slot (-1), token 0 at position 0, hidden 0; their
    # q_pos is -1 already (build_mla_metadata), so they attend to nothing
    T, idx = m.num_decodes * d.q_len, d.row_index
    ids = batch.input_ids.new_zeros(T).index_copy_(0, idx, batch.input_ids)
    pos = batch.positions.new_zeros(T).index_copy_(0, idx, batch.positions)
    slots = m.slot_mapping.new_full((T,), -1).index_copy_(0, idx, m.slot_mapping)
    rows = hidden.new_zeros(T, hidden.shape[-1]).index_copy_(0, idx, hidden)
    padded = dataclasses.replace(m, num_decode_tokens=T, slot_mapping=slots,
                                 decode=dataclasses.replace(d, row_index=None))
    return graphs.run(ids, pos, padded, hidden=rows)[idx]


def mtp_propose(runner, pending, accepted: dict[str, int]) -> dict[str, list[int]]:
    """MTP drafts (models/mtp.py) after a step, argmax at each depth.

    Every row of the step whose input token was real (prompt rows, the last token, accepted
    drafts) runs through the MTP layer with the main model's hidden state there and the token
    after it, writing the layer's cache at that position; the last row of each request that
    sampled yields its first draft. Further drafts feed the layer its own output and the
    draft, one row per request (the scheduler allocates those k - 1 lookahead slots).
    """
    if not pd.dp_rows():
        return _propose(runner, pending, accepted, lambda b, h: _run_layer(runner, b, h))
    # data parallelism: every DP rank runs the layer num_speculative_tokens times a step (its MoE
    # joins the other DP ranks'), with no rows of its own where this rank has none to draft
    passes = [0]

    def counted(b, h):
        passes[0] += 1
        return _run_layer(runner, b, h)
    try:
        return _propose(runner, pending, accepted, counted)
    finally:
        runner.model.dp_idle_step(mtp_passes=runner.spec.num_speculative_tokens - passes[0], main=False)


def _propose(runner, pending, accepted: dict[str, int], run_layer) -> dict[str, list[int]]:
    """mtp_propose's drafts, each pass of the MTP layer through `run_layer(batch, hidden)`."""
    batch, hidden = pending.mtp_inputs
    layer = runner.model.mtp[0]
    rotary = runner.model.model.rotary_emb
    rows: dict[str, list[int]] = {}
    toks, ctxs, tables, rids = [], [], [], []
    r0 = 0
    for rid, n, ctx in zip(batch.order, batch.query_lens, batch.context_lens):
        st = runner.requests.get(rid)
        m = n - len(pending.drafts.get(rid, [])) + accepted.get(rid, 0)
        if st is not None and len(st.token_ids) >= ctx + m + 1:  # the token after each row is known
            rows[rid] = list(range(r0, r0 + m))
            toks.append(st.token_ids[ctx + 1: ctx + 1 + m])
            ctxs.append(ctx)
            tables.append(st.block_ids)
            rids.append(rid)
        r0 += n
    if not rids:
        return {}
    mb = runner.prepare(toks, ctxs, tables, rids)
    index = to_device([r for rid in mb.order for r in rows[rid]], torch.int64, hidden.device)
    out = run_layer(mb, hidden[index])
    # a constrained request drafts nothing: its grammar must see each token before the next is
    # allowed (the n-gram path's rule, ModelRunner._propose); its rows still fill the layer's cache
    constrained = {rid for rid in accepted if runner.requests[rid].params.structured_outputs is not None}
    sampled = set(accepted) - constrained
    ends, lasts, pos = [], [], {}
    row = 0
    for rid, n, ctx in zip(mb.order, mb.query_lens, mb.context_lens):
        if rid in sampled:
            ends.append(rid)
            lasts.append(row + n - 1)
            pos[rid] = ctx + n  # the position of the first draft's input (the sampled token)
        row += n
    drafts: dict[str, list[int]] = {rid: [] for rid in (*ends, *constrained)}
    if not ends:
        return drafts
    h = out[to_device(lasts, torch.int64, out.device)]
    for depth in range(runner.spec.num_speculative_tokens):
        d = layer.compute_logits(h).argmax(dim=-1).tolist()  # waits: the next depth needs them
        for rid, t in zip(ends, d):
            drafts[rid].append(t)
        if depth + 1 == runner.spec.num_speculative_tokens:
            break
        # the next depth: one row per request at the draft's position, its cache slot
        # allocated ahead by the scheduler; stop before the model's last position
        keep = [i for i, rid in enumerate(ends) if pos[rid] + depth < min(
            rotary.max_positions, len(runner.requests[rid].block_ids) * runner.block_size * pd.dcp().size)]
        if not keep:
            break
        ends, h, d = [ends[i] for i in keep], h[keep], [d[i] for i in keep]
        cb = runner.prepare([[t] for t in d], [pos[rid] + depth for rid in ends],
                          [runner.requests[rid].block_ids for rid in ends], ends)
        h = run_layer(cb, h)  # same order: all 1 token
    return drafts
