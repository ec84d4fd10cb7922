"""One rank's worker: device, model (loaded and sharded), KV cache, model runner."""

from __future__ import annotations

import logging
import random
import time

import torch

from attention.kv_quant import is_fp8, resolve_kv_cache_dtype
from common import distributed as pd
from common.args import EngineArgs, piecewise_graph_sizes
from common.kernel_plan import TRITON, KernelPlan, resolve_plan
from common.launch_settings import use_autotune, use_pdl
from common.triton_launch import use_fast_launch
from engine.model_runner import ModelRunner
from engine.weight_memory import resolve_fp8_gemm
from models.config import ModelConfig
from models.deepseek import DeepseekForCausalLM
from models.loader import init_dummy_weights, load_weights

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_device(args: EngineArgs, local_rank: int = 0) -> torch.device:
    if args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available")
    return torch.device("cuda", local_rank)


def resolve_dtype(args: EngineArgs, cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if args.dtype != "auto":
        return _DTYPES[args.dtype]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in bf16 are slow and lossy; tiny models are small
    return _DTYPES.get(cfg.torch_dtype, torch.bfloat16)


def make_kernel_plan(args: EngineArgs, cfg: ModelConfig, device: torch.device,
                     dtype: torch.dtype, cache_dtype: torch.dtype) -> KernelPlan:
    """The kernel plan for this rank: `--kernels` and `--attention-backend` on this device, dtype
    and KV-cache dtype."""
    plan, notes = resolve_plan(args.kernels, args.attention_backend, device.type, str(dtype).removeprefix("torch."),
                               hasattr(torch, "_grouped_mm"),
                               cfg.kv_lora_rank >= 16 and cfg.qk_rope_head_dim >= 16,
                               wgmma_fit(cfg, device, dtype, cache_dtype),
                               device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0),
                               fp8_wgmma_fit(cfg, device, dtype, cache_dtype, args.block_size))
    for note in notes:
        log.warning(note)
    return plan


def wgmma_fit(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether this rank's decodes fit the Gluon wgmma decode (the kernel plan's default
    decode_wgmma_min_heads): a CUDA device and attention/gluon_decode_plan.py's checks."""
    if device.type != "cuda":
        return False
    from attention.gluon_decode_plan import decode_heads_fit, engine_fit_problem
    heads = cfg.num_attention_heads // pd.tp().size * pd.dcp().size
    if not decode_heads_fit(heads):
        return False
    problem = engine_fit_problem(device, dtype, cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if problem is not None and pd.tp().rank == 0:
        log.info("the Gluon wgmma decode does not fit decodes of %d heads here: %s", heads, problem)
    return problem is None


def fp8_wgmma_problem(cfg: ModelConfig, device: torch.device, dtype: torch.dtype,
                      cache_dtype: torch.dtype, page: int) -> str | None:
    """Why this rank's decodes cannot run on the Gluon FP8-cache decode (the kernel plan's
    decode_fp8_wgmma), or None: a CUDA device and attention/gluon_decode_fp8_plan.py's checks."""
    if device.type != "cuda" or not is_fp8(cache_dtype):
        return "it needs a CUDA device and --kv-cache-dtype fp8"
    from attention.gluon_decode_fp8_plan import engine_fit_problem
    heads = cfg.num_attention_heads // pd.tp().size * pd.dcp().size
    return engine_fit_problem(device, dtype, cache_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim, heads, page)


def fp8_wgmma_fit(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype,
                  page: int) -> bool:
    """Whether the kernel plan's default decode_fp8_wgmma is on; where an FP8 cache on CUDA misses
    it, the reason is logged."""
    problem = fp8_wgmma_problem(cfg, device, dtype, cache_dtype, page)
    if problem is not None and device.type == "cuda" and is_fp8(cache_dtype) and pd.tp().rank == 0:
        log.info("the Gluon FP8-cache decode does not fit here: %s", problem)
    return problem is None


def warm_up_sizes(max_tokens: int) -> list[int]:
    """The powers of two up to `max_tokens`, and `max_tokens`: one step of each size meets every
    token bucket the autotuned kernels key on (Worker.warm_up)."""
    sizes = [1 << i for i in range(max_tokens.bit_length()) if 1 << i <= max_tokens]
    return sizes if sizes[-1] == max_tokens else sizes + [max_tokens]


def dummy_prompt_lens(num_tokens: int, max_len: int) -> list[int]:
    """`num_tokens` prompt tokens as sequences of at most `max_len` each, for the start-up passes
    (profile run, warm-up): a position past the model's context would index its RoPE table out of
    range (a 2048-token warm-up prompt on a 256-position model would)."""
    return [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])


def kv_cache_bytes_per_block(cfg: ModelConfig, block_size: int, cache_dtype: torch.dtype,
                             num_mtp_layers: int = 0) -> int:
    """Bytes of one block over all layers (and the MTP drafter's), in the cache's storage dtype
    (FP8: 1 byte a value)."""
    return (cfg.num_hidden_layers + num_mtp_layers) * block_size * cfg.kv_cache_dim * cache_dtype.itemsize


class Worker:
    """Builds everything one rank needs; `runner` is then driven by the engine core."""

    def __init__(self, args: EngineArgs, cfg: ModelConfig, local_rank: int = 0):
        self.args, self.cfg = args, cfg
        self.device = resolve_device(args, local_rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = resolve_dtype(args, cfg, self.device)
        self.cache_dtype = resolve_kv_cache_dtype(args.kv_cache_dtype, self.dtype)
        torch.manual_seed(args.seed)  # identical on every rank: unseeded sampling stays in lockstep
        self.plan = make_kernel_plan(args, cfg, self.device, self.dtype, self.cache_dtype)
        if pd.tp().rank == 0:
            log.info("%s", self.plan.describe())
        use_autotune(self.plan.autotune)
        hopper = self.device.type == "cuda" and torch.cuda.get_device_capability(self.device) >= (9, 0)
        for key in ("pdl", "pdl_graph_max_batch"):
            if getattr(self.plan, key) and not hopper:
                raise ValueError(f"--kernels ...,{key}={int(getattr(self.plan, key))}: programmatic dependent "
                                 f"launch needs an sm_90+ GPU (Hopper or newer), not {self.device}; leave {key} at 0")
        use_pdl(self.plan.pdl)
        use_fast_launch(self.plan.launch == "fast")
        for key in ("decode_wgmma_producer", "decode_wgmma_seesaw"):
            if getattr(self.plan, key) and not self.plan.decode_wgmma_min_heads:
                raise ValueError(f"--kernels ...,{key}=1 configures the Gluon decode, which this plan does "
                                 "not use (decode_wgmma_min_heads=0): set decode_wgmma_min_heads, or leave "
                                 f"{key} at 0")
        if self.plan.decode_wgmma_producer and self.plan.decode_wgmma_seesaw:
            raise ValueError("--kernels ...,decode_wgmma_producer=1,decode_wgmma_seesaw=1: two schedules of the "
                             "Gluon decode (the seesaw one has its own copy warpgroup); set one of them")
        if self.plan.decode_fp8_wgmma:
            problem = fp8_wgmma_problem(cfg, self.device, self.dtype, self.cache_dtype, args.block_size)
            if problem is None and self.plan.attention != TRITON:
                problem = f"it is an option of the Triton attention backend, this plan has attention={self.plan.attention}"
            if problem is not None:
                raise ValueError(f"--kernels ...,decode_fp8_wgmma=1: {problem}; leave decode_fp8_wgmma at 0")
            if self.plan.decode_qk_fp8:
                raise ValueError("--kernels ...,decode_qk_fp8=1 is an option of the Triton FP8 decode, which "
                                 "decode_fp8_wgmma=1 replaces: set one of them")
        if self.plan.decode_qk_fp8 and not is_fp8(self.cache_dtype):
            raise ValueError(f"--kernels ...,decode_qk_fp8=1 rounds q for QK^T over an FP8 latent cache; this one is "
                             f"{self.cache_dtype} (--kv-cache-dtype fp8, or leave decode_qk_fp8 at 0)")
        if self.plan.decode_fuse_q_kv and not self.plan.absorb == self.plan.finish_kv == TRITON:
            raise ValueError(f"--kernels ...,decode_fuse_q_kv=1 fuses the Triton absorb_q and kv_finish kernels; this "
                             f"plan has absorb={self.plan.absorb} finish_kv={self.plan.finish_kv} (leave "
                             f"decode_fuse_q_kv at 0)")
        if self.plan.decode_merge_in_absorb and not self.plan.attention == self.plan.absorb == TRITON:
            raise ValueError(f"--kernels ...,decode_merge_in_absorb=1 merges the Triton decode's splits in the Triton "
                             f"absorb_o kernel; this plan has attention={self.plan.attention} absorb={self.plan.absorb} "
                             f"(leave decode_merge_in_absorb at 0)")
        if self.plan.router_fused_max_tokens:
            n = self.plan.router_fused_max_tokens
            if self.plan.router != TRITON:
                raise ValueError(f"--kernels ...,router_fused_max_tokens={n} is an option of the Triton router; "
                                 f"this plan has router={self.plan.router} (leave it at 0)")
            from models.triton_route import fused_router_refusal, router_grouped
            why = ("it has none (a dense model)" if cfg.n_routed_experts is None else
                   fused_router_refusal(cfg.n_routed_experts,
                                        router_grouped(cfg.scoring_func, cfg.topk_method, cfg.n_group)))
            if why is not None:
                raise ValueError(f"--kernels ...,router_fused_max_tokens={n}: the one-launch router cannot serve "
                                 f"this model's router: {why}; leave router_fused_max_tokens at 0")
        if self.plan.moe_route_align_max_tokens and cfg.n_routed_experts is not None:
            from models.route_align import route_align_refusal
            from models.triton_route import router_grouped
            why = route_align_refusal(cfg.n_routed_experts, router_grouped(cfg.scoring_func, cfg.topk_method,
                                                                            cfg.n_group))
            if why is not None:
                raise ValueError(f"--kernels ...,moe_route_align_max_tokens={self.plan.moe_route_align_max_tokens}: "
                                 f"the one-launch choice and alignment cannot serve this model's router: {why}; "
                                 f"leave moe_route_align_max_tokens at 0")
        if self.plan.decode_wgmma_min_heads and self.plan.attention == TRITON:
            from attention.gluon_decode_plan import check_engine_fit
            check_engine_fit(self.plan.decode_wgmma_min_heads, self.device, self.dtype, self.cache_dtype,
                             cfg.kv_lora_rank, cfg.qk_rope_head_dim)
        spec = args.speculative_config
        self.num_mtp_layers = 1 if spec is not None and spec.method == "mtp" else 0  # drafts chain on it
        # unset: FP8 weights (a checkpoint's, or --quantization fp8's) kept where the W8A8 kernels
        # run (engine/weight_memory.py)
        requested = args.fp8_gemm
        if requested is None and args.quantization == "fp8":
            requested = self.device.type == "cuda" and self.plan.any_triton
            if not requested and pd.tp().rank == 0:
                log.info("--quantization fp8: no W8A8 kernels on %s with this kernel plan: the FP8 weights "
                         "are dequantized to %s at load", self.device, self.dtype)
        fp8_gemm = resolve_fp8_gemm(requested, cfg, self.dtype, self.device, self.plan.any_triton,
                                    args.gpu_memory_utilization, self.num_mtp_layers)
        if fp8_gemm and not self.plan.any_triton:
            raise ValueError("--fp8-gemm runs W8A8 GEMM kernels (Triton or cuBLAS): not with the pure-torch "
                             "kernel plan (--kernels torch, or auto off CUDA), which dequantizes FP8 weights")
        t0 = time.perf_counter()
        try:
            self._build_model(fp8_gemm)
        except torch.cuda.OutOfMemoryError as e:
            raise MemoryError(self._weights_oom_message(fp8_gemm)) from e
        log.info("model loaded in %.1f s: %s, dtype %s, KV cache %s, device %s",
                 time.perf_counter() - t0, cfg.model_type, self.dtype, self.cache_dtype, self.device)

    def _build_model(self, fp8_gemm: bool) -> None:
        """The model on this rank's device with its weights (a checkpoint's or dummy ones)."""
        args, cfg = self.args, self.cfg
        with torch.device(self.device):
            try:
                self.model = DeepseekForCausalLM(cfg, self.dtype, self.plan, keep_fp8=fp8_gemm,
                                                 num_mtp_layers=self.num_mtp_layers)
            except ImportError as e:  # a kernel module of the plan (triton missing or broken)
                raise self.plan.error("importing its module", e) from e
        if args.load_format == "dummy":
            init_dummy_weights(self.model, args.seed, storage_dtype=self.dtype)  # as a checkpoint in it
            for m in self.model.mtp:  # as the report has it: the main model's embedding and head
                m.share_missing(self.model.model.embed_tokens, self.model.lm_head,
                                {"embed_tokens.weight", "shared_head.head.weight"})
        else:
            load_weights(self.model, args.model, cfg)
        self.model.process_weights_after_loading()
        self.model.eval()

    def _weights_oom_message(self, fp8_gemm: bool) -> str:
        """What to do when the weights alone do not fit this rank's GPU: keep an FP8 checkpoint in
        FP8 (half the bytes of its dequantized copy), or split the weights over more ranks."""
        where = str(self.device)
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            where += (f" ({total / 2**30:.1f} GiB, {torch.cuda.memory_allocated(self.device) / 2**30:.1f} GiB "
                      f"allocated when it failed)")
        tp = self.args.tensor_parallel_size
        more_tp = f"a larger --tensor-parallel-size than {tp} splits them over more GPUs"
        if self.cfg.fp8_block is not None and not fp8_gemm:
            why = ("with --no-fp8-gemm" if self.args.fp8_gemm is False
                   else "by default where the W8A8 kernels do not run (the CPU, --kernels torch)")
            return (f"out of GPU memory loading the model's weights on {where}: this FP8 checkpoint is "
                    f"dequantized to {self.dtype} {why}; --fp8-gemm keeps its weights in FP8 (1 byte a "
                    f"weight instead of {self.dtype.itemsize}; on CUDA with a Triton kernel plan), or {more_tp}")
        return f"out of GPU memory loading the model's weights on {where}: {more_tp}"

    def determine_num_blocks(self, max_num_batched_tokens: int) -> int:
        """KV blocks this rank can hold: --num-kv-blocks, else GPU memory left after a profile
        run, else the CPU memory setting."""
        a = self.args
        per_block = kv_cache_bytes_per_block(self.cfg, a.block_size, self.cache_dtype, self.num_mtp_layers)
        if a.num_kv_blocks is not None:
            return a.num_kv_blocks
        if self.device.type == "cpu":
            return max(1, int(a.cpu_kv_cache_gb * 2**30) // per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        try:
            self._profile_run(max_num_batched_tokens)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any kernel failure stops start-up, naming the flag
            raise self.plan.error("in the profile run", e) from e
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        used_by_others = total - free - torch.cuda.memory_reserved()
        budget = total * a.gpu_memory_utilization - used_by_others - torch.cuda.max_memory_allocated()
        if self.piecewise_sizes():
            # the piecewise graphs' pool holds the same intermediates as an eager step of the
            # largest size, beside the regular pool: reserve the profile run's peak above what
            # was allocated before it (its activations and its small caches: a little more)
            budget -= torch.cuda.max_memory_allocated() - before
        if budget < per_block:
            raise ValueError(f"--gpu-memory-utilization {a.gpu_memory_utilization}: no memory left "
                             f"for the KV cache after loading the model")
        return int(budget // per_block)

    def _profile_run(self, num_tokens: int) -> None:
        """A forward pass over `num_tokens` prompt tokens to measure peak activation memory."""
        lens = dummy_prompt_lens(num_tokens, self.args.resolve_max_model_len(self.cfg))
        nblocks = sum(-(-n // self.args.block_size) for n in lens)
        caches = [torch.empty(nblocks, self.args.block_size, self.cfg.kv_cache_dim, dtype=self.cache_dtype,
                              device=self.device) for _ in range(self.cfg.num_hidden_layers)]
        runner = ModelRunner(self.model, self.cfg, caches, self.args.block_size, self.device, [])
        runner.logits(runner.forward(self._dummy_batch(runner, [[0] * n for n in lens], nblocks))[-1:])
        del caches, runner

    def _dummy_batch(self, runner: ModelRunner, prompts: list[list[int]], num_blocks: int):
        """A prefill batch of `prompts`, each from position 0, in consecutive blocks (ids wrap at
        `num_blocks`)."""
        bs, tables, first = self.args.block_size, [], 0
        for p in prompts:
            n = -(-len(p) // bs)
            tables.append([(first + i) % num_blocks for i in range(n)])
            first += n
        return runner.prepare(prompts, [0] * len(prompts), tables)

    @torch.inference_mode()
    def warm_up(self, max_tokens: int, max_len: int, max_seqs: int) -> list[int]:
        """One prefill step of each size in `warm_up_sizes(max_tokens)` through the model (prompts
        of at most `max_len` tokens), then decode steps, mixed steps of 8 and of up to 64 sequences
        (decodes beside chunks after cached tokens), with speculation multi-token decodes, and
        decodes over wide block tables, before
        any request and before CUDA-graph capture; returns the prefill sizes. A failure raises KernelError
        naming the --kernels setting that avoids it.

        Every path of the plan runs here: the MoE's by token count, the prefill attention with
        and without cached context, the decode attention. The autotuned Triton kernels (fused MoE, expert-sorted MoE, W8A8 GEMM) pick
        their tiles per power-of-two token bucket on first use, compiling and timing every
        candidate: seconds in which every running request would stall if a bucket were first met
        while serving. The prompts (random tokens: tiles are then tuned under spread routing, as
        in serving) write their cache rows into blocks no request holds yet, ids taken modulo the
        cache size so that even a small cache is never indexed out of range."""
        t0 = time.perf_counter()
        runner = ModelRunner(self.model, self.cfg, self.kv_caches, self.args.block_size, self.device, [],
                             speculative_config=self.args.speculative_config)
        sizes = warm_up_sizes(max_tokens)
        rng = random.Random(0)  # varied tokens route to varied experts, as real prompts do
        num_blocks = self.kv_caches[0].shape[0]
        try:
            for n in sizes:
                prompts = [[rng.randrange(self.cfg.vocab_size) for _ in range(k)]
                           for k in dummy_prompt_lens(n, max_len)]
                runner.forward(self._dummy_batch(runner, prompts, num_blocks))
            # b prompts of 2 tokens, then a decode step (one more token each), then mixed steps of
            # 8 and of b sequences: some decode again (half, or all but one), the rest a chunk of `chunk` tokens
            # after their 3 cached ones (a prefill with context: the context gather, the context
            # attention and the merge); then, with speculation, a step of decodes of `q` tokens
            # each (multi-token decode); then two decodes whose block tables are wide (the decode
            # attention splits its keys).
            # Up to 64 sequences: each of the absorb kernels' tile sets (by decode rows), as serving's
            # eager mixed steps take them; a variant first met while serving compiles with every
            # request waiting.
            q = runner.decode_threshold
            chunk = q + 1  # the shortest chunk that is a prefill, not a decode
            b = min(64, max_seqs, max_tokens // max(2, chunk))
            if b and max_len > 3 + chunk:
                v = self.cfg.vocab_size
                bs = self.args.block_size
                nb = -(-(3 + chunk) // bs)
                tables = [[(i * nb + j) % num_blocks for j in range(nb)] for i in range(b)]
                prompts = [[rng.randrange(v) for _ in range(2)] for _ in range(b)]
                runner.forward(runner.prepare(prompts, [0] * b, tables))
                runner.forward(runner.prepare([[p[0]] for p in prompts], [2] * b, tables))
                # decodes beside chunks: 4, b // 2 (up to 32) and b - 1 (up to 63): the absorb kernels'
                # tiles change at 16 decode rows (absorb_o) and at 32 (absorb_q)
                for n, d in sorted({(min(8, b), min(8, b) // 2), (b, b // 2), (b, b - 1)}):
                    mixed = [[rng.randrange(v)] if i < d else [rng.randrange(v) for _ in range(chunk)]
                             for i in range(n)]
                    runner.forward(runner.prepare(mixed, [3] * n, tables[:n]))
                if q > 1:
                    runner.forward(runner.prepare([[rng.randrange(v) for _ in range(q)] for _ in range(b)],
                                                  [3] * b, tables))
                wide = max(nb, min(max_len, 1024) // bs)  # blocks past a sequence's end are never read
                w = min(2, b)
                runner.forward(runner.prepare([[rng.randrange(v)] for _ in range(w)], [3] * w,
                                              [t + [t[0]] * (wide - nb) for t in tables[:w]]))
            if self.device.type == "cuda":
                torch.cuda.synchronize()
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - any kernel failure stops start-up, naming the flag
            raise self.plan.error("warming up", e) from e
        log.info("warm-up: prompts of %s tokens, decode and mixed steps in %.1f s",
                 ", ".join(map(str, sizes)), time.perf_counter() - t0)
        return sizes

    def init_kv_cache(self, num_blocks: int, eos_token_ids: list[int], max_model_len: int) -> None:
        a = self.args
        bs = a.block_size
        alloc = torch.zeros if self.device.type == "cpu" else torch.empty
        self.kv_caches = [alloc(num_blocks, bs, self.cfg.kv_cache_dim, dtype=self.cache_dtype, device=self.device)
                          for _ in range(self.cfg.num_hidden_layers)]
        # the MTP drafter's own layer caches, on the same block ids as the model's
        mtp_caches = [alloc(num_blocks, bs, self.cfg.kv_cache_dim, dtype=self.cache_dtype, device=self.device)
                      for _ in range(self.num_mtp_layers)]
        per_token = kv_cache_bytes_per_block(self.cfg, 1, self.cache_dtype, self.num_mtp_layers)
        log.info("KV cache on this rank: %s, %d bytes per token (all layers), %d blocks of %d = %d tokens, %.2f GiB",
                 str(self.cache_dtype).removeprefix("torch."), per_token, num_blocks, bs, num_blocks * bs,
                 num_blocks * bs * per_token / 2**30)
        argmax = None
        if self.plan.argmax == TRITON:  # (triton: CUDA installs only)
            from common.triton_argmax import argmax_rows as argmax
        self.runner = ModelRunner(self.model, self.cfg, self.kv_caches, bs, self.device, eos_token_ids,
                                  rank_check_interval=a.rank_check_interval, speculative_config=a.speculative_config,
                                  mtp_kv_caches=mtp_caches, argmax=argmax)
        if argmax is not None:  # compiled now, not at the first greedy request (one variant for every batch)
            argmax(torch.zeros(2, self.cfg.vocab_size, device=self.device))
        if self.plan.warmup:
            self.warm_up(a.max_num_batched_tokens, max_model_len, a.max_num_seqs)
        # The torch reference ops sync with the host (lengths to Python): they cannot be captured.
        if self.device.type == "cuda" and not a.enforce_eager and self.plan.attention != "torch":
            from engine.cuda_graph import DecodeGraphs, default_buckets
            blocks_per_seq = -(-max_model_len // (bs * a.decode_context_parallel_size))
            spec = a.speculative_config
            q_lens = (1,) if spec is None else (1, spec.decode_threshold)
            self.runner.graphs = DecodeGraphs(self.model, self.kv_caches, blocks_per_seq,
                                              default_buckets(a.max_num_seqs, a.cuda_graph_sizes), self.device, q_lens,
                                              pdl_max_batch=self.plan.pdl_graph_max_batch)
            try:
                self.runner.graphs.capture()
                if self.num_mtp_layers and a.data_parallel_size == 1:  # under DP it runs eagerly (mtp_drafter.py)
                    self.runner.mtp_graphs = self._mtp_graphs(blocks_per_seq, mtp_caches[0])
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception as e:  # noqa: BLE001
                raise self.plan.error("capturing decode CUDA graphs (--enforce-eager avoids them)", e) from e
            sizes = self.piecewise_sizes()
            if sizes:
                from engine.piecewise_graph import PiecewiseGraphs
                self.runner.piecewise = PiecewiseGraphs(self.model, self.kv_caches, sizes, self.device, self.dtype)
                try:
                    self.runner.piecewise.capture()
                except torch.cuda.OutOfMemoryError:
                    raise
                except Exception as e:  # noqa: BLE001
                    raise self.plan.error("capturing piecewise CUDA graphs (--piecewise-graph-sizes none or "
                                          "--enforce-eager avoids them)", e) from e

    def graph_sizes(self) -> tuple[list[int], list[int]]:
        """(decode batch sizes, piecewise token counts) captured (engine/data_parallel.py pads to them)."""
        r = self.runner
        return (list(r.graphs.buckets) if r.graphs is not None and 1 in r.graphs.q_lens else [],
                list(r.piecewise.sizes) if r.piecewise is not None else [])

    def piecewise_sizes(self) -> list[int]:
        """The token counts whose piecewise CUDA graphs this rank captures (engine/piecewise_graph.py):
        none without CUDA graphs (--enforce-eager, no CUDA, the torch attention ops, which sync with
        the host), none with moe_large=loop (it reads expert counts on the host)."""
        a = self.args
        if (self.device.type != "cuda" or a.enforce_eager or self.plan.attention == "torch"
                or self.plan.moe_large == "loop" or not self.cfg.num_hidden_layers):
            return []
        return piecewise_graph_sizes(a.piecewise_graph_sizes, a.max_num_batched_tokens)

    def _mtp_graphs(self, blocks_per_seq: int, cache: torch.Tensor):
        """CUDA graphs of the MTP drafter's layer for 1 .. 1 + k rows per request (engine/mtp_drafter.py)."""
        from engine.cuda_graph import DecodeGraphs, default_buckets
        from engine.mtp_drafter import MTPStep
        spec = self.args.speculative_config
        step = MTPStep(self.model.mtp[0], self.model.model.rotary_emb)
        graphs = DecodeGraphs(step, cache, blocks_per_seq, default_buckets(self.args.max_num_seqs, self.args.cuda_graph_sizes), self.device,
                              tuple(range(1, spec.decode_threshold + 1)), hidden=(self.cfg.hidden_size, self.dtype))
        graphs.capture("MTP drafter")
        return graphs
