"""What the Gluon many-heads MLA decode (attention/gluon_decode.py) accepts and how it is tiled:
its config and shared-memory plan, the argument checks (each a ValueError naming the argument
and the limit) and the split count. Plain host code, importable without Gluon.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from attention.decode_config import DecodeConfig, check_paged_decode_args, choose_num_splits

LKV, R = 512, 64  # the widths the kernel is written for (every DeepSeek MLA model)
BLOCK_H = 64  # query rows per program: wgmma's M
GLUON_TRITON = "3.6"  # the Triton release whose Gluon API the kernel is written against (and compiled on)
OPTION = "mla_decode_wgmma (bench_mla_decode.py --impl gluon)"


@dataclass(frozen=True)
class GluonDecodeConfig:
    block_n: int = 32  # cache rows per tile
    num_stages: int = 4  # tiles in shared memory: a tile's loads are issued num_stages - 2 tiles early
    xbuf: int = 1  # partial-score exchange slots per direction
    worker_regs: int = 240  # register budget of the second warpgroup (setmaxnreg)
    q_pe_regs: bool = True  # q's rope slice in registers, not shared memory (8 KB less)
    lazy_rescale: bool = False  # rescale O only when some row's max grows by > 2^LAZY_TAU (decode_config)
    producer: bool = False  # a third warpgroup issues every copy (gluon_copies._producer_partition; >= 4 stages)
    producer_regs: int = 64  # its register budget (setmaxnreg; 64 compiles without spills)
    seesaw: bool = False  # the 64-row seesaw schedule (attention/gluon_seesaw.py; SEESAW below)
    min_split_tokens: int = 64
    max_splits: int = 128

    def smem_bytes(self) -> int:
        """Shared memory per program: q, the KV stages, the exchange slots, alpha, the mbarriers."""
        if self.seesaw:  # q whole, two 64-row stages, m / a / l per warpgroup, 14 mbarriers
            return (1 + self.num_stages) * BLOCK_H * (LKV + R) * 2 + 3 * 2 * BLOCK_H * 4 + 14 * 8
        q = BLOCK_H * LKV * 2 + (8 if self.q_pe_regs else BLOCK_H) * R * 2  # rope: 8-row token
        kv = self.num_stages * self.block_n * (LKV + R) * 2
        x = 2 * self.xbuf * BLOCK_H * self.block_n * 4
        return q + kv + x + 2 * BLOCK_H * 4 + 4 * self.xbuf * 8

    def split_config(self) -> DecodeConfig:
        """The DecodeConfig that `choose_num_splits` reads (one program per SM)."""
        return DecodeConfig(block_h=BLOCK_H, block_n=self.block_n, num_warps=8,
                            num_stages=self.num_stages, programs_per_sm=1,
                            min_split_tokens=self.min_split_tokens, max_splits=self.max_splits)


SMEM_LIMIT = 227 * 1024  # Hopper's opt-in shared memory per block
# the seesaw schedule's one shape: 64-row tiles in two stages, a producer warpgroup at 56 registers,
# the second compute warpgroup at 224 (the first gets the rest; the split that compiles without spills);
# splits of at least one pair of tiles (the kernel rounds split boundaries to 128 rows); xbuf and
# q_pe_regs do not apply (no score exchange; q whole in shared memory), lazy_rescale does
SEESAW = GluonDecodeConfig(block_n=64, num_stages=2, seesaw=True, worker_regs=224, producer_regs=56,
                           min_split_tokens=128)


def validate_inputs(q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, kv_lora_rank: int, q_len: int,
                    q_pos: torch.Tensor | None, cfg: GluonDecodeConfig) -> None:
    """The kernel's limits, each failure a ValueError naming the argument and the limit."""
    if kv_lora_rank != LKV or q.dim() != 3 or q.shape[2] != LKV + R:
        raise ValueError(f"kv_lora_rank must be {LKV} and q [B*q_len, H, {LKV + R}] "
                         f"(got {kv_lora_rank} and {tuple(q.shape)})")
    if q.dtype != torch.bfloat16 or kv_cache.dtype != torch.bfloat16:
        raise ValueError(f"q and kv_cache must be bfloat16 (got {q.dtype}, {kv_cache.dtype})")
    check_paged_decode_args(q, kv_cache, block_table, seq_lens, LKV, R, q_len, q_pos, BLOCK_H, aligned=("q", "kv_cache"))
    if cfg.seesaw:
        if (cfg.block_n, cfg.num_stages, cfg.producer) != (64, 2, False):
            raise ValueError("GluonDecodeConfig(seesaw=True) runs 64-row tiles in 2 stages with its own "
                             f"copy warpgroup (gluon_decode_plan.SEESAW), got {cfg}")
    elif cfg.block_n not in (16, 32):
        raise ValueError(f"GluonDecodeConfig.block_n must be 16 or 32, got {cfg.block_n}")
    if cfg.producer and not cfg.q_pe_regs:
        raise ValueError("GluonDecodeConfig.producer needs q_pe_regs=True (the compute warpgroups issue no copies)")
    # with the producer, tile j+1 is published only after tile j+2 is issued into the stage of
    # tile j+2-STAGES, which the compute warpgroups release at iteration j+3-STAGES: with 3 stages
    # that is the iteration waiting for tile j+1 (a deadlock)
    if cfg.producer and cfg.num_stages < 4:
        raise ValueError(f"GluonDecodeConfig.producer needs num_stages >= 4, got {cfg.num_stages}")
    for name in ("worker_regs", "producer_regs"):
        regs = getattr(cfg, name)
        if regs % 8 or not 24 <= regs <= 256:  # setmaxnreg's operand
            raise ValueError(f"GluonDecodeConfig.{name} must be a multiple of 8 in [24, 256], got {regs}")
    if cfg.num_stages < 3 and not cfg.seesaw:  # the loop refills tile j-1's stage while tile j+1's must be loaded
        raise ValueError(f"GluonDecodeConfig.num_stages must be >= 3, got {cfg.num_stages}")
    if cfg.smem_bytes() > SMEM_LIMIT:
        raise ValueError(f"GluonDecodeConfig needs {cfg.smem_bytes()} bytes of shared memory, "
                         f"more than {SMEM_LIMIT}")


def plan_splits(batch: int, rows: int, max_len: int, num_sms: int, cfg: GluonDecodeConfig) -> int:
    """Splits per sequence, by triton_decode's wave heuristic over 64-row programs."""
    return choose_num_splits(batch, rows // BLOCK_H, max_len, num_sms, cfg.split_config())


def engine_fit_problem(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
                       kv_lora_rank: int, rope_dim: int) -> str | None:
    """Why the Gluon decode cannot run in this engine (the model's widths, its dtypes, the GPU and
    Triton's Gluon dialect), or None where it can. Its per-call limits, heads a multiple of 64
    among them, are `validate_inputs`'."""
    if kv_lora_rank != LKV or rope_dim != R:
        return (f"the Gluon decode is written for kv_lora_rank {LKV} and qk_rope_head_dim {R}, "
                f"this model has {kv_lora_rank} and {rope_dim}")
    if dtype != torch.bfloat16 or cache_dtype != torch.bfloat16:
        return (f"the Gluon decode needs a bf16 model and KV cache, got {dtype} and {cache_dtype} "
                f"(--dtype / --kv-cache-dtype)")
    import triton
    if not triton.__version__.startswith(GLUON_TRITON):
        return (f"the Gluon decode is written against Triton {GLUON_TRITON}'s Gluon dialect, which changes "
                f"between releases; this is Triton {triton.__version__}")
    from attention.gluon_decode import check_gluon_available
    try:
        check_gluon_available(device)
    except RuntimeError as e:
        return str(e)
    return None


def decode_heads_fit(decode_heads: int) -> bool:
    """Whether decodes of `decode_heads` query heads per rank (the model's heads / TP, times the
    DCP size, whose ranks gather the group's heads) fill whole 64-row wgmma tiles."""
    return decode_heads >= BLOCK_H and decode_heads % BLOCK_H == 0


def check_engine_fit(min_heads: int, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
                     kv_lora_rank: int, rope_dim: int) -> None:
    """Start-up check of `--kernels ...,decode_wgmma_min_heads=N`: `engine_fit_problem` as a
    ValueError naming the setting."""
    problem = engine_fit_problem(device, dtype, cache_dtype, kv_lora_rank, rope_dim)
    if problem is not None:
        raise ValueError(f"--kernels ...,decode_wgmma_min_heads={min_heads}: {problem}; "
                         f"leave decode_wgmma_min_heads at 0")
