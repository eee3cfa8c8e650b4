"""A centralized critic's inputs: the joint history of every node, as causal rows.

CoMLRL's MAAC (1.4.3, `comlrl/trainers/actor_critic/maac.py`,
`MAACTrainer._build_critic_input`) values a state from every agent's prompt
("[Agent i] ..." joined) and, for Q, the joint action's completions. Here a
node's joint history is the agents' own contexts, token ids exactly as the
policies read them, concatenated in agent order:

  V:  [prompt_0, prompt_1, ..., prompt_{N-1}]                    one row per node
  Q:  [prompt_0, action_0, ..., prompt_{N-1}, action_{N-1}]      one row per joint action

where action_i is agent i's sample in the joint action (`joint_mode='align'`:
the g-th of every agent; a chain below its root: its one sample). Each row is
one causal path (`TrainBatch` with `ends` = L), the value head read at its
last token: one slot per row.

A row is kept where some agent's sample of it is trained (weight > 0). The
critic's value of a node (V) or joint action (Q) is every agent's value there
(`values_per_node`: [N, G] per node, as `rollout.critic.critic_advantages`
reads), and its target is the mean of the agents' targets over its trained
samples (`row_targets`): under the team reward (`agents.team_weight` 1) every
agent of a joint action has one return.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from mtrl_jax import buckets
from mtrl_jax.rollout import train_batch
from mtrl_jax.rollout.train_batch import TrainBatch
from mtrl_jax.rollout.tree import Tree


@dataclasses.dataclass(frozen=True)
class JointRow:
  """One row of a centralized critic: a node (V) or one of its joint actions (Q).

  Attributes:
    node: index of the node in `Tree.nodes`.
    sample: the joint action's sample index g (Q), or -1 (V: every sample of the node).
    tokens: int32 token ids of the joint history.
  """

  node: int
  sample: int
  tokens: np.ndarray


def joint_rows(tree: Tree, target: str) -> list[JointRow]:
  """The rows of `tree`'s trained nodes (V) or joint actions (Q), in node order.

  Args:
    tree: a finalized tree (weights set).
    target: 'v' or 'q'.
  """
  if target not in ("v", "q"):
    raise ValueError(f"joint_rows target={target!r}; allowed: 'v', 'q'")
  if not tree.finalized:
    raise ValueError("joint_rows needs a finalized tree (Tree.finalize())")
  if target == "q" and tree.cfg.joint_mode != "align":
    raise ValueError(
        f"joint_rows target='q' with joint_mode={tree.cfg.joint_mode!r}; "
        "allowed: 'align' (one action per agent in each joint action)"
    )
  rows = []
  for k, node in enumerate(tree.nodes):
    trained_NxG = node.weight_NxG > 0
    if target == "v":
      if trained_NxG.any():
        rows.append(
            JointRow(k, -1, np.concatenate([np.asarray(p, np.int32) for p in node.prompts]))
        )
      continue
    for g in np.flatnonzero(trained_NxG.any(axis=0)):
      parts = []
      for i, prompt in enumerate(node.prompts):
        parts += [np.asarray(prompt, np.int32), np.asarray(node.completions[i][g].ids, np.int32)]
      rows.append(JointRow(k, int(g), np.concatenate(parts)))
  return rows


def row_targets(tree: Tree, rows: list[JointRow], per_node: list) -> np.ndarray:
  """Each row's value of a per-node [N, G] array (`rollout.critic`'s targets, say): the
  mean over the row's trained samples (a V row: the node's; a Q row: its joint action's)."""
  out = np.zeros(len(rows), np.float64)
  for r, row in enumerate(rows):
    node = tree.nodes[row.node]
    x_NxG = np.asarray(per_node[row.node], np.float64)
    keep_NxG = node.weight_NxG > 0
    if row.sample >= 0:
      keep_NxG = keep_NxG & (np.arange(keep_NxG.shape[1]) == row.sample)[None, :]
    out[r] = x_NxG[keep_NxG].mean()
  return out


def values_per_node(tree: Tree, rows: list[JointRow], values_R) -> list[np.ndarray]:
  """The rows' values as every agent's value of each sample, per node [N, G] (0 where no
  row holds the sample): the layout `rollout.critic.critic_advantages` reads."""
  out = [np.zeros(node.weight_NxG.shape, np.float64) for node in tree.nodes]
  for row, v in zip(rows, np.asarray(values_R, np.float64)):
    if row.sample < 0:
      out[row.node][:] = v
    else:
      out[row.node][:, row.sample] = v
  return out


def rows_batch(
    rows: list[JointRow],
    *,
    pad_id: int = 0,
    row_multiple: int = 1,
    min_length: int = 64,
    targets_R=None,
    old_values_R=None,
) -> TrainBatch:
  """The rows as one causal batch with one value slot each (at the row's last token).

  Rows are padded to the next power of two (a multiple of `row_multiple`), the
  length to the next power of two >= `min_length`, so a run compiles one program
  per (rows, length) bucket. `targets_R`, `old_values_R`: the value targets and
  the rollout's values (clipping) of a training batch; None: zeros (a value pass).
  """
  if not rows:
    raise ValueError("rows_batch needs at least one row")
  longest = max(len(r.tokens) for r in rows)
  length = buckets.next_pow2(longest, min_length)
  b = buckets.row_count(len(rows), row_multiple)
  out = train_batch.empty(b, length, 1, pad_id, values=True)
  out.ends_BxL[: len(rows)] = length  # causal: each key is seen by the rest of its row
  for r, row in enumerate(rows):
    n = len(row.tokens)
    out.tokens_BxL[r, :n] = row.tokens
    out.positions_BxL[r] = np.arange(length, dtype=np.int32)
    out.value_pos_BxK[r, 0] = n - 1
    out.value_mask_BxK[r, 0] = True
    out.row_weight_B[r] = 1.0
  for field, x in (("value_target_BxK", targets_R), ("old_value_BxK", old_values_R)):
    if x is not None:
      getattr(out, field)[: len(rows), 0] = np.asarray(x, np.float32)
  return out


def joint_values(
    tree: Tree, target: str, values_fn, *, pad_id: int = 0, row_multiple: int = 1
) -> tuple[list[np.ndarray], Optional[list[JointRow]]]:
  """A centralized critic's value pass: per node [N, G] values, and the rows.

  `values_fn(batch)` returns the value head's [B, K] values of a `rows_batch`
  (`TrainStep.values`); one call over every row.
  """
  rows = joint_rows(tree, target)
  if not rows:
    return [np.zeros(node.weight_NxG.shape, np.float64) for node in tree.nodes], rows
  values = np.asarray(values_fn(rows_batch(rows, pad_id=pad_id, row_multiple=row_multiple)))
  return values_per_node(tree, rows, values[: len(rows), 0]), rows
