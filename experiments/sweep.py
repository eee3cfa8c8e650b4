"""Expands a config's `get_sweep(arg)` into runs, one workdir each.

  python -m experiments.sweep --config=configs/calculator.py --workdir=runs/sweep_T --sweep=turns
  python -m experiments.sweep --config=configs/calculator.py --workdir=runs/sweep_T --sweep=turns --print_only
  python -m experiments.sweep --config=configs/coop.py --workdir=runs/coop --sweep=all --parallel=6
  python -m experiments.sweep --config=configs/coop.py --workdir=runs/coop --sweep=all --only=show_partner

`get_sweep(arg)` (beside `get_config` in the config file) returns a list of
dicts of dotted overrides, e.g. [{"tree.num_turns": 1, "seed": 0}, ...]; seeds
are one more axis. Each run's workdir is named after its overrides, so a sweep
re-run skips finished runs (those with summary.json; --rerun runs them again),
resumes unfinished ones at their last checkpoint, and
`experiments/ablate.py` can read them back. With --parallel=K the runs are K
`experiments/train.py` processes at a time (each logs to <workdir>.log), e.g.
several small runs sharing one GPU.
"""

import os
import shlex
import subprocess
import sys
import time

from absl import app, flags, logging

from experiments import cli
from mtrl_jax.train import report

_CONFIG = flags.DEFINE_string("config", None, "config file (path[:arg])")
_SWEEP = flags.DEFINE_string("sweep", "", "argument of get_sweep(arg)")
_WORKDIR = flags.DEFINE_string("workdir", None, "parent directory of the runs")
_PRINT = flags.DEFINE_bool("print_only", False, "print one command per run instead of running")
_RERUN = flags.DEFINE_bool("rerun", False, "also run the runs that finished already "
                           "(their workdir has summary.json); by default they are skipped, so "
                           "repeating a sweep command completes the missing runs")
_ONLY = flags.DEFINE_list("only", [], "keep only the runs whose workdir name contains one of "
                          "these strings, e.g. --only=show_partner,num_generations=2")
_PARALLEL = flags.DEFINE_integer("parallel", 0, "run K train.py processes at a time (0: in-process, one by one)")
flags.mark_flags_as_required(["config", "workdir"])


def run_parallel(commands, k: int) -> None:
  """Runs (workdir, command) pairs, k at a time; reports each exit status."""
  pending, active, failed = list(commands), {}, []
  while pending or active:
    while pending and len(active) < k:
      workdir, cmd = pending.pop(0)
      os.makedirs(os.path.dirname(workdir) or ".", exist_ok=True)
      log = open(workdir + ".log", "w")
      argv = shlex.split(cmd)
      argv[0] = sys.executable  # the command says "python"; run this interpreter
      active[workdir] = (subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT),
                         log, time.time())
      print(f"started {workdir}", flush=True)
    for workdir, (proc, log, t0) in list(active.items()):
      if proc.poll() is not None:
        log.close()
        del active[workdir]
        print(f"finished {workdir} (exit {proc.returncode}, {time.time() - t0:.0f} s)", flush=True)
        if proc.returncode:
          failed.append(workdir)
    time.sleep(1.0)
  if failed:
    raise SystemExit(f"{len(failed)} runs failed; see their .log files: {failed}")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  runs = report.expand_sweep(_CONFIG.value, _SWEEP.value, _WORKDIR.value)
  if _ONLY.value:
    runs = [r for r in runs if any(o in os.path.basename(r[0]) for o in _ONLY.value)]
    if not runs:
      raise app.UsageError(f"--only={','.join(_ONLY.value)} matches no run of --sweep={_SWEEP.value}")
  if not (_RERUN.value or _PRINT.value):
    done = [w for w, _, _ in runs if os.path.exists(os.path.join(w, "summary.json"))]
    for w in done:
      print(f"skipped (finished; --rerun runs it again): {w}", flush=True)
    runs = [r for r in runs if r[0] not in done]
  if _PARALLEL.value > 0 and not _PRINT.value:
    commands = [(w, report.train_command(_CONFIG.value, w, o) + " --progress=false")
                for w, o, _ in runs]
    run_parallel(commands, _PARALLEL.value)
    return
  for workdir, overrides, config in runs:
    if _PRINT.value:
      print(report.train_command(_CONFIG.value, workdir, overrides))
      continue
    from mtrl_jax.train import rl
    print(f"== {workdir}", flush=True)
    rl.run(config, workdir)


if __name__ == "__main__":
  cli.run(main)
