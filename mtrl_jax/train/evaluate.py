"""Held-out evaluation and rollout statistics.

Evaluation rolls every held-out task along a single path (G = 1 at every
node, no early termination), greedy or sampled, through the same
environments, limits and reward composition as training. A trajectory
succeeds when the outcome of the step that ended it is above
`success_threshold` (for the calculator task: every answer right, outcome +1).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

import numpy as np

from mtrl_jax.rollout import expand_tree
from mtrl_jax.rollout.policy import SamplerPolicy


def _step_infos(info):
  """The env-step records of one joint action (one, or one per tool sub-step)."""
  if info is None:
    return []
  return list(info.get("substeps", [info]))


def action_outcome(info) -> tuple[bool, float]:
  """(ended, outcome) of a joint action from its info records."""
  steps = _step_infos(info)
  if not steps:
    return False, 0.0
  last = steps[-1]
  return bool(last.get("done", False)), float(last.get("reward", {}).get("outcome", 0.0))


def fault_counts(tree) -> dict[str, float]:
  counts = collections.Counter()
  for node in tree.nodes:
    for info in node.infos or []:
      for step in _step_infos(info):
        for f in step.get("faults", []):
          counts[f"faults/{f['kind']}"] += 1
  return {k: float(v) for k, v in sorted(counts.items())}


def rollout_metrics(tree, success_threshold: float) -> dict[str, float]:
  """Training-rollout statistics: success of ended actions, returns, faults."""
  ended, success = 0, 0
  for node in tree.nodes:
    for info in node.infos or []:
      done, outcome = action_outcome(info)
      if done:
        ended += 1
        success += outcome > success_threshold
  roots = [n for n in tree.nodes if n.parent_id < 0]
  out = {"rollout/success": success / max(ended, 1),
         "rollout/return": float(np.mean([n.returns_B[n.valid_B].mean() for n in roots
                                          if n.valid_B.any()] or [np.nan])),
         **fault_counts(tree)}
  return out


def path_results(tree) -> list[dict]:
  """Per root of a single-path tree (G = 1): outcome, return, turns, success inputs."""
  by_id = {n.node_id: n for n in tree.nodes}
  out = []
  for root in (n for n in tree.nodes if n.parent_id < 0):
    node, total, turns, ended, outcome = root, 0.0, 0, False, 0.0
    while True:
      total += float(node.rewards_B[0])
      turns += 1
      ended, outcome = action_outcome(node.infos[0] if node.infos else None)
      child = int(node.children_B[0]) if node.children_B is not None else -1
      if child < 0:
        break
      node = by_id[child]
    out.append({"return": total, "outcome": outcome, "ended": ended, "turns": turns,
                "masked": not bool(node.valid_B[0])})
  return out


def evaluate(sampler, params, renderer, transition, factory, tasks: Sequence[dict], exp, *,
             greedy: bool, key) -> dict[str, float]:
  """Single-path rollouts of `tasks`; mean success, outcome, return and turns."""
  tree_cfg = dataclasses.replace(exp.tree, num_generations=1, termination_threshold=None,
                                 advantage_mode="mean", advantage_std_norm=False)
  sampling = dataclasses.replace(exp.sampling, greedy=greedy)
  if not greedy:
    sampling = dataclasses.replace(sampling, temperature=1.0, top_p=1.0, top_k=0)
  policy = SamplerPolicy(sampler, params, sampling, stop_ids=renderer.fmt.stop_ids,
                         pad_id=renderer.tokenizer.pad_id)
  roots = transition.root_states(factory, tasks)
  tree = expand_tree(tree_cfg, policy, transition, roots, key)
  res = path_results(tree)
  thr = exp.run.success_threshold
  return {"success": float(np.mean([r["ended"] and r["outcome"] > thr for r in res])),
          "outcome": float(np.mean([r["outcome"] for r in res])),
          "return": float(np.mean([r["return"] for r in res])),
          "turns": float(np.mean([r["turns"] for r in res])),
          "masked": float(np.mean([r["masked"] for r in res]))}
