"""vLLM's engine flags that a vLLM launch line carries, on the `serve` parser: those that ask for
what this server does anyway (accepted, any other value an error naming the flag), the CUDA-graph
capture sizes (--cuda-graph-sizes, --max-cudagraph-capture-size) and --quantization, which
names the checkpoint's own FP8 quantization.
"""

from __future__ import annotations

import argparse
import json
import os


class BooleanOptional:
    """Marks a no-op flag of `VLLM_NOOPS` read as --flag / --no-flag."""


# (flags, bool (a switch) | BooleanOptional (must not be turned off) | (type, the one value; None:
# any value), help)
VLLM_NOOPS = [
    ("--enable-chunked-prefill", BooleanOptional,
     "chunked prefill is always on (prompts longer than --max-num-batched-tokens are prefilled in "
     "chunks); --no-enable-chunked-prefill is an error"),
    ("-pp|--pipeline-parallel-size", (int, 1), "only 1: no pipeline parallelism (use -tp / -dcp)"),
    ("-dp|--data-parallel-size", (int, 1),
     "only 1: one engine per server (run a server per GPU group behind a load balancer)"),
    ("--distributed-executor-backend", (str, "mp"), "only mp: the ranks are worker processes"),
    ("--tokenizer-mode", (str, "auto"), "only auto: the Hugging Face tokenizer of the model"),
    ("--disable-log-stats", bool, "accepted: this server logs no periodic stats (they are on /metrics)"),
    ("--disable-custom-all-reduce", bool,
     "accepted: the tensor-parallel ranks all-reduce through NCCL only (there is no custom all-reduce)"),
    ("--disable-cascade-attn", bool, "accepted: there is no cascade attention here"),
    ("--swap-space", (float, None),
     "accepted, any value: nothing is swapped to CPU memory; a preempted request is recomputed"),
    ("--max-seq-len-to-capture", (int, None),
     "accepted, any value: the decode CUDA graphs serve every context length up to --max-model-len"),
]


def add_vllm_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("vLLM engine flags (accepted so that vLLM launch lines run; a value "
                             "this server cannot honour is an error naming the flag)")
    g.add_argument("-q", "--quantization", choices=["fp8"], default=None,
                   help="fp8: the weights run in FP8 (W8A8 GEMMs where the kernel plan has them, as "
                        "--fp8-gemm): an FP8 checkpoint's own (DeepSeek-V3/R1's blocks, read as FP8 "
                        "whether given or not), or a bf16 checkpoint's quantized as they load to the "
                        "same format (e4m3, one scale per 128 x 128 block; scripts/quantize_fp8.py "
                        "writes it to disk); --no-fp8-gemm dequantizes them again")
    g.add_argument("--cuda-graph-sizes", type=int, nargs="+", default=None, metavar="N",
                   help="decode batch sizes (sequences; each captured for every query length "
                        "speculative decoding uses, where vLLM counts tokens) captured as CUDA "
                        "graphs: one value N means 1, 2, 4 and every multiple of 8 up to N, as in "
                        "vLLM; several are the sizes themselves. Sizes above --max-num-seqs are left "
                        "out; none at or below it is an error (default: 1, 2, 4, 8, then every 16 "
                        "up to 256, up to --max-num-seqs)")
    g.add_argument("--max-cudagraph-capture-size", type=int, default=None, metavar="N",
                   help="the largest decode batch captured as a CUDA graph (vLLM's flag): this "
                        "engine's default sizes (1, 2, 4, 8, then every 16) up to N, and N itself")
    for flag, kind, help_text in VLLM_NOOPS:
        if kind is bool:
            g.add_argument(flag, action="store_true", help=help_text)
        elif kind is BooleanOptional:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            g.add_argument(*flag.split("|"), type=kind[0], default=None,
                           metavar="N" if kind[1] is None else str(kind[1]).upper(), help=help_text)


def check_vllm_flags(ns: argparse.Namespace) -> None:
    """ValueError naming a vLLM flag given a value this server does not do."""
    if ns.enable_chunked_prefill is False:
        raise ValueError("--no-enable-chunked-prefill: chunked prefill cannot be turned off here "
                         "(the scheduler always chunks prompts under --max-num-batched-tokens)")
    for flag, kind, _ in VLLM_NOOPS:
        if isinstance(kind, tuple) and kind[1] is not None:
            name = flag.split("|")[-1]
            value = getattr(ns, name[2:].replace("-", "_"))
            if value is not None and value != kind[1]:
                raise ValueError(f"{name} {value}: only {kind[1]} is supported")


def cuda_graph_sizes(ns: argparse.Namespace) -> tuple[int, ...] | None:
    """The decode CUDA-graph batch sizes that --cuda-graph-sizes or --max-cudagraph-capture-size
    ask for, or None for the engine's default. The patterns are built only up to --max-num-seqs
    (no decode batch is larger), so a huge N costs nothing; a list is kept as given (the engine
    leaves out its sizes above --max-num-seqs)."""
    sizes, largest = getattr(ns, "cuda_graph_sizes", None), getattr(ns, "max_cudagraph_capture_size", None)
    if sizes is not None and largest is not None:
        raise ValueError("--cuda-graph-sizes and --max-cudagraph-capture-size: give one of them")
    cap = getattr(ns, "max_num_seqs", None) or 1 << 30
    if largest is not None:
        if largest < 1:
            raise ValueError(f"--max-cudagraph-capture-size must be >= 1, got {largest}")
        top = min(largest, cap)  # the default pattern, and the largest size itself
        return tuple(sorted({b for b in (1, 2, 4, 8, *range(16, top + 1, 16)) if b <= top} | {top}))
    if sizes is None:
        return None
    if min(sizes) < 1:
        raise ValueError(f"--cuda-graph-sizes: sizes must be >= 1, got {min(sizes)}")
    if len(sizes) == 1:  # vLLM's pattern for one value
        top = min(sizes[0], cap)
        return tuple(b for b in (1, 2, 4, *range(8, top + 1, 8)) if b <= top)
    return tuple(sorted(set(sizes)))


def check_quantization(quantization: str | None, model_dir: str) -> None:
    """--quantization fp8: the checkpoint's own FP8 block quantization, or, for a checkpoint
    without one, its weights quantized as they load (models/config.py ONLINE_FP8); refused for a
    checkpoint quantized another way (GPTQ, AWQ, ...), which this server cannot read."""
    if quantization is None:
        return
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
        q = (config.get("quantization_config") or {}) if isinstance(config, dict) else None
    except (OSError, ValueError) as e:
        raise ValueError(f"--quantization {quantization}: cannot read {path} ({e})") from None
    if not isinstance(q, dict):
        raise ValueError(f"--quantization {quantization}: {path}'s quantization_config is not a JSON object")
    if q and q.get("quant_method") != quantization:
        raise ValueError(f"--quantization {quantization}: the checkpoint in {model_dir} is quantized "
                         f"another way (its quantization_config: {q}), which this server cannot read; "
                         "serve its bf16 checkpoint (with --quantization fp8 to quantize it at load)")
