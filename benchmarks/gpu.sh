#!/usr/bin/env bash
# The GPU benchmark run behind docs/performance.md (one call on a lent GPU machine).
#
#   bash benchmarks/gpu.sh [OUTDIR]
#
# Runs on a machine whose python3 already has jax with CUDA (the lent H100/H200
# image: jax 0.11.2). Packages that image lacks travel as wheels in .whl/
# (ml_collections and the flax / orbax-checkpoint versions the
# project pins); they are installed into /tmp/site. Each benchmark's full
# output is written to OUTDIR (default: /tmp/gpu_bench) and echoed.
set -u
OUT_DIR=${1:-/tmp/gpu_bench}
source "$(dirname "$0")/gpu_setup.sh"

run train_f32 python3 -m benchmarks.bench_train --presets=bench,small --peak_n=8192 --repeats=10
run train_bf16 python3 -m benchmarks.bench_train --presets=qwen2-0.5b --dtype=bfloat16 \
  --rows=64 --peak_n=8192 --repeats=10
run sampler_f32 python3 -m benchmarks.bench_sampler --preset=bench --repeats=10
run sampler_bf16 python3 -m benchmarks.bench_sampler --preset=qwen2-0.5b --dtype=bfloat16 --repeats=10
run engine_bf16 python3 -m benchmarks.bench_engine --preset=qwen2-0.5b --dtype=bfloat16
run rl_f32 python3 -m benchmarks.bench_rl --preset=bench --steps=20
run rl_bf16 python3 -m benchmarks.bench_rl --preset=qwen2-0.5b --dtype=bfloat16 --steps=10
