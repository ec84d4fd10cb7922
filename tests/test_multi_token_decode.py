"""Multi-token decode (q_len > 1, e.g. speculative tokens) with the causal mask from query
positions, alone and over DCP's interleaved shards (DESIGN.md §7).

The oracle is dense attention over the whole sequence: query token at global position p sees
keys 0..p. For DCP size D each rank r holds the keys at global positions r, r + D, ... as its
local rows 0, 1, ...; every rank's decode (torch reference, and the Triton kernel under the
interpreter on the CPU) is merged by LSE and must equal the oracle, and the Triton kernel must
equal the torch reference rank by rank (lse -inf and o 0 where a token sees no key on a rank).
"""

from __future__ import annotations

import pytest
import torch

from attention.metadata import local_len
from attention.torch_backend import TorchAttentionOps


def dense_oracle(q, keys, q_pos, scale, lkv):
    """q [Q, H, Lkv+R], keys [L, Lkv+R] (global order), q_pos [Q] -> o [Q, H, Lkv], lse [Q, H]."""
    s = torch.einsum("qhd,kd->qhk", q.double(), keys.double()) * scale
    visible = torch.arange(keys.shape[0]).view(1, 1, -1) <= q_pos.view(-1, 1, 1).long()
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.einsum("qhk,kd->qhd", torch.exp(s - lse.unsqueeze(-1)), keys[:, :lkv].double())
    return o, lse


def shard(keys_per_seq, D, r, page, d, gen):
    """Rank r's paged cache and shuffled block table for sequences of global keys."""
    local = [k[r::D] for k in keys_per_seq]  # global position r + j*D at local index j
    per_seq = max([1] + [-(-len(x) // page) for x in local])
    nb = per_seq * len(local) + 2
    cache = torch.randn(nb, page, d, generator=gen)  # unused rows hold garbage
    table = torch.randperm(nb, generator=gen)[: per_seq * len(local)].view(len(local), per_seq)
    for b, x in enumerate(local):
        for j in range(len(x)):
            cache[table[b, j // page], j % page] = x[j]
    return cache, table.to(torch.int32), torch.tensor([len(x) for x in local], dtype=torch.int32)


def merge(parts):
    """LSE merge of per-rank (o, lse): exact with -inf (a rank that saw nothing weighs 0)."""
    lse = torch.logsumexp(torch.stack([p[1].double() for p in parts]), 0)
    o = sum(p[0].double() * torch.exp(p[1].double() - lse).nan_to_num(0.0).unsqueeze(-1) for p in parts)
    return o, lse


def check_case(q_len, D, ctx_lens, H=3, lkv=32, r=16, page=4, seed=0, device="cpu",
               dtype=torch.float32, triton_splits=None, use_triton=False, pad_every=0):
    """One batch (one sequence per context length, each with q_len new tokens) on every DCP rank:
    the reference (and Triton) per rank against each other, and merged against the oracle.
    `pad_every` n: every n-th sequence has fewer tokens and padding rows (position -1), as the
    runner pads a decode with fewer drafts; they must see nothing. Returns the worst relative
    error of the merged output."""
    gen = torch.Generator().manual_seed(seed)
    d = lkv + r
    n_real = [max(1, q_len - 1 - b % q_len) if pad_every and b % pad_every == 0 else q_len
              for b in range(len(ctx_lens))]
    lens = [c + k for c, k in zip(ctx_lens, n_real)]
    # rounded to the kernel's dtype first, so every path sees the same values
    keys = [torch.randn(n, d, generator=gen).to(dtype).float() for n in lens]
    B = len(lens)
    q = torch.randn(B * q_len, H, d, generator=gen).to(dtype).float()
    q_pos = torch.tensor([c + i if i < k else -1 for c, k in zip(ctx_lens, n_real) for i in range(q_len)],
                         dtype=torch.int32)
    real = q_pos >= 0
    scale = d ** -0.5 * 2.0
    ref_ops = TorchAttentionOps()
    if use_triton:
        from attention.triton_decode import mla_decode
    parts = []
    for rank in range(D):
        cache, table, seq_lens = shard(keys, D, rank, page, d, gen)
        assert seq_lens.tolist() == [int(local_len(n, D, rank)) for n in lens]
        o_ref, lse_ref = ref_ops.decode(q, cache, table, seq_lens, scale, lkv, q_len=q_len, q_pos=q_pos,
                                        dcp_size=D, dcp_rank=rank)
        if use_triton:
            dev = lambda t: t.to(device)
            o, lse = mla_decode(dev(q).to(dtype), dev(cache).to(dtype), dev(table), dev(seq_lens), scale, lkv,
                                q_len=q_len, q_pos=dev(q_pos), dcp_size=D, dcp_rank=rank,
                                num_splits=triton_splits)
            o, lse = o.float().cpu(), lse.cpu()
            assert o.shape == (B * q_len, H, lkv) and lse.shape == (B * q_len, H)
            none = torch.isinf(lse_ref)
            assert torch.equal(torch.isinf(lse), none), f"rank {rank}: -inf lse pattern differs"
            assert not torch.isnan(o).any() and not torch.isnan(lse).any(), f"rank {rank}: NaN"
            assert (o[none.unsqueeze(-1).expand_as(o)] == 0).all(), f"rank {rank}: o of unseen rows not 0"
            tol = 2e-5 if dtype == torch.float32 else 2e-2
            err = ((o - o_ref.float()).abs().max() / o_ref.abs().max().clamp_min(1e-6)).item()
            assert err < tol, f"rank {rank}: triton vs reference o rel err {err}"
            if (~none).any():
                d_lse = (lse[~none] - lse_ref[~none]).abs().max().item()
                assert d_lse < (1e-4 if dtype == torch.float32 else 2e-2), f"rank {rank}: lse diff {d_lse}"
            parts.append((o, lse))
        else:
            parts.append((o_ref, lse_ref))
    o, lse = merge(parts)
    assert torch.isneginf(lse[~real]).all() and (o[~real] == 0).all(), "a padding row saw keys"
    o, lse, q, q_pos = o[real], lse[real], q[real], q_pos[real]
    starts = [0] + torch.tensor(n_real).cumsum(0).tolist()
    rows = [slice(starts[b], starts[b + 1]) for b in range(B)]
    o_ref = torch.cat([dense_oracle(q[i], keys[b], q_pos[i], scale, lkv)[0] for b, i in enumerate(rows)])
    lse_ref = torch.cat([dense_oracle(q[i], keys[b], q_pos[i], scale, lkv)[1] for b, i in enumerate(rows)])
    assert torch.isfinite(lse).all()
    d_lse = (lse - lse_ref).abs().max().item()
    assert d_lse < (1e-4 if dtype == torch.float32 else 2e-2), f"merged lse differs from single-rank attention: {d_lse}"
    err = ((o - o_ref).abs().max() / o_ref.abs().max()).item()
    assert err < (1e-5 if dtype == torch.float32 else 3e-2), f"merged o rel err {err}"
    return err


# Context lengths 0..3 blocks of 4 rows; with q_len 1..5 every residue of L mod 4 (and mod 2) occurs.
CTX = [0, 1, 2, 3, 4, 5, 7, 8, 9, 11, 12]


@pytest.mark.parametrize("D", [1, 2, 4])
@pytest.mark.parametrize("q_len", [1, 2, 3, 4, 5])
def test_reference_shards_merge_to_single_rank_attention(q_len, D):
    lens = [c + q_len for c in CTX]
    assert {n % D for n in lens} == set(range(D))
    check_case(q_len, D, CTX, seed=q_len * 10 + D)
    if q_len > 1:
        check_case(q_len, D, CTX, seed=q_len * 10 + D + 1, pad_every=2)


def test_reference_without_positions_sees_every_key():
    """q_pos=None: each of a sequence's q_len queries attends to all seq_lens[b] keys."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.randn(9, 48, generator=gen)
    cache, table, seq_lens = shard([keys], 1, 0, 4, 48, gen)
    q = torch.randn(3, 2, 48, generator=gen)
    o, lse = TorchAttentionOps().decode(q, cache, table, seq_lens, 0.2, 32, q_len=3)
    o_ref, lse_ref = dense_oracle(q, keys, torch.full((3,), 8), 0.2, 32)
    assert torch.allclose(o.double(), o_ref, atol=1e-5) and torch.allclose(lse.double(), lse_ref, atol=1e-5)


def test_mla_dcp_merge_is_exact_with_empty_ranks():
    """The merge MLAAttention does after the DCP all-gather (logsumexp over ranks, weights
    exp(lse_r - lse), nan -> 0) leaves a rank with lse -inf out, even when every rank but one has it."""
    o1, l1 = torch.randn(2, 3, 8), torch.randn(2, 3)
    o0, l0 = torch.zeros(2, 3, 8), torch.full((2, 3), float("-inf"))
    lse_all = torch.stack([l0, l1])
    lse_g = torch.logsumexp(lse_all, dim=0)
    out = sum(o * torch.exp(l - lse_g).nan_to_num_(0.0).unsqueeze(-1) for o, l in [(o0, l0), (o1, l1)])
    assert torch.equal(lse_g, l1) and torch.allclose(out, o1)


# ---- Triton: CPU_CASES under the interpreter (fp32, tests/interpreted/test_multi_token_decode_kernel.py) ----

def _cpu_cases():
    cases = {}
    for D in (1, 2, 4):
        for q_len in (1, 2, 3, 4, 5):
            cases[f"D{D}_q{q_len}"] = dict(q_len=q_len, D=D, ctx_lens=CTX, use_triton=True)
    # forced splits: split boundaries fall inside the visible prefixes; 5x3 = 15 rows, 2 row tiles
    cases["D2_q3_splits3"] = dict(q_len=3, D=2, ctx_lens=[0, 9, 30], use_triton=True, triton_splits=3)
    cases["D4_q5_splits4_H6"] = dict(q_len=5, D=4, ctx_lens=[0, 3, 40], H=6, use_triton=True, triton_splits=4)
    for D in (1, 2, 4):  # decodes with fewer tokens, padded to q_len rows (position -1)
        cases[f"D{D}_q4_padded"] = dict(q_len=4, D=D, ctx_lens=CTX, use_triton=True, pad_every=2)
    return cases


CPU_CASES = _cpu_cases()


def _gpu_cases():
    """Real shapes: Lkv 512, R 64, pages of 64, bf16; 16 and 128 heads; contexts up to 5000."""
    cases = {}
    ctx = [0, 1, 63, 64, 65, 1000, 4093, 5000]
    for H in (16, 128):
        for q_len in (2, 4):
            for D in (1, 2):
                cases[f"H{H}_q{q_len}_D{D}"] = dict(q_len=q_len, D=D, ctx_lens=ctx, H=H, lkv=512, r=64, page=64,
                                                    device="cuda", dtype=torch.bfloat16, use_triton=True)
    cases["H16_q4_D2_padded"] = dict(q_len=4, D=2, ctx_lens=ctx, H=16, lkv=512, r=64, page=64, device="cuda",
                                     dtype=torch.bfloat16, use_triton=True, pad_every=2)
    cases["H16_q3_D4_splits7"] = dict(q_len=3, D=4, ctx_lens=ctx, H=16, lkv=512, r=64, page=64, device="cuda",
                                      dtype=torch.bfloat16, use_triton=True, triton_splits=7)
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(_gpu_cases()))
def test_triton_gpu(name):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    check_case(**_gpu_cases()[name])
