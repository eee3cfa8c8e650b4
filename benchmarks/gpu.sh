#!/usr/bin/env bash
# The GPU benchmark session behind docs/performance.md (one call on a lent GPU machine).
#
#   bash benchmarks/gpu.sh [OUTDIR]
#
# Runs on a machine whose python3 already has jax with CUDA (the lent H100/H200
# image: jax 0.11.2). Packages that image lacks travel as wheels in .whl/
# (ml_collections, tensorboardX, and the flax / orbax-checkpoint versions the
# project pins); they are installed into /tmp/site. Each benchmark's full
# output is written to OUTDIR (default: /tmp/gpu_bench) and echoed.
set -u
OUT_DIR=${1:-/tmp/gpu_bench}
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

run() {  # run NAME CMD...: time a benchmark, keep its output
  local name=$1; shift
  echo "=== $name: $*"
  local t0=$SECONDS
  "$@" 2>&1 | grep -v -E "^(W|I)[0-9]{4} |UserWarning|warnings.warn" | tee -a "$OUT_DIR/benchmarks.txt"
  echo "=== $name took $((SECONDS - t0)) s"
}

run train_f32 python3 -m benchmarks.bench_train --presets=bench,small --peak_n=8192 --repeats=10
run train_bf16 python3 -m benchmarks.bench_train --presets=qwen2-0.5b --dtype=bfloat16 \
  --rows=64 --peak_n=8192 --repeats=10
run sampler_f32 python3 -m benchmarks.bench_sampler --preset=bench --repeats=10
run sampler_bf16 python3 -m benchmarks.bench_sampler --preset=qwen2-0.5b --dtype=bfloat16 --repeats=10
run rollout_f32 python3 -m benchmarks.bench_rollout --preset=bench --repeats=5
run rollout_bf16 python3 -m benchmarks.bench_rollout --preset=qwen2-0.5b --dtype=bfloat16 --repeats=3
run rl_f32 python3 -m benchmarks.bench_rl --preset=bench --steps=20
run rl_bf16 python3 -m benchmarks.bench_rl --preset=qwen2-0.5b --dtype=bfloat16 --steps=10
