"""Engine knobs (separate from model hyperparameters, STYLE.md rule 7), shared by `LLM` and `serve`."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from common.kernel_plan import parse_kernels
from scheduler.config import SCHEDULING_POLICIES

# vLLM's spellings of --dtype that name one of ours
DTYPE_ALIASES = {"half": "float16", "bf16": "bfloat16", "float": "float32"}
# --kv-cache-dtype values and vLLM's aliases -> our names (attention/kv_quant.py)
KV_CACHE_DTYPES = {"auto": "auto", "bf16": "bf16", "bfloat16": "bf16", "fp8": "fp8", "fp8_e4m3": "fp8"}

DEFAULT_MODEL = str(Path(__file__).resolve().parent.parent / "configs" / "models" / "tiny-deepseek-v3")


def json_object(value: dict | str, flag: str) -> dict:
    """A JSON-object flag's value (`--speculative-config`, `--profiler-config`), as text or a
    dict; ValueError naming the flag."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def default_piecewise_sizes(max_tokens: int) -> list[int]:
    """128, 256, then multiples of 512 up to `max_tokens` (and `max_tokens` itself): a step of T
    tokens replays the smallest size >= T, so from 512 tokens on it pads fewer than 512 rows, and
    a step that fills the token budget (the steady state of a prefill-heavy load) none."""
    sizes = [s for s in (128, 256) if s < max_tokens] + list(range(512, max_tokens + 1, 512))
    return sizes if sizes and sizes[-1] == max_tokens else sizes + [max_tokens]


def piecewise_graph_sizes(spec: str, max_tokens: int) -> list[int]:
    """`--piecewise-graph-sizes`: "auto" (`default_piecewise_sizes`), "none", or comma-separated token
    counts, each 1..max_num_batched_tokens."""
    s = spec.strip().lower()
    if s == "auto":
        return default_piecewise_sizes(max_tokens)
    if s in ("none", "0", ""):
        return []
    try:
        sizes = sorted({int(x) for x in s.split(",")})
    except ValueError:
        raise ValueError(f"--piecewise-graph-sizes {spec!r}: expected auto, none or comma-separated token "
                         f"counts") from None
    bad = [n for n in sizes if not 1 <= n <= max_tokens]
    if bad:
        raise ValueError(f"--piecewise-graph-sizes: {bad} outside 1..{max_tokens} (--max-num-batched-tokens: a "
                         f"step never holds more tokens)")
    return sizes


@dataclass
class EngineArgs:
    model: str = DEFAULT_MODEL
    tokenizer: str | None = None  # defaults to `model`
    served_model_name: str | list[str] | None = None  # several: all accepted, the first reported
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts in, token ids out (no text)
    tensor_parallel_size: int = 1
    decode_context_parallel_size: int = 1
    # vLLM's --enable-expert-parallel: the MoE layers' routed experts split by expert over the TP
    # ranks (E / tp whole experts each) instead of every expert split tp ways; no-op at -tp 1
    enable_expert_parallel: bool = False
    # vLLM's --data-parallel-size: this many TP groups, each with its own requests and KV cache
    # (data-parallel attention), their MoE layers split over all dp * tp ranks (engine/data_parallel.py)
    data_parallel_size: int = 1
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # most tokens of one request's prompt a step prefills (0: the step's budget alone)
    long_prefill_token_threshold: int = 0
    # fcfs: admission in arrival order, the newest running request preempted first; priority:
    # by (priority, arrival), the lowest priority preempted first (vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"
    # None: the model's max_position_embeddings; "auto": that, cut to what the KV cache holds
    max_model_len: int | str | None = None
    block_size: int = 16
    dtype: str = "auto"  # auto | bfloat16 | float16 | float32 (or an alias in DTYPE_ALIASES)
    device: str = "auto"  # auto | cuda | cpu
    load_format: str = "auto"  # auto | safetensors | dummy
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_kv_cache_gb: float = 1.0  # KV cache size on CPU when num_kv_blocks is not given
    enable_prefix_caching: bool = True
    seed: int = 0
    enforce_eager: bool = False
    # steps that are not captured pure-decode batches: CUDA graphs of the work between attention
    # cores per token count (engine/piecewise_graph.py): "auto", "none" or "N,N,..."
    piecewise_graph_sizes: str = "auto"
    # decode batch sizes captured as CUDA graphs (--cuda-graph-sizes); None: engine/cuda_graph.py's
    # default_buckets. Sizes above max_num_seqs are left out.
    cuda_graph_sizes: tuple[int, ...] | None = None
    # schedule and launch step N+1 while step N runs; None: on when the model runs on CUDA
    async_scheduling: bool | None = None
    attention_backend: str = "auto"  # auto | torch | triton: the kernel plan's attention key
    # the kernel plan: auto | triton | torch, then key=value overrides (common/kernel_plan.py)
    kernels: str = "auto"
    # every N sampling steps the TP ranks compare digests of their sampled ids; 0: never
    rank_check_interval: int = 256
    # FP8 checkpoints: W8A8 block GEMMs on the FP8 weights (True) or dequantized weights (False);
    # None: FP8 kept only where the dequantized weights would not fit (engine/weight_memory.py)
    fp8_gemm: bool | None = None
    # "fp8" (vLLM's --quantization): the weights run in FP8, the checkpoint's own or, for one
    # without, quantized to 128 x 128 blocks as they load (models/config.py ONLINE_FP8); FP8 is
    # then kept (fp8_gemm) where the W8A8 kernels run, unless fp8_gemm says otherwise
    quantization: str | None = None
    # latent cache storage: auto (the model dtype) | bf16 | fp8 (e4m3, per-tensor scale); vLLM's
    # aliases bfloat16 and fp8_e4m3 are accepted (attention/kv_quant.py)
    kv_cache_dtype: str = "auto"
    hf_overrides: dict = field(default_factory=dict)
    # speculative decoding, vLLM's JSON: {"method": "ngram" | "mtp", "num_speculative_tokens": k,
    # "prompt_lookup_min": a, "prompt_lookup_max": b}; parsed into engine.spec_decode.SpeculativeConfig
    speculative_config: object = None
    # vLLM's --profiler-config JSON, parsed into engine.profiler.ProfilerConfig (None: off)
    profiler_config: object = None
    enable_log_requests: bool = False  # log each request's id, prompt length and parameters
    # multi-node: ranks are split evenly over nodes; node 0 runs the engine and the HTTP server
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: a free port (single node only)

    def __post_init__(self) -> None:
        if isinstance(self.hf_overrides, str):
            self.hf_overrides = json.loads(self.hf_overrides)
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        from engine.spec_decode import SpeculativeConfig
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        from engine.profiler import ProfilerConfig
        self.profiler_config = ProfilerConfig.parse(self.profiler_config)
        if isinstance(self.served_model_name, (list, tuple)):
            self.served_model_name = list(self.served_model_name) or None
        self.validate()

    def validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        need(self.load_format == "dummy" or os.path.isdir(self.model),
             f"--model: no such model directory: {self.model}")
        need(self.tensor_parallel_size >= 1, f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}")
        need(self.decode_context_parallel_size >= 1,
             f"--decode-context-parallel-size must be >= 1, got {self.decode_context_parallel_size}")
        need(self.tensor_parallel_size % self.decode_context_parallel_size == 0,
             f"--decode-context-parallel-size {self.decode_context_parallel_size} must divide "
             f"--tensor-parallel-size {self.tensor_parallel_size}")
        need(self.data_parallel_size >= 1, f"--data-parallel-size must be >= 1, got {self.data_parallel_size}")
        need(self.max_num_batched_tokens >= 1,
             f"--max-num-batched-tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.max_num_seqs >= 1, f"--max-num-seqs must be >= 1, got {self.max_num_seqs}")
        need(self.scheduling_policy in SCHEDULING_POLICIES,
             f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}")
        need(self.long_prefill_token_threshold >= 0,
             f"--long-prefill-token-threshold must be >= 0, got {self.long_prefill_token_threshold}")
        need(self.cuda_graph_sizes is None or (len(self.cuda_graph_sizes) > 0 and min(self.cuda_graph_sizes) >= 1),
             f"--cuda-graph-sizes: expected sizes >= 1, got {self.cuda_graph_sizes}")
        need(self.cuda_graph_sizes is None or min(self.cuda_graph_sizes) <= self.max_num_seqs,
             f"--cuda-graph-sizes: every size is above --max-num-seqs {self.max_num_seqs} (no decode "
             "batch is larger): give one at or below it")
        need(self.block_size >= 1 and self.block_size & (self.block_size - 1) == 0,
             f"--block-size must be a power of two, got {self.block_size}")
        need(self.dtype in ("auto", "bfloat16", "float16", "float32"), f"--dtype: unknown dtype {self.dtype!r}")
        need(self.device in ("auto", "cuda", "cpu"), f"--device: unknown device {self.device!r}")
        need(self.load_format in ("auto", "safetensors", "dummy"), f"--load-format: unknown format {self.load_format!r}")
        need(self.attention_backend in ("auto", "torch", "triton"),
             f"--attention-backend: unknown backend {self.attention_backend!r}")
        parse_kernels(self.kernels)  # ValueError naming --kernels
        piecewise_graph_sizes(self.piecewise_graph_sizes, self.max_num_batched_tokens)  # ValueError naming the flag
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"--kv-cache-dtype: unknown value {self.kv_cache_dtype!r}; expected one of "
             f"{', '.join(KV_CACHE_DTYPES)}")
        need(0 < self.gpu_memory_utilization <= 1,
             f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        need(self.cpu_kv_cache_gb > 0 and math.isfinite(self.cpu_kv_cache_gb),
             f"--cpu-kv-cache-gb must be a positive number, got {self.cpu_kv_cache_gb}")
        # torch.manual_seed's range (a uint64 or a negative int64)
        need(-(1 << 63) <= self.seed < (1 << 64), f"--seed must be in [-2**63, 2**64), got {self.seed}")
        ranks = self.tensor_parallel_size * max(self.data_parallel_size, 1)
        need(self.nnodes >= 1 and ranks % self.nnodes == 0,
             f"--nnodes {self.nnodes} must divide --tensor-parallel-size {self.tensor_parallel_size}"
             + (f" x --data-parallel-size {self.data_parallel_size}" if self.data_parallel_size > 1 else ""))
        need(0 <= self.node_rank < self.nnodes, f"--node-rank must be in [0, {self.nnodes}), got {self.node_rank}")
        need(self.nnodes == 1 or self.master_port is not None, "--master-port is required with --nnodes > 1")
        need(self.async_scheduling is None or isinstance(self.async_scheduling, bool),
             f"async_scheduling must be a bool or None (auto), got {self.async_scheduling!r}")
        need(self.fp8_gemm is None or isinstance(self.fp8_gemm, bool),
             f"fp8_gemm must be a bool or None (auto), got {self.fp8_gemm!r}")
        need(self.quantization in (None, "fp8"),
             f"--quantization {self.quantization!r} is not supported (fp8, or leave it out)")
        need(not (self.speculative_config is not None and self.async_scheduling),
             "--async-scheduling cannot be combined with --speculative-config: the next step's "
             "inputs depend on how many drafts this step accepts; leave --async-scheduling unset")
        need(self.rank_check_interval >= 0,
             f"--rank-check-interval must be >= 0, got {self.rank_check_interval}")
        need(self.max_model_len in (None, "auto") or (
             isinstance(self.max_model_len, int) and self.max_model_len >= 1),
             f"--max-model-len must be >= 1 or auto, got {self.max_model_len!r}")

    def resolve_max_model_len(self, cfg) -> int:
        """--max-model-len, or the model's max_position_embeddings (which it may not exceed).
        Under `auto` this is the upper bound the KV cache is sized and profiled for; the engine
        core cuts it to the cache's capacity (`fit_max_model_len`)."""
        limit = cfg.max_position_embeddings
        if self.max_model_len in (None, "auto"):
            return limit
        if self.max_model_len > limit:
            raise ValueError(f"--max-model-len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        return self.max_model_len

    def fit_max_model_len(self, cfg, capacity_tokens: int) -> int:
        """The served max_model_len once the KV cache is sized: `auto` takes the longest request
        the cache holds (vLLM's `--max-model-len auto`), any other setting is unchanged."""
        limit = self.resolve_max_model_len(cfg)
        return min(limit, capacity_tokens) if self.max_model_len == "auto" else limit

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.model

    @property
    def model_name(self) -> str:
        """What responses report as `model`: the first --served-model-name, else the name of the
        --model directory (never its path: the name is echoed in responses and errors)."""
        return self.model_names[0]

    @property
    def model_names(self) -> list[str]:
        """Every name a request may pass as `model`; the first is the one reported."""
        if isinstance(self.served_model_name, list):
            return list(self.served_model_name)
        if self.served_model_name:
            return [self.served_model_name]
        return [os.path.basename(os.path.normpath(self.model)) or self.model]


_HUMAN_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")


def human_readable_int(value: str) -> int:
    """A token count as vLLM's CLI reads it: a plain integer, or a number with a suffix, lower
    case decimal (32k = 32,000; 1.5m = 1,500,000) and upper case binary (32K = 32,768; whole
    numbers only)."""
    value = value.strip()
    m = _HUMAN_INT.fullmatch(value)
    if m is None:
        return int(value)  # ValueError for anything else; argparse names the flag
    number, suffix = m.groups()
    power = "kmgt".index(suffix.lower()) + 1
    if suffix.islower():
        return int(float(number) * 1000 ** power)
    if "." in number:
        raise ValueError(f"{value!r}: binary suffixes ({suffix}) take whole numbers; "
                         f"did you mean {number}{suffix.lower()}?")
    return int(number) * 1024 ** power

