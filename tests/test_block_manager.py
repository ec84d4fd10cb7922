"""KV block pool and prefix cache: ref counts, hit rules, LRU eviction, config validation."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from scheduler.block_manager import BlockManager, hash_block
from scheduler.config import SchedulerConfig
from scheduler.request import Request

TPB = 4  # tokens per block


def check_invariants(bm) -> None:
    """Raise AssertionError if the block pool's ref counts, free list and cache disagree."""
    refs = [0] * len(bm.blocks)
    for ids in bm.req_blocks.values():
        assert len(set(ids)) == len(ids), f"duplicate block in a request: {ids}"
        for b in ids:
            refs[b] += 1
    for block in bm.blocks:
        assert block.ref_cnt == refs[block.block_id], block
        assert (block.ref_cnt == 0) == (block.block_id in bm.free_blocks), block
    for h, b in bm.cached.items():
        assert bm.blocks[b].block_hash == h, (b, bm.blocks[b])
    assert bm.num_free_blocks + bm.num_used_blocks == bm.num_total_blocks


def make_req(req_id: str, tokens: list[int]) -> Request:
    return Request(req_id, tokens, SamplingParams(max_tokens=4), eos_token_id=None)


def compute(bm: BlockManager, req: Request, n: int, hits: list[int] | None = None) -> list[int]:
    """Allocate n more tokens, mark them computed and register full blocks (one fake step)."""
    new = bm.allocate(req, n, hits)
    assert new is not None
    req.num_computed_tokens += n
    bm.cache_full_blocks(req)
    check_invariants(bm)
    return new


def admit(bm: BlockManager, req: Request) -> tuple[list[int], int]:
    hits = bm.find_cached_prefix(req)
    req.num_computed_tokens = len(hits) * bm.tokens_per_block
    return hits, req.num_computed_tokens


def test_allocate_and_free_keep_counts():
    bm = BlockManager(8, TPB)
    a = make_req("a", list(range(10)))
    new = compute(bm, a, 10)
    assert len(new) == 3 and bm.num_used_blocks == 3 and bm.num_free_blocks == 5
    a.append_output_token(1)
    a.append_output_token(2)
    assert compute(bm, a, 2) == []  # 12 tokens still fit in 3 blocks
    a.append_output_token(3)
    assert len(compute(bm, a, 1)) == 1
    bm.free("a")
    check_invariants(bm)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0


def test_allocate_fails_without_side_effects():
    bm = BlockManager(3, TPB)
    a = make_req("a", list(range(13)))
    before = (bm.num_free_blocks, dict(bm.req_blocks))
    assert bm.allocate(a, 13) is None  # needs 4 blocks
    assert (bm.num_free_blocks, dict(bm.req_blocks)) == before
    check_invariants(bm)


def test_prefix_hit_shares_blocks_with_ref_counts():
    bm = BlockManager(16, TPB)
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks + 1
    a = make_req("a", prompt)
    compute(bm, a, 13)
    a_blocks = list(bm.get_block_ids("a"))
    b = make_req("b", prompt[:12] + [999])
    hits, num_hit = admit(bm, b)
    assert hits == a_blocks[:3] and num_hit == 12
    compute(bm, b, 1, hits)
    assert bm.get_block_ids("b")[:3] == a_blocks[:3]
    assert [bm.blocks[x].ref_cnt for x in a_blocks] == [2, 2, 2, 1]
    assert bm.num_used_blocks == 5  # 4 for a, 1 new for b
    bm.free("a")
    assert [bm.blocks[x].ref_cnt for x in a_blocks[:3]] == [1, 1, 1]
    bm.free("b")
    check_invariants(bm)
    assert bm.num_used_blocks == 0


def test_cache_salt_separates_prefix_chains():
    """Requests share cached blocks only with requests of the same cache_salt (none is a salt of
    its own); a salted request's hashes differ from the first block on."""
    bm = BlockManager(32, TPB)
    prompt = list(range(100, 113))

    def salted(req_id: str, salt: str | None) -> Request:
        return Request(req_id, prompt, SamplingParams(max_tokens=4, cache_salt=salt), eos_token_id=None)
    a = salted("a", "tenant-1")
    compute(bm, a, 13)
    for req_id, salt, hit in (("b", "tenant-1", 12), ("c", "tenant-2", 0), ("d", None, 0)):
        r = salted(req_id, salt)
        hits, num_hit = admit(bm, r)
        assert num_hit == hit and hits == bm.get_block_ids("a")[:hit // TPB], (salt, hits)
        compute(bm, r, 13 - num_hit, hits)
    e = make_req("e", prompt)  # unsalted: hits the unsalted d's blocks, not a's or c's
    assert bm.find_cached_prefix(e) == bm.get_block_ids("d")[:3]
    assert len(e.block_hashes) == 3 and not set(e.block_hashes) & set(a.block_hashes)
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_hit_never_covers_last_token():
    bm = BlockManager(16, TPB)
    prompt = list(range(8))  # exactly 2 blocks
    compute(bm, make_req("a", prompt), 8)
    bm.free("a")
    hits, num_hit = admit(bm, make_req("b", prompt))
    assert len(hits) == 1 and num_hit == 4  # rounded down one block: the last token is computed
    hits, num_hit = admit(bm, make_req("c", prompt + [77]))
    assert len(hits) == 2 and num_hit == 8


def test_partial_or_uncomputed_blocks_are_not_cached():
    bm = BlockManager(16, TPB)
    prompt = list(range(20, 30))
    a = make_req("a", prompt)
    assert bm.allocate(a, 10) is not None  # allocated but not yet computed
    assert admit(bm, make_req("b", prompt + [1]))[1] == 0
    a.num_computed_tokens = 6  # first chunk written: only block 0 is full and computed
    bm.cache_full_blocks(a)
    assert admit(bm, make_req("c", prompt + [1]))[1] == 4
    a.num_computed_tokens = 10
    bm.cache_full_blocks(a)
    assert admit(bm, make_req("d", prompt + [1]))[1] == 8  # block 2 (2 of 4 tokens) never


def test_chained_hash_depends_on_parent():
    bm = BlockManager(16, TPB)
    compute(bm, make_req("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
    # Same second block, different first block: no hit at all.
    assert admit(bm, make_req("b", [0, 2, 3, 4, 5, 6, 7, 8, 9]))[1] == 0
    assert hash_block(b"", [5, 6, 7, 8]) != hash_block(hash_block(b"", [1, 2, 3, 4]), [5, 6, 7, 8])
    assert admit(bm, make_req("c", [1, 2, 3, 4, 0, 6, 7, 8, 9]))[1] == 4


def test_hashes_computed_once_and_cached_on_request():
    bm = BlockManager(16, TPB)
    a = make_req("a", list(range(9)))
    bm.find_cached_prefix(a)
    first = list(a.block_hashes)
    assert len(first) == 2
    a.append_output_token(5)
    a.append_output_token(6)
    a.append_output_token(7)
    bm.find_cached_prefix(a)
    assert a.block_hashes[:2] == first and len(a.block_hashes) == 3
    assert all(x is y for x, y in zip(a.block_hashes, first))


def test_lru_eviction_order():
    bm = BlockManager(4, TPB)
    p1, p2 = [1] * 4 + [9], [2] * 4 + [9]
    compute(bm, make_req("a", p1), 4)
    compute(bm, make_req("b", p2), 4)
    blk_a, blk_b = bm.get_block_ids("a")[0], bm.get_block_ids("b")[0]
    bm.free("a")  # a's block is freed first: it is evicted first
    bm.free("b")
    assert list(bm.free_blocks)[-2:] == [blk_a, blk_b]
    # Two never-used blocks sit before them; allocating 3 evicts exactly a's block.
    compute(bm, make_req("c", [5] * 12), 12)
    assert blk_a in bm.get_block_ids("c") and blk_b not in bm.get_block_ids("c")
    assert admit(bm, make_req("x", p1))[1] == 0  # evicted hash dropped
    hits, n = admit(bm, make_req("y", p2))
    assert hits == [blk_b] and n == 4


def test_hit_revives_block_and_moves_lru():
    bm = BlockManager(3, TPB)
    p = [3] * 4 + [8]
    compute(bm, make_req("a", p), 4)
    blk = bm.get_block_ids("a")[0]
    bm.free("a")
    b = make_req("b", p)
    hits, _ = admit(bm, b)
    # The pool has 3 free blocks, one of them the hit: b needs the hit + 1 new block.
    compute(bm, b, 1, hits)
    assert bm.blocks[blk].ref_cnt == 1 and blk not in bm.free_blocks
    assert bm.num_free_blocks == 1
    # A hit on a free block counts against the free pool: 1 free, hit + 1 new does not fit.
    bm.free("b")
    c = make_req("c", [4] * 8)
    compute(bm, c, 8)  # takes the two blocks in front of the LRU list, not the cached one
    assert blk not in bm.get_block_ids("c")
    d = make_req("d", p + [1, 2, 3, 4])
    hits, n = admit(bm, d)
    assert hits == [blk]
    assert bm.allocate(d, 5, hits) is None  # needs hit + 2 new blocks, only 1 free
    check_invariants(bm)
    assert bm.blocks[blk].ref_cnt == 0 and blk in bm.free_blocks


def test_duplicate_content_computed_concurrently():
    bm = BlockManager(8, TPB)
    p = list(range(5))
    a, b = make_req("a", p), make_req("b", p)
    compute(bm, a, 5)
    compute(bm, b, 5)  # computed without a hit (admitted before a's blocks were registered)
    assert admit(bm, make_req("c", p + [0]))[0] == [bm.get_block_ids("a")[0]]
    bm.free("a")
    bm.free("b")
    check_invariants(bm)


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(8, TPB, enable_prefix_caching=False)
    compute(bm, make_req("a", list(range(9))), 9)
    bm.free("a")
    assert admit(bm, make_req("b", list(range(9))))[1] == 0
    assert not bm.cached


@pytest.mark.parametrize("field,value", [
    ("max_num_batched_tokens", 0), ("max_num_seqs", 0), ("max_model_len", -1),
    ("block_size", 0), ("num_blocks", 0), ("dcp_size", 0), ("num_blocks", 2.5),
])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


def test_config_virtual_block():
    cfg = SchedulerConfig(block_size=16, dcp_size=4, num_blocks=10)
    assert cfg.virtual_block_size == 64 and cfg.capacity_tokens == 640


def test_reset_prefix_cache_forgets_every_block_and_keeps_held_ones_right():
    """After a reset no lookup hits a block cached before it, free or held; held blocks stay
    their request's and do not come back to the cache when freed; blocks filled after it cache."""
    bm = BlockManager(16, TPB)
    prompt = list(range(100, 113))  # 3 full blocks + 1
    a, b = make_req("a", prompt), make_req("b", [7] * 9)
    compute(bm, a, 13)
    compute(bm, b, 9)
    bm.free("b")  # its 2 full blocks: free and cached
    assert len(bm.cached) == 5
    assert bm.reset_prefix_cache() == 5
    check_invariants(bm)
    assert admit(bm, make_req("c", prompt))[0] == [] and admit(bm, make_req("d", [7] * 9))[0] == []
    held = bm.get_block_ids("a")
    assert all(bm.blocks[x].ref_cnt == 1 for x in held)  # still a's
    a.append_output_token(1)
    a.append_output_token(2)
    a.append_output_token(3)
    compute(bm, a, 3)  # fills a's 4th block: cached from here on, as after any step
    assert list(bm.cached.values()) == [held[3]]
    bm.free("a")
    check_invariants(bm)
    assert len(bm.cached) == 1  # a's first 3 blocks came back unhashed
    e = make_req("e", prompt)
    hits, _ = admit(bm, e)
    assert hits == []  # the chain starts at block 0, forgotten: nothing before the reset is found
    compute(bm, e, 13)
    f = make_req("f", prompt)
    assert admit(bm, f)[0] == bm.get_block_ids("e")[:3]  # blocks computed after the reset hit
