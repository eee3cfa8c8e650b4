#!/usr/bin/env bash
# The host side of an RL step on a lent GPU machine (16 host cores): environment
# workers against threads, the demo's RL step on the rollout engine, and the engine's
# workloads at 0.5B. One call of under 10 minutes:
#
#   bash benchmarks/gpu_host.sh [OUTDIR]
#
# Same set-up as benchmarks/gpu_tree.sh (flax and orbax are the machine's own; .whl/
# carries ml_collections and nest_asyncio). Figures: docs/performance.md.
#   workers_C   benchmarks/bench_workers.py pinned to C cores (`taskset`; the process
#               pool takes one worker per usable core): threads vs processes.
#   demo_MODE   the demo config (configs/calculator.py: SFT warm-up until 30% success,
#               then RL) for 20 RL steps with env.workers=MODE; its metrics.jsonl is
#               copied to OUTDIR/demo_MODE.jsonl. The first arm compiles cold, the second
#               finds the first's programs in the persistent compile cache.
#   engine_bf16 benchmarks/bench_engine.py at qwen2-0.5b in bfloat16 (what time is left).
set -u
OUT_DIR=${1:-/tmp/gpu_bench}
source "$(dirname "$0")/gpu_setup.sh"
echo "host: $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo)" | tee -a "$OUT_DIR/benchmarks.txt"

for cores in 2 16; do
  run "workers_$cores" 80 taskset -c "0-$((cores - 1))" \
    python3 -m benchmarks.bench_workers --roots=16 --repeats=3
done
CACHE=/tmp/gpu_compile_cache
for mode in threads processes; do
  run "demo_$mode" 170 python3 -m experiments.train --config=configs/calculator.py \
    --workdir="/tmp/demo_$mode" --config.compile_cache="$CACHE" --config.rl.steps=20 \
    --config.eval.every=20 --config.eval.num_tasks=50 --config.env.workers="$mode" --progress=false
  cp "/tmp/demo_$mode/metrics.jsonl" "$OUT_DIR/demo_$mode.jsonl"
done
run engine_bf16 110 python3 -m benchmarks.bench_engine --preset=qwen2-0.5b --dtype=bfloat16 \
  --workloads=longctx,skew --steps=2
