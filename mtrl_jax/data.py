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
import importlib
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from mtrl_jax.registry import import_object

_SOURCES: dict[str, Callable[..., "TaskSource"]] = {}


class TaskSource(Protocol):
  """Tasks of one split, served by index."""

  def __len__(self) -> int:
    ...

  def __getitem__(self, index: int) -> Mapping[str, Any]:
    ...


def register_task_source(name: str):
  """Decorator: `name` -> a callable `(split, **kwargs) -> TaskSource`."""

  def decorate(fn):
    if name in _SOURCES:
      raise ValueError(f"task source {name!r} is already registered")
    _SOURCES[name] = fn
    return fn

  return decorate


def registered_task_sources() -> list[str]:
  return sorted(_SOURCES)


def resolve_task_source(spec: str, split: str, **kwargs) -> TaskSource:
  """A task source by registry name or import path (`pkg.module:attr`)."""
  if ":" in spec:
    fn = import_object(spec, "task source")
  else:
    if spec not in _SOURCES:
      # Built-in tasks register themselves on import.
      importlib.import_module("mtrl_jax.envs.tasks")
    if spec not in _SOURCES:
      raise ValueError(f"task source {spec!r}; registered: {registered_task_sources()} "
                       "(or give an import path 'pkg.module:attr')")
    fn = _SOURCES[spec]
  return fn(split, **kwargs)


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
      n = len(self.source)
      if self.shuffle:
        rng = np.random.default_rng([self.seed, self.epoch])
        self._order = rng.permutation(n)
      else:
        self._order = np.arange(n)
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
