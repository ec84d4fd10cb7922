"""The MTP drafter's step (`{"method": "mtp"}`): after the model runner has verified a step, run
the checkpoint's MTP layer (models/mtp.py) over the step's rows and draft each sampling request's
next tokens."""

from __future__ import annotations

import torch

from common import distributed as pd
from common.transfer import to_device


def mtp_propose(runner, pending, accepted: dict[str, int]) -> dict[str, list[int]]:
    """MTP drafts (models/mtp.py) after a step, argmax at each depth.

    Every row of the step whose input token was real (prompt rows, the last token, accepted
    drafts) runs through the MTP layer with the main model's hidden state there and the token
    after it, writing the layer's cache at that position; the last row of each request that
    sampled yields its first draft. Further drafts feed the layer its own output and the
    draft, one row per request (the scheduler allocates those k - 1 lookahead slots).
    """
    batch, hidden = pending.mtp_inputs
    layer, cache = runner.model.mtp[0], runner.mtp_kv_caches[0]
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
    out = layer(mb.input_ids, rotary.at(mb.positions), hidden[index], cache, mb.meta)
    sampled = set(accepted)
    ends, lasts, pos = [], [], {}
    row = 0
    for rid, n, ctx in zip(mb.order, mb.query_lens, mb.context_lens):
        if rid in sampled:
            ends.append(rid)
            lasts.append(row + n - 1)
            pos[rid] = ctx + n  # the position of the first draft's input (the sampled token)
        row += n
    drafts: dict[str, list[int]] = {rid: [] for rid in ends}
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
        h = layer(cb.input_ids, rotary.at(cb.positions), h, cache, cb.meta)  # same order: all 1 token
    return drafts
