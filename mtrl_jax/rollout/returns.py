"""Joint actions, termination, per-agent returns and sibling-baseline advantages (pure numpy).

The baselines are a table (`BASELINES`, mode name -> function of a sibling
group's returns): a new advantage mode is one entry here, and
`TreeConfig.advantage_mode` accepts exactly its keys.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Optional

import numpy as np

if TYPE_CHECKING:
  from mtrl_jax.rollout.config import TreeConfig

_STD_FLOOR = 1e-6


def _rloo(r: np.ndarray) -> np.ndarray:
  n = r.size
  return (n * r - r.sum()) / (n - 1) if n > 1 else np.zeros_like(r)


# Sibling baselines: A = f(R) over a node's valid samples of one agent.
BASELINES = {
    "mean": lambda r: r - r.mean(),  # R - mean R
    "raw": lambda r: r.copy(),  # R (no baseline)
    "max": lambda r: r - r.max(),  # R - max R
    "rloo": _rloo,  # (n R - sum R) / (n - 1): leave-one-out
}


def joint_actions(cfg: TreeConfig) -> np.ndarray:
  """Sample index of every agent in every joint action, int [B, N].

  align: row g is (g, ..., g); cross and marginal: itertools.product order
  (agent 0 slowest).
  """
  g, n = cfg.num_generations, cfg.num_agents
  if cfg.joint_mode in ("cross", "marginal"):
    return np.asarray(list(itertools.product(range(g), repeat=n)), np.int64).reshape(-1, n)
  return np.repeat(np.arange(g, dtype=np.int64)[:, None], n, axis=1)


def child_slots(cfg: TreeConfig) -> np.ndarray:
  """Per joint action, which of a node's children it spawns, int [B]: j itself
  (align, cross); under 'marginal' g for the aligned combination (g, ..., g), -1
  for the others (graded, never branched). Slots name children in the complete
  tree (`Node.full_id`), so a marginal tree's nodes are an align tree's."""
  joint_BxN = joint_actions(cfg)
  if cfg.joint_mode != "marginal":
    return np.arange(joint_BxN.shape[0], dtype=np.int64)
  aligned_B = (joint_BxN == joint_BxN[:, :1]).all(axis=1)
  return np.where(aligned_B, joint_BxN[:, 0], -1).astype(np.int64)


def should_terminate(cfg: TreeConfig, rewards_B: np.ndarray, valid_B: np.ndarray) -> bool:
  """Early termination: mean reward of the node's valid joint actions > tau (strict)."""
  if cfg.termination_threshold is None or not valid_B.any():
    return False
  return bool(rewards_B[valid_B].mean() > cfg.termination_threshold)


def agent_returns(
    cfg: TreeConfig,
    joint_BxN: np.ndarray,
    returns_B: np.ndarray,
    valid_B: np.ndarray,
    num_generations: Optional[int] = None,
) -> tuple[np.ndarray, np.ndarray]:
  """Per-agent sample returns and sample validity.

  Args:
    cfg: tree config (joint_mode, cross_return).
    joint_BxN: sample index of each agent in each joint action.
    returns_B: return of each joint action, [B] (every agent's), or [B, N]
      (column i: agent i's, with per-agent rewards).
    valid_B: validity of each joint action.
    num_generations: samples per agent at this node (default: cfg.num_generations).

  Returns:
    (returns_NxG float64, valid_NxG bool). A sample is valid iff every joint
    action containing it is valid. Cross: sum (or mean) over the joint actions
    containing the sample; align / N = 1: the joint return itself.
  """
  g = cfg.num_generations if num_generations is None else num_generations
  n = cfg.num_agents
  out_NxG = np.zeros((n, g), np.float64)
  valid_NxG = np.ones((n, g), bool)
  for i in range(n):
    # onehot_GxB[k, j]: joint action j contains sample k of agent i.
    onehot_GxB = joint_BxN[:, i][None, :] == np.arange(g)[:, None]
    valid_NxG[i] = ~(onehot_GxB & ~valid_B[None, :]).any(axis=1)
    mine_B = returns_B[:, i] if np.ndim(returns_B) == 2 else returns_B
    total_G = (onehot_GxB * np.where(valid_B, mine_B, 0.0)[None, :]).sum(axis=1)
    if cfg.joint_mode == "cross" and cfg.cross_return == "mean":
      total_G = total_G / onehot_GxB.sum(axis=1)
    out_NxG[i] = np.where(valid_NxG[i], total_G, 0.0)
  return out_NxG, valid_NxG


def advantages(returns_G: np.ndarray, valid_G: np.ndarray, mode: str, std_norm: bool) -> np.ndarray:
  """Sibling-baseline advantages of one agent at one node (invalid samples get 0).

  Args:
    returns_G: per-sample returns.
    valid_G: samples that take part (baselines are computed over these only).
    mode: 'mean' (R - mean), 'raw' (R), 'max' (R - max), 'rloo' ((n R - sum R) / (n - 1)).
    std_norm: then (A - mean A) / max(std_pop(A), 1e-6) when more than one sample.

  Returns:
    float64 [G].
  """
  if mode not in BASELINES:
    raise ValueError(f"advantage mode {mode!r}; allowed: {list(BASELINES)}")
  out = np.zeros(returns_G.shape, np.float64)
  r = returns_G[valid_G].astype(np.float64)
  count = r.size
  if count == 0:
    return out
  if mode != "raw" and np.all(r == r[0]):
    return out  # equal returns: exactly zero (r - mean(r) can be off by an ulp)
  a = BASELINES[mode](r)
  if std_norm and count > 1:
    a = (a - a.mean()) / max(a.std(), _STD_FLOOR)
  out[valid_G] = a
  return out
