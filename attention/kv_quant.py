"""The latent cache's storage formats: the model dtype, bf16, or FP8 e4m3 with a per-tensor scale.

FP8 (`--kv-cache-dtype fp8`): every value of a cache row `[c ‖ k_pe]` (Lkv + R) is stored as
e4m3 of `x * (1 / scale)`, saturated to ±448 and rounded to nearest even; a read returns `q * scale`.
One scale per cache tensor (vLLM's FP8 MLA cache format), 1.0 when no calibrated scale is given:
- the row keeps its layout (576 one-byte values, 16-byte aligned rows), so every kernel keeps
  its addressing and the capacity is exactly twice bf16's at equal memory;
- the scale folds out of both decode products (score = scale * q·ĉ, o = scale * Σ p ĉ): one
  multiply per score and per output, no per-element dequantisation beyond the convert;
- e4m3 is a float format: its relative precision (2^-4 at worst) does not depend on the scale,
  which only sets the range [2^-9 * scale, 448 * scale]; RMSNorm'd latents are O(1).
A prefill attends over its own new rows as the cache holds them too (`as_cached`: FP8, or bf16
under fp32 compute), so a token's keys are the same whether they were computed in the same pass
or read back from the cache.
FlashMLA's FP8 format (one fp32 scale per 128 latent values, k_pe kept in bf16, 656 bytes per
token) is more robust to outliers without calibration, at 1.76x capacity instead of 2x and a
dequantisation per 128-value group inside the products.

The kernels round explicitly (`triton_cache.fp8_store_value`) so that the stored bytes are exactly
those of this torch reference on the GPU and under the Triton interpreter (whose own fp32->fp8
cast mis-rounds values that round up to the next power of two).
"""

from __future__ import annotations

import torch

from common.args import KV_CACHE_DTYPES

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensor's dtype for a --kv-cache-dtype value (`auto`: the model's dtype)."""
    canon = KV_CACHE_DTYPES.get(name)
    if canon is None:
        raise ValueError(f"--kv-cache-dtype: unknown value {name!r}; expected one of {', '.join(KV_CACHE_DTYPES)}")
    return {"auto": model_dtype, "bf16": torch.bfloat16, "fp8": FP8_DTYPE}[canon]


def is_fp8(t: torch.Tensor | torch.dtype) -> bool:
    return (t.dtype if isinstance(t, torch.Tensor) else t) == FP8_DTYPE


def store_as(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Values as the cache stores them: FP8 quantised (saturating, nearest even), else a cast."""
    if cache_dtype != FP8_DTYPE:
        return x.to(cache_dtype)
    # times the fp32 reciprocal, as the kernels do: the same product, so the same rounding
    return (x.float() * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def e4m3_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] as e4m3 with one scale per row (amax / 448; 1 for a row of zeros): (x8 [..., D],
    scale [..., 1] fp32), x ~ x8 * scale. The decode's QK^T on e4m3 operands (DecodeConfig.qk_fp8)
    quantises q so, in the kernel, with the same arithmetic."""
    x = x.float()
    amax = x.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)
    return (x * (1.0 / scale)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def load_as(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """Cached values in the compute dtype: FP8 dequantised in fp32 (q * scale), else a cast."""
    if x.dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x as a read of the cache returns it after a write: quantised and dequantised for FP8 (the
    kernels' write rounds x in its own dtype, as store_as does), cast there and back for another
    dtype (a bf16 cache under fp32 compute), x itself in a cache of x's dtype."""
    if cache_dtype == x.dtype:
        return x
    return load_as(store_as(x, cache_dtype, scale), x.dtype, scale)
