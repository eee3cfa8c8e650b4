"""Evaluates a trained policy on held-out tasks and prints a markdown table.

  python experiments/eval.py --workdir=runs/calc                      # best checkpoint, greedy
  python experiments/eval.py --workdir=runs/calc --checkpoint=latest --num_tasks=200 --samples=8

The run is rebuilt from --workdir/config.json; --checkpoint picks 'best' (kept by
held-out success during training), 'latest' or a saved step. Each task of the
eval split (the first --num_tasks; default the run's eval.num_tasks) is rolled
out along one path, greedy, exactly as training evaluates it. --samples=k > 1
adds k sampled (temperature 1) attempts per task: their mean success and pass@k
(the fraction of tasks that any of the k attempts solved). A success is an
ended trajectory whose outcome is above the run's eval.success_threshold.

stderr names the checkpoint used ("using best checkpoint: step 40
(eval/greedy/success 0.62)") and warns in one line when the best is the
untrained step 0; an unreadable latest checkpoint is skipped for the one before,
with a warning line naming it. --num_tasks is not bounded by the run's
buckets or engine slots (the engine queues the prompts). A bad flag or a
workdir without that checkpoint, or a --json file in a missing folder, is
refused in one line before any model is built.
"""

import json
import sys

from absl import app, flags, logging

from experiments import cli, outputs
from mtrl_jax.run import experiment, saved

_WORKDIR = flags.DEFINE_string("workdir", None, "the training run's directory")
_CHECKPOINT = flags.DEFINE_string("checkpoint", "best", "'best' | 'latest' | a step number")
_NUM_TASKS = flags.DEFINE_integer("num_tasks", 0, "eval tasks (0: the run's eval.num_tasks)")
_SAMPLES = flags.DEFINE_integer("samples", 1, "sampled attempts per task (> 1: adds pass@k)")
_GREEDY = flags.DEFINE_bool("greedy", True, "also evaluate greedily")
_SEED = flags.DEFINE_integer("seed", 0, "key of the sampled attempts")
_JSON = flags.DEFINE_string("json", "", "also write the rows to this JSON file")
flags.mark_flags_as_required(["workdir"])


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments {argv[1:]}; allowed: flags only")
  logging.set_verbosity(logging.WARNING)  # Orbax logs every restore at INFO
  try:
    if _NUM_TASKS.value < 0 or _SAMPLES.value < 1:
      raise experiment.ConfigError(
          f"--num_tasks={_NUM_TASKS.value}, --samples={_SAMPLES.value}; allowed: "
          "num_tasks >= 0 (0: the run's eval.num_tasks), samples >= 1"
      )
    if _JSON.value:  # written after the evaluation: a path that cannot be is refused now
      outputs.check_output_file("--json", _JSON.value)
    if not _GREEDY.value and _SAMPLES.value == 1:
      raise experiment.ConfigError(
          "--nogreedy with --samples=1 evaluates one sampled attempt; "
          "allowed: --greedy, or --samples > 1"
      )
    policy = saved.load_policy(_WORKDIR.value, _CHECKPOINT.value)
  except experiment.ConfigError as e:
    raise app.UsageError(str(e)) from None
  print(policy.using, file=sys.stderr, flush=True)
  if policy.warning:
    print(f"warning: {policy.warning}", file=sys.stderr, flush=True)
  rows = saved.evaluate_policy(
      policy,
      num_tasks=_NUM_TASKS.value,
      samples=_SAMPLES.value,
      greedy=_GREEDY.value,
      seed=_SEED.value,
  )
  print(saved.markdown_table(rows), flush=True)
  if _JSON.value:
    with open(_JSON.value, "w") as f:
      json.dump(rows, f, indent=1)


if __name__ == "__main__":
  cli.run(main)
