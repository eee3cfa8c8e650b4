"""A one-turn task small enough for RL to learn in seconds on CPU (the suite's learning test).

The user names a character class; the policy's reply succeeds when its first
character belongs to that class:

    user:       "lower"     ->  assistant: "q"   success (a-z)
    user:       "digit"     ->  assistant: "%"   failure (wanted 0-9)

Classes: lower (26 characters), upper (26), digit (10), symbol (ASCII
punctuation, 32): together the 94 printable ASCII characters.

A freshly initialised tiny model is no starting point for RL: its tied
embeddings make the first reply token nearly deterministic per prompt (one id
with p > 0.8 is common), so success starts at 0 or 100% per class and the G
samples of a group agree. `warmup_conversation` is format-only SFT data: the
reply is a character of a random class, independent of the class asked for.
A short SFT on it spreads the reply over the four classes alike, whatever the
prompt: about 25% success by chance, for every class (drawing a character
uniformly from all 94 instead would start the digit class at 10/94, and RL
that sharpens the other three classes first then tends to lose it). Only RL
can learn which class each prompt asks for. Outcome: 1 on success,
0 otherwise (one step, no tools). Tasks are a pure function of (split,
index), so the data order is reproducible and resumable.

`tests/train/test_learning.py` runs the real RL loop on it (configs/charclass.py).
"""

from __future__ import annotations

import string
from typing import Any, Mapping, Optional

import numpy as np

from mtrl_jax import data
from mtrl_jax.envs import Environment, EnvironmentFactory, register_env_factory
from mtrl_jax.envs.grades import Grade

CLASSES = {
    "lower": frozenset(string.ascii_lowercase),
    "upper": frozenset(string.ascii_uppercase),
    "digit": frozenset(string.digits),
    "symbol": frozenset(string.punctuation),
}
_SPLIT_SEEDS = {"train": 20, "eval": 21, "test": 22}


def make_task(split: str, index: int) -> dict:
  """Task `index` of `split`: a class name drawn uniformly (seeded by (split, index))."""
  if split not in _SPLIT_SEEDS:
    raise ValueError(f"charclass split {split!r}; allowed: {sorted(_SPLIT_SEEDS)}")
  rng = np.random.default_rng([_SPLIT_SEEDS[split], index])
  name = sorted(CLASSES)[int(rng.integers(len(CLASSES)))]
  return {"prompt": name, "target": name, "split": split, "index": index}


def _reply(task: Mapping[str, Any], name: str, salt: int) -> str:
  rng = np.random.default_rng([_SPLIT_SEEDS[task["split"]], int(task["index"]), salt])
  members = sorted(CLASSES[name])
  return members[int(rng.integers(len(members)))]


def warmup_conversation(task: Mapping[str, Any]) -> list[tuple[str, str]]:
  """Format-only SFT data: the reply is a character of a class drawn uniformly, seeded by
  the task's (split, index) and independent of the class the prompt asks for."""
  rng = np.random.default_rng([_SPLIT_SEEDS[task["split"]], int(task["index"]), 1])
  name = sorted(CLASSES)[int(rng.integers(len(CLASSES)))]
  return [("user", task["prompt"]), ("assistant", _reply(task, name, 2))]


def golden_conversation(task: Mapping[str, Any]) -> list[tuple[str, str]]:
  """A right episode: a character of the class asked for."""
  return [("user", task["prompt"]), ("assistant", _reply(task, task["target"], 3))]


class CharClassEnv(Environment):
  """One reply, graded on its first character; the episode always ends there."""

  def react_to(self, thread):
    reply = thread.last_assistant or ""
    target = self.metadata["target"]
    ok = bool(reply) and reply[0] in CLASSES[target]
    return None, Grade(float(ok), f"first character {reply[:1]!r}; wanted a {target}")


@register_env_factory("charclass")
class CharClassFactory(EnvironmentFactory):
  """Fresh `CharClassEnv` per trajectory."""

  outcome_range = (0.0, 1.0)

  def create_environment(self, metadata: Mapping[str, Any]) -> CharClassEnv:
    if metadata.get("target") not in CLASSES:
      raise ValueError(
          f"charclass task target {metadata.get('target')!r}; allowed: {sorted(CLASSES)}"
      )
    return CharClassEnv(metadata)


@data.register_task_source("charclass")
def charclass_tasks(split: str, size: Optional[int] = None) -> data.GeneratedTasks:
  """`size` tasks of a split (default: 10k train, 200 eval/test)."""
  return data.GeneratedTasks(make_task, split, size or (10_000 if split == "train" else 200))
