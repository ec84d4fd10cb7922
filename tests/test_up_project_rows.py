"""The prefill's up-projection over a row count rounded up to a multiple of 128 where the buffer
holds the rows (attention/mla.py `padded_rows`): the same k_nope and v as over the exact rows."""

import torch

from attention.mla import UP_PROJECT_ROWS, MLAAttention, padded_rows
from common.kernel_plan import KernelPlan
from attention.torch_backend import TorchAttentionOps


def test_padded_rows_reads_only_rows_the_storage_holds():
    buf = torch.randn(300, 576)
    c = buf[:200, :512]  # a view with rows to spare after it, row stride 576
    p = padded_rows(c, 128)
    assert p.shape == (256, 512) and p.stride() == c.stride() and p.data_ptr() == c.data_ptr()
    assert torch.equal(p[:200], c) and torch.equal(p[200:], buf[200:256, :512])
    tail = buf[250:, :512]  # 50 rows, none to spare: unchanged
    assert padded_rows(tail, 128) is tail
    assert padded_rows(buf[:256, :512], 128).shape == (256, 512)  # already a multiple
    mid = buf[100:190, :512]  # 90 rows at offset 100: 128 rows fit (100 + 128 <= 300)
    assert padded_rows(mid, 128).shape == (128, 512)


def test_up_project_over_padded_rows_equals_exact_rows():
    torch.manual_seed(0)
    H, P, V, L, R = 4, 16, 8, 32, 8
    mla = MLAAttention(H, P, R, V, L, 0.1, KernelPlan(), TorchAttentionOps())
    mla.set_kv_b_weight(torch.randn(H * (P + V), L))
    spare = torch.full((70 + UP_PROJECT_ROWS, L + R), float("nan"))  # garbage past the rows used
    spare[:70] = torch.randn(70, L + R)
    c = spare[:70, :L]
    k_nope, v = mla._up_project(c)
    k_ref, v_ref = mla._up_project(c.clone())  # exact storage: no padding
    assert k_nope.shape == (70, H, P) and v.shape == (70, H, V)
    assert torch.equal(k_nope, k_ref) and torch.equal(v, v_ref)
    assert not torch.isnan(k_nope).any()
