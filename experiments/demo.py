"""The default experiment (`make demo`): SFT warm-up then ENVGRPO on the calculator task.

  python -m experiments.demo                      # one seed (~12 min on 2 CPU cores)
  python -m experiments.demo --seeds=0,1,2        # the README figure (mean and spread)
  python -m experiments.demo --config=configs/calculator.py:smoke=True --seeds=0  # seconds

Prints a summary table (held-out success after SFT, after RL, best step) and
writes `learning_curve.png` beside the per-seed run directories.
"""

import os
import re
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli, report
from mtrl_jax.run import recipes

DEFAULT_CONFIG = "configs/calculator.py"
# No default here: config_flags would load it and apply --config.<key> overrides at import,
# where a mistyped key is a traceback; the default goes into argv below instead.
_CONFIG = config_flags.DEFINE_config_file(
    "config", None, f"config file (default: {DEFAULT_CONFIG})", lock_config=True
)
_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "parent of the per-seed run directories")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds to run, one run directory each")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  recipes.check_workdir(_WORKDIR.value, "--workdir")
  if not _SEEDS.value or not all(s.strip().isdigit() for s in _SEEDS.value):
    raise app.UsageError(f"--seeds={','.join(_SEEDS.value)}; allowed: integers >= 0, e.g. 0,1,2")
  workdirs = report.run_seeds(_CONFIG.value, _WORKDIR.value, [int(s) for s in _SEEDS.value])
  print(report.summary_table(workdirs))
  png = report.plot_learning_curves(workdirs, os.path.join(_WORKDIR.value, "learning_curve.png"))
  print(f"learning curve: {png}")


if __name__ == "__main__":
  if not any(re.match(r"^--?config(=|$)", arg) for arg in sys.argv[1:]):
    sys.argv.insert(1, f"--config={DEFAULT_CONFIG}")
  cli.run(main)
