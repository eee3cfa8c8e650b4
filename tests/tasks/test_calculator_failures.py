"""The failure classes of calculator completions (`mtrl_jax.tasks.calculator.failure_class`)
and the `experiments.calc_errors` table over a run's rollout dumps."""

import json
import os
import subprocess
import sys

from mtrl_jax.tasks.calculator import failure_class, failure_classes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALL = '<tool_call>{"name":"calculate","arguments":{"expression":"%s"}}</tool_call><|end|>'
RIGHT = CALL % "66+63" + "<|tool|>129<|end|><|assistant|><answer>129</answer><|end|>"
MISCOPIED = CALL % "66+66" + "<|tool|>132<|end|><|assistant|><answer>132</answer><|end|>"
BAD_ANSWER = CALL % "66+63" + "<|tool|>129<|end|><|assistant|><answer>192</answer><|end|>"
GOES_ON = {"steps": [{"grades": {}}]}


def _done(score):
  """An action's dump record whose last step carries the final grade."""
  return {"steps": [{"grades": {"grade": {"score": score, "reason": "", "components": {}}}}]}


NODES = [
    {
        "node_id": 0,
        "turn": 0,
        "completions": [[RIGHT, MISCOPIED]],
        "actions": [GOES_ON, _done(-1.0)],
    },
    {
        "node_id": 1,
        "turn": 1,
        "completions": [[BAD_ANSWER, RIGHT]],
        "actions": [_done(-1.0), _done(1.0)],
    },
]


def test_classes_of_hand_written_completions():
  assert failure_class(RIGHT, GOES_ON) == "right"  # no final grade: the episode went on
  assert failure_class(RIGHT, _done(1.0)) == "right"
  assert failure_class(MISCOPIED, _done(-1.0)) == "wrong expression"
  assert failure_class(BAD_ANSWER, _done(-1.0)) == "answer != tool result"
  assert failure_class("<answer>129</answer><|end|>", _done(-1.0)) == "no tool call"
  got = failure_classes(NODES)
  assert got == {
      0: {"right": 1, "wrong expression": 1},
      1: {"answer != tool result": 1, "right": 1},
  }


def test_the_table_of_a_runs_dumps_and_its_one_line_refusals(tmp_path):
  os.makedirs(tmp_path / "rollouts")
  (tmp_path / "rollouts" / "step_000010.jsonl").write_text(
      "".join(json.dumps(n) + "\n" for n in NODES)
  )

  def run(*args):
    return subprocess.run(
        [sys.executable, "-m", "experiments.calc_errors", f"--workdir={tmp_path}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )

  out = run()
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert lines[0].startswith("| RL step | turn 1: right | turn 1: no tool call |")
  # turn 1: one right, one miscopied; turn 2: one bad answer, one right
  assert lines[2] == ("| 10 | 0.50 | 0.00 | 0.50 | 0.00 | 0.50 | 0.00 | 0.00 | 0.50 |")
  for args, want in [
      (["--steps=11"], "has no dump of steps [11]; allowed: [10]"),
      (["--steps=x"], "--steps=x; allowed: dumped step numbers"),
  ]:
    out = run(*args)
    assert out.returncode != 0 and want in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
