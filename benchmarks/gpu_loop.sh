#!/usr/bin/env bash
# The engine's loop on a lent GPU machine: launch to the first update with a cold
# compile cache, the demo's RL step, where its host time goes, and skewed lengths at
# equal memory. One call of under 10 minutes:
#
#   bash benchmarks/gpu_loop.sh [OUTDIR]
#
# Same set-up as benchmarks/gpu_host.sh (.whl/ carries ml_collections and nest_asyncio).
# Figures: docs/performance.md.
#   demo_cold   the demo config (configs/calculator.py: SFT warm-up until 30% success,
#               then RL) for 20 RL steps, threads, an empty compile cache; its
#               metrics.jsonl is copied to OUTDIR/demo_cold.jsonl.
#   host        benchmarks/bench_host.py on the demo config after 105 SFT steps: the host
#               time of 2 RL steps by category (programs from demo_cold's cache).
#   skew_bf16   benchmarks/bench_engine.py's skewed-lengths workload at qwen2-0.5b in
#               bfloat16: level-sync at 64 and 16 slots against the engine's 16.
set -u
OUT_DIR=${1:-/tmp/gpu_bench}
source "$(dirname "$0")/gpu_setup.sh"
echo "host: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo)" | tee -a "$OUT_DIR/benchmarks.txt"
CACHE=/tmp/gpu_compile_cache
rm -rf "$CACHE"
run demo_cold 250 python3 -m experiments.train --config=configs/calculator.py \
  --workdir=/tmp/demo_cold --config.compile_cache="$CACHE" --config.rl.steps=20 \
  --config.eval.every=20 --config.eval.num_tasks=50 --progress=false
cp /tmp/demo_cold/metrics.jsonl "$OUT_DIR/demo_cold.jsonl"
cp /tmp/demo_cold/summary.json "$OUT_DIR/demo_cold_summary.json"
run host 130 python3 -m benchmarks.bench_host --config=configs/calculator.py \
  --config.compile_cache="$CACHE" --steps=2 --sft_steps=105
run skew_bf16 100 python3 -m benchmarks.bench_engine --preset=qwen2-0.5b --dtype=bfloat16 \
  --workloads=skew --steps=2
