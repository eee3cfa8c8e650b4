"""The default experiment (`make demo`): SFT warm-up then ENVGRPO on the calculator task.

  python -m experiments.demo                      # one seed (~12 min on 2 CPU cores)
  python -m experiments.demo --seeds=0,1,2        # the README figure (mean and spread)
  python -m experiments.demo --config=configs/calculator.py:smoke=True --seeds=0  # seconds

Prints a summary table (held-out success after SFT, after RL, best step) and
writes `learning_curve.png` beside the per-seed run directories.
"""

import os

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from mtrl_jax.train import report

_CONFIG = config_flags.DEFINE_config_file("config", "configs/calculator.py", "config file",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", "runs/demo", "parent of the per-seed run directories")
_SEEDS = flags.DEFINE_list("seeds", ["0"], "seeds to run, one run directory each")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  workdirs = report.run_seeds(_CONFIG.value, _WORKDIR.value, [int(s) for s in _SEEDS.value])
  print(report.summary_table(workdirs))
  png = report.plot_learning_curves(workdirs, os.path.join(_WORKDIR.value, "learning_curve.png"))
  print(f"learning curve: {png}")


if __name__ == "__main__":
  cli.run(main)
