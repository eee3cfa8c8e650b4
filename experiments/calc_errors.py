"""Where a calculator policy fails: its rollout dumps, classified per turn.

  python -m experiments.calc_errors --workdir=runs/demo/seed_0 --steps=10,50,100

Every completion of every dumped tree node (`workdir/rollouts/step_*.jsonl`,
written every `rl.dump_every` steps) is one attempt at one user turn, put in
one class (`mtrl_jax.tasks.calculator.failure_class`):

  right                  the turn's answer was accepted (the episode goes on
                         to the follow-up, or ends graded +1);
  no tool call           graded -1 without a `calculate` call;
  wrong expression       the tool ran, but on an expression whose value is
                         not the expected answer (operands miscopied);
  answer != tool result  the tool returned the right value but the answer
                         copied it wrongly.

Prints one markdown row per dumped step with the share of each class, per
user turn.
"""

from __future__ import annotations

from absl import app, flags

from experiments import cli
from mtrl_jax.rollout.dump import dump_files, no_dumps_message, read_dump
from mtrl_jax.tasks.calculator import FAILURE_CLASSES, failure_classes

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (with rollouts/)")
_STEPS = flags.DEFINE_list("steps", [], "dumped steps to report (default: all)")
flags.mark_flag_as_required("workdir")


def main(argv):
  del argv
  files = dump_files(_WORKDIR.value)
  if not files:
    raise app.UsageError(no_dumps_message(_WORKDIR.value))
  try:
    want = sorted({int(s) for s in _STEPS.value}) if _STEPS.value else list(files)
  except ValueError:
    raise app.UsageError(
        f"--steps={','.join(_STEPS.value)}; allowed: dumped step numbers, of {list(files)}"
    ) from None
  missing = [s for s in want if s not in files]
  if missing:
    raise app.UsageError(
        f"--steps: {_WORKDIR.value} has no dump of steps {missing}; allowed: {list(files)}"
    )
  rows = [(step, failure_classes(read_dump(files[step]))) for step in want]
  turns = sorted({t for _, b in rows for t in b})
  print(
      "| RL step | "
      + " | ".join(f"turn {t + 1}: {c}" for t in turns for c in FAILURE_CLASSES)
      + " |"
  )
  print("|---|" + "---|" * (len(turns) * len(FAILURE_CLASSES)))
  for step, b in rows:
    cells = []
    for t in turns:
      total = sum(b.get(t, {}).values()) or 1
      cells += [f"{b.get(t, {}).get(c, 0) / total:.2f}" for c in FAILURE_CLASSES]
    print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  cli.run(main)
