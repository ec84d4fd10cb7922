"""The kernel plan: which implementation runs each op of the model, chosen once at start-up.

The plan is resolved from `--kernels` (and `--attention-backend`) with the device and dtype
known, logged in one line, and passed to the model at construction; modules dispatch on its
fields and nothing else (never on environment variables). A kernel that fails at start-up or
in the warm-up stops the engine with a `KernelError` naming the `--kernels` setting that avoids
it; nothing falls back at run time but fp8_gemm=auto, which takes Triton for a shape cuBLAS refuses.

`--kernels` is a base, `auto` | `triton` | `torch`, followed by comma-separated `key=value`
overrides of single choices (`--kernels triton,router=torch,moe_fused_max_tokens=0`). `torch` is
the pure-torch engine on any device: the reference the Triton plan is tested against.

To add a choice: one `Choice` in `CHOICES` (its key, values, default per base, help), one field
of the same name in `KernelPlan`, and the dispatch in the module that runs it; the CLI's help,
the parser, the log line and the failure messages follow from the entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.launch_settings import interpreting

TRITON, TORCH = "triton", "torch"
# decode_wgmma_min_heads under base triton where the Gluon decode fits: one 64-row wgmma tile.
# On the H200 it beat the Triton decode at every 64- and 128-head shape timed (B 1..128, S 1k..16k:
# 1.15-1.41x; RESULTS.md)
WGMMA_MIN_HEADS = 64
# decode_fp8_wgmma_min_rows under base triton: 16 tiles of 16 query rows (B 16 at 16 heads, B 2 at
# 128), where the two FP8 decodes were level on the H200 (RESULTS.md)
FP8_WGMMA_MIN_ROWS = 256
# pdl_graph_max_batch under base triton on sm_90+: PDL in the decode graphs of up to 16 sequences, where
# it won in most runs of V2-Lite on the H200 and an H100 (batch 1 -2.7 to -4.7%, batch 8 and 16 -0.6
# to -1.6%, one +2.2%), and was level or slower past it (RESULTS.md).
PDL_GRAPH_MAX_BATCH = 16
W8A16_MAX_ROWS = 16  # fp8_gemm_w8a16_max_tokens' bound (the kernel's one row tile)


@dataclass(frozen=True)
class Choice:
    key: str
    values: tuple  # allowed values; ints and bools take any value of their type
    help: str
    modules: tuple[str, ...] = ()  # a failure raised inside one of these is charged to this key
    triton: object = TRITON  # the value under base `triton`
    torch: object = TORCH  # the value under base `torch`
    triton_help: str | None = None  # the help's "triton:" entry where resolve_plan adjusts the value


# moe_norm_in_router_max_tokens under base triton: off. On H100s (V2-Lite, bench_pdl_variants.py) the
# norm inside the router's logits kernel won at batch 1 in two engines and lost 3.5-8% in three on
# another machine, and gained 0.4-0.6% at batch 8-16 with SideNorm: no consistent win (RESULTS.md).
NORM_IN_ROUTER_MAX_TOKENS = 0


# Every kernel choice, in log order. `triton` / `torch` give each key's value under that base;
# the resolver (resolve_plan) adjusts a few for the device and dtype.
CHOICES: tuple[Choice, ...] = (
    Choice("attention", (TRITON, TORCH),
           "paged decode, prefill, context gather and KV write (the AttentionOps backend)",
           ("attention.triton_backend", "attention.triton_decode", "attention.triton_prefill")),
    Choice("finish_kv", (TRITON, TORCH),
           "new tokens' cache rows: RMSNorm of c, RoPE of k_pe and the cache write as one kernel",
           ("attention.triton_cache",)),
    Choice("absorb", (TRITON, TORCH),
           "decode's q RoPE, absorb_q (q_nope @ W_UK) and absorb_o (o_lat @ W_UV^T) kernels",
           ("attention.triton_absorb",)),
    Choice("router", (TRITON, TORCH), "expert choice after the router GEMM as one kernel per token",
           ("models.triton_route",)),
    Choice("router_fused_max_tokens", (int,), "with router=triton, steps of up to this many tokens compute "
           "the router's logits and the expert choice in one launch (models/triton_route.py "
           "_router_fused_kernel: tiles of 16 tokens, each program the whole router on the tensor cores) "
           "instead of two; routers without expert groups (V2-Lite; not V2's or V3's grouped choice) whose "
           "weight is exactly bf16 under bf16 activations (or fp32 throughout), of at most 64 experts; any other "
           "router stops the start-up naming this setting (0: never); slower than the two launches on "
           "an H100 (~10.5 against 3.6-7.4 us a call at 1-512 tokens)",
           triton=0, torch=0),
    Choice("norm", (TRITON, TORCH),
           "RMSNorm and the residual add + RMSNorm as one Triton kernel each (common/triton_norm.py); "
           "torch: the elementwise glue, compiled or not as `compile` says. Eager steps with prefill are "
           "paced by the host's launches, and a Triton launch costs it less than a compiled call",
           ("common.triton_norm",)),
    Choice("moe", (TRITON, TORCH),
           "routed experts: Triton kernels by token count (moe_fused_max_tokens, "
           "moe_blocked_max_tokens), then moe_large; torch: a loop over the experts hit",
           ("models.fused_moe", "models.blocked_moe")),
    Choice("moe_fused_max_tokens", (int,), "batches up to this many tokens take the fused "
           "small-batch MoE kernel (0: never)", triton=4, torch=0),
    Choice("moe_fused_max_tokens_fp8", (int,), "the same bound for experts kept in FP8 (--fp8-gemm), "
           "which take the block kernels at every larger size", triton=8, torch=0),
    Choice("moe_blocked_max_tokens", (int,), "larger batches up to this many tokens take the "
           "expert-sorted block kernels (0: never); FP8 experts take them at any size", triton=512, torch=0),
    Choice("moe_shared_dense_min_tokens", (int,), "batches from this many tokens on (past the fused "
           "small-batch bound) run the shared experts as their own GEMMs instead of as experts of "
           "the block kernels or moe_large (0: never; with --fp8-gemm the shared experts are a W8A8 MLP "
           "of their own and this does not apply)",
           triton=1024, torch=0),
    Choice("moe_fp8_w8a8", (bool,), "with --fp8-gemm, the FP8 block MoE kernels quantize activations per "
           "token per 128 group and multiply in FP8 (W8A8, as the dense W8A8 GEMMs) instead of converting "
           "the weights to bf16 (R1 with 4 layers on the H200: TPOT at batch 32 / 128 4.01 / 5.76 -> "
           "3.44 / 5.00 ms; the activation rounding is vLLM's and DeepSeek's own W8A8 recipe)",
           triton=True, torch=False),
    Choice("moe_large", ("grouped", "dense", "loop"),
           "experts beyond the Triton bounds: grouped (torch._grouped_mm, CUDA bf16), dense "
           "(every expert on every token, no host sync), loop (experts hit, one by one)",
           triton="grouped", torch="loop"),
    Choice("moe_sum_in_norm", (bool,), "the Triton MoE paths (fused, block kernels) leave each token's pair rows "
           "unsummed and the next residual add + RMSNorm kernel sums them (common/triton_norm.py): one launch "
           "fewer per MoE layer; needs moe and norm triton; one TP rank only (under TP the sum precedes the "
           "all-reduce)", ("common.triton_norm",), triton=True, torch=False,
           triton_help="1 where norm is triton, else 0"),
    Choice("moe_norm_in_router_max_tokens", (int,), "MoE layers of steps of up to this many tokens run the residual "
           "add + post-attention RMSNorm inside the router's logits kernel (models/triton_route.py "
           "add_norm_router_logits: the norm kernel's bits, then the logits from them) where the Triton logits "
           "kernel takes the step (up to 32 tokens on V2-Lite, 5 on V2, 2 on V3; not the one-launch router's "
           "steps): one launch fewer a layer; where the shared experts run on their own stream (moe_shared_stream) "
           "that stream computes the same norm for them with a kernel of its own and forks first (models/moe.py "
           "SideNorm); needs router and norm triton (0: never; opt-in: on H100s V2-Lite's TPOT at batch 8 "
           "-0.4 to -0.6%, 16 -0.4%, 24-32 level, and batch 1 without the side stream's norm +3.5 to +8% in three "
           "engines, -2.1 and -2.9% in two others); a failure there is charged to this key",
           triton=NORM_IN_ROUTER_MAX_TOKENS, torch=0),
    Choice("moe_route_align_max_tokens", (int,), "block-MoE steps of up to this many tokens make the expert choice "
           "and the alignment of the pairs into blocks in one launch (models/route_align.py) instead of two, where "
           "the choice's tile holds the step (T x E <= 2048 logits: 32 tokens on V2-Lite's 64 experts); routers "
           "without expert groups only (V2's and V3's grouped routers stop the start-up naming this setting); "
           "needs router and moe triton (0: never; opt-in: level with the two launches on an H100 at batch 8-32); "
           "a failure there is charged to this key by Router", triton=0, torch=0),
    Choice("moe_shared_stream", (bool,), "with moe triton and the shared experts folded into the experts (not "
           "when --fp8-gemm keeps them in FP8: nothing to overlap, the setting is then unused), steps that take "
           "the pair-parallel fused MoE (moe_fused_max_tokens) or the block kernels (moe_blocked_max_tokens; not "
           "where moe_shared_dense_min_tokens makes the shared experts GEMMs of their own) run "
           "the shared experts' pairs on a second CUDA stream, concurrently with the router, the expert sort and "
           "the routed pairs (models/fused_moe.py fused_moe_small_overlapped, the same output bits; "
           "models/blocked_moe.py fused_moe_blocked_overlapped, the shared experts in 64-row blocks); on the H200 "
           "(V2-Lite) TPOT at batch 4 3.870 ms against 3.950 / 3.952 on one stream (profile_graphs.py), an MoE "
           "layer at 8 / 32 / 128 / 256 tokens 158.3 / 258.3 / 287.7 / 303.4 us against 159.8 / 263.7 / 296.0 / "
           "312.0 (bench_moe_stream.py); a failure there is charged to this key by MoE.forward",
           triton=True, torch=False),
    Choice("gemm_skinny_max_tokens", (int,), "projections (bf16/fp16/fp32 weights) of steps with up to this "
           "many tokens run on a Triton weight-streaming GEMM (models/skinny_gemm.py) instead of cuBLAS "
           "(0: never)", ("models.skinny_gemm",), triton=0, torch=0),
    Choice("fp8_gemm", ("auto", TRITON, "cublas"),
           "W8A8 block GEMM with --fp8-gemm: cuBLAS's block-scaled GEMM where torch, GPU and "
           "shape have it, Triton elsewhere and, with fp8_gemm_splitk, through 16 rows (auto), or one of them", ("models.fp8_gemm",), triton="auto", torch="auto"),
    Choice("fp8_gemm_splitk", (bool,), "with --fp8-gemm, the Triton W8A8 GEMM at <= 16 rows splits K over "
           "more programs where its tiles alone would leave SMs idle (models/fp8_gemm_splitk.py; R1 with 4 "
           "layers on the H200: batch-1 TPOT 3.27 -> 3.05 ms)", ("models.fp8_gemm_splitk",), triton=True, torch=False),
    Choice("fp8_gemm_fuse_act", (bool,), "with fp8_gemm_splitk, where the split-K W8A8 GEMM serves a "
           "projection (<= 16 rows) it quantizes the activations itself, bit for bit as act_quant: one "
           "launch and one FP8 copy of x fewer a projection (opt-in: slower on an H100, V2-Lite --quantization "
           "fp8 batch-1 TPOT 3.87 against 3.00 ms)",
           (), triton=False, torch=False),
    Choice("fp8_gemm_splitk_serial", (bool,), "with fp8_gemm_splitk, a split W8A8 product's partials are "
           "summed by each output tile's last program (a counter per tile, reset by that program) instead of "
           "a reduce launch: the same bits, one launch fewer a projection (opt-in: level on an H100)",
           (), triton=False, torch=False),
    Choice("fp8_gemm_w8a16_max_tokens", (int,), "projections kept in FP8 (--fp8-gemm) of steps with up to "
           f"this many tokens (at most {W8A16_MAX_ROWS}) run on one Triton launch that streams the FP8 weight and "
           "keeps the activations in their dtype (models/fp8_w8a16.py: no act_quant, no split reduce) instead "
           "of the W8A8 GEMM (0: never; opt-in: on an H100 it beat W8A8 by 2-5% at batch 1-8 on V2-Lite, lost 10-20% on R1)", ("models.fp8_w8a16",), triton=0, torch=0),
    Choice("decode_wgmma_min_heads", (int,), "query heads per rank from which the MLA decode runs on the "
           "Gluon wgmma kernel (attention/gluon_decode.py: sm_90, bf16 model and cache, kv_lora_rank 512, "
           "rope 64, heads a multiple of 64, Triton 3.6) instead of the Triton kernel (0: never)",
           ("attention.gluon_decode", "attention.gluon_decode_plan"), triton=0, torch=0,
           triton_help="64 where all of that holds, else 0"),
    Choice("decode_wgmma_producer", (bool,), "with decode_wgmma_min_heads, a third warpgroup of the Gluon decode "
           "issues every copy (GluonDecodeConfig.producer, attention/gluon_copies.py); opt-in: on the H200 at 128 "
           "heads, S 4096, B 8 / 32 / 128: 36.6 / 104.3 / 377.2 us against 38.9 / 111.8 / 396.8 (S 16k, B 128: "
           "1,529 against 1,501)", ("attention.gluon_copies",), triton=False, torch=False),
    Choice("decode_wgmma_seesaw", (bool,), "with decode_wgmma_min_heads, the Gluon decode's seesaw schedule "
           "(attention/gluon_seesaw.py): 64-row cache tiles in pairs, each warpgroup the QK^T and softmax of one "
           "tile of the pair and half of O over both, a third warpgroup issuing the copies (0: the lockstep "
           "schedule on 32-row tiles)", ("attention.gluon_seesaw",), triton=False, torch=False,
           triton_help="1 with decode_wgmma_min_heads unless decode_wgmma_producer=1, else 0"),
    Choice("decode_fp8_wgmma", (bool,), "with --kv-cache-dtype fp8, the MLA decode on the Gluon e4m3-wgmma kernel "
           "(attention/gluon_decode_fp8.py: sm_90, bf16 model, kv_lora_rank 512, rope 64, a multiple of 16 heads "
           "per rank up to 128, --block-size 16 or 64, Triton 3.6): the cache's bytes are the products' operands, "
           "never converted, instead of the Triton kernel's conversions to fp16", ("attention.gluon_decode_fp8",),
           triton=False, torch=False, triton_help="1 where all of that holds, else 0"),
    Choice("decode_fp8_wgmma_min_rows", (int,), "with decode_fp8_wgmma, decodes of fewer query rows (sequences x "
           "query tokens x heads) stay on the Triton FP8 kernel, whose programs start faster: on the H200 at 16 "
           "heads, S 4k, B 1 / 4 / 8 / 16 / 32 it took 14.0 / 18.6 / 25.3 / 38.0 / 59.9 us against the Gluon "
           "kernel's 19.2 / 22.8 / 34.1 / 39.3 / 51.5 (0: every FP8 decode on the Gluon kernel)",
           triton=FP8_WGMMA_MIN_ROWS, torch=0),
    # decode_fuse_q_kv and argmax=triton are on: the H200's graph profile of V2-Lite decode (scripts/
    # profile_graphs.py, with moe_sum_in_norm) put TPOT at batch 1 / 8 / 32 / 128 at 2.187 / 5.472 /
    # 8.456 / 10.200 ms with both against 2.210 / 5.570 / 8.546 / 10.324 without
    Choice("decode_fuse_q_kv", (bool,), "pure decode steps run absorb_q and kv_finish (the new tokens' cache "
           "rows) as one launch (attention/triton_absorb.py absorb_q_kv_finish): one kernel fewer per layer; "
           "needs absorb and finish_kv triton", ("attention.triton_absorb",), triton=True, torch=False,
           triton_help="1 where absorb and finish_kv are triton, else 0"),
    Choice("decode_merge_in_absorb", (bool,), "the Triton MLA decode's split merge runs inside absorb_o "
           "(attention/triton_absorb.py absorb_o_merge: the splits' fp32 partials merged by their lse and "
           "multiplied by W_UV in one launch) instead of its own launch, for decodes of 2 to 16 splits; not "
           "under DCP (its merge needs the lse), for decodes of differing draft counts, or on the Gluon "
           "decodes, which merge themselves; needs attention and absorb triton (opt-in, slower: on an H100 TPOT at "
           "batch 8 / 16 / 32 +7.7% / +1.4% / +3.0%, its 64 programs each streaming 512 KB of partials)",
           ("attention.triton_absorb",), triton=False, torch=False),
    Choice("decode_qk_fp8", (bool,), "with --kv-cache-dtype fp8, the MLA decode's QK^T on e4m3 operands: each "
           "query row rounded to e4m3 with its own scale, the cache's bytes as they are (Triton: "
           "DecodeConfig.qk_fp8; torch: the same rounding); opt-in: on the H200 at B 128, S 16k, 16 heads 713.8 us "
           "against the FP8 default's 743.0 and bf16's 560.1", triton=False, torch=False),
    Choice("pdl", (bool,), "programmatic dependent launch (sm_90+) for the decode path's Triton kernels: "
           "each is launched while its predecessor drains and waits for its writes on the GPU",
           ("common.pdl",), triton=False, torch=False),
    Choice("pdl_graph_max_batch", (int,), "decode CUDA graphs of up to this many sequences are captured with "
           "programmatic dependent launch (sm_90+) for the decode path's Triton kernels, as pdl=1 does for "
           "every launch (0: none)", ("common.pdl",), triton=0, torch=0,
           triton_help=f"{PDL_GRAPH_MAX_BATCH} on sm_90+ GPUs, else 0"),
    Choice("argmax", (TRITON, TORCH), "greedy sampling's argmax over the vocabulary: torch's, or two Triton "
           "launches (common/triton_argmax.py: blocks of 2048 logits, then their merge; the same index, ties "
           "and NaN as torch)", ("common.triton_argmax",)),
    Choice("launch", ("fast", TRITON), "how the host launches the Triton kernels of eager steps: fast "
           "(common/triton_launch.py: each kernel's compiled form kept per argument specialization and "
           "launched directly, without Triton's per-call binding) or triton (`kernel[grid](...)`, as Triton "
           "does; launch hooks such as proton's need it)", ("common.triton_launch",), triton="fast", torch=TRITON),
    Choice("compile", (bool,), "torch.compile the elementwise glue (norms, RoPE, SwiGLU) on CUDA",
           ("torch._dynamo", "torch._inductor"), triton=True, torch=False),
    Choice("autotune", (bool,), "autotune Triton tiles per token bucket (off: one fixed tile per "
           "kernel, for quick GPU test runs)", triton=True, torch=False),
    Choice("warmup", (bool,), "run every chosen path once at start-up (prefill steps of each "
           "autotuned token bucket and a decode step), before serving", triton=True, torch=False),
)
_BY_KEY = {c.key: c for c in CHOICES}


class KernelError(RuntimeError):
    """A kernel of the plan failed at start-up or in the warm-up; the message names the flag."""


@dataclass(frozen=True)
class KernelPlan:
    """One value per `CHOICES` key. The default is the pure-torch plan."""

    attention: str = TORCH
    finish_kv: str = TORCH
    absorb: str = TORCH
    router: str = TORCH
    router_fused_max_tokens: int = 0
    norm: str = TORCH
    moe: str = TORCH
    moe_fused_max_tokens: int = 0
    moe_fused_max_tokens_fp8: int = 0
    moe_blocked_max_tokens: int = 0
    moe_shared_dense_min_tokens: int = 0
    moe_fp8_w8a8: bool = False
    moe_large: str = "loop"
    moe_sum_in_norm: bool = False
    moe_norm_in_router_max_tokens: int = 0
    moe_route_align_max_tokens: int = 0
    moe_shared_stream: bool = False
    gemm_skinny_max_tokens: int = 0
    fp8_gemm: str = "auto"
    fp8_gemm_splitk: bool = False
    fp8_gemm_fuse_act: bool = False
    fp8_gemm_splitk_serial: bool = False
    fp8_gemm_w8a16_max_tokens: int = 0
    decode_wgmma_min_heads: int = 0
    decode_wgmma_producer: bool = False
    decode_wgmma_seesaw: bool = False
    decode_fp8_wgmma: bool = False
    decode_fp8_wgmma_min_rows: int = 0
    decode_fuse_q_kv: bool = False
    decode_merge_in_absorb: bool = False
    decode_qk_fp8: bool = False
    pdl: bool = False
    pdl_graph_max_batch: int = 0
    argmax: str = TORCH
    launch: str = TRITON
    compile: bool = False
    autotune: bool = False
    warmup: bool = False

    def describe(self) -> str:
        """The one log line: every choice as key=value."""
        return "kernel plan: " + " ".join(f"{c.key}={_show(getattr(self, c.key))}" for c in CHOICES)

    @property
    def any_triton(self) -> bool:
        return TRITON in (self.attention, self.finish_kv, self.absorb, self.router, self.norm, self.moe,
                          self.argmax)

    def avoid(self, key: str | None) -> str:
        """The --kernels setting that avoids a failure charged to `key` (None: unknown)."""
        c = _BY_KEY.get(key)
        if c is None or c.key == "attention":
            return "--kernels torch"
        if c.values[0] in (bool, int):
            off = "0"
        elif TORCH in c.values:
            off = TORCH
        else:  # another implementation of the op
            off = next(v for v in c.values if v not in (getattr(self, c.key), "auto"))
        return f"--kernels auto,{c.key}={off} (or --kernels torch)"

    def error(self, what: str, exc: BaseException) -> KernelError:
        """A KernelError for `exc`, raised while `what`, naming the flag that avoids it."""
        key = charged_key(exc)
        where = f"the {key} kernel" if key else "a kernel of the plan"
        return KernelError(f"{where} failed while {what}: {type(exc).__name__}: {exc}. "
                           f"{self.avoid(key)} avoids it ({self.describe()})")


def _show(v) -> str:
    return str(int(v)) if isinstance(v, bool) else str(v)


def charged_key(exc: BaseException) -> str | None:
    """The plan key whose module raised `exc`: the key a dispatcher set on it as `plan_key` (a
    path of one key reached through another key's module), else the outermost frame in a
    Choice's modules (the Triton attention backend calls kernels of attention/triton_cache.py
    too: a failure there is the backend's)."""
    if getattr(exc, "plan_key", None) in _BY_KEY:
        return exc.plan_key
    tb = exc.__traceback__
    while tb is not None:
        mod = tb.tb_frame.f_globals.get("__name__", "")
        for c in CHOICES:
            if any(mod == m or mod.startswith(m + ".") for m in c.modules):
                return c.key
        tb = tb.tb_next
    return None


def parse_kernels(spec: str) -> tuple[str, dict]:
    """`--kernels` as (base, {key: value}); ValueError naming the flag and the allowed values."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts or parts[0] not in ("auto", TRITON, TORCH):
        raise ValueError(f"--kernels {spec!r}: must start with auto, triton or torch")
    overrides = {}
    for p in parts[1:]:
        key, eq, value = p.partition("=")
        c = _BY_KEY.get(key.strip())
        if c is None or not eq:
            raise ValueError(f"--kernels: {p!r} is not key=value with a key of {', '.join(_BY_KEY)}")
        overrides[c.key] = _value(c, value.strip())
    return parts[0], overrides


def _value(c: Choice, s: str):
    kind = c.values[0]
    if kind is bool:
        if s not in ("0", "1", "true", "false", "on", "off"):
            raise ValueError(f"--kernels {c.key}={s}: expected 0 or 1")
        return s in ("1", "true", "on")
    if kind is int:
        if not s.isdigit():
            raise ValueError(f"--kernels {c.key}={s}: expected a token count >= 0")
        return int(s)
    if s not in c.values:
        raise ValueError(f"--kernels {c.key}={s}: expected one of {', '.join(c.values)}")
    return s


def resolve_plan(spec: str, attention_backend: str, device_type: str, dtype_name: str,
                 grouped_mm: bool, mla_dims_ok: bool, wgmma_fit: bool = False,
                 hopper: bool = False, fp8_wgmma_fit: bool = False) -> tuple[KernelPlan, list[str]]:
    """The plan for `--kernels spec` on this device; returns (plan, notes for the log).

    auto is triton on CUDA, torch elsewhere. With base triton: torch's grouped GEMM only where it
    runs (CUDA, bf16, `grouped_mm`), else the dense CUDA path; no compile or tuning under the
    interpreter; the Triton MLA kernels need kv_lora_rank and qk_rope_head_dim >= 16
    (`mla_dims_ok`), else attention, finish_kv and absorb stay torch under auto; decodes of 64 or
    more heads on the Gluon wgmma kernel where this model, its dtypes and the GPU fit it
    (`wgmma_fit`: attention/gluon_decode_plan.py's engine_fit_problem finds nothing) and attention
    is triton; decodes over an FP8 cache on the Gluon e4m3 kernel where it fits (`fp8_wgmma_fit`:
    attention/gluon_decode_fp8_plan.py's engine_fit_problem finds nothing) and attention is
    triton, unless decode_qk_fp8 (a Triton-kernel option) is set; PDL in the small decode graphs
    (pdl_graph_max_batch) on sm_90+ GPUs (`hopper`) when attention is triton. `--attention-backend` sets the attention key (finish_kv and absorb follow it unless
    set).
    """
    base, over = parse_kernels(spec)
    notes = []
    triton_ok = device_type == "cuda" or interpreting()
    if base == "auto":
        base = TRITON if device_type == "cuda" else TORCH
    if base == TRITON and not triton_ok:
        raise ValueError("--kernels triton: Triton kernels need a CUDA device (or TRITON_INTERPRET=1 "
                         "on the CPU, for tests); use --kernels torch")
    values = {c.key: getattr(c, base) for c in CHOICES}
    if attention_backend != "auto":
        over.setdefault("attention", attention_backend)
    if base == TRITON:
        if not (device_type == "cuda" and dtype_name == "bfloat16" and grouped_mm):
            values["moe_large"] = "dense" if device_type == "cuda" else "loop"
        if device_type != "cuda" or interpreting():
            values["compile"] = values["autotune"] = values["warmup"] = False
            values["launch"] = TRITON  # nothing compiled to launch under the interpreter
            # the interpreter runs a norm's rows one program at a time: the engine tests there keep
            # the torch glue, and tests/interpreted checks the kernel itself
            values["norm"] = TORCH
        if not mla_dims_ok and "attention" not in over:
            values["attention"] = TORCH
            notes.append("Triton MLA kernels need kv_lora_rank and qk_rope_head_dim >= 16: "
                         "attention, finish_kv and absorb use torch, without CUDA graphs")
    values.update(over)
    if values["moe_sum_in_norm"] and not values["moe"] == values["norm"] == TRITON:
        if "moe_sum_in_norm" in over:
            raise ValueError(f"--kernels ...,moe_sum_in_norm=1 sums the Triton MoE's pair rows in the Triton add + "
                             f"RMSNorm kernel; this plan has moe={values['moe']} norm={values['norm']} (set "
                             f"moe_sum_in_norm=0, or moe and norm triton)")
        values["moe_sum_in_norm"] = False
    if values["fp8_gemm_w8a16_max_tokens"] > W8A16_MAX_ROWS:
        raise ValueError(f"--kernels ...,fp8_gemm_w8a16_max_tokens={values['fp8_gemm_w8a16_max_tokens']}: the "
                         f"weight-streaming FP8 kernel takes at most {W8A16_MAX_ROWS} rows")
    if values["moe_route_align_max_tokens"] and not values["router"] == values["moe"] == TRITON:
        raise ValueError(f"--kernels ...,moe_route_align_max_tokens={values['moe_route_align_max_tokens']} makes the "
                         f"Triton router's choice and the Triton block MoE's alignment in one launch; this plan has "
                         f"router={values['router']} moe={values['moe']} (leave moe_route_align_max_tokens at 0, or "
                         f"set router and moe triton)")
    if values["moe_norm_in_router_max_tokens"] and not values["router"] == values["norm"] == TRITON:
        if "moe_norm_in_router_max_tokens" in over:
            raise ValueError(f"--kernels ...,moe_norm_in_router_max_tokens={values['moe_norm_in_router_max_tokens']} "
                             f"runs the Triton add + RMSNorm inside the Triton router's logits kernel; this plan has "
                             f"router={values['router']} norm={values['norm']} (leave moe_norm_in_router_max_tokens at "
                             f"0, or set router and norm triton)")
        values["moe_norm_in_router_max_tokens"] = 0
    if base == TRITON and wgmma_fit and values["attention"] == TRITON and "decode_wgmma_min_heads" not in over:
        values["decode_wgmma_min_heads"] = WGMMA_MIN_HEADS
    if (base == TRITON and values["decode_wgmma_min_heads"] and "decode_wgmma_seesaw" not in over
            and not values["decode_wgmma_producer"]):
        # H100, 128 heads: B 128 S 4096 302.0 us against the lockstep schedule's 401.4, B 32 92.2
        # against 114.2, B 8 level (RESULTS.md, "Issue 24: MLA decode kernels")
        values["decode_wgmma_seesaw"] = True
    if (base == TRITON and fp8_wgmma_fit and values["attention"] == TRITON and "decode_fp8_wgmma" not in over
            and not values["decode_qk_fp8"]):
        values["decode_fp8_wgmma"] = True
    if base == TRITON and hopper and values["attention"] == TRITON and "pdl_graph_max_batch" not in over:
        values["pdl_graph_max_batch"] = PDL_GRAPH_MAX_BATCH
    for key in ("finish_kv", "absorb"):
        if key not in over and values["attention"] == TORCH:
            values[key] = TORCH
    if "decode_fuse_q_kv" not in over and not values["absorb"] == values["finish_kv"] == TRITON:
        values["decode_fuse_q_kv"] = False  # nothing to fuse (asked for, the worker refuses it)
    plan = KernelPlan(**values)
    if plan.any_triton and not triton_ok:
        raise ValueError(f"--kernels / --attention-backend: Triton kernels ({plan.describe()}) need a "
                         f"CUDA device (or TRITON_INTERPRET=1 on the CPU, for tests)")
    return plan, notes


def kernels_help() -> str:
    """The --kernels help text, from CHOICES."""
    keys = "; ".join(f"{c.key}=" + ("N" if c.values[0] is int else "0|1" if c.values[0] is bool
                                    else "|".join(c.values)) + f" ({c.help}; triton: {c.triton_help or _show(c.triton)})"
                     for c in CHOICES)
    return ("kernel plan (logged at start-up): auto (triton on CUDA, torch elsewhere), triton, or "
            "torch (pure torch on any device: the reference), then optional comma-separated "
            f"key=value overrides: {keys}")

