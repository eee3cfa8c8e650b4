"""`SlotPool`'s transitions and the `SlotState` each leaves a slot in."""

import numpy as np

from mtrl_jax.sampling.slots import EngineStats, Handle, SlotPool, SlotState


def _parked(pool, slot):
  h = Handle(0, 0, slot, np.arange(3))
  pool.park(h)
  return h


def test_take_park_release_flush():
  pool, stats = SlotPool(3), EngineStats()
  assert [pool.state(s) for s in range(3)] == [SlotState.FREE] * 3
  assert pool.take(2, frozenset(), stats) == [0, 1]  # the lowest first
  assert pool.state(0) == pool.state(1) == SlotState.DECODING
  h = _parked(pool, 0)
  assert pool.state(0) == SlotState.PARKED and pool.available() == 2
  pool.add_ref(h)
  pool.release(h)  # a queued request still names it
  assert pool.state(0) == SlotState.PARKED and h.alive
  pool.drop_ref(h)
  assert pool.state(0) == SlotState.DEFERRED_FREE and not h.alive
  assert pool.available() == 1  # not handed out before `flush`
  pool.flush()
  assert pool.state(0) == SlotState.FREE and pool.available() == 2
  assert stats.evictions == 0


def test_take_evicts_least_recently_used_unreferenced_first():
  pool, stats = SlotPool(3), EngineStats()
  pool.take(3, frozenset(), stats)
  a, b, c = (_parked(pool, s) for s in range(3))
  pool.touch(a)  # a is now the most recently used
  pool.add_ref(b)  # a queued request names b
  assert pool.take(1, frozenset(), stats) == [2]  # c: unreferenced and least recent
  assert not c.alive and a.alive and b.alive
  assert pool.take(1, {1}, stats) == [0]  # b is protected
  assert not a.alive and stats.evictions == 2
  assert pool.take(1, {1}, stats) is None  # nothing left that may be evicted
  assert pool.state(1) == SlotState.PARKED


def test_take_over_hands_the_parked_slot_to_its_last_request():
  pool, stats = SlotPool(2), EngineStats()
  pool.take(1, frozenset(), stats)
  h = _parked(pool, 0)
  pool.add_ref(h)
  pool.release(h)
  pool.take_over(h)
  pool.drop_ref(h)
  assert pool.state(0) == SlotState.DECODING and not h.alive and h.refs == 0
  assert pool.available() == 1


def test_stats_as_dict_names_every_counter():
  stats = EngineStats()
  stats.evictions += 2
  d = stats.as_dict()
  assert d["evictions"] == 2 and d["requests"] == 0
  assert set(d) == {
      "requests",
      "prefill_tokens",
      "reused_tokens",
      "decode_tokens",
      "slot_steps",
      "decode_steps",
      "chunks",
      "occupancy_sum",
      "parked_sum",
      "evictions",
      "admit_calls",
      "decode_calls",
      "device_seconds",
  }
