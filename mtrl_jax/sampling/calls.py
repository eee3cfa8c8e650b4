"""A step's work as the rollout engine's device calls, each of a fixed shape.

`DecodeEngine.step` admits planned requests and decodes the slots that are
decoding; here that work becomes calls. Every admit call has exactly
`admit_rows` rows per (shard, agent) and every decode call `rows` (padded;
more work takes more calls): float rounding depends on shapes, and which
requests share a call depends on when environments answer, so a sample's
arithmetic must not depend on its batch-mates. Likewise a row decodes over a
window (columns attended) that is a bucket of its own longest context
(prompt plus token budget, fixed while it decodes), rows of different
windows in different calls (masked columns add zeros, but XLA vectorizes a
reduction by its shape, so a wider window rounds differently), and a
request's new tokens fall in a bucket of their own count. Padding rows
name the scratch slot (index `slots`, after the pool's real slots) and the
pad token.

Arrays are this process's block, [D, A, R, ...] for its D local shards and A
agents; a row's index within its (shard, agent) is its order in the call.
"""

from __future__ import annotations

import collections
from typing import Callable

import numpy as np


def split_calls(items: list, owner: Callable, per_call: int) -> list[list]:
  """`items` split into calls of at most `per_call` per (shard, agent) (`owner(item)`),
  each owner's items in order."""
  per: dict = collections.defaultdict(list)
  for item in items:
    per[owner(item)].append(item)
  if not per:
    return []
  n = max(len(v) for v in per.values())
  return [
      [item for v in per.values() for item in v[k : k + per_call]] for k in range(0, n, per_call)
  ]


def admit_arrays(
    plans: list,
    shards: int,
    agents: int,
    rows: int,
    fanout: int,
    new_tokens: int,
    scratch: int,
    pad: int,
) -> tuple:
  """(src, dst, tokens, start, count, last) of one admit call of `plans`.

  Args:
    plans: `admission.Admission`s, at most `rows` per (shard, agent); each names
      its `shard`, `agent`, source slot `src`, destination slots `dst` (at most
      `fanout`), start column `start` and new tokens `ext` (at most `new_tokens`).
    shards, agents: the block's D and A.
    rows: E, rows of the call per (shard, agent).
    fanout: F, destination slots per row.
    new_tokens: X, the call's new-token bucket.
    scratch: the scratch slot's index.
    pad: the pad id.
  Returns:
    src [D, A, E], dst [D, A, E, F], tokens [D, A, E, X], start [D, A, E],
    count [D, A, E] and last [D, A, E], the prompt's last token (int32).
  """
  d, a, e, f = shards, agents, rows, fanout
  src = np.full((d, a, e), scratch, np.int32)
  dst = np.full((d, a, e, f), scratch, np.int32)
  tokens = np.full((d, a, e, new_tokens), pad, np.int32)
  start = np.zeros((d, a, e), np.int32)
  count = np.zeros((d, a, e), np.int32)
  last = np.full((d, a, e), pad, np.int32)
  used = collections.Counter()
  for p in plans:
    sa = (p.shard, p.agent)
    i = used[sa]
    used[sa] += 1
    ext = p.ext
    src[sa + (i,)] = p.src
    dst[sa + (i,)][: len(p.dst)] = p.dst
    tokens[sa + (i,)][: len(ext)] = ext
    start[sa + (i,)] = p.start
    count[sa + (i,)] = len(ext)
    last[sa + (i,)] = p.req.prompt[-1]
  return src, dst, tokens, start, count, last


def decode_arrays(
    rows: list, shards: int, agents: int, per_call: int, scratch: int
) -> tuple[tuple, list]:
  """The inputs of one decode call over `rows` (`slots.Row`s, at most `per_call` per
  (shard, agent)) and where each row sits.

  The rows' input tokens, columns and draws so far live on the device
  (`programs.SlotRows`); the host sends what it fixed at admission.

  Returns:
    ((slot, key, keyrow, max_new, live), placed): arrays [D, A, R] (key
    [D, A, R, 2] uint32 raw key data, keyrow uint32 the sample's row in its
    request, live False on padding rows) and `placed`, (index, row) per row,
    the index into the call's outputs.
  """
  d, a, r = shards, agents, per_call
  slot = np.full((d, a, r), scratch, np.int32)
  key = np.zeros((d, a, r, 2), np.uint32)
  keyrow = np.zeros((d, a, r), np.uint32)
  max_new = np.ones((d, a, r), np.int32)
  live = np.zeros((d, a, r), bool)
  placed = []
  used = collections.Counter()
  for row in rows:
    sa = (row.shard, row.agent)
    i = used[sa]
    used[sa] += 1
    idx = sa + (i,)
    slot[idx], key[idx], keyrow[idx] = row.slot, row.req.key, row.req.rows[row.g]
    max_new[idx], live[idx] = row.max_new, True
    placed.append((idx, row))
  return (slot, key, keyrow, max_new, live), placed
