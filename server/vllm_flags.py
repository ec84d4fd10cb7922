"""vLLM's engine flags that a vLLM launch line carries, on the `serve` parser: those that ask for
what this server does anyway (accepted, any other value an error naming the flag), the CUDA-graph
capture sizes (--cuda-graph-sizes, --max-cudagraph-capture-size, and --compilation-config's
CUDA-graph keys) and --quantization, which names the checkpoint's own FP8 quantization.
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
    ("--distributed-executor-backend", (str, "mp"), "only mp: the ranks are worker processes"),
    ("--tokenizer-mode", (str, "auto"), "only auto: the Hugging Face tokenizer of the model"),
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
    g.add_argument("--compilation-config", default=None, metavar="JSON",
                   help="vLLM's compilation config, a JSON object; of its keys this server takes "
                        "cudagraph_mode (FULL_AND_PIECEWISE: the default here, decode steps captured "
                        "whole and the others in pieces; FULL_DECODE_ONLY: --piecewise-graph-sizes none; "
                        "NONE: --enforce-eager), cudagraph_capture_sizes (decode batch sizes, as "
                        "--cuda-graph-sizes with several values), max_cudagraph_capture_size (as the "
                        "flag), and accepts level, mode and custom_ops with any value (this server "
                        "compiles nothing with torch.compile and has no op choices); any other key, or "
                        "cudagraph_mode PIECEWISE or FULL, is an error naming it")
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


# --compilation-config's keys: what each must be; the CUDA-graph ones are read below, the others
# accepted with any value (vLLM's torch.compile level / mode and custom-op choices: nothing here
# is compiled by torch.compile, and there are no op implementations to choose between)
_CC_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "NONE")
_CC_ANY = ("level", "mode", "custom_ops")


def compilation_config(ns: argparse.Namespace) -> dict:
    """--compilation-config, checked: {} when not given; a JSON object whose keys are among
    cudagraph_mode, cudagraph_capture_sizes, max_cudagraph_capture_size and _CC_ANY (a bare
    integer is vLLM's older spelling of its level). ValueError naming the key otherwise."""
    text = getattr(ns, "compilation_config", None)
    if text is None:
        return {}
    try:
        cc = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--compilation-config is not valid JSON: {e}") from None
    if isinstance(cc, int) and not isinstance(cc, bool):
        return {"level": cc}
    if not isinstance(cc, dict):
        raise ValueError("--compilation-config must be a JSON object")
    known = ("cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size", *_CC_ANY)
    unknown = [k for k in cc if k not in known]
    if unknown:
        raise ValueError(f"--compilation-config: {', '.join(map(repr, unknown))} not supported here (this server "
                         f"takes {', '.join(known)})")
    mode = cc.get("cudagraph_mode", "FULL_AND_PIECEWISE")
    if not isinstance(mode, str) or mode.upper() not in _CC_MODES:
        raise ValueError(f"--compilation-config cudagraph_mode {mode!r}: this server captures decode steps whole "
                         f"and the others in pieces, so it takes {', '.join(_CC_MODES)}")
    sizes = cc.get("cudagraph_capture_sizes")
    if sizes is not None and (not isinstance(sizes, list) or not sizes
                              or not all(isinstance(n, int) and not isinstance(n, bool) for n in sizes)):
        raise ValueError(f"--compilation-config cudagraph_capture_sizes must be a list of integers, got {sizes!r}")
    largest = cc.get("max_cudagraph_capture_size")
    if largest is not None and (not isinstance(largest, int) or isinstance(largest, bool)):
        raise ValueError(f"--compilation-config max_cudagraph_capture_size must be an integer, got {largest!r}")
    return dict(cc, cudagraph_mode=mode.upper())


def cuda_graph_sizes(ns: argparse.Namespace) -> tuple[int, ...] | None:
    """The decode CUDA-graph batch sizes that --cuda-graph-sizes, --max-cudagraph-capture-size or
    --compilation-config's cudagraph_capture_sizes / max_cudagraph_capture_size ask for, or None
    for the engine's default. The patterns are built only up to --max-num-seqs (no decode batch is
    larger), so a huge N costs nothing; a list is kept as given (the engine leaves out its sizes
    above --max-num-seqs)."""
    sizes, largest = getattr(ns, "cuda_graph_sizes", None), getattr(ns, "max_cudagraph_capture_size", None)
    cc = compilation_config(ns)
    given = [name for name, v in (("--cuda-graph-sizes", sizes), ("--max-cudagraph-capture-size", largest),
                                  ("--compilation-config cudagraph_capture_sizes", cc.get("cudagraph_capture_sizes")),
                                  ("--compilation-config max_cudagraph_capture_size",
                                   cc.get("max_cudagraph_capture_size"))) if v is not None]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)}: give one of them")
    listed = cc.get("cudagraph_capture_sizes")
    if listed is not None:  # vLLM's list: the sizes themselves, one value too (no pattern)
        if min(listed) < 1:
            raise ValueError(f"--compilation-config cudagraph_capture_sizes must be >= 1, got {min(listed)}")
        return tuple(sorted(set(listed)))
    largest = cc.get("max_cudagraph_capture_size", largest)
    cap = getattr(ns, "max_num_seqs", None) or 1 << 30
    if largest is not None:
        if largest < 1:
            raise ValueError(f"{given[0]} must be >= 1, got {largest}")
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
