"""Where a step admits queued requests: the slots of a run's pools, and one plan per request.

`SlotTable` holds a run's `SlotPool` per local (shard, agent). Each
`DecodeEngine.step` plans the queue in order (FIFO; a request that does not
fit waits): a request whose parent handle is still parked (and reuse is on)
goes to the parent's pool and prefills only what the parent's cache lacks
(from the longest common prefix of the cached ids and its context); a
released parent that only this request still names hands its own slot over
to the first sample. Any other request goes to the pool of its agent with
the most room (the lowest shard on ties) and prefills its whole context. A
slot read as a source in the step is protected from eviction until the
step's admits have run.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Optional

import numpy as np

from mtrl_jax.sampling.slots import EngineStats, Handle, Request, SlotPool, lcp


@dataclasses.dataclass(frozen=True)
class Admission:
  """One request's admission: a prefill of `ext` on top of slot `src`'s first `start`
  columns, written to the `dst` slots its samples decode in.

  Attributes:
    req: the request (prompt, keys, token budget).
    shard: the batch shard of the pool.
    agent: the agent of the pool (the request's).
    src: the slot whose cache the prefill continues (the parent's, or `dst[0]`).
    dst: one slot per sample, in sample order (the first may be `src`).
    start: cache columns reused from `src` (0: the whole context is prefilled).
    ctx: the prompt but its last token: what the slots hold once admitted.
  """

  req: Request
  shard: int
  agent: int
  src: int
  dst: tuple
  start: int
  ctx: np.ndarray

  @property
  def ext(self) -> np.ndarray:
    """The context's tokens the admit prefills."""
    return self.ctx[self.start :]


class SlotTable:
  """A run's slot pools, one per local (shard, agent), and the step's admission plans.

  Args:
    shards: local batch shards.
    agents: parameter sets.
    slots: slots per pool (`EngineConfig.slots`).
    reuse: continue a request from its parent's cache (`EngineConfig.reuse`).
  """

  def __init__(self, shards: int, agents: int, slots: int, reuse: bool):
    self.shards, self.reuse = shards, reuse
    self.pools = {(d, a): SlotPool(slots) for d in range(shards) for a in range(agents)}
    self._reading = collections.defaultdict(set)  # (shard, agent) -> slots read as sources

  def _pool(self, h: Handle) -> SlotPool:
    return self.pools[(h.shard, h.agent)]

  def add_ref(self, h: Handle) -> None:
    """A queued request names `h`."""
    self._pool(h).add_ref(h)

  def release(self, h: Handle) -> None:
    """No further request names `h`; its slot frees once no queued request does."""
    self._pool(h).release(h)

  def park(self, h: Handle) -> None:
    """`h`'s sample finished: its slot keeps the cache."""
    self._pool(h).park(h)

  def parked(self) -> int:
    """Parked slots over every pool."""
    return sum(len(p.parked) for p in self.pools.values())

  def flush(self) -> None:
    """Slots freed so far become free (no admit reads them any more)."""
    for pool in self.pools.values():
      pool.flush()

  def begin_step(self) -> None:
    """A new step: frees what was released since the last one; no slot is read yet."""
    self.flush()
    self._reading = collections.defaultdict(set)

  def plan(self, queue: list[Request], stats: EngineStats) -> tuple[list[Admission], list]:
    """(admissions, requests left waiting): slots for `queue` in order."""
    plans, waiting = [], []
    for req in queue:
      plan = self._plan(req, stats)
      if plan is None:
        waiting.append(req)
      else:
        plans.append(plan)
    return plans, waiting

  def _plan(self, req: Request, stats: EngineStats) -> Optional[Admission]:
    g = len(req.rows)
    ctx = req.prompt[:-1]
    h = req.parent
    if h is not None and h.alive and self.reuse:
      pool = self._pool(h)
      reading = self._reading[(h.shard, h.agent)]
      takeover = h.released and h.refs == 1
      fresh = pool.take(g - 1 if takeover else g, reading | {h.slot}, stats)
      if fresh is None:
        return None
      start = lcp(h.ids, ctx)
      if takeover:
        pool.take_over(h)
        dst = [h.slot] + fresh
      else:
        dst = fresh
        reading.add(h.slot)  # no later plan of this step may evict and overwrite it
        pool.touch(h)  # recently used
      pool.drop_ref(h)
      shard, src = h.shard, h.slot
    else:
      shard = max(
          range(self.shards),
          key=lambda d: (self.pools[(d, req.agent)].available(self._reading[(d, req.agent)]), -d),
      )
      dst = self.pools[(shard, req.agent)].take(g, self._reading[(shard, req.agent)], stats)
      if dst is None:
        return None
      if h is not None:
        self._pool(h).drop_ref(h)
      src, start = dst[0], 0
    plan = Admission(req, shard, req.agent, src, tuple(dst), start, ctx)
    stats.prefill_tokens += len(plan.ext)
    stats.reused_tokens += plan.start
    return plan
