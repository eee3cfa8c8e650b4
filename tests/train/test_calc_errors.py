"""experiments/calc_errors.py: the failure classes of calculator completions."""

import json

from experiments import calc_errors

CALL = '<tool_call>{"name":"calculate","arguments":{"expression":"%s"}}</tool_call><|end|>'


def _done(score):
  """An action's dump record whose last step carries the final grade."""
  return {"steps": [{"grades": {"grade": {"score": score, "reason": "", "components": {}}}}]}


GOES_ON = {"steps": [{"grades": {}}]}


def test_classes_of_hand_written_completions(tmp_path):
  right = CALL % "66+63" + "<|tool|>129<|end|><|assistant|><answer>129</answer><|end|>"
  miscopied = CALL % "66+66" + "<|tool|>132<|end|><|assistant|><answer>132</answer><|end|>"
  bad_answer = CALL % "66+63" + "<|tool|>129<|end|><|assistant|><answer>192</answer><|end|>"
  assert calc_errors.classify(right, GOES_ON) == "right"  # no final grade: the episode went on
  assert calc_errors.classify(right, _done(1.0)) == "right"
  assert calc_errors.classify(miscopied, _done(-1.0)) == "wrong expression"
  assert calc_errors.classify(bad_answer, _done(-1.0)) == "answer != tool result"
  assert calc_errors.classify("<answer>129</answer><|end|>", _done(-1.0)) == "no tool call"
  dump = tmp_path / "step_000010.jsonl"
  nodes = [{"turn": 0, "completions": [[right, miscopied]], "actions": [GOES_ON, _done(-1.0)]},
           {"turn": 1, "completions": [[bad_answer]], "actions": [_done(-1.0)]}]
  dump.write_text("".join(json.dumps(n) + "\n" for n in nodes))
  b = calc_errors.breakdown(str(dump))
  assert b[0] == {"right": 1, "wrong expression": 1} and b[1] == {"answer != tool result": 1}
