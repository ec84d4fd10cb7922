"""Typed DeepSeek-V2/V3 model config, built from an HF `config.json` in one place and validated."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


# --quantization fp8 on a checkpoint without FP8 weights: DeepSeek-V3's own format (e4m3, one
# fp32 scale per 128 x 128 block of each projection weight, activations quantized at run time),
# so the FP8 checkpoints' kernels and checks serve it unchanged
ONLINE_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
              "weight_block_size": [128, 128]}


@dataclass
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"  # "default" | "yarn"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    moe_intermediate_size: int = 0
    n_routed_experts: int | None = None  # None: a dense model
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    topk_method: str = "greedy"  # V2: greedy | group_limited_greedy; V3: noaux_tc
    scoring_func: str = "softmax"  # softmax (V2) | sigmoid (V3)
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    hidden_act: str = "silu"
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "bfloat16"
    num_nextn_predict_layers: int = 0
    quantization_config: dict | None = None
    # set by from_pretrained(quantization="fp8") for a checkpoint without FP8 weights: its
    # projection weights are quantized to ONLINE_FP8's blocks as they load (models/loader.py)
    quantized_at_load: bool = False

    # ---- derived quantities (notation of DESIGN.md §4) ----
    @property
    def qk_head_dim(self) -> int:  # P + R
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:  # Lkv + R
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim ** -0.5
        r = self.rope
        if r.type == "yarn" and r.mscale_all_dim:
            m = yarn_mscale(r.factor, r.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def fp8_block(self) -> tuple[int, int] | None:
        """Block shape of an FP8 block-quantized checkpoint, or None."""
        q = self.quantization_config
        if not q:
            return None
        return tuple(q.get("weight_block_size") or (128, 128))

    def packed_fp8_block(self, rows: list[int]) -> tuple[int, int] | None:
        """The FP8 block of a packed weight whose parts have `rows` rows on a rank: None, the
        compute dtype, for a checkpoint quantized at load whose parts but the last do not fill
        whole blocks (V2-Lite's dense MLP, 10944 = 85.5 x 128 rows of gate then up), which the
        W8A8 GEMM cannot pack; an FP8 checkpoint's stays FP8 (PackedLinear refuses what cannot)."""
        block = self.fp8_block
        if block is None or not self.quantized_at_load or not any(n % block[0] for n in rows[:-1]):
            return block
        return None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts is not None and layer_idx >= self.first_k_dense_replace
                and layer_idx % self.moe_layer_freq == 0)

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else [e] if isinstance(e, int) else list(e)

    # ---- construction ----
    @classmethod
    def from_dict(cls, d: dict, overrides: dict | None = None) -> "ModelConfig":
        d = {**d, **(overrides or {})}
        model_type = d.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: unsupported model_type {model_type!r}; "
                             f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        known = {f.name for f in fields(cls)} - {"rope", "quantized_at_load"}
        kw = {k: v for k, v in d.items() if k in known and v is not None}
        kw["model_type"] = model_type
        if "torch_dtype" not in kw and isinstance(d.get("dtype"), str):
            kw["torch_dtype"] = d["dtype"]
        if model_type == "deepseek_v3":
            kw.setdefault("scoring_func", "sigmoid")
            kw.setdefault("topk_method", "noaux_tc")
        kw["rope"] = _rope_from_dict(d)
        try:
            cfg = cls(**kw)
        except TypeError as e:
            raise ValueError(f"config.json: {e}") from None
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, overrides: dict | None = None,
                        quantization: str | None = None) -> "ModelConfig":
        """The model directory's config.json with `overrides` (--hf-overrides). `quantization`
        "fp8" (--quantization): a checkpoint in FP8 already is read as it is; any other gets
        ONLINE_FP8 as its quantization_config and is quantized as it loads."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in model directory {model_dir}")
        cfg = cls.from_dict(json.loads(path.read_text()), overrides)
        if quantization is None:
            return cfg
        if quantization != "fp8":
            raise ValueError(f"--quantization {quantization!r} is not supported (fp8)")
        q = cfg.quantization_config
        if not q:
            cfg.quantization_config, cfg.quantized_at_load = dict(ONLINE_FP8), True
        return cfg

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(f"config.json: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
            need(getattr(self, name) > 0, f"{name} must be > 0, got {getattr(self, name)}")
        need(self.qk_rope_head_dim % 2 == 0, f"qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")
        need(self.hidden_act == "silu", f"hidden_act {self.hidden_act!r} is not supported (only silu)")
        if self.n_routed_experts is not None:
            need(self.num_experts_per_tok >= 1, "num_experts_per_tok must be >= 1 for an MoE model")
            need(self.n_routed_experts % self.n_group == 0,
                 f"n_routed_experts {self.n_routed_experts} is not divisible by n_group {self.n_group}")
            need(self.scoring_func in ("softmax", "sigmoid"),
                 f"scoring_func {self.scoring_func!r} is not supported (softmax, sigmoid)")
            need(self.topk_method in ("greedy", "group_limited_greedy", "noaux_tc"),
                 f"topk_method {self.topk_method!r} is not supported")
            need(self.moe_layer_freq >= 1, f"moe_layer_freq must be >= 1, got {self.moe_layer_freq}")
        q = self.quantization_config
        if q:
            need(q.get("quant_method") == "fp8" and q.get("fmt", "e4m3") == "e4m3",
                 f"quantization_config {q} is not supported (only fp8 e4m3 block quantization)")
            need(len(q.get("weight_block_size") or (128, 128)) == 2, "weight_block_size must be [bn, bk]")
        need(self.rope.type in ("default", "yarn"),
             f"rope_scaling type {self.rope.type!r} is not supported (default, yarn)")


def check_parallel_layout(cfg: ModelConfig, tp: int, dcp: int, expert_parallel: bool = False, dp: int = 1) -> None:
    """Refuse a TP/DCP(/EP/DP) layout this model cannot be split into, naming the flag. The MoE
    layers are split over `tp * dp` ranks (every rank under data parallelism); with
    `expert_parallel` (over more than one rank) their routed experts by expert, each kept whole,
    and their shared experts (moe_intermediate_size x n_shared_experts units) by units."""
    if tp % dcp:
        raise ValueError(f"--decode-context-parallel-size {dcp} must divide --tensor-parallel-size {tp}")
    if cfg.num_attention_heads % tp:
        raise ValueError(f"--tensor-parallel-size {tp} must divide the model's "
                         f"{cfg.num_attention_heads} attention heads")
    moe_ranks = tp * dp
    flag = "--tensor-parallel-size" + (" x --data-parallel-size" if dp > 1 else "")
    ep = expert_parallel and moe_ranks > 1 and bool(cfg.n_routed_experts)
    if ep and cfg.n_routed_experts % moe_ranks:
        raise ValueError(f"--enable-expert-parallel: {flag} {moe_ranks} must divide the model's "
                         f"{cfg.n_routed_experts} routed experts")
    # what the MoE ranks split of the MoE layers: with EP only the shared experts' units
    moe_split = (("shared experts' units (moe_intermediate_size x n_shared_experts)",
                  (cfg.moe_intermediate_size or 0) * cfg.n_shared_experts) if ep else
                 ("moe_intermediate_size", cfg.moe_intermediate_size))
    for name, v, n, f in (("intermediate_size", cfg.intermediate_size, tp, "--tensor-parallel-size"),
                          (*moe_split, moe_ranks, flag)):
        if v and v % n:
            raise ValueError(f"{f} {n} must divide the model's {name} {v}")
    if cfg.fp8_block and moe_ranks > 1:
        H = cfg.num_attention_heads
        split = {"q_b_proj/q_proj rows": (H * cfg.qk_head_dim, tp),
                 "kv_b_proj rows": (H * (cfg.qk_nope_head_dim + cfg.v_head_dim), tp),
                 "o_proj columns": (H * cfg.v_head_dim, tp), "intermediate_size": (cfg.intermediate_size, tp),
                 moe_split[0]: (moe_split[1], moe_ranks)}
        for name, (v, n) in split.items():
            if v and (v // n) % cfg.fp8_block[0]:
                raise ValueError(f"{'--tensor-parallel-size' if n == tp else flag} {n} would split a "
                                 f"{cfg.fp8_block[0]}x{cfg.fp8_block[1]} FP8 block: {name} {v} gives {v // n} per rank")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_from_dict(d: dict) -> RopeConfig:
    # Old spelling: rope_theta + rope_scaling {type|rope_type, ...}; new: rope_parameters {rope_type, rope_theta, ...}.
    params = dict(d.get("rope_parameters") or {})
    scaling = d.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", d.get("rope_theta", 10000.0))
    rtype = params.get("rope_type", params.get("type", "default")) or "default"
    r = RopeConfig(theta=float(theta), type=rtype)
    if rtype == "yarn":
        r.factor = float(params["factor"])
        r.original_max_position_embeddings = int(params["original_max_position_embeddings"])
        r.beta_fast = float(params.get("beta_fast") or 32)
        r.beta_slow = float(params.get("beta_slow") or 1)
        r.mscale = float(params.get("mscale") or 1.0)
        r.mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    return r
