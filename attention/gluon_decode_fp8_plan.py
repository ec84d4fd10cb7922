"""What the Gluon FP8-cache MLA decode (attention/gluon_decode_fp8.py) accepts and how it is tiled:
its config and shared-memory plan, the argument checks (each a ValueError naming the argument and
the limit), the engine's fit check and O^T's row order. Plain host code, importable without Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.decode_config import DecodeConfig, check_paged_decode_args

LKV, R = 512, 64  # the widths the kernel is written for (every DeepSeek MLA model)
BLOCK_H = 16  # query rows per program: the N of both wgmmas
BLOCK_N = 64  # cache rows per tile: wgmma's M for QK^T, its K (two steps of 32) for PV
# lazy_rescale's threshold (log2 domain): smaller than the Triton decode's (decode_config.LAZY_TAU =
# 8) because P is written as e4m3 (<= 448): p <= 2^4 leaves P room for a factor 2^4, which keeps
# small p in e4m3's normal range
LAZY_TAU = 4.0
OPTION = "the Gluon FP8-cache decode (attention/gluon_decode_fp8.py)"  # the engine's errors add its plan key
SMEM_LIMIT = 227 * 1024


@dataclass(frozen=True)
class Fp8DecodeConfig:
    num_stages: int = 2  # tiles in shared memory; 2 leaves room for 2 programs per SM
    lazy_rescale: bool = False  # rescale O only when a column's max grows by > 2^LAZY_TAU
    qk_promote: int = 256  # QK^T's e4m3 products summed in fp32 every this many K (wgmma's own sum is
    #                      of reduced precision); 0: one wgmma chain over K = 576
    # the defaults below are the fastest measured at B = 128, S = 16k, 16 heads (RESULTS.md)
    vt_early: bool = True  # load V^T's fragment under QK^T instead of after the softmax
    vt_prmt: bool = False  # V^T's byte transposes by 8 explicit byte permutes a 4 x 4 block
    p_hw_decode: bool = True  # P's hi term back to fp32 by the hardware convert
    fence_first: bool = True  # the proxy fence before the refill's issue, not after (5 barriers a tile, not 4)
    programs_per_sm: int = 2  # for the split heuristic (smem_bytes() must allow it)
    min_split_tokens: int = 128
    max_splits: int = 128

    def p_scale(self) -> float:
        """P's factor before it is written as e4m3: p <= 2^LAZY_TAU (lazy) or 1, times this <= 256."""
        return 2.0 ** (8 - LAZY_TAU) if self.lazy_rescale else 256.0

    def smem_bytes(self) -> int:
        """Shared memory per program: the KV stages, q's two terms, P's two terms and the 4 warps'
        column maxima (plus Triton's scratch for its own reductions, not counted)."""
        return (self.num_stages * BLOCK_N * (LKV + R) + 2 * BLOCK_H * (LKV + R) + 2 * BLOCK_H * BLOCK_N
                + 4 * BLOCK_H * 4)

    def split_config(self) -> DecodeConfig:
        return DecodeConfig(block_h=BLOCK_H, block_n=BLOCK_N, num_warps=4, num_stages=self.num_stages,
                            programs_per_sm=self.programs_per_sm, min_split_tokens=self.min_split_tokens,
                            max_splits=self.max_splits)


def validate_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, kv_lora_rank: int, q_len: int,
                    q_pos: torch.Tensor | None, cfg: Fp8DecodeConfig) -> None:
    """The kernel's limits, each failure a ValueError naming the argument and the limit."""
    if kv_lora_rank != LKV or q.dim() != 3 or q.shape[2] != LKV + R:
        raise ValueError(f"kv_lora_rank must be {LKV} and q [B*q_len, H, {LKV + R}] "
                         f"(got {kv_lora_rank} and {tuple(q.shape)})")
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"q must be bfloat16 and kv_cache float8_e4m3fn (got {q.dtype}, {kv_cache.dtype})")
    check_paged_decode_args(q, kv_cache, block_table, seq_lens, LKV, R, q_len, q_pos, BLOCK_H)
    if cfg.num_stages < 2:
        raise ValueError(f"Fp8DecodeConfig.num_stages must be >= 2, got {cfg.num_stages}")
    if cfg.smem_bytes() > SMEM_LIMIT // cfg.programs_per_sm:
        raise ValueError(f"Fp8DecodeConfig needs {cfg.smem_bytes()} bytes of shared memory a program, "
                         f"more than {SMEM_LIMIT // cfg.programs_per_sm} for {cfg.programs_per_sm} a SM")


GLUON_TRITON = "3.6"  # the Triton release whose Gluon API the kernel is written against


# what the engine uses it for: the page sizes its GPU tests covered (16 and 64) and heads per rank
# in 1-8 tiles of 16 (timed against the Triton FP8 decode at 16, 64 and 128 heads: RESULTS.md)
ENGINE_PAGES = (16, 64)
ENGINE_MAX_HEADS = 128


def engine_fit_problem(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
                       kv_lora_rank: int, rope_dim: int, decode_heads: int, page: int) -> str | None:
    """Why this decode cannot serve an engine (the model's widths and dtypes, the cache and its
    page size, the decode's heads per rank, the GPU, Triton's Gluon), or None where it can. The
    kernel itself takes any power-of-two page and any multiple of 16 rows (`validate_inputs`);
    the engine takes it only where it was tested and timed (ENGINE_PAGES, ENGINE_MAX_HEADS)."""
    if cache_dtype != torch.float8_e4m3fn:
        return f"the Gluon FP8 decode reads an FP8 cache (--kv-cache-dtype fp8), this one is {cache_dtype}"
    if kv_lora_rank != LKV or rope_dim != R:
        return (f"the Gluon FP8 decode is written for kv_lora_rank {LKV} and qk_rope_head_dim {R}, "
                f"this model has {kv_lora_rank} and {rope_dim}")
    if dtype != torch.bfloat16:
        return f"the Gluon FP8 decode needs a bf16 model (--dtype), got {dtype}"
    if decode_heads % BLOCK_H or decode_heads > ENGINE_MAX_HEADS:
        return (f"the engine takes the Gluon FP8 decode for a multiple of 16 heads per rank up to "
                f"{ENGINE_MAX_HEADS} (16-row tiles; more are not timed), this rank decodes {decode_heads}")
    if page not in ENGINE_PAGES:
        return (f"the engine takes the Gluon FP8 decode at --block-size {' or '.join(map(str, ENGINE_PAGES))} "
                f"(the page sizes its GPU tests cover), not {page}")
    import triton
    if not triton.__version__.startswith(GLUON_TRITON):
        return (f"the Gluon FP8 decode is written against Triton {GLUON_TRITON}'s Gluon dialect, which changes "
                f"between releases; this is Triton {triton.__version__}")
    from attention.gluon_decode_fp8 import check_available
    try:
        check_available(device)
    except RuntimeError as e:
        return str(e)
    return None


# The V^T fragment (module docstring). O^T's row r (the wgmma's M) holds latent column PERM(r):
# with r's bits (MSB first) i2 i1 i0 w1 w0 h g2 g1 g0 - i: the 64-row wgmma, w: the warp, h: the
# upper 8 rows of a warp's 16, g: the lane's row - PERM(r) has the bits w1 w0 g2 g1 g0 i2 i1 i0 h,
# so that the 16 rows (i, h) of a thread are 16 consecutive columns.
def perm_rows(r: torch.Tensor) -> torch.Tensor:
    """PERM for the torch side (tests): latent column of O^T's row r."""
    return ((r >> 3) & 1) | (((r >> 6) & 7) << 1) | ((r & 7) << 4) | (((r >> 4) & 3) << 7)


