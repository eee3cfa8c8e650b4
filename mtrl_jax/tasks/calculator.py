"""The CPU demo task: multi-turn arithmetic with a `calculate` tool.

An episode (compact byte-level chat format):

    user:       "37+415*2="
    assistant:  <tool_call>{"name":"calculate","arguments":{"expression":"37+415*2"}}</tool_call>
    tool:       "867"
    assistant:  <answer>867</answer>
    user:       "then -58"                 (a scripted follow-up on that result)
    assistant:  <tool_call>{... "expression":"867-58"}}</tool_call>
    tool:       "809"
    assistant:  <answer>809</answer>

So one episode has two user turns and two tool calls. The trajectory's
outcome is +1 when every answer is right and -1 otherwise (a wrong answer or a
message with neither a tool call nor an answer ends the episode at once); step
and invalid-call penalties come from the run's `RewardConfig`. The first tool
call of each stage also returns a per-turn grade `copy`: how close its
expression is to the stage's expression (`copy_similarity`, 1 = exact), which
`reward.shaping_weight` turns into shaping (0 by default: no effect). Tasks are
generated from a seed: index i of a split is always the same task, so a run's
data order is reproducible and resumable. Difficulty = number of operands;
`level` (0-4, `LEVELS`) picks operand count and digits together for a
curriculum (`curriculum.enabled`, `mtrl_jax.data.CurriculumStream`); without
it the task keeps its keyword arguments (the default equals level 2).
"""

from __future__ import annotations

import ast
import collections
import operator
import re
from typing import Any, Mapping, Optional

import numpy as np

from mtrl_jax import data
from mtrl_jax.envs import Environment, EnvironmentFactory, Thread, Turn, register_env_factory
from mtrl_jax.envs.tools import ToolSet, tool
from mtrl_jax.envs.grades import Grade
from mtrl_jax.text.tool_calls import extract_answer, render_tool_call

# Byte-tokenizer specials that make the JSON tool call of this task short: the
# fixed JSON around the expression becomes two tokens (the text is unchanged).
TOOL_PREFIX = '{"name":"calculate","arguments":{"expression":"'
TOOL_SUFFIX = '"}}'
EXTRA_SPECIALS = (TOOL_PREFIX, TOOL_SUFFIX)

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_SPLIT_SEEDS = {"train": 0, "eval": 1, "test": 2}
# Curriculum levels: (min_operands, max_operands, max_digits), easiest first.
# Level 2 is the default task; level 4's longest episode (4 three-digit
# operands, a product, a follow-up) still fits the calculator config's
# env.max_tokens = 160.
LEVELS = ((2, 2, 1), (2, 2, 2), (2, 3, 2), (3, 3, 2), (3, 4, 3))
NUM_FOLLOWUPS = 1  # make_task's default: two stages (the question, one follow-up)


def evaluate(expression: str) -> int:
  """Evaluates an integer expression of + - * and parentheses (no eval())."""
  if len(expression) > 64:
    raise ValueError(f"expression too long ({len(expression)} > 64 characters)")

  def ev(node):
    if isinstance(node, ast.Expression):
      return ev(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
      return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
      return _OPS[type(node.op)](ev(node.left), ev(node.right))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
      return -ev(node.operand)
    raise ValueError(f"unsupported syntax in {expression!r}: only integers, + - * and ()")

  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except SyntaxError as e:
    raise ValueError(f"cannot parse {expression!r}: {e.msg}") from None
  return ev(tree)


# The call itself takes microseconds (64 characters at most); the limit only guards against a
# stuck worker. 2 s fired under CPU load (four runs on 2 cores), masking actions that a quiet
# run keeps, so seeded runs diverged with machine load (docs/ablations.md).
@tool(cacheable=True, timeout_s=10.0, model_errors=(ValueError,))
def calculate(expression: str) -> str:
  """Evaluates an arithmetic expression.

  Args:
    expression: integers with + - * and parentheses, e.g. "12+7*3".
  """
  return str(evaluate(expression))


def make_task(
    split: str,
    index: int,
    min_operands: int = 2,
    max_operands: int = 3,
    max_digits: int = 2,
    num_followups: int = NUM_FOLLOWUPS,
    level: Optional[int] = None,
) -> dict:
  """Task `index` of `split`: a deterministic function of (split, index[, level]).

  `level` (an index into `LEVELS`) overrides min_operands, max_operands and max_digits.
  """
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"calculator split {split!r}; allowed: {sorted(_SPLIT_SEEDS)}")
  if level is not None:
    if isinstance(level, bool) or not isinstance(level, int) or not 0 <= level < len(LEVELS):
      raise ValueError(f"calculator level={level!r}; allowed: 0 .. {len(LEVELS) - 1}")
    min_operands, max_operands, max_digits = LEVELS[level]
  rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
  n = int(rng.integers(min_operands, max_operands + 1))
  hi = 10**max_digits
  nums = [int(rng.integers(1, hi)) for _ in range(n)]
  ops = list(rng.choice(["+", "-", "*"], size=n - 1, p=[0.45, 0.35, 0.2]))
  if ops.count("*") > 1:  # at most one product keeps results short
    ops = [o if o != "*" or i == ops.index("*") else "+" for i, o in enumerate(ops)]
  expression = "".join(f"{a}{o}" for a, o in zip(nums, ops)) + str(nums[-1])
  answers = [evaluate(expression)]
  followups = []
  for _ in range(num_followups):
    op = str(rng.choice(["+", "-"]))
    x = int(rng.integers(1, hi))
    followups.append(f"then {op}{x}")
    answers.append(evaluate(f"{answers[-1]}{op}{x}"))
  task = {
      "question": f"{expression}=",
      "expression": expression,
      "followups": followups,
      "answers": answers,
      "difficulty": n,
      "split": split,
      "index": index,
  }
  if level is not None:
    task["level"] = level
  return task


def stage_expressions(task: Mapping[str, Any]) -> list[str]:
  """The expression the tool call of each stage should carry: the question's, then
  each follow-up applied to the previous answer ("867-58")."""
  return [task["expression"]] + [
      f"{prev}{f[len('then '):]}" for prev, f in zip(task["answers"], task["followups"])
  ]


def copy_similarity(got: str, want: str) -> float:
  """1 - Levenshtein(got, want) / max(len(got), len(want)): 1 for an exact copy, 0 for
  nothing in common; one wrong, missing or extra character of 8 scores 0.875."""
  if not got and not want:
    return 1.0
  prev = list(range(len(want) + 1))
  for i, a in enumerate(got, 1):
    cur = [i]
    for j, b in enumerate(want, 1):
      cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (a != b)))
    prev = cur
  return 1.0 - prev[-1] / max(len(got), len(want))


def golden_conversation(task: Mapping[str, Any]) -> list[tuple[str, str]]:
  """The ideal episode of `task` as (role, content) pairs (SFT data)."""
  msgs = [("user", task["question"])]
  expressions = stage_expressions(task)
  for stage, (expr, answer) in enumerate(zip(expressions, task["answers"])):
    if stage:
      msgs.append(("user", task["followups"][stage - 1]))
    msgs.append(("assistant", render_tool_call("calculate", {"expression": expr})))
    msgs.append(("tool", str(evaluate(expr))))
    msgs.append(("assistant", f"<answer>{answer}</answer>"))
  return msgs


class CalculatorEnv(Environment):
  """Tool calls are executed; answers are checked; a follow-up comes after each right one.

  The first tool call of a stage is graded `copy` (per-turn, so shaping): the similarity
  of its `expression` argument to the stage's expression (0 when the call has none).
  Later calls of the stage are not graded, so retries cannot collect shaping.
  """

  def __init__(
      self, metadata: Mapping[str, Any], show_tools: bool = False, max_tool_calls: int = 2
  ):
    super().__init__(metadata, tools=ToolSet([calculate]))
    self.show_tools = show_tools
    self.max_tool_calls = max_tool_calls
    self.stage = 0
    self.tool_calls = 0
    self.graded_stage = -1  # the last stage whose first tool call was graded
    self.expressions = stage_expressions(metadata)  # what each stage's call should carry

  def system_prompt(self) -> str:
    # The from-scratch demo policy learns the tool from SFT; real models see schemas.
    return super().system_prompt() if self.show_tools else ""

  def initial_thread(self) -> Thread:
    turns = []
    if self.system_prompt():
      turns.append(Turn("system", self.system_prompt()))
    turns.append(Turn("user", self.metadata["question"]))
    return Thread(tuple(turns), dict(self.metadata))

  def finalize(self, thread: Thread) -> Grade:
    # A trajectory the framework truncated (turn cap, token budget) failed:
    # scoring it 0 would make rambling until the budget beat a wrong answer.
    del thread
    return Grade(-1.0, "truncated before answering")

  def react_to(self, thread: Thread):
    text = thread.last_assistant
    answer = extract_answer(text)
    if answer is None:
      self.tool_calls += 1
      if self.tool_calls > self.max_tool_calls * len(self.metadata["answers"]):
        return None, Grade(-1.0, "too many tool calls")
      next_thread = self.run_tools(thread)
      if next_thread is not None:
        return next_thread, self._grade_copy()
      self.report_fault("model_format", "neither a tool call nor an <answer>", "calculator")
      return None, Grade(-1.0, "no tool call and no answer")
    expected = self.metadata["answers"][self.stage]
    if answer != str(expected):
      return None, Grade(-1.0, f"answer {answer!r} at stage {self.stage}; expected {expected}")
    self.stage += 1
    if self.stage == len(self.metadata["answers"]):
      return None, Grade(1.0, "all answers right")
    return thread.append(Turn("user", self.metadata["followups"][self.stage - 1])), None

  def _grade_copy(self) -> Optional[dict]:
    if self.graded_stage == self.stage:
      return None
    self.graded_stage = self.stage
    args = self.last_tool_results.calls[0].arguments
    got = args.get("expression") if isinstance(args, dict) else None
    want = self.expressions[self.stage]
    score = copy_similarity(got, want) if isinstance(got, str) else 0.0
    reason = f"tool call expression {got!r}; stage {self.stage} wants {want!r}"
    return {"copy": Grade(score, reason)}


@register_env_factory("calculator")
class CalculatorFactory(EnvironmentFactory):
  """Fresh `CalculatorEnv` per trajectory."""

  outcome_range = (-1.0, 1.0)

  def __init__(self, show_tools: bool = False, max_tool_calls: int = 2):
    self.show_tools = show_tools
    self.max_tool_calls = max_tool_calls

  def create_environment(self, metadata: Mapping[str, Any]) -> CalculatorEnv:
    return CalculatorEnv(metadata, self.show_tools, self.max_tool_calls)

  def max_graded_turns(self, task_kwargs: Mapping[str, Any]) -> int:
    """One graded call per stage: the question's, then one per follow-up (`make_task`)."""
    return 1 + int(task_kwargs.get("num_followups", NUM_FOLLOWUPS))


@data.register_task_source("calculator")
def calculator_tasks(split: str, size: Optional[int] = None, **task_kwargs) -> data.GeneratedTasks:
  """`size` tasks of a split (default: 100k train, 200 eval/test)."""
  return data.GeneratedTasks(
      make_task, split, size or (100_000 if split == "train" else 200), **task_kwargs
  )


# The failure classes of a completion (`python -m experiments.calc_errors`).
FAILURE_CLASSES = ("right", "no tool call", "wrong expression", "answer != tool result")
_TOOL_REPLY = re.compile(r"<\|tool\|>(.*?)<\|end\|>")
_ANSWER = re.compile(r"<answer>(.*?)</answer>")


def failure_class(completion: str, action: Mapping[str, Any]) -> str:
  """The class of one completion, from its text and its joint action's dump record.

  `right`: the answer was accepted (the episode went on to the follow-up, or
  ended graded +1); `no tool call`: graded -1 without a tool reply; `answer !=
  tool result`: the tool returned a value the answer copied wrongly; `wrong
  expression`: the tool ran on an expression whose value is not the expected
  answer (operands miscopied).
  """
  grade = action["steps"][-1].get("grades", {}).get("grade")
  if grade is None or grade["score"] > 0:  # no final grade: the episode went on
    return "right"
  reply, answer = _TOOL_REPLY.search(completion), _ANSWER.search(completion)
  if reply is None:
    return "no tool call"
  if answer is not None and answer.group(1) != reply.group(1):
    return "answer != tool result"
  return "wrong expression"


def failure_classes(nodes) -> dict[int, collections.Counter]:
  """turn -> Counter of `failure_class` over every completion of a dump's node records."""
  out = collections.defaultdict(collections.Counter)
  for node in nodes:
    for completion, action in zip(node["completions"][0], node["actions"]):
      out[node["turn"]][failure_class(completion, action)] += 1
  return dict(out)
