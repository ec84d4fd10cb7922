#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks; tables at the end, JSON under $OUT.
# Usage (on the GPU machine, repo root): bash scripts/gpu_check.sh [tests|latency|throughput]...
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests latency throughput}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
for s in $steps; do case $s in
  tests) timeout 200 python3 -m pytest -q -p no:cacheprovider -x tests/test_gpu_engine.py tests/test_fused_moe.py tests/test_fp8_gemm.py 2>&1 | tail -15 | tee "$OUT/gpu_tests.txt" ;;
  latency) timeout 240 python3 scripts/bench_latency.py --json "$OUT/latency.json" 2>&1 | grep -v "Loading\|Warning" | tail -14 ;;
  fp8) timeout 120 python3 scripts/bench_fp8_gemm.py --json "$OUT/fp8_gemm.json" 2>&1 | tail -20 ;;
  throughput) timeout 240 python3 scripts/bench_throughput.py --json "$OUT/throughput.json" 2>&1 | tail -4 ;;
esac; done
