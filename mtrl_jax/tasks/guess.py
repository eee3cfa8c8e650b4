"""Example: number guessing with "higher" / "lower" user turns, a tool and two graders.

The user thinks of a number in [1, high]; the policy guesses with
`<answer>N</answer>` and may first call the `midpoint` tool on its current
bounds. Each wrong guess gets a scripted user turn, "higher" or "lower"; a
right guess, or `max_guesses` wrong ones, ends the episode:

    user:       "Guess my number, 1 to 20."
    assistant:  <tool_call>{"name":"midpoint","arguments":{"low":1,"high":20}}</tool_call>
    tool:       "10"
    assistant:  <answer>10</answer>
    user:       "higher"
    assistant:  <answer>15</answer>
    user:       "right"                    (the episode ends here, graded)

Every guess is graded per turn (`consistent`: 1 when it lies inside the
bounds the earlier hints left, so `reward.shaping_weight` > 0 rewards using
them); the episode is graded once (`found`: 1 for the number). A tree turn is
one guess (`tree.branch_on='user_turn'`: the tool call continues its turn), so
T = `tree.num_turns` guesses; docs/recipes.md relates T to `env.max_turns`.
"""

import functools
from typing import Optional

import numpy as np

from mtrl_jax import data
from mtrl_jax.envs import Environment, EnvironmentFactory, ToolSet, Turn, register_env_factory
from mtrl_jax.envs import tool
from mtrl_jax.envs.grades import Grade
from mtrl_jax.graders import FunctionGrader
from mtrl_jax.text import extract_answer
from mtrl_jax.text.tool_calls import render_tool_call

_SPLIT_SEEDS = {"train": 20, "eval": 21, "test": 22}
SYSTEM = "Guess the number: reply <answer>N</answer>; the user says higher or lower."


@tool(timeout_s=2.0, cacheable=True)
def midpoint(low: int, high: int) -> str:
  """The integer midpoint of a range, the best next guess.

  Args:
    low: the smallest number still possible.
    high: the largest number still possible.
  """
  return str((int(low) + int(high)) // 2)


def bounds(thread, high: int) -> tuple[int, int]:
  """(low, high) the hints so far leave: each "higher" / "lower" moves one bound."""
  low, guess = 1, None
  for t in thread.turns:
    if t.role == "assistant":
      guess = extract_answer(t.content) or guess
    elif t.role == "user" and guess is not None and guess.isdigit():
      if t.content == "higher":
        low = max(low, int(guess) + 1)
      elif t.content == "lower":
        high = min(high, int(guess) - 1)
  return low, high


def consistent(thread, high: int) -> float:
  """Per-turn: 1 when the last guess lies within the bounds the earlier hints left."""
  guess = extract_answer(thread.last_assistant)
  low, top = bounds(thread.replace(turns=thread.turns[:-1]), high)
  return float(guess is not None and guess.isdigit() and low <= int(guess) <= top)


def found(thread) -> Grade:
  """Trajectory: 1 when the last guess is the number."""
  guess = extract_answer(thread.last_assistant)
  right = guess is not None and guess.isdigit() and int(guess) == thread.metadata["number"]
  return Grade(float(right), f"last guess {guess!r}")


def golden_conversation(task) -> list[tuple[str, str]]:
  """The ideal episode of `task` as (role, content) pairs (SFT data): a binary search,
  the first guess through the tool. It starts with the environment's system prompt,
  which the SFT rows do not get otherwise."""
  low, high, number = 1, task["high"], task["number"]
  call = render_tool_call("midpoint", {"low": low, "high": high})
  msgs = [
      ("system", ToolSet([midpoint]).system_prompt(SYSTEM)),
      ("user", f"Guess my number, 1 to {high}."),
      ("assistant", call),
      ("tool", midpoint(low, high)),
  ]
  while True:
    guess = (low + high) // 2
    msgs.append(("assistant", f"<answer>{guess}</answer>"))
    if guess == number:
      return msgs
    low, high = (guess + 1, high) if guess < number else (low, guess - 1)
    msgs.append(("user", "higher" if guess < number else "lower"))


class GuessEnv(Environment):
  """One hidden number; a user turn after each wrong guess; ends when found or out of guesses."""

  def __init__(self, metadata, max_guesses: int = 5):
    super().__init__(metadata, tools=ToolSet([midpoint]), system=SYSTEM)
    self.max_guesses = max_guesses
    self.turn_grader = FunctionGrader(
        # A partial, not a lambda: the environment pickles (env.workers='processes').
        functools.partial(consistent, high=metadata["high"]),
        name="consistent",
        scope="turn",
    )
    self.final_grader = FunctionGrader(found)

  def react_to(self, thread):
    next_thread = self.run_tools(thread)
    if next_thread is not None:  # a tool call: its result continues the turn
      return next_thread, None
    guess, number = extract_answer(thread.last_assistant), self.metadata["number"]
    ended = guess is None or not guess.isdigit() or int(guess) == number  # no guess, or found
    if ended or thread.count("user") >= self.max_guesses:  # or out of guesses
      return None, {"found": self.final_grader.grade(thread)}
    hint = "higher" if int(guess) < number else "lower"
    return thread.append(Turn("user", hint)), {"consistent": self.turn_grader.grade(thread)}

  def on_cut(self, thread):
    """Cut by the tree (more guesses to come): graded as a natural end is."""
    return {"found": self.final_grader.grade(thread)}


@register_env_factory("guess")
class GuessFactory(EnvironmentFactory):
  """Fresh `GuessEnv` per trajectory; `env.kwargs` may set `max_guesses`."""

  def __init__(self, max_guesses: int = 5):
    self.max_guesses = max_guesses

  def create_environment(self, metadata):
    prompt = f"Guess my number, 1 to {metadata['high']}."
    return GuessEnv({**metadata, "prompt": prompt}, self.max_guesses)


def make_task(split: str, index: int, high: int = 20) -> dict:
  """Task `index` of `split`: a number in [1, high], seeded by (split, index)."""
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"guess split {split!r}; allowed: {sorted(_SPLIT_SEEDS)}")
  rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
  return {"number": int(rng.integers(1, high + 1)), "high": high, "split": split, "index": index}


@data.register_task_source("guess")
def guess_tasks(split: str, size: Optional[int] = None, high: int = 20) -> data.GeneratedTasks:
  """`size` tasks of a split (default: 1000 train, 100 eval/test)."""
  return data.GeneratedTasks(
      make_task, split, size or (1000 if split == "train" else 100), high=high
  )
