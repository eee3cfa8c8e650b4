"""Expands a config's `get_sweep(arg)` into runs, one workdir each.

  python experiments/sweep.py --config=configs/calculator.py --workdir=runs/sweep_T --sweep=turns
  python experiments/sweep.py --config=configs/calculator.py --workdir=runs/sweep_T --sweep=turns --print_only

`get_sweep(arg)` (beside `get_config` in the config file) returns a list of
dicts of dotted overrides, e.g. [{"tree.num_turns": 1, "seed": 0}, ...]; seeds
are one more axis. Each run's workdir is named after its overrides, so a sweep
re-run skips finished runs (they resume at their last step) and
`experiments/ablate.py` can read them back.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # configs/

from absl import app, flags, logging

from mtrl_jax.train import report

_CONFIG = flags.DEFINE_string("config", None, "config file (path[:arg])")
_SWEEP = flags.DEFINE_string("sweep", "", "argument of get_sweep(arg)")
_WORKDIR = flags.DEFINE_string("workdir", None, "parent directory of the runs")
_PRINT = flags.DEFINE_bool("print_only", False, "print one command per run instead of running")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  runs = report.expand_sweep(_CONFIG.value, _SWEEP.value, _WORKDIR.value)
  for workdir, overrides, config in runs:
    if _PRINT.value:
      print(report.train_command(_CONFIG.value, workdir, overrides))
      continue
    from mtrl_jax.train import rl
    print(f"== {workdir}", flush=True)
    rl.run(config, workdir)


if __name__ == "__main__":
  app.run(main)
