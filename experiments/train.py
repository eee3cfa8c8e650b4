"""Trains a policy with ENVGRPO / ENVGSPO (optional SFT warm-up) from a config file.

  python -m experiments.train --config=configs/calculator.py --workdir=runs/calc \
      --config.loss.algorithm=gspo --config.tree.num_generations=8

Resumes automatically when --workdir holds a checkpoint. On several hosts run
the same command on every host with --config.distributed.mode=auto (TPU pod
slices, SLURM) or explicit addresses; on one machine `experiments/launch_local.py`
starts the processes (docs/multihost.md). A flag, config or workdir that
cannot run is refused before any model is built or file written, with one line
naming the field, its value and what is allowed (exit status 2, no traceback;
`experiments/cli.py`).

The run says what it is doing in one line per phase on stderr (the SFT warm-up,
programs compiling, each held-out evaluation with the best so far, the end:
`mtrl_jax/run/console.py`); --progress=false turns off the progress bar only.
"""

import json
import sys

from absl import app, flags, logging
from ml_collections import config_flags

from experiments import cli
from mtrl_jax import distributed
from mtrl_jax.run import experiment, recipes, rl

_CONFIG = config_flags.DEFINE_config_file("config", None, "config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (created; resumed if present)")
_PROGRESS = flags.DEFINE_bool(
    "progress",
    True,
    "show a progress bar (false: no bar; the one-line phase messages on stderr stay)",
)
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; allowed: flags only")
  logging.set_verbosity(logging.WARNING)  # start-up and Orbax's saves log at INFO
  recipes.check_workdir(_WORKDIR.value, "--workdir")
  # Joins the other processes first (validation counts them), then validates.
  exp = experiment.start(_CONFIG.value)
  summary = rl.train(exp, _CONFIG.value, _WORKDIR.value, progress=_PROGRESS.value)
  if summary.get("halted"):  # nothing was learning: the loop printed why, summary.json has it
    sys.exit(3)
  if not distributed.is_writer():
    return
  print(
      json.dumps(
          {k: summary[k] for k in ("workdir", "best", "compiles") if k in summary},
          indent=1,
          default=float,
      )
  )


if __name__ == "__main__":
  cli.run(main)
