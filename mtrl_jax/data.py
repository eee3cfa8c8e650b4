"""Task sources, the deterministic, resumable task stream of a training run, its curriculum.

A task is a metadata dict handed to `EnvironmentFactory.create_environment`.
A `TaskSource` serves tasks of one split by index (generated on the fly from a
seed, or read from a TFDS / array_record data source). The `TaskStream` walks a
source in a seeded, per-epoch shuffled order; its whole state is two integers
(epoch, position), saved with every checkpoint so a resumed run sees exactly
the same tasks in the same order (docs/design.md invariant 6). A
`CurriculumStream` keeps one such stream per difficulty level and moves
between levels by the rolling rollout success of the last k RL steps; its
state (level, window, positions) is checkpointed the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

import numpy as np

from mtrl_jax.registry import Registry

# name -> a callable `(split, **kwargs) -> TaskSource`. Built-in tasks register
# themselves when `mtrl_jax.tasks` is imported (the run's composition root does).
TASK_SOURCES = Registry(
    "task source", hint="the built-in tasks register when mtrl_jax.tasks is imported"
)


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
  resumed run walks the same order (docs/design.md invariant 6)."""
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
      task = self.source[index]
      if isinstance(task, Mapping):  # anything else: the rollout masks its root
        task = dict(task)
        task.setdefault("task_index", index)
      out.append(task)
      self.position += 1
      if self.position == len(order):
        self.epoch, self.position, self._order = self.epoch + 1, 0, None
    return out

  def state(self) -> dict:
    return {"epoch": self.epoch, "position": self.position}

  def rewound(self, mark: Mapping[str, Any]) -> dict:
    """The state with the draws since `mark` (a `state()` taken earlier) undone."""
    return dict(mark)

  def restore(self, state: Mapping[str, int]) -> None:
    self.epoch, self.position, self._order = int(state["epoch"]), int(state["position"]), None


# ------------------------------------------------------------------ curriculum
@dataclasses.dataclass(frozen=True)
class CurriculumConfig:
  """When a `CurriculumStream` moves between difficulty levels (config group `curriculum`).

  Attributes:
    enabled: False keeps the plain `TaskStream` over `tasks.kwargs`.
    level_key: the task source keyword that selects a level (the calculator: 'level').
    num_levels: levels 0 .. num_levels - 1; the task source must serve each.
    start_level: the level of the first RL step.
    window: k, the RL steps whose rollout success is averaged.
    raise_above: one level up when the mean over a full window is above this.
    lower_below: one level down when it is below this.
  """

  enabled: bool = False
  level_key: str = "level"
  num_levels: int = 5
  start_level: int = 0
  window: int = 10
  raise_above: float = 0.8
  lower_below: float = 0.3

  def __post_init__(self):
    for name, low in (("num_levels", 2), ("window", 1), ("start_level", 0)):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"config curriculum.{name}={value!r}; allowed: an int >= {low}")
    if self.start_level >= self.num_levels:
      raise ValueError(
          f"config curriculum.start_level={self.start_level}; allowed: 0 .. "
          f"num_levels - 1 = {self.num_levels - 1}"
      )
    if not 0.0 <= self.lower_below < self.raise_above <= 1.0:
      raise ValueError(
          f"config curriculum.lower_below={self.lower_below} and raise_above="
          f"{self.raise_above}; allowed: 0 <= lower_below < raise_above <= 1"
      )
    if not isinstance(self.level_key, str) or not self.level_key.isidentifier():
      raise ValueError(
          f"config curriculum.level_key={self.level_key!r}; allowed: the name of "
          "the task source's level keyword"
      )


class CurriculumStream:
  """A task stream that moves between difficulty levels by rolling rollout success.

  Each level has its own `TaskStream` (seeded, epoch-shuffled) over
  `make_source(level)`. After every RL step the loop calls `observe` with
  the step's rollout success; once the last `window` observations at the
  current level average above `raise_above` the level goes up one (below
  `lower_below`: down one, never past the ends), and the window empties, so
  every decision rests on `window` steps at one level.

  A step's tasks may be drawn before the previous step's success is observed
  (`rl.max_staleness=1` draws step k + 1 during step k's update), so a move
  decided by `observe` reaches the draws after the ones already taken: the
  stream keeps the levels of its draws not yet observed (`pending`), and
  `observe` labels each step with the level its tasks came from. The whole
  state (level, window, pending levels, each level's position) is plain JSON
  for the checkpoint meta, so a resumed run draws the same tasks at the same
  levels (docs/design.md invariant 6); `rewound` gives the state of a
  checkpoint taken while a draw is in flight.
  """

  def __init__(
      self,
      make_source: Callable[[int], TaskSource],
      cfg: CurriculumConfig,
      seed: int,
      shuffle: bool = True,
  ):
    self.cfg = cfg
    self.streams = [
        TaskStream(make_source(level), seed, shuffle) for level in range(cfg.num_levels)
    ]
    self.level = cfg.start_level
    self.window: list[float] = []
    self.pending: list[int] = []  # levels of the draws not yet observed, oldest first
    self.redraw: list[int] = []  # levels of draws a checkpoint undid, taken again first
    self.draws = 0  # next() calls so far

  def next(self, count: int) -> list[dict]:
    """The next `count` tasks, each tagged with its `curriculum_level`: the current
    level's, or the level of a draw the restored checkpoint undid."""
    level = self.redraw.pop(0) if self.redraw else self.level
    self.pending.append(level)
    self.draws += 1
    return [
        dict(t, curriculum_level=level) if isinstance(t, Mapping) else t
        for t in self.streams[level].next(count)
    ]

  def observe(self, success: float) -> dict[str, float]:
    """Records one RL step's rollout success (steps in draw order); may move the level
    for the draws to come.

    Returns:
      `curriculum/level` (the level the step's tasks came from) and
      `curriculum/rolling_success` (mean over the window so far, this step included).
    """
    used = self.pending.pop(0) if self.pending else self.level
    self.window = (self.window + [float(success)])[-self.cfg.window :]
    rolling = sum(self.window) / len(self.window)
    if len(self.window) == self.cfg.window:
      if rolling > self.cfg.raise_above and self.level < self.cfg.num_levels - 1:
        self.level, self.window = self.level + 1, []
      elif rolling < self.cfg.lower_below and self.level > 0:
        self.level, self.window = self.level - 1, []
    return {"curriculum/level": float(used), "curriculum/rolling_success": rolling}

  def state(self) -> dict:
    return {
        "level": self.level,
        "window": list(self.window),
        "draws": self.draws,
        "pending": list(self.pending),
        "redraw": list(self.redraw),
        "streams": [s.state() for s in self.streams],
    }

  def rewound(self, mark: Mapping[str, Any]) -> dict:
    """The state with the draws since `mark` (a `state()` taken earlier) undone: each
    level's position of `mark`, the level and window of now (every step observed
    since counts), and the undone draws' levels, which a restored stream takes
    again before the current level.

    Raises:
      ValueError when a draw since `mark` was observed already (its success
        counts, so its tasks cannot be drawn again).
    """
    undone = self.draws - int(mark["draws"])
    if undone > len(self.pending):
      raise ValueError(
          f"{undone} draws since the mark, {len(self.pending)} not yet observed: "
          "an observed draw cannot be undone"
      )
    kept = len(self.pending) - undone
    return {
        **self.state(),
        "streams": [dict(x) for x in mark["streams"]],
        "draws": int(mark["draws"]),
        "pending": self.pending[:kept],
        "redraw": self.pending[kept:] + self.redraw,
    }

  def restore(self, state: Mapping[str, Any]) -> None:
    if len(state["streams"]) != len(self.streams):
      raise ValueError(
          f"curriculum state has {len(state['streams'])} levels; this run has "
          f"{len(self.streams)} (curriculum.num_levels changed?)"
      )
    self.level = int(state["level"])
    self.window = [float(x) for x in state["window"]]
    self.draws = int(state["draws"])
    self.pending = [int(x) for x in state["pending"]]
    self.redraw = [int(x) for x in state["redraw"]]
    for stream, s in zip(self.streams, state["streams"]):
      stream.restore(s)
