"""Example: a weather assistant with a tool, a per-turn grader and a trajectory grader.

The policy answers "What is the temperature in <city>?" by calling
`get_weather` and then replying with `<answer>N</answer>`. Every tool-calling
turn is graded (did the calls succeed?); the finished conversation is graded
on the answer and on efficiency, combined with `CombinedGrader`.
An episode the tree cuts (still calling tools at `tree.num_turns`) is graded
by `on_cut` as a natural end is: the trajectory grader, so not answering
never pays more than a wrong answer; the per-turn grader counts only with
`reward.shaping_weight > 0` (the run says so once otherwise).
Tasks come from the "weather" task source (one city per task, a deterministic
function of split and index; the task dict is the metadata `create_environment`
gets). Run by name with `python -m experiments.train --config=configs/base.py`
and the flags

    --config.env.factory=weather --config.tasks.source=weather
    --config.env.max_tokens=768 --config.rl.length_buckets='(256,512,1024)'

(with the byte tokenizer the first prompt, the system prompt with its tool
schema, is ~510 tokens: more than the default env.max_tokens, 256, and the
default largest length bucket, 512). docs/recipes.md teaches the API with
`mtrl_jax/tasks/guess.py`, which adds user turns to this pattern.
"""

from typing import Literal, Optional

import numpy as np

from mtrl_jax import data
from mtrl_jax.envs import Environment, EnvironmentFactory, ToolSet, register_env_factory, tool
from mtrl_jax.envs import ToolError
from mtrl_jax.graders import CombinedGrader, FunctionGrader
from mtrl_jax.text import extract_answer

TEMPS_C = {"paris": 18, "oslo": 4, "cairo": 31, "lima": 22}
_SPLIT_SEEDS = {"train": 0, "eval": 1, "test": 2}


@tool(timeout_s=2.0, cacheable=True)
def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
  """Current temperature of a city.

  Args:
    city: the city name, e.g. "Paris".
    unit: "c" for Celsius, "f" for Fahrenheit.
  """
  if city.lower() not in TEMPS_C:
    raise ToolError(f"unknown city {city!r}; known: {sorted(TEMPS_C)}")
  c = TEMPS_C[city.lower()]
  return str(c if unit == "c" else round(c * 9 / 5 + 32))


def tools_ok(thread):
  """Per-turn: fraction of this turn's tool results that are not errors."""
  results = []
  for t in reversed(thread.turns):  # the tool turns after the last policy message
    if t.role != "tool":
      break
    results.append(t.metadata.get("ok", False))
  return sum(results) / max(len(results), 1)


def correct(thread):
  """Trajectory: the final answer is the city's temperature in Celsius."""
  answer = extract_answer(thread.last_assistant)
  return (answer == str(TEMPS_C[thread.metadata["city"]]), f"answer={answer!r}")


def concise(thread):
  """Trajectory: 1.0 for at most two policy turns, less for each extra one."""
  return 1.0 / max(thread.count("assistant") - 1, 1)


class WeatherEnv(Environment):
  """One question about one city; the episode ends at the first non-tool reply."""

  def __init__(self, metadata):
    super().__init__(
        metadata,
        tools=ToolSet([get_weather]),
        system="Answer with <answer>N</answer> (degrees Celsius).",
    )
    self.turn_grader = FunctionGrader(tools_ok, scope="turn")
    self.final_grader = CombinedGrader(
        [(FunctionGrader(correct), 0.9), (FunctionGrader(concise), 0.1)]
    )

  def react_to(self, thread):
    next_thread = self.run_tools(thread)
    if next_thread is not None:  # tool turns appended: continue, graded per turn
      return next_thread, {"tools_ok": self.turn_grader.grade(next_thread)}
    return None, {"final": self.final_grader.grade(thread)}

  def on_cut(self, thread):
    """The tree cut the episode (still calling tools at its last turn): graded as a
    natural end is, so the unanswered question scores as a wrong answer does."""
    return {"final": self.final_grader.grade(thread)}


@register_env_factory("weather")
class WeatherFactory(EnvironmentFactory):

  def create_environment(self, metadata):
    city = metadata["city"]
    return WeatherEnv({**metadata, "prompt": f"What is the temperature in {city.title()}?"})


def make_task(split: str, index: int) -> dict:
  """Task `index` of `split`: a city drawn from `TEMPS_C`, seeded by (split, index)."""
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"weather split {split!r}; allowed: {sorted(_SPLIT_SEEDS)}")
  rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
  city = sorted(TEMPS_C)[int(rng.integers(len(TEMPS_C)))]
  return {"city": city, "answer": TEMPS_C[city], "split": split, "index": index}


@data.register_task_source("weather")
def weather_tasks(split: str, size: Optional[int] = None) -> data.GeneratedTasks:
  """`size` tasks of a split (default: 1000 train, 100 eval/test)."""
  return data.GeneratedTasks(make_task, split, size or (1000 if split == "train" else 100))
