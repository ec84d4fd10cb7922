"""Block-quantized FP8 weights as DeepSeek-V3/R1 ship them.

A weight `W [N, K]` is stored as float8 e4m3 `Wq` with one fp32 `weight_scale_inv` per
`bn x bk` block (128 x 128): `W = Wq * s[i // bn, j // bk]`. Edge blocks may be partial.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
BLOCK = 128  # DeepSeek's FP8 block: weights in 128 x 128 blocks, activations in groups of 128


def expand_scales(s: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """Per-element scales `[..., N, K]` from per-block scales `[..., ceil(N/bn), ceil(K/bk)]`
    (leading dims, e.g. stacked experts, pass through)."""
    bn, bk = block
    N, K = shape[-2], shape[-1]
    return s.repeat_interleave(bn, -2)[..., :N, :].repeat_interleave(bk, -1)[..., :K]


def dequantize(wq: torch.Tensor, s: torch.Tensor, block: tuple[int, int],
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`Wq * s` per block, for one weight `[N, K]` or stacked weights `[E, N, K]`."""
    return (wq.float() * expand_scales(s.float(), tuple(wq.shape), block)).to(dtype)


def quantize(w: torch.Tensor, block: tuple[int, int] = (128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(Wq fp8 [N, K], scale_inv fp32 [ceil(N/bn), ceil(K/bk)]) with each block's amax at 448."""
    N, K = w.shape
    bn, bk = block
    nb, kb = -(-N // bn), -(-K // bk)
    padded = torch.zeros(nb * bn, kb * bk, dtype=torch.float32, device=w.device)
    padded[:N, :K] = w.float()
    blocks = padded.view(nb, bn, kb, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [nb, kb]
    s = amax / FP8_MAX
    q = (blocks / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * bn, kb * bk)[:N, :K]
    return q.to(FP8), s


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """Which checkpoint tensors DeepSeek quantizes: every 2-D projection weight except the
    embeddings, the LM head and the router."""
    return tensor.dim() == 2 and (name.endswith("_proj.weight") or name.endswith("_proj_with_mqa.weight"))
