#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks; tables at the end, JSON under $OUT.
# Usage (on the GPU machine, repo root): bash scripts/gpu_check.sh [quick]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py tests/test_triton_ops.py tests/test_sampler.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt"
python3 scripts/bench_latency.py --json "$OUT/latency.json" 2>&1 | grep -v "Loading\|Warning" | tail -12
python3 scripts/bench_throughput.py --json "$OUT/throughput.json" ${1:+--num-prompts 200} 2>&1 | tail -3
