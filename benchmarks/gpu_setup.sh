# Sourced by benchmarks/gpu*.sh on a lent GPU machine: installs the wheels in
# .whl/ (packages the machine's image lacks) into /tmp/site, prints the device,
# and defines `run NAME [SECONDS] CMD...`, which runs a benchmark (under a time
# limit when SECONDS is given) and appends its output to $OUT_DIR/benchmarks.txt.
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

run() {  # run NAME [SECONDS] CMD...
  local name=$1; shift
  local limit=()
  if [[ $1 =~ ^[0-9]+$ ]]; then limit=(timeout "$1"); shift; fi
  echo "=== $name: $*"
  local t0=$SECONDS
  "${limit[@]}" "$@" 2>&1 | grep -v -E "^(W|I)[0-9]{4} |UserWarning|warnings.warn" \
    | tee -a "$OUT_DIR/benchmarks.txt"
  echo "=== $name took $((SECONDS - t0)) s (exit ${PIPESTATUS[0]})"
}
