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
from typing import Any, Sequence

import numpy as np

from mtrl_jax import distributed
from mtrl_jax.rollout import expand_tree
from mtrl_jax.rollout import TreeConfig
from mtrl_jax.rollout.policy import SamplerPolicy
from mtrl_jax.sampling import SamplingConfig


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


# Reward components of a step record (`StepOutcome.to_dict()["reward"]`), logged per action.
REWARD_PARTS = ("outcome", "step_penalty", "tool_penalty", "shaping")


def reward_metrics(tree) -> dict[str, float]:
  """Mean reward components per valid joint action: `reward/outcome`, `reward/step_penalty`,
  `reward/tool_penalty`, `reward/shaping` (weighted as composed; an action's sub-steps
  summed, so the four add up to the mean action reward). Shows whether the outcome
  dominates the penalties and shaping; {} when no action carries a reward record."""
  per_part = {k: [] for k in REWARD_PARTS}
  for node in tree.nodes:
    for b, info in enumerate(node.infos or []):
      if node.valid_B is not None and not node.valid_B[b]:
        continue  # masked (infrastructure fault): not trained on
      records = [s["reward"] for s in _step_infos(info) if "reward" in s]
      if records:
        for k in REWARD_PARTS:
          per_part[k].append(sum(float(r.get(k, 0.0)) for r in records))
  if not per_part["outcome"]:
    return {}
  return {f"reward/{k}": float(np.mean(v)) for k, v in per_part.items()}


def path_success(tree, success_threshold: float) -> float:
  """The chance that one trajectory sampled from a root succeeds within the tree's turns,
  averaged over roots: at every node each valid joint action is an equally likely sample,
  an ended action counts its outcome, a continuing one its child's chance, and one that
  neither ended nor has a child (cut at turn T, early termination) counts as no success.
  Unlike `rollout/success` (the share of ended actions that succeed, where a tree lists
  an early success once and a late one G times per level), it is comparable with the
  held-out success of single-path evaluation. NaN when no root has a valid action."""
  chance = {}
  for node in reversed(tree.nodes):  # children always have larger ids
    vals = []
    for b, info in enumerate(node.infos or []):
      if node.valid_B is not None and not node.valid_B[b]:
        continue  # masked (infrastructure fault): not a sample of the policy
      done, outcome = action_outcome(info)
      child = -1 if node.children_B is None else int(node.children_B[b])
      if done:
        vals.append(float(outcome > success_threshold))
      elif child < 0:
        vals.append(0.0)
      elif chance[child] is not None:
        vals.append(chance[child])
    chance[node.node_id] = float(np.mean(vals)) if vals else None
  roots = [chance[n.node_id] for n in tree.nodes
           if n.parent_id < 0 and chance[n.node_id] is not None]
  return float(np.mean(roots)) if roots else float("nan")


def rollout_metrics(tree, success_threshold: float) -> dict[str, float]:
  """Training-rollout statistics: success of ended actions and of sampled paths
  (`path_success`), returns, reward components, faults."""
  ended, success = 0, 0
  for node in tree.nodes:
    for info in node.infos or []:
      done, outcome = action_outcome(info)
      if done:
        ended += 1
        success += outcome > success_threshold
  roots = [n for n in tree.nodes if n.parent_id < 0]
  out = {"rollout/success": success / max(ended, 1),
         "rollout/path_success": path_success(tree, success_threshold),
         "rollout/return": float(np.mean([n.returns_B[n.valid_B].mean() for n in roots
                                          if n.valid_B.any()] or [np.nan])),
         **reward_metrics(tree), **fault_counts(tree)}
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


@dataclasses.dataclass
class Evaluator:
  """Single-path rollouts of tasks with one policy: the SFT stop check and held-out eval.

  Built once per run (`train.components`) from the run's sampler, renderer,
  transition and factory; the tree, sampling and success settings are the
  run's, with one generation per node and no early termination.
  """

  sampler: Any
  renderer: Any
  transition: Any
  factory: Any
  tree: TreeConfig
  sampling: SamplingConfig
  success_threshold: float = 0.0

  def __call__(self, params, tasks: Sequence[dict], *, greedy: bool, key,
               samples: int = 1) -> dict[str, float]:
    """Mean success, outcome, return, turns and masked fraction over `tasks`.

    `samples` > 1 rolls each task that many times (independent attempts; use
    greedy=False) and adds `pass@{samples}`: the fraction of tasks that any of
    their attempts solved. The means are over all attempts.
    """
    if samples < 1:
      raise ValueError(f"evaluate samples={samples}; allowed: an int >= 1")
    tree_cfg = dataclasses.replace(self.tree, num_generations=1, termination_threshold=None,
                                   advantage_mode="mean", advantage_std_norm=False)
    sampling = dataclasses.replace(self.sampling, greedy=greedy)
    if not greedy:
      sampling = dataclasses.replace(sampling, temperature=1.0, top_p=1.0, top_k=0)
    policy = SamplerPolicy(self.sampler, params, sampling, stop_ids=self.renderer.fmt.stop_ids,
                           pad_id=self.renderer.tokenizer.pad_id)
    # Several processes: each rolls its own block of tasks, the per-root results
    # come back in process order (the single-process order) and every process
    # computes the same means.
    mine = list(tasks)[distributed.share(len(tasks))]
    roots = self.transition.root_states(self.factory, [t for t in mine for _ in range(samples)])
    tree = expand_tree(tree_cfg, policy, self.transition, roots, key)
    res = distributed.gather_lists(path_results(tree))
    solved = [r["ended"] and r["outcome"] > self.success_threshold for r in res]
    out = {"success": float(np.mean(solved)),
           "outcome": float(np.mean([r["outcome"] for r in res])),
           "return": float(np.mean([r["return"] for r in res])),
           "turns": float(np.mean([r["turns"] for r in res])),
           "masked": float(np.mean([r["masked"] for r in res]))}
    if samples > 1:
      out[f"pass@{samples}"] = float(np.mean([any(solved[i:i + samples])
                                              for i in range(0, len(solved), samples)]))
    return out


def indexed(source, count: int, start: int = 0) -> list[dict]:
  """Tasks `start .. start+count-1` of a task source (clipped to its length), each with
  its `task_index`."""
  return [dict(source[i], task_index=i) for i in range(start, min(start + count, len(source)))]
