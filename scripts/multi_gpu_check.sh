#!/usr/bin/env bash
# One call on a multi-GPU machine: NCCL TP/DCP parity tests, then DeepSeek-V2-Lite (dummy bf16)
# decode at batch 64 with long prompts, -tp N vs -tp N -dcp N (KV capacity is in the logs).
# Usage: bash scripts/multi_gpu_check.sh [N] [PROMPT_LEN]
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
N=${1:-2}; L=${2:-8192}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | sort | uniq -c
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_parallel.py 2>&1 | tail -4
for dcp in 1 $N; do
  timeout 200 python3 scripts/bench_latency.py -tp $N -dcp $dcp --batch-sizes 64 --prompt-len $L \
    --max-model-len $((L + 256)) --max-num-batched-tokens 16384 --decode-steps 30 \
    --json "$OUT/tp${N}_dcp${dcp}.json" 2>&1 | grep -E "KV cache|batch +64|Error|error" | sort -u | tail -4
done
