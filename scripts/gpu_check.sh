#!/usr/bin/env bash
# One device call: GPU tests, then the benchmarks; each step's full log lands in $OUT/<step>.txt
# (written as it runs, so a step cut by its timeout still leaves what it printed).
# Usage (GPU machine, repo root): bash scripts/gpu_check.sh [tests|quick|moe|moestream|mla|decode|gluon|seesaw|seesawtime|ep|pdl|mergeo|fewer|fewer2|sidenorm|b1norm|latency|latency_sync|profile|graphs|router|ops|host|throughput|offline|offline2|offlineab|http|q8|q8fuse|q8w16|q8w16r1|fp8|r1|v3gluon|r1fp8|r1dec|r1tput|r1fp8x|fp8ops|fp8dec]...
#   tests       GPU-marked tests: fused MoE, FP8 GEMM, engine (CUDA graphs, Triton vs torch backend)
#   quick       the GPU tests minus the slow ones (trained-model bf16, bf16 closeness, W8A8 shapes),
#               with one fixed tile per Triton kernel (pytest --no-autotune: no tuning per test shape),
#               as QUICK_SHARDS (default 3) pytest runs side by side on the one GPU (pytest --shard I/N;
#               the tests' engines have fixed KV caches, so they share its memory): one run is mostly
#               single-threaded Triton compiles and tiny models' launches, and 3 shards take about
#               2/5 of its time (RESULTS.md); the log ends with
#               each shard's failures and counts (QUICK_SHARDS=1: one run, as before)
#   moe         the MoE paths at V2-Lite shapes, bf16, 1-8192 tokens: fused, block kernels (16-128-row
#               blocks), grouped GEMM, each with the shared experts folded in or dense (+sd); then FP8
#               experts through the block kernels at R1 shapes, 16-4096 tokens (bench_fused_moe.py
#               [--fp8]); the step's timeout is halved between the two (give it `moe:360`)
#   moestream   one MoE layer with the shared experts on one stream and on two (moe_shared_stream),
#               the two-stream path's shared block depths, the router's chain and the routed and
#               shared launches alone, at 8 / 32 / 128 / 256 tokens (bench_moe_stream.py; ~20-60 s)
#   mla         Triton MLA kernels: real-shape checks, decode grid, prefill (bench_mla_decode.py)
#   gluon       the Gluon many-heads decode (attention/gluon_decode.py): its sm_90 compile report, a
#               3-case smoke test (a hang shows here), all its GPU tests and its engine test
#               (decode_wgmma_min_heads=64), then its time next to the Triton kernel's at 64 and
#               128 heads over B 1..128, S 1k..16k; the step's timeout is shared out (give it `gluon:540`)
#   seesaw      the seesaw many-heads decode (attention/gluon_seesaw.py): its sm_90 compile report, a
#               1-case smoke test (a hang shows here), its GPU tests and the engine's Gluon-decode tests (the
#               first compiles for ~130 s on an H100: half the step's timeout), then its time next to the
#               lockstep schedule and its producer+lazy variant at 128 heads (bench_gluon_configs.py; `seesaw:420`)
#   ep          --enable-expert-parallel: its GPU test (V2-Lite's MoE layer as 4 EP ranks on one GPU, summed,
#               against one rank), then bench_expert_parallel.py (R1's MoE layer of one rank at -tp 8, split by
#               expert against every expert split; 1/3 and 2/3 of the step's timeout, `ep:420`)
#   seesawtime  the seesaw step's timing alone (compile report, then seesaw against lockstep at 128 heads, B x S
#               from SEESAW_SHAPES), no tests: issue 24's figure where device time is short (`seesawtime:120`)
#   decode      the MLA decode kernel alone: its GPU tests (bf16 and FP8 caches, every DecodeConfig
#               variant), split counts at 1k contexts (bench_decode_splits.py), then its tiles swept at B=128, S=4k/16k,
#               16 and 128 heads, bf16 and FP8 (bench_mla_decode.py --decode-only --sweep); the step's
#               timeout is shared out: 1/2 tests, 1/6 splits, 1/3 sweep (give it `decode:540`)
#   latency     V2-Lite dummy bf16 TPOT at batch 1/8/32/128 (bench_latency.py; async scheduling, the default)
#   latency_sync   the same with --no-async-scheduling
#   pdl         TPOT at batch 1/8/32/128 with --kernels auto and auto,pdl=1 (programmatic dependent
#               launch), twice each, alternating: four runs of bench_latency.py, each under a quarter
#               of the step's timeout (give it `pdl:480`)
#   mergeo      the decode's split merge inside absorb_o (decode_merge_in_absorb): its GPU tests, then
#               TPOT at batch 1/8/16/32/128 without and with it in one engine, alternating twice
#               (bench_pdl_variants.py --variants base merge_o; batches 1 (~130 splits, more than the
#               fold takes) and 128 (one split) are controls);
#               1/5 and 4/5 of the step's timeout (give it `mergeo:420`)
#   fewer       the three opt-in launch removals: decode_merge_in_absorb (above), moe_norm_in_router
#               (the MoE layers' add + norm inside the router's logits kernel) and moe_route_align (the
#               choice and the block MoE's alignment in one launch): their kernels' GPU tests, then
#               TPOT at batch 1/8/16/32/128 in one engine, base / each / all three, alternating twice
#               (bench_pdl_variants.py); 1/5 and 4/5 of the step's timeout (give it `fewer:580`)
#   fewer2      the two that did not lose in `fewer` (H100, 2026-12-06): TPOT at batch 1/4/8/16/24/32
#               (where they apply): the norm in the router off, the default (on at batch 1), on to 32,
#               the choice + alignment in one launch, reps in ABBA order (3/5 of the timeout), then
#               their GPU tests (kernels, and the engine's tokens against the default plan; 2/5)
#               (give it `fewer2:570`)
#   sidenorm    the norm in the router's logits kernel past the fused MoE (5-32 tokens), the shared
#               experts' stream computing the norm for itself (SideNorm): its GPU tests (the MoE
#               layer at V2-Lite shapes, the engine's tokens; fixed tiles), then TPOT at batch
#               1/4/8/16/24/32 with the norm in the router off, on at batch 1 alone, on to 1024,
#               ABBA (bench_pdl_variants.py); 2/5 and 3/5 of the step's timeout (`sidenorm:300`)
#   b1norm      the norm in the router at batch 1 and 8, off against on (to 1024), in two engines: one
#               warmed up and tuned with it off (`moe_norm_in_router_max_tokens=0`), one with fixed
#               tiles (`autotune=0`); does the engine's warm-up path decide which variant is faster?
#               (half the step's timeout each; `b1norm:400`)
#   profile     GPU time per op over eager decode steps at batch 1 (profile_step.py --kernels)
#   graphs      the CUDA-graph decode step at batch 1/8/32/128: TPOT, the replay alone, kernel time
#               and the idle time before each kernel (profile_graphs.py), once per --kernels plan of
#               AB_PLANS (default "auto"), sharing the timeout; one step's kernel sequence per batch
#               in $OUT/seq_<plan>.txt
#   router      the one-launch router (router_fused_max_tokens): its GPU tests, its time against the two
#               launches at 1-512 tokens (bench_router_logits.py --route), then the decode step at batch
#               8 / 32 / 128 with and without it (profile_graphs.py); 1/8, 1/8 and 3/8 + 3/8 of the
#               step's timeout (give it `router:560`)
#   ops         GPU time per op and per module against each op's floor: decode steps at batch 32
#               and 128, prefill steps of 8 x 1024 and 1 x 8192 tokens (profile_ops.py; issue 19's
#               table, and the 8192-token step's share of the bf16 peak), and the offline run's
#               typical mixed step, 211 decodes + 8 new 1000-token prompts: its kernels' sum against
#               its unprofiled wall time (to set beside the offline step's GPU span per step)
#   throughput  V2-Lite 1000 x (1000 in, 100 out) (bench_throughput.py)
#   offline     the same, prefix caching off, with its instruments: wall / host launch / GPU span per
#               step kind, GPU idle between steps, host stack samples, GC, Triton compiles and the
#               CUDA allocator during the run (bench_throughput.py --step-stats --host-sample)
#   host        the host side of the offline run's mixed step (211 decodes + 8 new 1000-token prompts):
#               forward enqueue with the GPU idle and held busy, host ms per layer, cProfile
#               (profile_host.py), once per --kernels plan of AB_PLANS (default "auto"), sharing the timeout
#   offline2    the offline step's run (prefix caching off, step stats) with --kernels auto and with
#               auto,moe_shared_dense_min_tokens=0, once each, each under half the step's timeout
#   offlineab   the offline step's run (prefix caching off, step stats) with each --kernels plan of
#               AB_PLANS (default "auto auto,moe_shared_dense_min_tokens=0": the shared experts folded
#               into the grouped MoE instead of their own GEMMs from 1024 tokens), alternating twice:
#               with two plans four runs, each under a quarter of the step's timeout (`offlineab:400`)
#   offlinepw   the offline step's run (prefix caching off, step stats) with each --piecewise-graph-sizes
#               of PW_SIZES (default "auto none": piecewise CUDA graphs of the steps with prefill, or
#               eager), alternating twice, each run under its share of the step's timeout
#   http        the same workload offline, then over HTTP (serve + bench_serving), one table with
#               the HTTP / offline ratio (bench_http_vs_offline.py; give it time: `http:560`)
#   peer        the issues' side-by-side method: a random-weight V2-Lite checkpoint
#               (.bench/make_random_ckpt.py into /tmp/v2l, ~45 s), then .bench/peer_bench.py --engine
#               ours on it (TPOT at batch 1/8/32/128, offline 1000 x (1000 in, 100 out)); needs
#               ../shared/bench copied into .bench and `carry: [".bench"]` (give it `peer:560`)
#   q8          V2-Lite's random-weight checkpoint (.bench/make_random_ckpt.py into /tmp/v2l, as peer)
#               served with --quantization fp8 (quantized at load, W8A8) and in bf16: TPOT at batch
#               1/8/32/128 of each (bench_latency.py); the start-up log has the load time (`q8:480`)
#   q8fuse      the same checkpoint with --quantization fp8 at batch 1/4/8/16, in one engine (its graphs
#               captured again per variant, ABBA, bench_pdl_variants.py): the default; fp8_gemm_fuse_act
#               (the split-K W8A8 GEMM quantizing x itself); fp8_gemm_splitk_serial (no reduce launch);
#               both (`q8fuse:420`; 1/4 of it for the checkpoint where /tmp/v2l has none)
#   q8w16       --quantization fp8 (dummy weights) at batch 1/4/8/16 in one engine: the W8A8 projections
#               against the weight-streaming kernel (fp8_gemm_w8a16_max_tokens=16) with its PDL signal at
#               its start, after its K loop, and without PDL (bench_pdl_variants.py; `q8w16:300`)
#   q8w16r1     the same on DeepSeek-R1's config with 4 layers (dummy FP8 weights): W8A8 against the
#               weight-streaming kernel up to 16 and 8 rows (its default signal), its signal at its
#               start, and without PDL; first (1/4 of the timeout) the kernel's PDL-signal GPU test
#               and its engine test (`q8w16r1:360`)
#   fp8         block-FP8 GEMM vs bf16 at V3 shapes (bench_fp8_gemm.py)
#   r1          DeepSeek-R1 config, 4 layers, dummy FP8 weights (kept in FP8: the default): TPOT at batch 1 and 64
#   v3gluon     the DeepSeek-V3 config, 4 layers, bf16 dummy weights (128 heads: the Gluon decode by
#               default on sm_90): TPOT at batch 1/32/128 with --kernels auto and with
#               auto,decode_wgmma_min_heads=0 (the Triton decode), alternating twice; four runs,
#               each under a quarter of the step's timeout (give it `v3gluon:480`)
#   r1fp8       the R1 config, 4 layers, dummy FP8 weights: TPOT at batch 1/32/128 and offline
#               throughput (500 x (1000 in, 100 out)), dequantized to bf16 (--no-fp8-gemm) against
#               kept in FP8 (--fp8-gemm, the default); four runs, each under a quarter of the step's timeout (give it `r1fp8:400`)
#   r1dec       the R1 config, 4 layers, dummy FP8 weights: decode TPOT at batch 1/8/32/128, dequantized
#               to bf16 (--no-fp8-gemm) against kept in FP8 (--fp8-gemm, the default); two runs, each under half the step's timeout
#               (`r1dec:360`; batches 1 and 8 run the fused small MoE, FP8 experts scaled per tile)
#   r1tput      the same R1 config's offline run, 500 x (1000 in, 100 out), prefix caching off,
#               --no-fp8-gemm then --fp8-gemm, then both again (alternating: four runs, each under a
#               quarter of the step's timeout; a cold run's warm-up is ~85 s, so give it `r1tput:560`)
#   r1fp8x      the same R1 config with --fp8-gemm, its FP8 kernels one at a time: TPOT at batch
#               1/32/128 with --kernels auto (split-K on, weight-only FP8 MoE), with
#               fp8_gemm_splitk=0,moe_fp8_w8a8=1, and with moe_fp8_w8a8=1 (both); three runs, each
#               under a third of the step's timeout (give it `r1fp8x:480`: each run compiles and
#               tunes the FP8 kernels, ~100 s for the first)
#   fp8ops      every FP8 GEMM and MoE call of a tiny FP8 V3's engine against the fp32 emulation of its
#               arithmetic, each run twice (scripts/check_fp8_ops.py; `auto` and fp8_gemm=triton)
#   fp8dec      the W8A8 GPU tests at real shapes (the W8A8 block MoE first; split-K GEMM, in the engine
#               too; the dense W8A8 GEMM), then the small-M W8A8 GEMM at R1's decode shapes, M 1-16
#               split-K (chosen and swept) against unsplit, cuBLAS, bf16 and the FP8 byte floor in
#               CUDA graphs (bench_fp8_gemm.py --decode); 3/5 and 2/5 of the step's timeout
#               (`fp8dec:420`: the tests need over 210 s, the bench ~160 s)
#   spec        speculative decoding: decode step cost at q_len 1..4 (V2-Lite), then MTP end to end
#               on the V3 config with 4 layers, warm (bench_spec_decode.py step / e2e)
#   core        the control plane on this host's CPU: serve around a stub model with 44 ms steps,
#               minimal and httpx clients (bench_core_overhead.py; no GPU use)
#   core_host   the same with the GPU engine's step costs emulated: device 14 ms + 9 us/token, and
#               92 ms of host time holding the GIL per step with prompt tokens (eager), offline and
#               HTTP with both clients (bench_core_overhead.py; no GPU use)
# A step may carry its own timeout in seconds: `tests:150` (tests/test_gpu_engine.py alone takes
# over 290 s: give `tests` or `quick` 420 or more). Default STEP_TIMEOUT (240); spec, core and
# core_host run two scripts, each under that timeout.
# LATENCY_ARGS: extra flags for the latency step (e.g. "--batch-sizes 1 8").
set -uo pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests latency throughput}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
for spec in $steps; do
  s=${spec%%:*}; T=${STEP_TIMEOUT:-240}; [ "$s" != "$spec" ] && T=${spec#*:}
  log="$OUT/$s.txt"; start=$(date +%s)
  case $s in
    tests) timeout "$T" python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=8 \
             tests/test_fused_moe.py tests/test_fp8_gemm.py tests/test_gpu_engine.py tests/test_gpu_fp8_engine.py tests/test_triton_route.py \
             tests/test_triton_absorb.py tests/test_triton_kv_finish.py tests/test_triton_norm.py \
             tests/test_triton_launch.py tests/test_piecewise_graph.py > "$log" 2>&1 ;;
    quick) N=${QUICK_SHARDS:-3}; pids=()
           if ! [ "$N" -ge 1 ] 2>/dev/null; then echo "QUICK_SHARDS=$N: expected 1 or more" > "$log"; false
           else
           for i in $(seq 0 $((N - 1))); do
             timeout "$T" python3 -m pytest -q -p no:cacheprovider -m gpu --no-autotune -rfE --durations=5 \
               --shard "$i/$N" tests/test_triton_route.py tests/test_triton_absorb.py tests/test_triton_kv_finish.py \
               tests/test_triton_norm.py tests/test_triton_launch.py tests/test_piecewise_graph.py tests/test_skinny_gemm.py tests/test_triton_argmax.py \
               tests/test_fused_moe.py tests/test_gpu_engine.py tests/test_gpu_fp8_engine.py tests/test_fp8_gemm.py tests/test_route_align.py \
               tests/test_gpu_launch_opt_ins.py tests/test_profiler.py -k "not trained and not bf16_as_close and not w8a8_real and not splitk_r1" > "$OUT/quick_$i.txt" 2>&1 &
             pids+=($!)
           done
           qrc=0; for p in "${pids[@]}"; do wait "$p"; r=$?; [ "$qrc" -eq 0 ] && qrc=$r; done  # the first failure's code
           for i in $(seq 0 $((N - 1))); do echo "## shard $i/$N"; cat "$OUT/quick_$i.txt"; done > "$log"
           for i in $(seq 0 $((N - 1))); do  # each shard's failures and its last line (the counts)
             grep -E "^(FAILED|ERROR) " "$OUT/quick_$i.txt" | sed "s|^|shard $i: |"
             echo "shard $i: $(grep -v '^\s*$' "$OUT/quick_$i.txt" | tail -1)"
           done >> "$log"; (exit "$qrc")
           fi ;;
    moe) { timeout $((T / 2)) python3 scripts/bench_fused_moe.py --tokens 1 4 8 16 32 128 256 512 1024 2048 8192 \
             --json "$OUT/fused_moe.json"
           timeout $((T / 2)) python3 scripts/bench_fused_moe.py --fp8 --json "$OUT/fused_moe_fp8.json"; } > "$log" 2>&1 ;;
    moestream) timeout "$T" python3 scripts/bench_moe_stream.py --tokens 8 32 128 256 > "$log" 2>&1 ;;
    mla) timeout "$T" python3 scripts/bench_mla_decode.py --check --sweep --budget-s $((T - 40)) \
           --out "$OUT/bench_mla_decode.json" > "$log" 2>&1 ;;
    decode) { timeout $((T / 2)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_triton_ops.py \
                tests/test_kv_cache_fp8.py -k decode
              timeout $((T / 6)) python3 scripts/bench_decode_splits.py --splits 2 4 8 16 32 64
              timeout $((T / 3)) python3 scripts/bench_mla_decode.py --decode-only --sweep --budget-s $((T / 3 - 30)) \
                --decode-shapes 128x4096,128x16384 --heads 16,128 --cache-dtypes bf16,fp8 \
                --out "$OUT/bench_mla_decode.json"; } > "$log" 2>&1 ;;
    gluon) { timeout $((T / 10)) python3 scripts/compile_sm90.py
             timeout $((T / 5)) python3 -m pytest tests/test_gluon_decode.py -m gpu -x -q -p no:cacheprovider \
               -k "S17_H64_p16_splits1 or B3_0_17_1000_H128_p16_splits5 or cfg_s3x2_B3_0_17_1000" && \
             timeout $((T / 2)) python3 -m pytest tests/test_gluon_decode.py tests/test_gpu_engine.py -m gpu -q -s \
               -p no:cacheprovider -rfE -k "not test_gpu_engine or gluon"
             timeout $((T / 5)) python3 scripts/bench_mla_decode.py --decode-only --impl gluon --heads 64,128 \
               --decode-shapes 1x4096,8x4096,32x1024,32x4096,128x1024,128x4096,128x16384 --cache-dtypes bf16 \
               --out "$OUT/gluon_decode.json"; } > "$log" 2>&1 ;;
    seesaw) { timeout $((T / 10)) python3 scripts/compile_sm90.py --seesaw 1 --page 64
              timeout $((T / 6)) python3 -m pytest tests/test_gluon_seesaw.py -m gpu -x -q -p no:cacheprovider \
                -k "seesaw_S17_H128_p16_auto" && \
              timeout $((T / 2)) python3 -m pytest tests/test_gluon_seesaw.py tests/test_gpu_engine.py -m gpu -q \
                -p no:cacheprovider -rfE --durations=5 \
                -k "seesaw or gluon_decode_in_the_engine or gluon_decode_with_mtp"
              timeout $((T / 4)) python3 scripts/bench_gluon_configs.py \
                --configs seesaw,lockstep,producer+lazy,seesaw+lazy \
                --shapes ${SEESAW_SHAPES:-128x4096,128x16384,32x4096,8x4096}; } > "$log" 2>&1 ;;
    seesawtime) { timeout $((T / 3)) python3 scripts/compile_sm90.py --seesaw 1 --page 64 | tail -3
                  timeout $((T * 2 / 3)) python3 scripts/bench_gluon_configs.py --configs seesaw,lockstep \
                    --shapes ${SEESAW_SHAPES:-128x4096,128x16384,32x4096}; } > "$log" 2>&1 ;;
    latency) timeout "$T" python3 scripts/bench_latency.py ${LATENCY_ARGS:-} --json "$OUT/latency.json" > "$log" 2>&1 ;;
    latency_sync) timeout "$T" python3 scripts/bench_latency.py --no-async-scheduling ${LATENCY_ARGS:-} \
          --json "$OUT/latency_sync.json" > "$log" 2>&1 ;;
    pdl) { for k in auto auto,pdl=1 auto auto,pdl=1; do echo "## --kernels $k"
             timeout $((T / 4)) python3 scripts/bench_latency.py --kernel-plan "$k" --batch-sizes 1 8 32 128 \
               --json "$OUT/latency_${k//[,=]/_}_$SECONDS.json"; done; } > "$log" 2>&1 ;;
    mergeo) { timeout $((T / 5)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_triton_absorb.py \
                -k "merge or absorb_kernels_real"
              timeout $((T * 4 / 5)) python3 scripts/bench_pdl_variants.py --batch-sizes 1 8 16 32 128 \
                --variants base merge_o --reps 2; } > "$log" 2>&1 ;;
    fewer) { timeout $((T / 5)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_triton_absorb.py \
               tests/test_triton_route.py tests/test_route_align.py -k "merge or absorb_kernels_real or norm_logits or route_align"
             timeout $((T * 4 / 5)) python3 scripts/bench_pdl_variants.py --batch-sizes 1 8 16 32 128 \
               --variants base merge_o norm_router route_align all3 --reps 2; } > "$log" 2>&1 ;;
    sidenorm) { timeout $((T * 2 / 5)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --no-autotune \
                  tests/test_fused_moe.py tests/test_gpu_launch_opt_ins.py -k "side_norm or norm_in_router"
                timeout $((T * 3 / 5)) python3 scripts/bench_pdl_variants.py --batch-sizes 1 4 8 16 24 32 \
                  --variants norm_router_off norm_router_b1 norm_router --reps 2; } > "$log" 2>&1 ;;
    b1norm) { for k in auto,moe_norm_in_router_max_tokens=0 auto,autotune=0; do echo "## --kernel-plan $k"
                timeout $((T / 2)) python3 scripts/bench_pdl_variants.py --kernel-plan $k --batch-sizes 1 8 \
                  --variants norm_router_off norm_router --reps 2; done; } > "$log" 2>&1 ;;
    fewer2) { timeout $((T * 3 / 5)) python3 scripts/bench_pdl_variants.py --batch-sizes 1 4 8 16 24 32 \
                --variants norm_router_off base norm_router route_align --reps 2
              timeout $((T * 2 / 5)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_triton_route.py \
                tests/test_route_align.py tests/test_gpu_launch_opt_ins.py -k "norm_logits or route_align or opt_ins"
            } > "$log" 2>&1 ;;
    profile) timeout "$T" python3 scripts/profile_step.py --kernels > "$log" 2>&1 ;;
    graphs) { P=${AB_PLANS:-auto}; n=$(echo $P | wc -w); for k in $P; do echo "## --kernels $k"
        timeout $((T / n)) python3 scripts/profile_graphs.py --kernel-plan "$k" \
          --seq-file "$OUT/seq_$(echo "$k" | tr ',=' '__').txt"; done; } > "$log" 2>&1 ;;
    router) { timeout $((T / 8)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_triton_route.py
              timeout $((T / 8)) python3 scripts/bench_router_logits.py --route --tokens 1 8 32 128 256 512
              for k in auto auto,router_fused_max_tokens=512; do echo "## --kernels $k"
                timeout $((T * 3 / 8)) python3 scripts/profile_graphs.py --kernel-plan "$k" --batch-sizes 8 32 128 \
                  --steps 1 --max-num-batched-tokens 2048 --piecewise-graph-sizes none; done; } > "$log" 2>&1 ;;
    ops) timeout "$T" python3 scripts/profile_ops.py --decode 32 128 --prefill 8x1024 1x8192 --mixed 211x8 > "$log" 2>&1 ;;
    throughput) timeout "$T" python3 scripts/bench_throughput.py --json "$OUT/throughput.json" > "$log" 2>&1 ;;
    offline) timeout "$T" python3 scripts/bench_throughput.py --no-enable-prefix-caching --step-stats --host-sample \
               --json "$OUT/offline.json" > "$log" 2>&1 ;;
    host) { P=${AB_PLANS:-auto}; n=$(echo $P | wc -w); for k in $P; do echo "## --kernels $k"
            timeout $((T / n)) python3 scripts/profile_host.py --reps 3 --kernel-plan "$k"; done; } > "$log" 2>&1 ;;
    offline2) { for k in auto auto,moe_shared_dense_min_tokens=0; do
             echo "## --kernels $k"
             timeout $((T / 2)) python3 scripts/bench_throughput.py --no-enable-prefix-caching --kernel-plan "$k" \
               --step-stats --json "$OUT/offline_${k//[,=]/_}_$SECONDS.json"; done; } > "$log" 2>&1 ;;
    offlineab) { P=${AB_PLANS:-auto auto,moe_shared_dense_min_tokens=0}; for k in $P $P; do
             echo "## --kernels $k"
             timeout $((T / 4)) python3 scripts/bench_throughput.py --no-enable-prefix-caching --kernel-plan "$k" \
               --step-stats --json "$OUT/offline_${k//[,=]/_}_$SECONDS.json"; done; } > "$log" 2>&1 ;;
    offlinepw) { P=${PW_SIZES:-auto none}; n=$(( $(echo $P | wc -w) * 2 )); for k in $P $P; do
             echo "## --piecewise-graph-sizes $k"
             timeout $((T / n)) python3 scripts/bench_throughput.py --no-enable-prefix-caching --piecewise-graph-sizes "$k" \
               --step-stats --json "$OUT/offline_pw_${k//,/_}_$SECONDS.json"; done; } > "$log" 2>&1 ;;
    http) timeout "$T" python3 scripts/bench_http_vs_offline.py --out-dir "$OUT/http" > "$log" 2>&1 ;;
    ep) { timeout $((T / 3)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_expert_parallel.py
          timeout $((T * 2 / 3)) python3 scripts/bench_expert_parallel.py; } > "$log" 2>&1 ;;
    peer) { [ -f .bench/peer_bench.py ] || echo "no .bench/peer_bench.py: copy ../shared/bench to .bench and carry it"
            [ -f /tmp/v2l/config.json ] || timeout $((T / 4)) python3 .bench/make_random_ckpt.py configs/models/DeepSeek-V2-Lite /tmp/v2l
            timeout $((T * 3 / 4)) python3 .bench/peer_bench.py --engine ours --model /tmp/v2l --load-format auto \
              --out "$OUT/peer_bench.json"; } > "$log" 2>&1 ;;
    q8) { [ -f /tmp/v2l/config.json ] || timeout $((T / 5)) python3 .bench/make_random_ckpt.py configs/models/DeepSeek-V2-Lite /tmp/v2l
          for q in "--quantization fp8" ""; do
            echo "## latency ${q:-bf16}"
            timeout $((T * 2 / 5)) python3 scripts/bench_latency.py --model /tmp/v2l --load-format auto --skip-tokenizer-init \
              $q --batch-sizes 1 8 32 128 --decode-steps 50 --json "$OUT/v2l_latency${q:+_fp8}.json"
          done; } > "$log" 2>&1 ;;
    q8fuse) { [ -f /tmp/v2l/config.json ] || timeout $((T / 4)) python3 .bench/make_random_ckpt.py configs/models/DeepSeek-V2-Lite /tmp/v2l
              timeout $((T * 3 / 4)) python3 scripts/bench_pdl_variants.py --model /tmp/v2l --load-format auto \
                --skip-tokenizer-init --quantization fp8 --batch-sizes 1 4 8 16 --reps 2 \
                --variants base fuse_act serial fuse_act+serial; } > "$log" 2>&1 ;;
    q8w16) timeout "$T" python3 scripts/bench_pdl_variants.py --load-format dummy --quantization fp8 \
             --batch-sizes 1 4 8 16 --reps 2 --variants w8a8 w8a16_start w8a16_late w8a16_nopdl > "$log" 2>&1 ;;
    q8w16r1) { timeout $((T / 4)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE tests/test_fp8_gemm.py \
                 tests/test_gpu_fp8_engine.py -k "w8a16_pdl_signal or w8a16_in_the_engine"
               timeout $((T * 3 / 4)) python3 scripts/bench_pdl_variants.py --model configs/models/DeepSeek-R1 \
                 --hf-overrides '{"num_hidden_layers": 4}' --batch-sizes 1 4 8 16 --reps 2 \
                 --variants w8a8 w8a16 w8a16_8 w8a16_start w8a16_nopdl; } > "$log" 2>&1 ;;
    fp8) timeout "$T" python3 scripts/bench_fp8_gemm.py --json "$OUT/fp8_gemm.json" > "$log" 2>&1 ;;
    r1) timeout "$T" python3 scripts/bench_latency.py --model configs/models/DeepSeek-R1 \
          --hf-overrides '{"num_hidden_layers": 4}' --batch-sizes 1 64 --decode-steps 50 \
          --json "$OUT/r1_latency.json" > "$log" 2>&1 ;;
    v3gluon) { for k in auto auto,decode_wgmma_min_heads=0 auto auto,decode_wgmma_min_heads=0; do
             echo "## --kernels $k"
             timeout $((T / 4)) python3 scripts/bench_latency.py --model configs/models/DeepSeek-V3 --dtype bfloat16 \
               --hf-overrides '{"num_hidden_layers": 4}' --kernel-plan "$k" --batch-sizes 1 32 128 --decode-steps 50 \
               --json "$OUT/v3_latency_${k//[,=]/_}_$SECONDS.json"; done; } > "$log" 2>&1 ;;
    r1fp8) { R1="--model configs/models/DeepSeek-R1 --hf-overrides {\"num_hidden_layers\":4}"
            for g in --no-fp8-gemm --fp8-gemm; do
              echo "## latency $g"
              timeout $((T / 4)) python3 scripts/bench_latency.py $R1 $g --batch-sizes 1 32 128 --decode-steps 50 \
                --json "$OUT/r1_latency${g//-/_}.json"
              echo "## throughput $g"
              timeout $((T / 4)) python3 scripts/bench_throughput.py $R1 $g --num-prompts 500 --no-enable-prefix-caching \
                --json "$OUT/r1_throughput${g//-/_}.json"
            done; } > "$log" 2>&1 ;;
    r1dec) { R1="--model configs/models/DeepSeek-R1 --hf-overrides {\"num_hidden_layers\":4}"
            for g in --no-fp8-gemm --fp8-gemm; do
              echo "## latency $g"
              timeout $((T / 2)) python3 scripts/bench_latency.py $R1 $g --batch-sizes 1 8 32 128 --decode-steps 50 \
                --json "$OUT/r1dec${g//-/_}.json"
            done; } > "$log" 2>&1 ;;
    r1tput) { R1="--model configs/models/DeepSeek-R1 --hf-overrides {\"num_hidden_layers\":4}"
            for g in --no-fp8-gemm --fp8-gemm --no-fp8-gemm --fp8-gemm; do
              echo "## throughput $g"
              timeout $((T / 4)) python3 scripts/bench_throughput.py $R1 $g --num-prompts 500 --no-enable-prefix-caching \
                --json "$OUT/r1tput${g//-/_}_$SECONDS.json"
            done; } > "$log" 2>&1 ;;
    r1fp8x) { R1="--model configs/models/DeepSeek-R1 --hf-overrides {\"num_hidden_layers\":4}"
            for k in auto auto,fp8_gemm_splitk=0,moe_fp8_w8a8=1 auto,moe_fp8_w8a8=1; do
              echo "## latency --fp8-gemm --kernel-plan $k"
              timeout $((T / 3)) python3 scripts/bench_latency.py $R1 --fp8-gemm --kernel-plan "$k" \
                --batch-sizes 1 32 128 --decode-steps 50 --json "$OUT/r1_latency_${k//[,=]/_}.json"
            done; } > "$log" 2>&1 ;;
    fp8ops) timeout "$T" python3 scripts/check_fp8_ops.py > "$log" 2>&1 ;;
    fp8dec) { timeout $((T * 3 / 5)) python3 -m pytest -q -p no:cacheprovider -m gpu -rfE --durations=8 \
                tests/test_fused_moe.py tests/test_gpu_fp8_engine.py tests/test_fp8_gemm.py -k "splitk or w8a8_real"
              timeout $((T * 2 / 5)) python3 scripts/bench_fp8_gemm.py --decode --splits 2 4 8 16 32 \
                --json "$OUT/fp8_decode.json"; } > "$log" 2>&1 ;;
    spec) { timeout "$T" python3 scripts/bench_spec_decode.py step --batch-sizes 1 4 16 64 --q-lens 1 2 3 4 \
              --json "$OUT/spec_step.json"
            timeout "$T" python3 scripts/bench_spec_decode.py e2e --method mtp --num-speculative-tokens 1 --batch-sizes 1 1 \
              --model configs/models/DeepSeek-V3 --hf-overrides '{"num_hidden_layers": 4}' \
              --json "$OUT/spec_mtp.json"; } > "$log" 2>&1 ;;
    core) { timeout "$T" python3 scripts/bench_core_overhead.py --device-ms 44 --json "$OUT/core_raw.json"
            timeout "$T" python3 scripts/bench_core_overhead.py --device-ms 44 --mode http --client httpx \
              --json "$OUT/core_httpx.json"; } > "$log" 2>&1 ;;
    core_host) { EMU="--device-ms 14 --device-us-per-token 9 --prefill-host-ms 92"
            timeout "$T" python3 scripts/bench_core_overhead.py $EMU --json "$OUT/core_host_raw.json"
            timeout "$T" python3 scripts/bench_core_overhead.py $EMU --mode http --client httpx \
              --json "$OUT/core_host_httpx.json"; } > "$log" 2>&1 ;;
    *) echo "unknown step $s" > "$log" ;;
  esac
  rc=$?
  echo "=== $s: rc=$rc, $(( $(date +%s) - start )) s"
  grep -v "Loading\|Warning\|warn(" "$log" | tail -${TAIL:-25}
done
