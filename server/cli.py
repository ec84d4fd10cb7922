"""`serve`: start the engine and the OpenAI-compatible HTTP server (flag names follow vLLM)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import sys

from engine.args import EngineArgs

logger = logging.getLogger("server")

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)
             if f.default is not dataclasses.MISSING}


class _OneLineParser(argparse.ArgumentParser):
    """argparse, but a bad flag is one line on stderr (no usage dump), exit code 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The `serve` flags, each with help text; defaults come from EngineArgs."""
    d = _DEFAULTS
    p = _OneLineParser(prog="serve", description=(
        "Serve a DeepSeek MLA model (V2, V2-Lite, V3, R1) over the OpenAI completions and chat "
        "completions API, e.g. `serve --model DIR -tp 2` then point the openai client or "
        "`lm_eval --model local-completions` at http://HOST:PORT/v1."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d["model"],
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer "
                        "files). Defaults to the bundled tiny demo model.")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory, when it is not the model directory")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts must be token ids, completions carry "
                        "`token_ids` and empty text; /tokenize, /detokenize and /tokenizer_info "
                        "answer 400")
    g.add_argument("--served-model-name", default=None,
                   help="the name clients pass as `model`; defaults to the --model path")
    g.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default=d["load_format"],
                   help="weights to load; `dummy` fills random weights from config.json "
                        "(benchmarks without a checkpoint)")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32"], default=d["dtype"],
                   help="compute dtype; auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="JSON object merged into config.json, e.g. "
                        "'{\"num_hidden_layers\": 2}'")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + completion in tokens; default: the model's "
                        "max_position_embeddings")
    g = p.add_argument_group("parallelism and devices")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=d["tensor_parallel_size"],
                   help="number of tensor-parallel ranks (one process each; one GPU each on CUDA)")
    g.add_argument("-dcp", "--decode-context-parallel-size", type=int,
                   default=d["decode_context_parallel_size"],
                   help="ranks that share the KV cache by token inside each TP group (must "
                        "divide -tp); multiplies KV capacity")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default=d["device"],
                   help="where to run; auto: cuda when available, else cpu")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                   default=d["attention_backend"],
                   help="MLA kernels: torch reference or Triton; auto: triton on CUDA, torch on CPU")
    g.add_argument("--fp8-gemm", action="store_true",
                   help="FP8 checkpoints: keep attention and dense MLP projections in FP8 (Triton "
                        "W8A8 block GEMMs) and routed experts in FP8 instead of dequantizing them "
                        "at load (experimental: less memory, not yet faster; RESULTS.md)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs for decode steps")
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step N+1 while the GPU runs step N "
                        "(default: on with CUDA, off on the CPU)")
    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="token budget of one engine step; longer prompts are prefilled in chunks")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="most requests in one engine step")
    g.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV cache block (a power of two)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"],
                   help="fraction of GPU memory for weights + activations + KV cache (0, 1]")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="KV cache blocks to allocate; overrides the memory-based sizing")
    g.add_argument("--cpu-kv-cache-gb", type=float, default=d["cpu_kv_cache_gb"],
                   help="KV cache size on CPU when --num-kv-blocks is not given")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d["enable_prefix_caching"],
                   help="reuse KV blocks of prompts that share a prefix")
    g.add_argument("--seed", type=int, default=d["seed"],
                   help="seed of the engine's random state (requests may carry their own seed)")
    g = p.add_argument_group("multi-node (ranks split evenly over nodes; node 0 serves HTTP)")
    g.add_argument("--nnodes", type=int, default=d["nnodes"], help="number of machines")
    g.add_argument("--node-rank", type=int, default=d["node_rank"],
                   help="this machine's index; nodes other than 0 run workers only")
    g.add_argument("--master-addr", default=d["master_addr"],
                   help="address of node 0, reachable from every node")
    g.add_argument("--master-port", type=int, default=None,
                   help="free TCP port on node 0 for torch.distributed (required with --nnodes > 1)")
    g = p.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1",
                   help="address to listen on; 0.0.0.0 listens on all interfaces")
    g.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    g.add_argument("--api-key", default=None,
                   help="if set, /v1 routes require the header 'Authorization: Bearer KEY'")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="logging level of the server and engine (debug also logs each HTTP request)")
    return p


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; raises ValueError naming the flag."""
    try:
        overrides = json.loads(ns.hf_overrides) if ns.hf_overrides else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-overrides is not valid JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError("--hf-overrides must be a JSON object")
    args = EngineArgs(
        model=ns.model, tokenizer=ns.tokenizer, served_model_name=ns.served_model_name,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        tensor_parallel_size=ns.tensor_parallel_size,
        decode_context_parallel_size=ns.decode_context_parallel_size,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
        max_model_len=ns.max_model_len, block_size=ns.block_size, dtype=ns.dtype,
        device=ns.device, load_format=ns.load_format, num_kv_blocks=ns.num_kv_blocks,
        gpu_memory_utilization=ns.gpu_memory_utilization, cpu_kv_cache_gb=ns.cpu_kv_cache_gb,
        enable_prefix_caching=ns.enable_prefix_caching, seed=ns.seed,
        enforce_eager=ns.enforce_eager, async_scheduling=ns.async_scheduling, attention_backend=ns.attention_backend, fp8_gemm=ns.fp8_gemm,
        hf_overrides=overrides, nnodes=ns.nnodes, node_rank=ns.node_rank,
        master_addr=ns.master_addr, master_port=ns.master_port)
    if not 1 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {ns.port}")
    _check_devices(args)
    return args


def _check_devices(args: EngineArgs) -> None:
    if args.device == "cpu":
        return
    import torch  # late: `serve --help` stays fast

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and n == 0:
        raise ValueError("--device cuda: no CUDA device is visible")
    if n and args.device in ("cuda", "auto") and args.tensor_parallel_size > n:
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size} needs "
                         f"{args.tensor_parallel_size} CUDA devices, only {n} visible")


async def _serve(ns: argparse.Namespace, engine_args: EngineArgs) -> int:
    import uvicorn

    from engine.async_llm import AsyncLLM, EngineStartError
    from server.api_server import build_app

    # Built inside the running loop, so that the engine binds its output queues to this loop.
    try:
        engine = AsyncLLM(engine_args)
    except (ValueError, FileNotFoundError, OSError, EngineStartError) as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 1
    try:
        app = build_app(engine, ns)
        config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level,
                                access_log=ns.log_level == "debug", timeout_keep_alive=30,
                                backlog=2048)
        server = uvicorn.Server(config)
        logger.info("serving %s on http://%s:%d/v1", engine.model_name, ns.host, ns.port)
        await server.serve()
        return 0 if server.started else 1
    finally:
        engine.shutdown()


def _worker_node(args: EngineArgs) -> int:
    """A node other than 0: its ranks only, until node 0's engine stops them."""
    from engine.multiproc import run_worker_node
    from models.config import ModelConfig, check_parallel_layout

    try:
        cfg = ModelConfig.from_pretrained(args.model, args.hf_overrides)
        check_parallel_layout(cfg, args.tensor_parallel_size, args.decode_context_parallel_size)
        run_worker_node(args, cfg, cfg.eos_token_ids[:1])
    except (ValueError, RuntimeError) as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `serve` console script and `python -m server`."""
    ns = build_parser().parse_args(argv)
    logging.basicConfig(level=ns.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine_args = engine_args_from(ns)
    except ValueError as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    if engine_args.node_rank > 0:
        return _worker_node(engine_args)
    try:
        return asyncio.run(_serve(ns, engine_args))
    except KeyboardInterrupt:
        return 0
