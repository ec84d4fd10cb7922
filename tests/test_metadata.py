"""Attention metadata: the decode/prefill split and the DCP layout (DESIGN.md §5, §7)."""

from __future__ import annotations

import pytest

from attention.metadata import build_mla_metadata, local_len


@pytest.mark.parametrize("D", [2, 3, 4])
def test_local_len_matches_brute_force(D):
    for L in range(1, 18):
        for r in range(D):
            assert local_len(L, D, r) == sum(1 for i in range(L) if i % D == r), (L, D, r)


def test_split_is_rebased_and_sliced():
    # two decodes then a first chunk (5 tokens) and a continuation (3 tokens after 6 cached)
    m = build_mla_metadata([1, 1, 5, 3], [4, 9, 0, 6], [[7, 2], [3, 8, 1], [5, 6], [9, 4, 0]],
                           block_size=4, device="cpu")
    assert (m.num_decodes, m.num_decode_tokens, m.num_prefills, m.num_prefill_tokens) == (2, 2, 2, 8)
    assert m.decode.seq_lens.tolist() == [5, 10]
    assert m.decode.block_table.shape[0] == 2 and m.prefill.block_table.shape[0] == 2
    assert m.prefill.query_start_loc.tolist() == [0, 5, 8]  # rebased, prefill rows only
    assert m.prefill.context_lens == [0, 6] and m.prefill.has_context  # the flag vLLM forgot
    # slots: position p of a request lives in block table[p // 4] at offset p % 4
    assert m.slot_mapping.tolist() == [2 * 4 + 0, 1 * 4 + 1,
                                       5 * 4 + 0, 5 * 4 + 1, 5 * 4 + 2, 5 * 4 + 3, 6 * 4 + 0,
                                       4 * 4 + 2, 4 * 4 + 3, 0 * 4 + 0]


def test_unordered_batch_is_refused():
    with pytest.raises(ValueError, match="decodes first"):
        build_mla_metadata([3, 1], [0, 5], [[0], [1, 2]], block_size=4, device="cpu")


def test_dcp_slots_and_context_gather_cover_every_token_once():
    D, bs = 2, 4
    ctx, q = [13, 0], [3, 6]
    tables = [[3, 1, 0], [2, 5]]
    seen = {}
    for r in range(D):
        m = build_mla_metadata(q, ctx, tables, bs, "cpu", dcp_size=D, dcp_rank=r, context_chunk_tokens=4)
        slots = m.slot_mapping.tolist()
        pos = [c + i for c, n in zip(ctx, q) for i in range(n)]
        for p, s in zip(pos, slots):
            assert (s >= 0) == (p % D == r)
        # every context token gathered exactly once over ranks and chunks
        total = sum(sum(ch.cu_seqlens_k.diff().tolist()[:1]) for ch in m.prefill.context_chunks)
        seen[r] = total
    assert seen[0] == seen[1] == 13  # after the all-gather each rank sees the whole context


@pytest.mark.parametrize("D", [1, 2, 4])
def test_multi_token_decodes_carry_positions_and_local_lengths(D):
    # decodes of 1 + 2 tokens and one of 1 token (padded to 3 rows), then a first chunk; under
    # DCP each rank's lengths are its local shares
    q, ctx = [3, 1, 3, 3, 4], [0, 6, 5, 8, 0]
    tables = [[0, 1, 2], [8, 9], [3, 4], [5, 6, 7], [10]]
    for r in range(D):
        m = build_mla_metadata(q, ctx, tables, 4, "cpu", dcp_size=D, dcp_rank=r, decode_threshold=3)
        assert (m.num_decodes, m.num_decode_tokens, m.num_prefills, m.num_prefill_tokens) == (4, 10, 1, 4)
        assert m.decode.q_len == 3
        assert m.decode.q_pos.tolist() == [0, 1, 2, 6, -1, -1, 5, 6, 7, 8, 9, 10]
        assert m.decode.row_index.tolist() == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
        assert m.decode.seq_lens.tolist() == [local_len(n, D, r) for n in (3, 7, 8, 11)]
        assert m.prefill.query_start_loc.tolist() == [0, 4] and m.prefill.context_lens == [0]
    uniform = build_mla_metadata([3, 3], [0, 5], tables[:2], 4, "cpu", decode_threshold=3)
    assert uniform.decode.row_index is None and uniform.decode.q_pos.tolist() == [0, 1, 2, 5, 6, 7]


def test_single_token_decodes_need_no_positions():
    m = build_mla_metadata([1, 1], [4, 9], [[0, 1], [2, 3, 4]], 4, "cpu", dcp_size=2, decode_threshold=3)
    assert m.decode.q_len == 1 and m.decode.q_pos is None and m.num_decodes == 2


def test_misordered_multi_token_decodes_are_refused():
    with pytest.raises(ValueError, match="decodes first"):
        build_mla_metadata([3, 4, 1], [4, 4, 4], [[0, 1], [2, 3], [4, 5]], 4, "cpu", decode_threshold=3)


def test_context_attention_covers_only_prefills_up_to_the_last_with_context():
    # decodes, then prefills with context [0, 9, 0, 0]: only prefills 0..1 need the context
    # attention; the chunk budget goes to the one prefill that has context
    q, ctx = [1, 1, 5, 3, 4, 2], [7, 3, 0, 9, 0, 0]
    tables = [[0, 1], [2], [3, 4], [5, 6, 7], [8], [9]]
    m = build_mla_metadata(q, ctx, tables, 4, "cpu", context_chunk_tokens=16)
    p = m.prefill
    assert (p.num_context_prefills, p.context_query_rows, p.context_max_query_len) == (2, 8, 5)
    assert len(p.context_chunks) == 1  # 9 rows fit the 16-row budget of its only context prefill
    ch = p.context_chunks[0]
    assert ch.cu_seqlens_k.tolist() == [0, 0, 9] and ch.num_tokens == 9 and ch.max_seqlen_k == 9
    none = build_mla_metadata([5, 3], [0, 0], [[0, 1], [2]], 4, "cpu").prefill
    assert (none.num_context_prefills, none.context_query_rows, none.has_context) == (0, 0, False)
