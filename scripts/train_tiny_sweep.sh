#!/usr/bin/env bash
# Train several tiny-model recipes side by side on one GPU (the model is small: each process is
# host-bound, so they share the GPU well), evaluate each with transformers generate(), and bring
# back the best checkpoint's weights. Device, from the repo root:
#   bash scripts/train_tiny_sweep.sh SECONDS "NAME:FLAGS" ["NAME:FLAGS"...]
# $OUT/NAME.log per recipe; $OUT/best.safetensors (+ best.txt) of the highest bf16 accuracy.
set -uo pipefail
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
secs=$1; shift
work=/tmp/tiny_sweep; mkdir -p $work
for spec in "$@"; do
  name=${spec%%:*}; flags=${spec#*:}
  python3 -m scripts.train_tiny_model --out $work/$name --time-budget "$secs" --workers 3 \
      --log-every 250 $flags > "$OUT/$name.log" 2>&1 &
done
wait
best=""; best_acc=-1
for spec in "$@"; do
  name=${spec%%:*}
  acc=$(grep "ACCURACY dtype=torch.bfloat16 bos=True" "$OUT/$name.log" | sed 's/.*: \([0-9.]*\) .*/\1/')
  echo "== $name (${spec#*:}): $(grep -c . "$OUT/$name.log") log lines"; grep "ACCURACY\|trained\|cutting" "$OUT/$name.log"
  if [ -n "$acc" ] && awk "BEGIN{exit !($acc > $best_acc)}"; then best=$name; best_acc=$acc; fi
done
if [ -n "$best" ]; then
  cp $work/$best/model.safetensors "$OUT/best.safetensors"
  echo "$best $best_acc" > "$OUT/best.txt"; echo "best: $best ($best_acc)"
fi
