#!/usr/bin/env bash
# Tree-packed training and chunked decoding on a lent GPU.
#
#   bash benchmarks/gpu_tree.sh PART [OUTDIR]     PART = 1 | 2 (each fits one 10-minute call)
#
# Same set-up as benchmarks/gpu.sh, except that flax and orbax are the machine's
# own (flax 0.12.8 does not import on its jax 0.11.2); .whl/ carries only
# ml_collections and nest_asyncio. Figures: docs/performance.md. Each benchmark runs
# under its own time limit, so one that fails (out of memory, an unsupported
# cuDNN mask) leaves the others' figures.
set -u
PART=${1:-1}
OUT_DIR=${2:-/tmp/gpu_bench}
source "$(dirname "$0")/gpu_setup.sh"

Q="--dtype=bfloat16"
if [ "$PART" = 1 ]; then
  run sampler_bf16 200 python3 -m benchmarks.bench_sampler --preset=qwen2-0.5b $Q \
    --repeats=10 --decode_chunks=8,16
  run train_tree_cudnn 170 python3 -m benchmarks.bench_train --presets=qwen2-0.5b $Q \
    --rows=64 --peak_n=8192 --repeats=10 --packing=tree,rows --roots=2 --tree_kl=0.05 \
    --attention=cudnn
  run train_tree_xla_remat 200 python3 -m benchmarks.bench_train --presets=qwen2-0.5b $Q \
    --rows=64 --peak_n=8192 --repeats=5 --packing=tree,rows --roots=2 --tree_kl=0.05 --remat
else
  run rl_bf16 530 python3 -m benchmarks.bench_rl --preset=qwen2-0.5b $Q --steps=3 --long_steps=2 \
    --workloads=agentic,longctx,grpo --attention=cudnn
fi
