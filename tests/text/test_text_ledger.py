"""TokenLedger: append-only records, prefix-sharing forks, numpy export."""

import random

import numpy as np
import pytest

from mtrl_jax.text import TokenLedger


def _snapshot(ledger):
  return (ledger.ids, ledger.roles, ledger.trainable, ledger.logprobs, ledger.turn)


def test_extend_records_and_arrays():
  led = TokenLedger()
  assert len(led) == 0 and led.num_turns == 0
  led.extend([5, 6], role="user", turn=0)
  led.extend([7, 8, 9], role="assistant", turn=1, trainable=True, logprobs=[-0.5, -1.0, -2.0])
  led.extend([10], role="assistant", turn=1, trainable=[False])
  assert led.ids == (5, 6, 7, 8, 9, 10)
  assert led.roles == ("user",) * 2 + ("assistant",) * 4
  assert led.trainable == (False, False, True, True, True, False)
  assert led.logprobs == (0.0, 0.0, -0.5, -1.0, -2.0, 0.0)
  assert led.turn == (0, 0, 1, 1, 1, 1) and led.num_turns == 2
  arr = led.to_arrays()
  assert arr["ids"].dtype == np.int32 and arr["trainable"].dtype == bool
  assert arr["logprobs"].dtype == np.float32 and arr["turn"].dtype == np.int32
  np.testing.assert_array_equal(arr["ids"], [5, 6, 7, 8, 9, 10])
  np.testing.assert_array_equal(arr["roles"], ["user"] * 2 + ["assistant"] * 4)
  np.testing.assert_array_equal(arr["logprobs"], np.float32([0, 0, -0.5, -1, -2, 0]))
  empty = TokenLedger().to_arrays()
  assert all(a.shape == (0,) for a in empty.values())


def test_extend_validation():
  led = TokenLedger()
  led.extend([1], role="user", turn=2)
  with pytest.raises(ValueError, match="2 ids but 1 trainable flags and 2 logprobs"):
    led.extend([1, 2], role="user", turn=2, trainable=[True], logprobs=[0.0, 0.0])
  with pytest.raises(ValueError, match="turn=1 is before the last turn 2"):
    led.extend([1], role="user", turn=1)
  with pytest.raises(ValueError, match="role must be a non-empty string"):
    led.extend([1], role="", turn=2)
  with pytest.raises(ValueError, match="negative token id"):
    led.extend([-1], role="user", turn=2)
  assert led.ids == (1,)  # failed calls appended nothing


def test_records_are_read_only():
  led = TokenLedger()
  led.extend([1, 2], role="user", turn=0)
  with pytest.raises(AttributeError):
    led.ids.append(3)
  with pytest.raises(AttributeError):
    led.ids = (9,)


def test_copy_is_independent_in_both_directions():
  parent = TokenLedger()
  parent.extend([1, 2, 3], role="user", turn=0)
  parent.open_turn = 1
  before = _snapshot(parent)
  child = parent.copy()
  assert child.open_turn == 1
  child.extend([4], role="assistant", turn=1, trainable=True, logprobs=[-0.1])
  assert _snapshot(parent) == before
  parent.extend([9, 9], role="assistant", turn=1)
  assert child.ids == (1, 2, 3, 4) and parent.ids == (1, 2, 3, 9, 9)
  assert len(child) == 4 and len(parent) == 5
  # The prefix is shared, not copied.
  assert child._chunks[0] is parent._chunks[0]


def test_random_fork_tree_matches_plain_list_reference():
  """Random extends and forks on a tree of ledgers against naive list copies."""
  rng = random.Random(0)
  nodes = [(TokenLedger(), [[] for _ in range(5)])]
  for step in range(300):
    led, ref = nodes[rng.randrange(len(nodes))]
    if rng.random() < 0.3:
      nodes.append((led.copy(), [list(f) for f in ref]))
      continue
    n = rng.randrange(0, 4)
    ids = [rng.randrange(300) for _ in range(n)]
    flags = [rng.random() < 0.5 for _ in range(n)]
    lps = [-rng.random() for _ in range(n)]
    role = rng.choice(["user", "assistant", "tool"])
    turn = led.num_turns if rng.random() < 0.5 else max(led.num_turns - 1, 0)
    led.extend(ids, role=role, turn=turn, trainable=flags, logprobs=lps)
    for field, vals in zip(ref, (ids, [role] * n, flags, lps, [turn] * n)):
      field.extend(vals)
    if step % 7 == 0:  # materialise at odd times so stale caches would show
      for led2, ref2 in nodes:
        assert _snapshot(led2) == tuple(tuple(f) for f in ref2)
  for led, ref in nodes:
    assert _snapshot(led) == tuple(tuple(f) for f in ref)
    assert len(led) == len(ref[0])
