"""What the rollout engine is asked for and hands back, and its host-side slot bookkeeping.

`EngineConfig` sizes an engine; a `Request` asks for G samples of a prompt
(optionally continuing a finished sample's cache, its `Handle`); a `Sample`
comes back with the tokens, their log q and its own `Handle`. `SlotPool`
tracks one (shard, agent) pool's free and parked slots; `Row` is a slot that
is decoding.
"""

from __future__ import annotations

import collections
import dataclasses
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
  """A finished sample's parked cache: slot `slot` of (shard, agent) holds `ids`."""

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
  """A decoding slot."""

  __slots__ = (
      "req",
      "g",
      "shard",
      "agent",
      "slot",
      "ctx",
      "token",
      "pos",
      "t",
      "max_new",
      "ids",
      "logps",
  )

  def __init__(self, req, g, shard, agent, slot, ctx, max_new):
    self.req, self.g, self.shard, self.agent, self.slot = req, g, shard, agent, slot
    self.ctx, self.max_new = ctx, max_new
    self.token, self.pos, self.t = int(req.prompt[-1]), len(ctx), 0
    self.ids, self.logps = [], []


class SlotPool:
  """Host bookkeeping of one (shard, agent) pool: free and parked (LRU) slots."""

  def __init__(self, n):
    self.free = list(range(n - 1, -1, -1))  # pop() hands out the lowest first
    self.parked: collections.OrderedDict = collections.OrderedDict()  # slot -> Handle

  def available(self, protect=frozenset()) -> int:
    return len(self.free) + sum(1 for s in self.parked if s not in protect)

  def take(self, count: int, protect, stats) -> Optional[list]:
    """`count` slots, evicting least recently used parked slots (unreferenced first)
    but none in `protect` (caches this step still reads)."""
    if self.available(protect) < count:
      return None
    while len(self.free) < count:
      victims = [s for s, h in self.parked.items() if s not in protect and h.refs == 0]
      victim = victims[0] if victims else next(s for s in self.parked if s not in protect)
      self.parked.pop(victim).alive = False
      self.free.append(victim)
      stats["evictions"] += 1
    return [self.free.pop() for _ in range(count)]


def lcp(a: np.ndarray, b: np.ndarray) -> int:
  """Length of the longest common prefix of two id arrays."""
  n = min(len(a), len(b))
  diff = np.flatnonzero(a[:n] != b[:n])
  return int(diff[0]) if diff.size else n


STAT_KEYS = (
    "requests",
    "prefill_tokens",
    "reused_tokens",
    "decode_tokens",
    "slot_steps",
    "chunks",
    "occupancy_sum",
    "evictions",
    "admit_calls",
    "decode_calls",
    "device_seconds",
)
