#!/usr/bin/env bash
# Tree-packed training and chunked decoding on a lent GPU (issue 13), one call:
#
#   bash benchmarks/gpu_tree.sh [OUTDIR]
#
# Same set-up as benchmarks/gpu.sh (the machine's jax with CUDA; flax, orbax,
# ml_collections and tensorboardX travel as wheels in .whl/).
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

run sampler_bf16 python3 experiments/bench_sampler.py --preset=qwen2-0.5b --dtype=bfloat16 \
  --repeats=10 --decode_chunks=1,4,8,16
run train_bf16 python3 experiments/bench_train.py --presets=qwen2-0.5b --dtype=bfloat16 \
  --rows=64 --peak_n=8192 --repeats=10 --packing=tree,rows --roots=4
run rl_bf16 python3 experiments/bench_rl.py --preset=qwen2-0.5b --dtype=bfloat16 --steps=5 \
  --long_steps=3
