"""`serve`'s flags (names follow vLLM): the parser, its checks, and the EngineArgs they give."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from common.args import DTYPE_ALIASES, KV_CACHE_DTYPES, EngineArgs
from common.hub import is_repo_id, resolve_model_dir
from common.kernel_plan import kernels_help
from server.api_servers import add_api_server_flags, check_api_server_count
from server.flag_parser import OneLineParser, model_len, token_count
from server.frontend_options import JSON_LIST, FrontendOptions, add_frontend_flags
from server.limits import ServerLimits
from server.overrides import load_chat_template, load_generation_defaults
from server.reasoning import check_parser_name
from server.responses_store import ResponseStore, add_responses_flags
from server.tls import check_ssl
from server.tool_calls import check_tool_flags
from server.vllm_flags import (add_vllm_flags, check_quantization, check_vllm_flags, compilation_config,
                               cuda_graph_sizes)

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineArgs)
             if f.default is not dataclasses.MISSING}
_LIMITS = ServerLimits()


def build_parser() -> argparse.ArgumentParser:
    """The `serve` flags, each with help text; defaults come from EngineArgs."""
    d = _DEFAULTS
    p = OneLineParser(prog="serve", description=(
        "Serve a DeepSeek MLA model (V2, V2-Lite, V3, R1) over the OpenAI completions and chat "
        "completions API, e.g. `serve --model DIR -tp 2` then point the openai client or "
        "`lm_eval --model local-completions` at http://HOST:PORT/v1."),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("model")
    g.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model directory, as `vllm serve MODEL` takes it (same as --model)")
    g.add_argument("--model", default=None,
                   help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer "
                        "files), or a Hub repository id such as deepseek-ai/DeepSeek-V2-Lite-Chat, "
                        "fetched into the Hub's cache as vLLM does (HF_HUB_OFFLINE=1: the cache "
                        "only). Defaults to the bundled tiny demo model.")
    g.add_argument("--revision", default=None,
                   help="with a repository id: the branch, tag or commit to fetch (default: main)")
    g.add_argument("--tokenizer-revision", default=None,
                   help="with a --tokenizer repository id: its branch, tag or commit")
    g.add_argument("--download-dir", default=None,
                   help="with a repository id: the cache directory to fetch into and read from "
                        "(default: the Hugging Face cache, HF_HOME)")
    g.add_argument("--hf-token", default=None,
                   help="with a repository id: the Hub token for gated or private repositories "
                        "(default: HF_TOKEN or the stored login)")
    g.add_argument("--trust-remote-code", action="store_true",
                   help="accepted for vLLM compatibility and ignored: the DeepSeek V2/V3 model "
                        "code is built in; no code from a model directory is ever run")
    g.add_argument("--tokenizer", default=None,
                   help="tokenizer directory (or Hub repository id), when it is not the model's")
    g.add_argument("--skip-tokenizer-init", action="store_true",
                   help="load no tokenizer: prompts must be token ids, completions carry "
                        "`token_ids` and empty text; /tokenize, /detokenize and /tokenizer_info "
                        "answer 400")
    g.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="the name(s) clients pass as `model`; with several, any is accepted and "
                        "the first is the one responses report; defaults to the --model directory's name "
                        "(the path is accepted as `model` too)")
    g.add_argument("--load-format", choices=["auto", "safetensors", "dummy"], default=d["load_format"],
                   help="weights to load; `dummy` fills random weights from config.json "
                        "(benchmarks without a checkpoint)")
    g.add_argument("--dtype", choices=["auto", "bfloat16", "float16", "float32", *DTYPE_ALIASES],
                   default=d["dtype"],
                   help="compute dtype (half = float16, bf16 = bfloat16, float = float32); "
                        "auto: bfloat16 on CUDA, float32 on CPU")
    g.add_argument("--hf-overrides", default=None, metavar="JSON",
                   help="JSON object merged into config.json, e.g. "
                        "'{\"num_hidden_layers\": 2}'")
    g.add_argument("--chat-template", default=None, metavar="FILE_OR_TEMPLATE",
                   help="Jinja chat template to use instead of the tokenizer's: a file path, or "
                        "the template itself (a value with {, } or a newline in it)")
    g.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="defaults of requests that do not set them (temperature, top_p, top_k, "
                        "min_p, repetition_penalty; max_new_tokens as max_tokens): auto reads the "
                        "model directory's generation_config.json, vllm uses none (the API's "
                        "defaults), DIR reads DIR/generation_config.json")
    g.add_argument("--override-generation-config", default=None, metavar="JSON",
                   help="request defaults as a JSON object of generation_config.json's keys "
                        "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens), "
                        "over those --generation-config reads, e.g. '{\"temperature\": 0.6}'")
    g.add_argument("--max-model-len", type=model_len, default=None,
                   help="longest prompt + completion in tokens, as a number or vLLM's "
                        "human-readable form (32k = 32000, 32K = 32768), or auto (or -1): the "
                        "model's limit cut to what the KV cache holds; default: the model's "
                        "max_position_embeddings")
    g = p.add_argument_group("parallelism and devices")
    g.add_argument("-tp", "--tensor-parallel-size", type=int, default=d["tensor_parallel_size"],
                   help="number of tensor-parallel ranks (one process each; one GPU each on CUDA)")
    g.add_argument("-dcp", "--decode-context-parallel-size", type=int,
                   default=d["decode_context_parallel_size"],
                   help="ranks that share the KV cache by token inside each TP group (must "
                        "divide -tp); multiplies KV capacity")
    g.add_argument("-ep", "--enable-expert-parallel", action=argparse.BooleanOptionalAction,
                   default=d["enable_expert_parallel"],
                   help="split the MoE layers' routed experts by expert over the -tp (x -dp) ranks (E / "
                        "(tp x dp) whole experts each) instead of splitting every expert; the shared experts "
                        "stay split")
    g.add_argument("-dp", "--data-parallel-size", type=int, default=d["data_parallel_size"],
                   help="data-parallel attention: this many groups of -tp ranks (dp x tp processes, one GPU "
                        "each on CUDA), each with its own requests and KV cache; the MoE layers are split over "
                        "all dp x tp ranks and run on every group's tokens (vLLM's -dp for DeepSeek; over "
                        "--nnodes too)")
    g.add_argument("--device", choices=["auto", "cuda", "cpu"], default=d["device"],
                   help="where to run; auto: cuda when available, else cpu")
    g.add_argument("--attention-backend", choices=["auto", "torch", "triton"],
                   default=d["attention_backend"],
                   help="MLA attention ops (decode, prefill, context gather, KV write): torch "
                        "reference or Triton; auto: as --kernels says (the plan's attention key)")
    # argparse formats help with %: the plan's measured figures carry percent signs
    g.add_argument("--kernels", default=d["kernels"], metavar="BASE[,KEY=VALUE...]",
                   help=kernels_help().replace("%", "%%"))
    g.add_argument("--fp8-gemm", action=argparse.BooleanOptionalAction, default=None,
                   help="FP8 checkpoints: keep attention and dense MLP projections in FP8 (W8A8 "
                        "block GEMMs) and the experts in FP8 instead of dequantizing them at load "
                        "(half the weight memory; R1's config decodes 1.3-1.6x faster at batch "
                        "1-128: RESULTS.md). Unset: kept in FP8 wherever the W8A8 kernels run (CUDA "
                        "with a Triton kernel plan), else dequantized; --no-fp8-gemm dequantizes")
    g.add_argument("--enforce-eager", action="store_true",
                   help="never capture CUDA graphs (decode steps, piecewise graphs of the others)")
    g.add_argument("--piecewise-graph-sizes", default=d["piecewise_graph_sizes"], metavar="SIZES",
                   help="steps with prompt tokens (and decode batches past the decode graphs): CUDA "
                        "graphs of the work between the attention cores, captured per token count "
                        "and replayed for steps of up to that many tokens (the padding rows' work is "
                        "dropped). auto: 128, 256 and multiples of 512 up to "
                        "--max-num-batched-tokens; none: eager; or comma-separated token counts")
    g.add_argument("--rank-check-interval", type=int, default=d["rank_check_interval"], metavar="N",
                   help="every N sampling steps the tensor-parallel ranks compare a digest of the "
                        "tokens each sampled (each rank samples for itself) and stop the engine "
                        "if they differ; 0: never")
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, as a JSON object: {"method": "ngram", '
                        '"num_speculative_tokens": k, "prompt_lookup_min": a, "prompt_lookup_max": b} '
                        '(drafts looked up in the prompt and output, any model) or {"method": "mtp", '
                        '"num_speculative_tokens": k} (the checkpoint\'s multi-token-prediction layer, '
                        'V3/R1); every decode then verifies up to k drafts in one step; turns async '
                        'scheduling off')
    g.add_argument("--profiler-config", default=None, metavar="JSON",
                   help='vLLM\'s profiler config, a JSON object: {"profiler": "torch", "torch_profiler_dir": '
                        'DIR} serves POST /start_profile and /stop_profile, between which every rank '
                        'records a torch.profiler trace (written to DIR at the stop, one a rank); '
                        '"profiler": "cuda" brackets the span with cudaProfilerStart/Stop for nsys; '
                        'keys torch_profiler_with_stack, _with_flops, _use_gzip, _dump_cuda_time_total, '
                        '_record_shapes, _with_memory, delay_iterations, max_iterations as vLLM\'s')
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="schedule and launch step N+1 while the GPU runs step N "
                        "(default: on with CUDA, off on the CPU)")
    g = p.add_argument_group("scheduler and KV cache")
    g.add_argument("--max-num-batched-tokens", type=token_count, default=d["max_num_batched_tokens"],
                   help="token budget of one engine step (8k = 8000, 8K = 8192); longer prompts "
                        "are prefilled in chunks")
    g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"],
                   help="most requests in one engine step")
    g.add_argument("--long-prefill-token-threshold", type=token_count,
                   default=d["long_prefill_token_threshold"], metavar="N",
                   help="a step prefills at most N tokens of one prompt, so that a long prompt "
                        "leaves room for others to start in each step (vLLM's; 0: the step's "
                        "--max-num-batched-tokens alone)")
    g.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default=d["scheduling_policy"],
                   help="fcfs: requests start in arrival order and the newest running one is "
                        "preempted first when the KV cache is full; priority: by each request's "
                        "`priority` (lower first), then arrival, and the lowest priority is "
                        "preempted first (vLLM's; with fcfs a request's priority must be 0)")
    g.add_argument("--block-size", type=int, default=d["block_size"],
                   help="tokens per KV cache block (a power of two)")
    g.add_argument("--gpu-memory-utilization", type=float, default=d["gpu_memory_utilization"],
                   help="fraction of GPU memory for weights + activations + KV cache (0, 1]")
    g.add_argument("--kv-cache-dtype", choices=list(KV_CACHE_DTYPES), default=d["kv_cache_dtype"],
                   help="latent KV cache storage: auto (the model dtype), bf16, or fp8 (e4m3 with a "
                        "per-tensor scale: half the bytes of bf16, twice the tokens; its decode is "
                        "slower than bf16's today, docs/kernel_notes.md); bfloat16 and fp8_e4m3 "
                        "are vLLM's aliases")
    g.add_argument("--num-kv-blocks", "--num-gpu-blocks-override", type=int, default=None,
                   help="KV cache blocks (of --block-size tokens) to allocate; overrides the "
                        "memory-based sizing (vLLM's name: --num-gpu-blocks-override)")
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
    g.add_argument("--config", metavar="FILE",
                   help="read flags from a YAML file of flag names and values (as vLLM's); "
                        "the command line's own flags win")
    g.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key file")
    g.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate file")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates file for client certificates")
    g.add_argument("--ssl-cert-reqs", type=int, choices=[0, 1, 2], default=0,
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's "
                        "ssl.CERT_NONE / CERT_OPTIONAL / CERT_REQUIRED)")
    g.add_argument("--root-path", default=None,
                   help="the path prefix a proxy serves this server under (FastAPI's root_path)")
    g.add_argument("--api-key", default=None,
                   help="if set, /v1 routes require the header 'Authorization: Bearer KEY'; "
                        "default: the VLLM_API_KEY environment variable, as in vLLM")
    g.add_argument("--log-level", choices=["debug", "info", "warning", "error"], default="info",
                   help="logging level of the server and engine (debug also logs each HTTP request)")
    g.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                   default=None, help="logging level of uvicorn alone; default: --log-level")
    g.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                   default=d["enable_log_requests"],
                   help="log each request at info level: its id, prompt length and sampling "
                        "parameters; at debug level (--log-level debug) also its prompt "
                        "(see --max-log-len)")
    g.add_argument("--disable-log-requests", action="store_true",
                   help="do not log requests (the default; vLLM's older spelling, kept so its "
                        "launch lines run)")
    g.add_argument("--allowed-origins", type=JSON_LIST, default=None, metavar="JSON",
                   help="CORS: allowed origins, a JSON list such as '[\"https://a.example\"]'; "
                        "given any CORS flag, the others default to [\"*\"] as in vLLM; none "
                        "given: no CORS headers")
    g.add_argument("--allowed-methods", type=JSON_LIST, default=None, metavar="JSON",
                   help="CORS: allowed methods, a JSON list such as '[\"GET\", \"POST\"]'")
    g.add_argument("--allowed-headers", type=JSON_LIST, default=None, metavar="JSON",
                   help="CORS: allowed request headers, a JSON list")
    g.add_argument("--allow-credentials", action="store_true",
                   help="CORS: allow credentials (cookies, Authorization) on cross-origin requests")
    g.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="split chat output at </think> into message.reasoning_content (and "
                        "reasoning) and content: deepseek_r1 (R1: all text before </think> is "
                        "reasoning), deepseek_v3 (V3.1+: the same when the request sends "
                        "chat_template_kwargs {\"thinking\": true}); default: no split")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="chat requests with tools (tool_choice \"auto\", the default with "
                        "tools) get the model's tool calls as message.tool_calls, parsed by "
                        "--tool-call-parser; without it such requests answer 400")
    g.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="the model's tool-call markup: deepseek_v3 (V3, R1) or deepseek_v31 "
                        "(V3.1 and later); tool_choice \"required\" or a named function "
                        "constrains the output to the tools' schemas with or without it")
    g.add_argument("--disable-fastapi-docs", action="store_true",
                   help="serve no /docs, /redoc or /openapi.json (served by default, as in vLLM)")
    g.add_argument("--shutdown-timeout", type=float, default=15.0,
                   help="on SIGTERM or SIGINT, seconds to let running requests finish before "
                        "the engine and its workers are stopped")
    add_api_server_flags(g)
    add_frontend_flags(p)
    add_responses_flags(p)
    add_vllm_flags(p)
    g = p.add_argument_group("limits (a shared server must not be held by one client)")
    lim = _LIMITS
    g.add_argument("--max-request-body-bytes", type=int, default=lim.max_request_body_bytes,
                   help="largest HTTP request body; larger ones get 413")
    g.add_argument("--max-inflight-body-bytes", type=int, default=lim.max_inflight_body_bytes,
                   help="bytes of request bodies being read at once over every connection (slow "
                        "senders hold theirs); a body that would pass it gets 503")
    g.add_argument("--http-header-timeout", type=float, default=lim.http_header_timeout,
                   help="seconds a connection may take to send its request line and headers "
                        "before it is closed")
    g.add_argument("--http-body-timeout", type=float, default=lim.http_body_timeout,
                   help="seconds a request may take to send its whole body (408 after)")
    g.add_argument("--http-keep-alive-timeout", type=float, default=lim.http_keep_alive_timeout,
                   help="seconds an idle kept-alive connection stays open")
    g.add_argument("--max-prompts-per-request", type=int, default=lim.max_prompts_per_request,
                   help="most prompts in one completions request")
    g.add_argument("--max-seqs-per-request", type=int, default=lim.max_seqs_per_request,
                   help="most sequences (prompts x n) in one request")
    g.add_argument("--max-stop-strings", type=int, default=lim.max_stop_strings,
                   help="most stop strings in one request")
    g.add_argument("--max-stop-str-len", type=int, default=lim.max_stop_str_len,
                   help="longest stop string, in characters")
    g.add_argument("--max-logprobs", type=int, default=lim.max_logprobs,
                   help=f"most alternatives per token a request may ask for (logprobs, "
                        f"top_logprobs, prompt_logprobs), in [0, {lim.max_logprobs}] (vLLM's flag)")
    g.add_argument("--max-prompt-logprob-entries", type=int, default=lim.max_prompt_logprob_entries,
                   help="most prompt logprob entries (prompt tokens x (alternatives + 1), a text "
                        "prompt counted by its UTF-8 bytes + 2) in one completions request with echo and "
                        "logprobs, or prompt_logprobs: the answer is built at once")
    g.add_argument("--max-response-logprob-entries", type=int, default=lim.max_response_logprob_entries,
                   help="most generated logprob entries (tokens x (alternatives + 1), over its choices) a "
                        "request answered whole (not streamed) may gather; past it the request stops "
                        "with a 400 naming this flag (a stream is not limited)")
    g.add_argument("--stream-stall-timeout", type=float, default=lim.stream_stall_timeout,
                   help="seconds a stream's outputs may wait unread (its client not reading) before "
                        "the request is aborted and what waits is dropped; the wait is bounded so "
                        "that the front end's memory is")
    g.add_argument("--engine-stall-timeout", type=float, default=lim.engine_stall_timeout,
                   help="/health answers 503 once the engine holds requests and has finished "
                        "no step for this many seconds (a wedged worker or collective)")
    return p


def api_key_from(flag: str | None) -> str | None:
    """--api-key, else the VLLM_API_KEY environment variable (vLLM's fallback), else none."""
    return flag or os.environ.get("VLLM_API_KEY") or None


def _check_limits(ns: argparse.Namespace) -> None:
    for flag in ("max_request_body_bytes", "max_inflight_body_bytes", "max_prompts_per_request", "max_seqs_per_request",
                 "max_stop_strings", "max_stop_str_len", "max_prompt_logprob_entries",
                 "max_response_logprob_entries"):
        if getattr(ns, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(ns, flag)}")
    if not 0 <= ns.max_logprobs <= _LIMITS.max_logprobs:
        raise ValueError(f"--max-logprobs must be in [0, {_LIMITS.max_logprobs}] (the engine's "
                         f"cap), got {ns.max_logprobs}")
    for flag in ("http_header_timeout", "http_body_timeout", "http_keep_alive_timeout",
                 "engine_stall_timeout", "stream_stall_timeout", "shutdown_timeout"):
        if not getattr(ns, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(ns, flag)}")


def graph_modes(ns: argparse.Namespace) -> tuple[bool, str]:
    """(enforce_eager, piecewise_graph_sizes) from the flags and --compilation-config's
    cudagraph_mode: NONE is --enforce-eager, FULL_DECODE_ONLY is --piecewise-graph-sizes none (a
    list of sizes given with it is an error naming both), FULL_AND_PIECEWISE changes nothing."""
    mode = compilation_config(ns).get("cudagraph_mode")
    piecewise = ns.piecewise_graph_sizes
    if mode == "FULL_DECODE_ONLY":
        if piecewise.strip().lower() not in ("auto", "none"):
            raise ValueError(f"--compilation-config cudagraph_mode FULL_DECODE_ONLY and --piecewise-graph-sizes "
                             f"{piecewise}: give one of them")
        piecewise = "none"
    return ns.enforce_eager or mode == "NONE", piecewise


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    """EngineArgs from parsed flags; raises ValueError naming the flag."""
    try:
        overrides = json.loads(ns.hf_overrides) if ns.hf_overrides else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--hf-overrides is not valid JSON: {e}") from None
    if not isinstance(overrides, dict):
        raise ValueError("--hf-overrides must be a JSON object")
    if ns.model_tag is not None and ns.model is not None and ns.model_tag != ns.model:
        raise ValueError(f"the model is named twice: {ns.model_tag} (positional) and --model {ns.model}")
    # the checks that read nothing first: a bad flag must not wait for a Hub download
    if not 1 <= ns.port <= 65535:
        raise ValueError(f"--port must be in [1, 65535], got {ns.port}")
    check_vllm_flags(ns)
    graph_sizes = cuda_graph_sizes(ns)
    enforce_eager, piecewise = graph_modes(ns)
    check_ssl(ns)
    check_parser_name(ns.reasoning_parser)
    check_tool_flags(ns.enable_auto_tool_choice, ns.tool_call_parser)
    _check_limits(ns)
    check_api_server_count(ns)
    FrontendOptions.from_args(ns)  # its checks: --max-log-len
    ResponseStore.from_args(ns)  # its checks: --responses-store-size, --responses-store-max-bytes
    model = ns.model_tag or ns.model or _DEFAULTS["model"]
    served = ns.served_model_name
    if is_repo_id(model):
        served = served or [model]  # vLLM's default name: the repository id as given
        model = resolve_model_dir(model, "--model", ns.revision, ns.download_dir, ns.hf_token,
                                  weights=ns.load_format != "dummy")
    tokenizer = ns.tokenizer
    if tokenizer is not None and not ns.skip_tokenizer_init:
        tokenizer = resolve_model_dir(tokenizer, "--tokenizer", ns.tokenizer_revision, ns.download_dir,
                                      ns.hf_token, weights=False)
    check_quantization(ns.quantization, model)
    args = EngineArgs(
        model=model, tokenizer=tokenizer, served_model_name=served,
        skip_tokenizer_init=ns.skip_tokenizer_init,
        tensor_parallel_size=ns.tensor_parallel_size,
        decode_context_parallel_size=ns.decode_context_parallel_size,
        enable_expert_parallel=ns.enable_expert_parallel, data_parallel_size=ns.data_parallel_size,
        max_num_batched_tokens=ns.max_num_batched_tokens, max_num_seqs=ns.max_num_seqs,
        long_prefill_token_threshold=ns.long_prefill_token_threshold,
        scheduling_policy=ns.scheduling_policy,
        max_model_len=ns.max_model_len, block_size=ns.block_size, dtype=ns.dtype,
        device=ns.device, load_format=ns.load_format, num_kv_blocks=ns.num_kv_blocks,
        gpu_memory_utilization=ns.gpu_memory_utilization, cpu_kv_cache_gb=ns.cpu_kv_cache_gb,
        enable_prefix_caching=ns.enable_prefix_caching, seed=ns.seed,
        enforce_eager=enforce_eager,
        piecewise_graph_sizes=piecewise, async_scheduling=ns.async_scheduling, attention_backend=ns.attention_backend,
        kernels=ns.kernels, fp8_gemm=ns.fp8_gemm, quantization=ns.quantization,
        kv_cache_dtype=ns.kv_cache_dtype,
        hf_overrides=overrides, rank_check_interval=ns.rank_check_interval,
        speculative_config=ns.speculative_config, profiler_config=ns.profiler_config,
        cuda_graph_sizes=graph_sizes,
        enable_log_requests=ns.enable_log_requests and not ns.disable_log_requests, nnodes=ns.nnodes, node_rank=ns.node_rank,
        master_addr=ns.master_addr, master_port=ns.master_port)
    load_chat_template(ns.chat_template)
    load_generation_defaults(ns.generation_config, args.model, ns.override_generation_config)
    _check_devices(args)
    return args


def _check_devices(args: EngineArgs) -> None:
    if args.device == "cpu":
        return
    import torch  # late: `serve --help` stays fast

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and n == 0:
        raise ValueError("--device cuda: no CUDA device is visible")
    ranks = args.tensor_parallel_size * args.data_parallel_size
    if n and args.device in ("cuda", "auto") and ranks > n:
        dp = f" x --data-parallel-size {args.data_parallel_size}" if args.data_parallel_size > 1 else ""
        raise ValueError(f"--tensor-parallel-size {args.tensor_parallel_size}{dp} needs "
                         f"{ranks} CUDA devices, only {n} visible")
