"""Task sources and the deterministic, resumable task stream of a training run.

A task is a metadata dict handed to `EnvironmentFactory.create_environment`.
A `TaskSource` serves tasks of one split by index (generated on the fly from a
seed, or read from a TFDS / array_record data source). The `TaskStream` walks a
source in a seeded, per-epoch shuffled order; its whole state is two integers
(epoch, position), saved with every checkpoint so a resumed run sees exactly
the same tasks in the same order (DESIGN.md invariant 6).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from mtrl_jax.registry import Registry

# name -> a callable `(split, **kwargs) -> TaskSource`. Built-in tasks register
# themselves when `mtrl_jax.tasks` is imported (the run's composition root does).
TASK_SOURCES = Registry("task source", hint="the built-in tasks register when mtrl_jax.tasks "
                        "is imported")


class TaskSource(Protocol):
  """Tasks of one split, served by index."""

  def __len__(self) -> int:
    ...

  def __getitem__(self, index: int) -> Mapping[str, Any]:
    ...


def register_task_source(name: str):
  """Decorator: `name` -> a callable `(split, **kwargs) -> TaskSource`."""
  return TASK_SOURCES.register(name)


def registered_task_sources() -> list[str]:
  return TASK_SOURCES.names()


def resolve_task_source(spec: str, split: str, **kwargs) -> TaskSource:
  """A task source by registry name or import path (`pkg.module:attr`)."""
  return TASK_SOURCES.resolve(spec)(split, **kwargs)


def epoch_order(n: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
  """The order in which epoch `epoch` visits indices 0..n-1: a permutation seeded by
  (seed, epoch), or 0..n-1 when not shuffling. A pure function of its arguments, so a
  resumed run walks the same order (DESIGN.md invariant 6)."""
  if not shuffle:
    return np.arange(n)
  return np.random.default_rng([seed, epoch]).permutation(n)


@dataclasses.dataclass
class ListSource:
  """A task source over an in-memory list of metadata dicts."""

  tasks: Sequence[Mapping[str, Any]]

  def __len__(self) -> int:
    return len(self.tasks)

  def __getitem__(self, index: int) -> Mapping[str, Any]:
    return self.tasks[index]


class GeneratedTasks:
  """Task source over a generator `make(split, index, **kwargs) -> dict` (indices 0..size-1).

  Generated tasks are a pure function of (split, index), so any index can be
  served in any order and a resumed run sees the same tasks.
  """

  def __init__(self, make: Callable[..., dict], split: str, size: int, **kwargs):
    make(split, 0, **kwargs)  # validates split and kwargs now, not mid-run
    self.make, self.split, self.size, self.kwargs = make, split, size, kwargs

  def __len__(self) -> int:
    return self.size

  def __getitem__(self, index: int) -> dict:
    if not 0 <= index < self.size:
      raise IndexError(f"task {index} of split {self.split!r} out of range [0, {self.size})")
    return self.make(self.split, index, **self.kwargs)


class TaskStream:
  """Seeded epoch-shuffled walk over a task source; state = (epoch, position)."""

  def __init__(self, source: TaskSource, seed: int, shuffle: bool = True):
    if len(source) == 0:
      raise ValueError("TaskStream: the task source is empty")
    self.source = source
    self.seed = seed
    self.shuffle = shuffle
    self.epoch = 0
    self.position = 0
    self._order: Optional[np.ndarray] = None

  def _epoch_order(self) -> np.ndarray:
    if self._order is None:
      self._order = epoch_order(len(self.source), self.seed, self.epoch, self.shuffle)
    return self._order

  def next(self, count: int) -> list[dict]:
    """The next `count` tasks (crossing epoch boundaries as needed)."""
    out = []
    while len(out) < count:
      order = self._epoch_order()
      index = int(order[self.position])
      task = dict(self.source[index])
      task.setdefault("task_index", index)
      out.append(task)
      self.position += 1
      if self.position == len(order):
        self.epoch, self.position, self._order = self.epoch + 1, 0, None
    return out

  def state(self) -> dict:
    return {"epoch": self.epoch, "position": self.position}

  def restore(self, state: Mapping[str, int]) -> None:
    self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None
