#!/usr/bin/env bash
# The engine's loop on a lent GPU machine: launch to the first update with a cold
# compile cache, the demo's RL step, where its host time goes, skewed lengths at equal
# memory, and train-step programs compiled one or eight at a time. Each arm fits one
# call of under 10 minutes, most with one or two others (seconds are the arms' limits):
#
#   bash benchmarks/gpu_loop.sh [OUTDIR] [ARMS]     # ARMS default: demo_cold,host,skew_bf16
#   bash benchmarks/gpu_loop.sh /tmp/out compile
#
# Same set-up as benchmarks/gpu_host.sh (.whl/ carries ml_collections and nest_asyncio).
# Figures: docs/performance.md.
#   demo_cold   (250 s) the demo config (configs/calculator.py: SFT warm-up until 30%
#               success, then RL) for 20 RL steps, threads, an empty compile cache; its
#               metrics.jsonl is copied to OUTDIR/demo_cold.jsonl.
#   host        (130 s) benchmarks/bench_host.py on the demo config after 105 SFT steps:
#               the host time of 2 RL steps by category (demo_cold's cache, if it ran).
#   skew_bf16   (100 s) benchmarks/bench_engine.py's skewed-lengths workload at qwen2-0.5b
#               in bfloat16: level-sync at 64 and 16 slots against the engine's 16, read
#               chunk by chunk and with engine.overlap (each chunk read while the next
#               decodes).
#   compile     (450 s) benchmarks/bench_startup.py --runs=demo: the demo's programs
#               precompiled cold and warm with the train step's 1 and 8 at a time.
set -u
OUT_DIR=${1:-/tmp/gpu_bench}
ARMS=",${2:-demo_cold,host,skew_bf16},"
source "$(dirname "$0")/gpu_setup.sh"
echo "host: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo)" | tee -a "$OUT_DIR/benchmarks.txt"
CACHE=/tmp/gpu_compile_cache
if [[ $ARMS == *,demo_cold,* ]]; then
  rm -rf "$CACHE"
  run demo_cold 250 python3 -m experiments.train --config=configs/calculator.py \
    --workdir=/tmp/demo_cold --config.compile_cache="$CACHE" --config.rl.steps=20 \
    --config.eval.every=20 --config.eval.num_tasks=50 --progress=false
  cp /tmp/demo_cold/metrics.jsonl "$OUT_DIR/demo_cold.jsonl"
  cp /tmp/demo_cold/summary.json "$OUT_DIR/demo_cold_summary.json"
fi
if [[ $ARMS == *,host,* ]]; then
  run host 130 python3 -m benchmarks.bench_host --config=configs/calculator.py \
    --config.compile_cache="$CACHE" --steps=2 --sft_steps=105
fi
if [[ $ARMS == *,skew_bf16,* ]]; then
  run skew_bf16 100 python3 -m benchmarks.bench_engine --preset=qwen2-0.5b --dtype=bfloat16 \
    --workloads=skew --steps=2
fi
if [[ $ARMS == *,compile,* ]]; then
  run compile 450 python3 -m benchmarks.bench_startup --runs=demo --threads=2 \
    --train_threads=1,8
fi
