"""What the rollout engine is asked for and hands back, and its host-side slot bookkeeping.

`EngineConfig` sizes an engine; a `Request` asks for G samples of a prompt
(optionally continuing a finished sample's cache, its `Handle`); a `Sample`
comes back with the tokens, their log q and its own `Handle`. `SlotPool`
owns the state of one (shard, agent) pool's slots (`SlotState`); `Row` is a
slot that is decoding; `EngineStats` counts what a run did.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
from typing import Any, Optional

import jax
import numpy as np


def _geometric(lo: int, hi: int, factor: int) -> tuple:
  """lo, lo * factor, ... below hi, then hi."""
  out, b = [], min(lo, hi)
  while b < hi:
    out.append(b)
    b *= factor
  return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Sizes and policy of a `DecodeEngine`; hashable.

  Attributes:
    slots: KV slots per agent per batch shard (the KV budget: slots x
      capacity tokens). At least the most samples one request asks for.
    capacity: cache columns per slot; a request's prompt plus its token
      budget must fit in capacity - 1.
    chunk: decode steps per `step` (admission happens between chunks).
    decode_rows: rows of one decode call per (shard, agent); more decoding
      slots take several calls. Every call has exactly this many rows (padded),
      so a sample's arithmetic never depends on how many others decode beside
      it: float rounding depends on shapes, and which requests share a call
      depends on when environments answer. 0: min(slots, 64) on CPU,
      min(slots, 256) elsewhere.
    admit_rows: requests of one admit call per (shard, agent), likewise fixed.
    reuse: continue a request from its parent's cache; False prefills every
      request's whole prompt (the level-synchronous baseline).
    agent_map: separate policies: 'map' (each agent's rows through its own
      parameters in turn, inside one program) or 'vmap' (agents batched into
      each op); None: 'map' on CPU, 'vmap' elsewhere. Either samples what an
      agent alone samples, up to float rounding.
    window_buckets: decode windows (columns attended); None: a quarter, a
      half and all of `capacity` (multiples of 16). A row decodes over the
      bucket of its prompt plus token budget (rows of different buckets take
      separate calls), so its bits never depend on its batch-mates; more
      buckets cut attention columns but can split a chunk into more calls.
    extend_buckets: admitted new-token counts; None: 16, 64, 256, ... up to
      `capacity`. A request's bucket is a function of its own tokens.
    overlap: each `step` reads the previous step's decode chunk after
      dispatching its own, so the device decodes while the host books tokens
      and admits; a sample comes back one chunk later (and its slot frees a
      chunk later). The samples are the same either way.
  """

  slots: int
  capacity: int
  chunk: int = 8
  decode_rows: int = 0
  admit_rows: int = 8
  reuse: bool = True
  agent_map: Optional[str] = None
  window_buckets: Optional[tuple] = None
  extend_buckets: Optional[tuple] = None
  overlap: bool = False

  def __post_init__(self):
    for name, low in (
        ("slots", 1),
        ("capacity", 16),
        ("chunk", 1),
        ("decode_rows", 0),
        ("admit_rows", 1),
    ):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"EngineConfig.{name}={v!r}; allowed: an int >= {low}")
    if not isinstance(self.overlap, bool):
      raise ValueError(f"EngineConfig.overlap={self.overlap!r}; allowed: True or False")
    if self.agent_map not in (None, "map", "vmap"):
      raise ValueError(f"EngineConfig.agent_map={self.agent_map!r}; allowed: None, 'map', 'vmap'")
    for name in ("window_buckets", "extend_buckets"):
      b = getattr(self, name)
      if b is not None and (
          not b
          or any(isinstance(x, bool) or not isinstance(x, int) or x < 1 for x in b)
          or max(b) < self.capacity
      ):
        raise ValueError(
            f"EngineConfig.{name}={b!r}; allowed: None or ints >= 1 whose "
            f"largest is at least capacity={self.capacity}"
        )

  @property
  def rows(self) -> int:
    """Rows of every decode call per (shard, agent)."""
    if self.decode_rows:
      return min(self.decode_rows, self.slots)
    return min(self.slots, 64 if jax.default_backend() == "cpu" else 256)

  @property
  def windows(self) -> tuple:
    c = self.capacity
    return tuple(
        sorted(self.window_buckets or {max(16, -(-c // k // 16) * 16) for k in (4, 2)} | {c})
    )

  @property
  def extends(self) -> tuple:
    return tuple(sorted(self.extend_buckets or _geometric(16, self.capacity, 4)))


@dataclasses.dataclass(frozen=True)
class Request:
  """G samples of one prompt.

  Attributes:
    tag: the caller's name for the request; comes back with each sample.
    prompt: the full context's token ids (int).
    key: raw key data (uint32 [2]) shared by the request's samples.
    rows: uint32 [G]: sample g draws token t with uniform(fold_in(fold_in(key, rows[g]), t)).
    agent: whose parameters sample it (0 for a shared policy).
    parent: a finished sample's `Handle` whose cache may hold a prefix of `prompt`.
    max_new: token budget of each sample (None: the run's `max_new_tokens`).
  """

  tag: Any
  prompt: Any
  key: Any
  rows: Any
  agent: int = 0
  parent: Optional["Handle"] = None
  max_new: Optional[int] = None


class Handle:
  """A finished sample's parked cache: slot `slot` of (shard, agent) holds `ids`.

  Its flags are written by the pool of (shard, agent) only (`SlotPool`):
  `alive` while the slot still holds `ids` (False once evicted, taken over or
  freed), `released` once the caller names it in no further request, `refs`
  the queued requests that name it.
  """

  __slots__ = ("shard", "agent", "slot", "ids", "alive", "released", "refs")

  def __init__(self, shard, agent, slot, ids):
    self.shard, self.agent, self.slot, self.ids = shard, agent, slot, ids
    self.alive, self.released, self.refs = True, False, 0


@dataclasses.dataclass
class Sample:
  """One finished sample: tokens exactly as sampled with their log q, and its cache."""

  tag: Any
  index: int
  ids: np.ndarray
  logprobs: np.ndarray
  finish_reason: str
  handle: Handle


class Row:
  """A decoding slot: sample `g` of `req` in slot `slot` of (shard, agent), and what it
  has drawn so far as the host has read it."""

  __slots__ = ("req", "g", "shard", "agent", "slot", "ctx", "max_new", "ids", "logps")

  def __init__(self, req, g, shard, agent, slot, ctx, max_new):
    self.req, self.g, self.shard, self.agent, self.slot = req, g, shard, agent, slot
    self.ctx, self.max_new = ctx, max_new
    self.ids, self.logps = [], []


class SlotState(enum.Enum):
  """Where a slot of a pool stands (`SlotPool.state`)."""

  FREE = "free"  # in `free`: `take` hands it out
  DECODING = "decoding"  # taken: a `Row` samples into it, or an admit is about to fill it
  PARKED = "parked"  # in `parked` under its live `Handle`: a request may continue its cache
  DEFERRED_FREE = "deferred_free"  # freed, but this step's admits may still read it (`flush`)


class SlotPool:
  """Host bookkeeping of one (shard, agent) pool, and the only writer of its slots' state.

  A slot is `SlotState.FREE` (in `free`), `PARKED` (in `parked`, an LRU of live
  handles), `DEFERRED_FREE` (in `deferred`: freed while an admit of the step may
  still read it) or else `DECODING`. The transitions:

    take      FREE -> DECODING, evicting least recently used PARKED slots
    park      DECODING -> PARKED (a finished sample's `Handle`)
    touch     PARKED stays PARKED, most recently used
    take_over PARKED -> DECODING (a released handle's last request writes into it)
    add_ref   a queued request names a handle (its `refs`)
    drop_ref  that request is planned; a released, unreferenced handle is freed
              (PARKED -> DEFERRED_FREE)
    release   the caller names the handle in no further request; freed likewise
    flush     DEFERRED_FREE -> FREE (nothing reads those slots any more)
  """

  def __init__(self, n):
    self.free = list(range(n - 1, -1, -1))  # pop() hands out the lowest first
    self.parked: collections.OrderedDict = collections.OrderedDict()  # slot -> Handle
    self.deferred: list[int] = []  # freed slots, in the order they were freed

  def state(self, slot: int) -> SlotState:
    if slot in self.parked:
      return SlotState.PARKED
    if slot in self.deferred:
      return SlotState.DEFERRED_FREE
    if slot in self.free:
      return SlotState.FREE
    return SlotState.DECODING

  def available(self, protect=frozenset()) -> int:
    return len(self.free) + sum(1 for s in self.parked if s not in protect)

  def take(self, count: int, protect, stats: "EngineStats") -> Optional[list]:
    """`count` slots, evicting least recently used parked slots (unreferenced first)
    but none in `protect` (caches this step still reads)."""
    if self.available(protect) < count:
      return None
    while len(self.free) < count:
      victims = [s for s, h in self.parked.items() if s not in protect and h.refs == 0]
      victim = victims[0] if victims else next(s for s in self.parked if s not in protect)
      self.parked.pop(victim).alive = False
      self.free.append(victim)
      stats.evictions += 1
    return [self.free.pop() for _ in range(count)]

  def park(self, handle: Handle) -> None:
    self.parked[handle.slot] = handle

  def touch(self, handle: Handle) -> None:
    self.parked.move_to_end(handle.slot)

  def take_over(self, handle: Handle) -> None:
    handle.alive = False
    self.parked.pop(handle.slot)

  def add_ref(self, handle: Handle) -> None:
    handle.refs += 1

  def drop_ref(self, handle: Handle) -> None:
    handle.refs -= 1
    self._maybe_free(handle)

  def release(self, handle: Handle) -> None:
    handle.released = True
    self._maybe_free(handle)

  def flush(self) -> None:
    self.free.extend(self.deferred)
    self.deferred = []

  def _maybe_free(self, handle: Handle) -> None:
    if handle.alive and handle.released and handle.refs == 0:
      handle.alive = False
      self.parked.pop(handle.slot)
      self.deferred.append(handle.slot)


def lcp(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two id arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


@dataclasses.dataclass
class EngineStats:
  """A run's counters (`DecodeEngine.stats`); `as_dict` keys are the metric names."""

  requests: int = 0  # submitted
  prefill_tokens: int = 0  # admitted (prefilled) prompt tokens
  reused_tokens: int = 0  # prompt tokens found in a parent's cache
  decode_tokens: int = 0  # sampled tokens
  slot_steps: int = 0  # decode rows x steps run, padding included
  decode_steps: int = 0  # steps run, summed over decode calls (one after another on a device)
  chunks: int = 0  # steps that decoded
  occupancy_sum: float = 0  # decoding slots / all slots, summed over chunks
  parked_sum: float = 0  # parked slots (caches kept for a continuation) / all slots, likewise
  evictions: int = 0  # parked caches evicted for room
  admit_calls: int = 0
  decode_calls: int = 0
  device_seconds: float = 0  # wall time of the steps' device calls

  def as_dict(self) -> dict:
    return dataclasses.asdict(self)
