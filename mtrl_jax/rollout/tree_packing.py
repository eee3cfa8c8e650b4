"""Tree packing: every token of a rollout tree appears once in the training batch.

A rollout tree's trained actions (`tree_actions`) become a `TrainBatch`
(`rollout.train_batch`) in one of two ways. `pack_rows` writes one row per
action, each repeating its whole context (a tree without shared prefixes:
the baseline). `pack_actions` inserts each agent's actions into a token trie
instead: an action's path is its prompt followed by
its completion; prompts share every prefix already present (a child's prompt
runs through its parent's completion, siblings share their node's prompt, and
roots share a common system prompt), while each action's completion tokens are
its own. The trie is laid out depth-first (pre-order), so the subtree of a
token is a contiguous range and ancestor-only attention is one number per
token: `ends[k]`, the end of k's subtree (`models.transformer.
tree_attention_mask`). A token's position id is its depth on its path, which
is its index in the row layout, so every hidden state equals the row layout's.

Splitting and bin packing: a subtree that does not fit the row length is split
at its root, whose path is copied in front of each group of its children
(first-fit decreasing); the resulting items are then bin-packed into rows
(first-fit decreasing). An action is trained (loss-masked in) in exactly one
item: the first that holds its last token, which holds its whole path.

Logits only where the loss needs them: for each trained token the batch names
the row position of its predecessor on the path (`prev_BxK`: the LM head runs
there only) and its id (`target_BxK`). Per-token training arrays are `[B, K]`
(K: a bucket of the most trained tokens in a row); `action_BxK` numbers the
actions of a row, so GSPO's sequence ratio and the `seq-mean-*` aggregations
see one action as one sequence wherever it sits.

Batch fields: `rollout.train_batch.TrainBatch`.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mtrl_jax.buckets import bucket, row_count
from mtrl_jax.rollout.train_batch import TrainBatch, empty, from_rows, logit_buckets
from mtrl_jax.rollout.tree import Tree


@dataclasses.dataclass(frozen=True)
class Action:
  """One trained action: its path is prompt + completion; only completion tokens train."""

  prompt: Sequence[int]
  ids: np.ndarray
  logprobs: np.ndarray
  trainable: np.ndarray  # bool, sampled tokens of the completion
  advantage: float
  value_target: float = 0.0  # the critic's target for this action (`rollout.critic`)
  old_value: float = 0.0  # the rollout critic's value of it (value clipping)


class _Trie:
  """Token trie of one agent's actions (node 0 is a virtual root without a token)."""

  def __init__(self):
    self.token = [-1]
    self.parent = [-1]
    self.kids: list[list[int]] = [[]]
    self.by_token: list[dict[int, list[int]]] = [{}]
    self.action = [-1]  # the action a completion token belongs to, -1 for context
    self.logp = [0.0]
    self.trainable = [False]

  def _add(self, parent: int, token: int, action: int, logp: float, trainable: bool) -> int:
    n = len(self.token)
    self.token.append(token)
    self.parent.append(parent)
    self.kids.append([])
    self.by_token.append({})
    self.action.append(action)
    self.logp.append(logp)
    self.trainable.append(trainable)
    self.kids[parent].append(n)
    self.by_token[parent].setdefault(token, []).append(n)
    return n

  def _longest_match(self, seq: Sequence[int]) -> tuple[int, int]:
    # Completions are never merged, so a token may have several children with
    # the same id; any of them gives the same path (same ids, same depths),
    # so the search only looks for the longest one.
    best, best_len = 0, 0
    stack = [(0, 0)]
    while stack:
      node, k = stack.pop()
      if k > best_len:
        best, best_len = node, k
        if k == len(seq):
          break
      if k < len(seq):
        stack.extend((c, k + 1) for c in self.by_token[node].get(seq[k], ()))
    return best, best_len

  def insert(self, action_index: int, action: Action) -> int:
    """Adds one action; returns the trie node of its last token."""
    node, k = self._longest_match(action.prompt)
    for tok in action.prompt[k:]:
      # Context tokens merge with an existing context child of the same id.
      same = [c for c in self.by_token[node].get(int(tok), ()) if self.action[c] < 0]
      node = same[0] if same else self._add(node, int(tok), -1, 0.0, False)
    for tok, lp, tr in zip(action.ids, action.logprobs, action.trainable):
      node = self._add(node, int(tok), action_index, float(lp), bool(tr))
    return node

  def sizes(self) -> np.ndarray:
    size = np.ones(len(self.token), np.int64)
    for n in range(len(self.token) - 1, 0, -1):  # children have larger ids
      size[self.parent[n]] += size[n]
    return size

  def preorder(self, root: int) -> list[int]:
    out, stack = [], [root]
    while stack:
      n = stack.pop()
      out.append(n)
      stack.extend(reversed(self.kids[n]))
    return out


def _first_fit_decreasing(sizes: Sequence[int], capacity: int) -> list[list[int]]:
  """Groups item indices into bins of at most `capacity` (first-fit decreasing)."""
  bins: list[list[int]] = []
  free: list[int] = []
  for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
    for b, room in enumerate(free):
      if sizes[i] <= room:
        bins[b].append(i)
        free[b] -= sizes[i]
        break
    else:
      bins.append([i])
      free.append(capacity - sizes[i])
  return bins


def _items(trie: _Trie, max_len: int) -> list[tuple[tuple[int, ...], list[int]]]:
  """Splits the trie into items (path copies, subtree roots), each <= max_len tokens."""
  size = trie.sizes()
  items = []
  work = [((), trie.kids[0])]
  while work:
    path, kids = work.pop(0)
    room = max_len - len(path)
    small = [k for k in kids if size[k] <= room]
    for group in _first_fit_decreasing([int(size[k]) for k in small], room):
      items.append((path, [small[i] for i in sorted(group)]))
    for k in kids:
      if size[k] > room:
        if len(path) + 2 > max_len:
          raise ValueError(
              f"a single path of {len(path) + 2}+ tokens exceeds the largest "
              f"length bucket {max_len}; raise rl.length_buckets"
          )
        work.append((path + (k,), trie.kids[k]))
  return items


def pack_actions(
    actions_by_agent: Sequence[Sequence[Action]],
    *,
    length: int,
    row_buckets: Optional[Sequence[int]] = None,
    row_multiple: int = 1,
    pad_id: int = 0,
    values: Optional[str] = None,
) -> tuple[TrainBatch, dict[str, float]]:
  """Packs trained actions (one list per agent: agents never share context) into a batch.

  Args:
    actions_by_agent: per agent, its trained actions in tree order (parents
      before children, so a child's prompt finds its parent's completion).
    length: the row length L (every item is split to fit it).
    row_buckets: allowed row counts; default: powers of two (times row_multiple).
    row_multiple: the row count is a multiple of this (the data shards).
    pad_id: token id of padding.
    values: a critic's value fields: 'v' (read at each action's last prompt
      token) or 'q' (at its last token); None: none.

  Returns:
    (batch, stats): the `TrainBatch` and counts: tokens_trained
    (tokens in rows), tokens_rows_equivalent (what one row per action would
    hold), padding_fraction, rows, actions; with `values` also value_slots,
    int [actions, 2]: the (row, slot) of each action's value, agent by agent
    in the order given.
  """
  items = []  # (trie, sizes, depths, path length, nodes, loss flags, actions, last nodes)
  equivalent = 0
  first_action = {}  # id(trie) -> index of its agent's first action among all agents'
  offsets = np.cumsum([0] + [len(a) for a in actions_by_agent])
  for agent, actions in enumerate(actions_by_agent):
    if not actions:
      continue
    trie = _Trie()
    first_action[id(trie)] = int(offsets[agent])
    last = {}
    for a, act in enumerate(actions):
      if len(act.prompt) == 0:
        raise ValueError("an action with an empty prompt (position 0 must be context)")
      last[trie.insert(a, act)] = a
      equivalent += len(act.prompt) + len(act.ids)
    size = trie.sizes()
    depth = np.full(len(trie.token), -1, np.int64)
    for n in range(1, len(trie.token)):
      depth[n] = depth[trie.parent[n]] + 1
    assigned: set[int] = set()
    for path, roots in _items(trie, length):
      nodes = list(path) + [n for r in roots for n in trie.preorder(r)]
      mine = set()
      for n in nodes:
        a = last.get(n)
        if a is not None and a not in assigned:
          assigned.add(a)
          mine.add(a)
      loss = [trie.action[n] in mine and trie.trainable[n] for n in nodes]
      items.append(
          (trie, size, depth, len(path), nodes, loss, actions, {a: n for n, a in last.items()})
      )
  bins = _first_fit_decreasing([len(it[4]) for it in items], length)
  num_rows = len(bins)
  if row_buckets is not None:
    r = bucket(max(num_rows, 1), row_buckets, "packed row count")
    if r % row_multiple:
      raise ValueError(f"row bucket {r} is not a multiple of row_multiple={row_multiple}")
  else:
    r = row_count(num_rows, row_multiple)
  most = max((sum(sum(items[i][5]) for i in b) for b in bins), default=1)
  k = bucket(max(most, 1), logit_buckets(length), "trained tokens per row")

  out = empty(r, length, k, pad_id, values is not None)  # padding: its own subtree only
  tokens, positions, ends = out.tokens_BxL, out.positions_BxL, out.ends_BxL
  prev, target, action = out.prev_BxK, out.target_BxK, out.action_BxK
  loss_mask, old_logp, adv, row_weight = (
      out.loss_mask_BxK,
      out.old_logp_BxK,
      out.adv_BxK,
      out.row_weight_B,
  )
  used = 0
  valued: set = set()
  slots = np.zeros((sum(map(len, actions_by_agent)), 2), np.int64)
  for row, b in enumerate(bins):
    off, j, local_actions = 0, 0, {}
    for i in sorted(b):
      trie, size, depth, num_path, nodes, loss, actions, last_node = items[i]
      where = {n: off + pos for pos, n in enumerate(nodes)}
      stop = off + len(nodes)
      for pos, n in enumerate(nodes):
        tokens[row, off + pos] = trie.token[n]
        positions[row, off + pos] = depth[n]  # its index on its own path
        # A path copy's subtree (within this item) is the rest of the item.
        ends[row, off + pos] = stop if pos < num_path else off + pos + size[n]
        if loss[pos]:
          prev[row, j] = where[trie.parent[n]]
          target[row, j] = trie.token[n]
          action[row, j] = local_actions.setdefault((id(trie), trie.action[n]), len(local_actions))
          loss_mask[row, j] = True
          old_logp[row, j] = trie.logp[n]
          adv[row, j] = actions[trie.action[n]].advantage
          if values is not None and (id(trie), trie.action[n]) not in valued:
            valued.add((id(trie), trie.action[n]))  # the action's first trained token
            act = actions[trie.action[n]]
            out.value_mask_BxK[row, j] = True
            out.value_pos_BxK[row, j] = (
                prev[row, j] if values == "v" else where[last_node[trie.action[n]]]
            )
            out.value_target_BxK[row, j] = act.value_target
            out.old_value_BxK[row, j] = act.old_value
            slots[first_action[id(trie)] + trie.action[n]] = (row, j)
          j += 1
      off = stop
    row_weight[row] = 1.0
    used += off
  stats = {
      "tokens_trained": float(used),
      "tokens_rows_equivalent": float(equivalent),
      "padding_fraction": 1.0 - used / float(r * length),
      "rows": float(r),
      "actions": float(sum(len(a) for a in actions_by_agent)),
  }
  if values is not None:
    stats["value_slots"] = slots
  return out, stats


def pack_rows(
    actions_by_agent: Sequence[Sequence[Action]],
    *,
    length_buckets: Sequence[int],
    row_buckets: Optional[Sequence[int]] = None,
    row_multiple: int = 1,
    pad_id: int = 0,
    values: Optional[str] = None,
) -> tuple[TrainBatch, dict[str, float]]:
  """One row per action (its prompt, then its completion), right-padded: `pack_actions`'
  layout without shared prefixes, each row one causal path with K = L slots.

  Args:
    actions_by_agent: per agent, its trained actions.
    length_buckets: allowed row lengths; the smallest that holds the longest action.
    row_buckets, row_multiple, pad_id, values: as for `pack_actions`.
  Returns:
    (batch, stats) as `pack_actions`; nothing is shared, so tokens_trained equals
    tokens_rows_equivalent.
  """
  actions = [a for per in actions_by_agent for a in per]
  if any(len(a.prompt) == 0 for a in actions):
    raise ValueError("an action with an empty prompt (position 0 must be context)")
  longest = max((len(a.prompt) + len(a.ids) for a in actions), default=1)
  length = bucket(longest, length_buckets, "row length")
  if row_buckets is not None:
    rows = bucket(max(len(actions), 1), row_buckets, "row count")
    if rows % row_multiple:
      raise ValueError(f"row bucket {rows} is not a multiple of row_multiple={row_multiple}")
  else:
    rows = row_count(len(actions), row_multiple)
  tokens_BxL = np.full((rows, length), pad_id, np.int32)
  mask_BxL = np.zeros((rows, length), bool)
  old_BxL = np.zeros((rows, length), np.float32)
  adv_B = np.zeros(rows, np.float32)
  for b, act in enumerate(actions):
    p, c = len(act.prompt), len(act.ids)
    tokens_BxL[b, :p] = act.prompt
    tokens_BxL[b, p : p + c] = act.ids
    mask_BxL[b, p : p + c] = act.trainable
    old_BxL[b, p : p + c] = act.logprobs
    adv_B[b] = act.advantage
  weight_B = (np.arange(rows) < len(actions)).astype(np.float32)
  batch = from_rows(
      tokens_BxL,
      mask_BxL,
      old_logp_BxL=old_BxL,
      adv=adv_B,
      row_weight_B=weight_B,
      num_logits=length,
  )
  if values is not None:  # slot 0 of a row: its action's first trained token
    n = len(actions)
    first_B = np.zeros(rows, np.int32)
    first_B[:n] = [
        len(a.prompt) - 1 if values == "v" else len(a.prompt) + len(a.ids) - 1 for a in actions
    ]
    batch = batch.replace(
        value_pos_BxK=np.pad(first_B[:, None], ((0, 0), (0, length - 1))),
        value_mask_BxK=np.pad((np.arange(rows) < n)[:, None], ((0, 0), (0, length - 1))),
        value_target_BxK=np.pad(
            np.asarray([a.value_target for a in actions] + [0.0] * (rows - n), np.float32)[:, None],
            ((0, 0), (0, length - 1)),
        ),
        old_value_BxK=np.pad(
            np.asarray([a.old_value for a in actions] + [0.0] * (rows - n), np.float32)[:, None],
            ((0, 0), (0, length - 1)),
        ),
    )
  used = float(sum(len(a.prompt) + len(a.ids) for a in actions))
  stats = {
      "tokens_trained": used,
      "tokens_rows_equivalent": used,
      "padding_fraction": 1.0 - used / float(rows * length),
      "rows": float(rows),
      "actions": float(len(actions)),
  }
  if values is not None:
    stats["value_slots"] = np.stack(
        [np.arange(len(actions)), np.zeros(len(actions), np.int64)], axis=1
    )
  return batch, stats


def tree_actions(
    tree: Tree, trained_NxG_per_node: Optional[list] = None, critic: Optional[tuple] = None
) -> list[list[Action]]:
  """The trained actions of a finalized tree, per agent, in node and sample order.

  An action is trained when its weight is > 0 (no infrastructure fault) and,
  if `trained_NxG_per_node` is given (the zero-variance filter), where it says so.
  `critic`: (values, targets), per node [N, G] each (`rollout.critic`): the
  actions' old values and value targets.
  """
  if not tree.finalized:
    raise ValueError("tree packing needs a finalized tree (call Tree.finalize())")
  n = tree.cfg.num_agents
  out: list[list[Action]] = [[] for _ in range(n)]
  for idx, node in enumerate(tree.nodes):
    if node.completions is None:
      raise ValueError(f"node {node.node_id} was never sampled")
    for i in range(n):
      for g, comp in enumerate(node.completions[i]):
        keep = node.weight_NxG[i, g] > 0
        if trained_NxG_per_node is not None:
          keep = keep and bool(trained_NxG_per_node[idx][i, g])
        if keep:
          out[i].append(
              Action(
                  prompt=node.prompts[i],
                  ids=np.asarray(comp.ids, np.int32),
                  logprobs=np.asarray(comp.logprobs, np.float32),
                  trainable=comp.sampled_mask,
                  advantage=float(node.advantages_NxG[i, g]),
                  value_target=0.0 if critic is None else float(critic[1][idx][i, g]),
                  old_value=0.0 if critic is None else float(critic[0][idx][i, g]),
              )
          )
  return out
