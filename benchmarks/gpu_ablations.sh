#!/usr/bin/env bash
# The ablation runs behind docs/ablations.md, many small runs sharing one GPU.
#
#   bash benchmarks/gpu_ablations.sh OUTDIR [SECONDS]
#
# Starts the calculator 'all' sweep (7 settings x 3 seeds, 7 processes at a
# time) and the coop 'all' sweep (5 settings x 3 seeds, 5 at a time) side by
# side on one GPU, stops whatever is still running after SECONDS (default
# 520; a stopped run keeps its metrics so far), and packs every run's
# metrics, summary, config and log into OUTDIR/ablations.tgz. Then:
#   tar xzf ablations.tgz -C runs/ && python experiments/ablate.py --runs='runs/ablations/calc/*'
set -u
OUT_DIR=${1:?OUTDIR}
LIMIT=${2:-520}
if ls .whl/*.whl >/dev/null 2>&1; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:.
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=2 XLA_PYTHON_CLIENT_PREALLOCATE=false
mkdir -p runs/ablations "$OUT_DIR"
timeout "$LIMIT" python3 experiments/sweep.py --config=configs/calculator.py --sweep=all \
  --workdir=runs/ablations/calc --parallel=7 > "$OUT_DIR/sweep_calc.txt" 2>&1 &
timeout "$LIMIT" python3 experiments/sweep.py --config=configs/coop.py --sweep=all \
  --workdir=runs/ablations/coop --parallel=5 > "$OUT_DIR/sweep_coop.txt" 2>&1 &
wait
pkill -f experiments/train.py; sleep 2
tar czf "$OUT_DIR/ablations.tgz" --exclude=ckpt --exclude=best --exclude=tb --exclude=rollouts \
  runs/ablations
grep -h "finished\|started" "$OUT_DIR"/sweep_*.txt | sort | uniq -c | sort -rn | head -3
grep -h "finished" "$OUT_DIR"/sweep_*.txt
