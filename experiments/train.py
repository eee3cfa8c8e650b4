"""Trains a policy with ENVGRPO / ENVGSPO (optional SFT warm-up) from a config file.

  python -m experiments.train --config=configs/calculator.py --workdir=runs/calc \
      --config.loss.algorithm=gspo --config.tree.num_generations=8

Resumes automatically when --workdir holds a checkpoint.
"""

import json

from absl import app, flags, logging
from ml_collections import config_flags

from mtrl_jax.train import rl

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (created; resumed if present)")
_PROGRESS = flags.DEFINE_bool("progress", True, "show a progress bar")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # Orbax logs every save at INFO
  summary = rl.run(_CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)
  print(json.dumps({k: summary[k] for k in ("workdir", "best", "compiles") if k in summary},
                   indent=1, default=float))


if __name__ == "__main__":
  app.run(main)
