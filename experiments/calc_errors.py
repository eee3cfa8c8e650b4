"""Where a calculator policy fails: its rollout dumps, classified per turn.

  python -m experiments.calc_errors --workdir=runs/demo/seed_0 --steps=10,50,100

Every completion of every dumped tree node (`workdir/rollouts/step_*.jsonl`,
written every `rl.dump_every` steps) is one attempt at one user turn, put in
one class:

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

import collections
import glob
import json
import os
import re

from absl import app, flags

from experiments import cli

_WORKDIR = flags.DEFINE_string("workdir", None, "run directory (with rollouts/)")
_STEPS = flags.DEFINE_list("steps", [], "dumped steps to report (default: all)")
flags.mark_flag_as_required("workdir")

CLASSES = ("right", "no tool call", "wrong expression", "answer != tool result")
_TOOL = re.compile(r"<\|tool\|>(.*?)<\|end\|>")
_ANSWER = re.compile(r"<answer>(.*?)</answer>")


def classify(completion: str, action: dict) -> str:
  """The class of one completion from its text and its action's dump record (see module doc)."""
  grade = action["steps"][-1].get("grades", {}).get("grade")
  if grade is None or grade["score"] > 0:  # no final grade: the episode went on
    return "right"
  tool, answer = _TOOL.search(completion), _ANSWER.search(completion)
  if tool is None:
    return "no tool call"
  if answer is not None and answer.group(1) != tool.group(1):
    return "answer != tool result"
  return "wrong expression"


def breakdown(path: str) -> dict[int, collections.Counter]:
  """turn -> Counter of classes over every completion in one dump file."""
  out = collections.defaultdict(collections.Counter)
  with open(path) as f:
    for line in f:
      node = json.loads(line)
      for completion, action in zip(node["completions"][0], node["actions"]):
        out[node["turn"]][classify(completion, action)] += 1
  return out


def main(argv):
  del argv
  paths = sorted(glob.glob(os.path.join(_WORKDIR.value, "rollouts", "step_*.jsonl")))
  if _STEPS.value:
    want = {int(s) for s in _STEPS.value}
    paths = [p for p in paths if int(re.search(r"step_(\d+)", p).group(1)) in want]
  if not paths:
    raise app.UsageError(f"--workdir={_WORKDIR.value!r} --steps={','.join(_STEPS.value)}: no "
                         "rollout dumps; allowed: a run directory with rollouts/step_<k>.jsonl "
                         "(written every rl.dump_every steps) for those steps")
  rows = [(int(re.search(r"step_(\d+)", p).group(1)), breakdown(p)) for p in paths]
  turns = sorted({t for _, b in rows for t in b})
  print("| RL step | " + " | ".join(f"turn {t + 1}: {c}" for t in turns for c in CLASSES) + " |")
  print("|---|" + "---|" * (len(turns) * len(CLASSES)))
  for step, b in rows:
    cells = []
    for t in turns:
      total = sum(b[t].values()) or 1
      cells += [f"{b[t][c] / total:.2f}" for c in CLASSES]
    print(f"| {step} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  cli.run(main)
