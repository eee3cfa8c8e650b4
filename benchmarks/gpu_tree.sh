#!/usr/bin/env bash
# Tree-packed training and chunked decoding on a lent GPU (issue 13).
#
#   bash benchmarks/gpu_tree.sh PART [OUTDIR]     PART = 1 | 2 (each fits one 10-minute call)
#
# Same set-up as benchmarks/gpu.sh, except that flax and orbax are the machine's
# own (flax 0.12.8 does not import on its jax 0.11.2); .whl/ carries only
# ml_collections, tensorboardX and nest_asyncio. Figures: docs/performance.md. Each benchmark runs
# under its own time limit, so one that fails (out of memory, an unsupported
# cuDNN mask) leaves the others' figures.
set -u
PART=${1:-1}
OUT_DIR=${2:-/tmp/gpu_bench}
mkdir -p "$OUT_DIR"
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
else
  export PYTHONPATH=.
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv | tee -a "$OUT_DIR/benchmarks.txt"
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())" \
  | tee -a "$OUT_DIR/benchmarks.txt"

run() {  # run NAME SECONDS CMD...: a benchmark under a time limit, output kept
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | grep -v -E "^(W|I)[0-9]{4} |UserWarning|warnings.warn" \
    | tee -a "$OUT_DIR/benchmarks.txt"
  echo "=== $name took $((SECONDS - t0)) s (exit ${PIPESTATUS[0]})"
}

Q="--dtype=bfloat16"
if [ "$PART" = 1 ]; then
  # Each decode_chunk is its own set of programs: 1,8,16 did not compile within 150 s.
  run sampler_bf16 200 python3 -m benchmarks.bench_sampler --preset=qwen2-0.5b $Q \
    --repeats=10 --decode_chunks=1,8
  run train_tree_cudnn 170 python3 -m benchmarks.bench_train --presets=qwen2-0.5b $Q \
    --rows=64 --peak_n=8192 --repeats=10 --packing=tree,rows --roots=2 --tree_kl=0.05 \
    --attention=cudnn
  run train_tree_xla_remat 200 python3 -m benchmarks.bench_train --presets=qwen2-0.5b $Q \
    --rows=64 --peak_n=8192 --repeats=5 --packing=tree,rows --roots=2 --tree_kl=0.05 --remat
else
  run rl_bf16 530 python3 -m benchmarks.bench_rl --preset=qwen2-0.5b $Q --steps=3 --long_steps=2 \
    --workloads=agentic,longctx,grpo --attention=cudnn
fi
