"""The fused cache-row kernel (attention/triton_cache.py kv_finish) against the unfused path:
RMSNorm of c, RoPE of k_pe, cat, the torch backend's write_kv."""

from __future__ import annotations

import pytest
import torch

from attention.torch_backend import TorchAttentionOps
from attention.triton_cache import kv_finish
from common.fused import apply_rope, rms_norm
from models.config import RopeConfig
from models.layers import YarnRotaryEmbedding


def check(T, L, R, page, dtype, device, tol):
    g = torch.Generator().manual_seed(T + L)
    proj = torch.randn(T, L + R + 24, generator=g).to(device, dtype)  # kv as a view of a wider output
    kv = proj[:, 24:]
    w = (1 + 0.1 * torch.randn(L, generator=g)).to(device, dtype)
    rope = YarnRotaryEmbedding(R, 4096, RopeConfig()).to(device)
    positions = torch.randint(0, 4096, (T,), generator=g).to(device)
    cs = rope.at(positions)
    nb = max(8, -(-T // page) + 1)
    slots = torch.randperm(nb * page, generator=g)[:T].to(device)
    slots[1::3] = -1  # padding / another DCP rank's tokens (row 0 is stored: T = 1 writes)
    ref_cache = torch.full((nb, page, L + R), 7.0, dtype=dtype, device=device)
    got_cache = ref_cache.clone()
    k_pe = apply_rope(cs, kv[:, L:])
    ref = torch.cat([rms_norm(kv[:, :L], w, 1e-6), k_pe], dim=-1)
    TorchAttentionOps().write_kv(ref_cache, ref, slots)
    got = kv_finish(kv, w, 1e-6, cs, got_cache, slots)
    assert got.shape == (T, L + R) and got.is_contiguous()
    err = ((got.double() - ref.double()).norm() / ref.double().norm()).item() if T else 0.0
    cerr = ((got_cache.double() - ref_cache.double()).norm() / ref_cache.double().norm()).item()
    assert err < tol and cerr < tol, (T, L, R, page, dtype, err, cerr)
    untouched = torch.ones(nb * page, dtype=torch.bool, device=device)
    untouched[slots[slots >= 0]] = False
    assert (got_cache.view(-1, L + R)[untouched] == 7.0).all()  # no stray writes


def test_kv_finish_rejects_mismatched_cache():
    from attention.triton_cache import kv_finish
    with pytest.raises(ValueError, match="kv_finish"):
        kv_finish(torch.randn(2, 48), torch.ones(32), 1e-6, torch.randn(2, 16), torch.zeros(4, 4, 40),
                  torch.zeros(2, dtype=torch.long))


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
@pytest.mark.parametrize("T", [1, 33, 1000])
def test_kv_finish_real_shapes(T, page):
    check(T, 512, 64, page, torch.bfloat16, "cuda", 1e-2)
    check(T, 512, 64, page, torch.float32, "cuda", 1e-5)
