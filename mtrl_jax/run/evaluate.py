"""Held-out evaluation: single-path rollouts of held-out tasks through the rollout engine.

Evaluation rolls every held-out task along a single path (G = 1 at every
node, no early termination), greedy or sampled, through the same
environments, limits and reward composition as training, on the run's
`DecodeEngine`. A trajectory succeeds when the outcome of the step that ended
it is above `success_threshold`: the run's `eval.success_threshold`, by default
just below the top of the factory's `outcome_range` (a full score: for the
calculator task every answer right, outcome +1; `run/checks.py`). The
rollout statistics themselves are `mtrl_jax.rollout.stats`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from mtrl_jax import distributed
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.stats import path_results
from mtrl_jax.sampling import SamplingConfig


@dataclasses.dataclass
class Evaluator:
  """Single-path rollouts of tasks with one policy: the SFT stop check and held-out eval.

  Built once per run (`run.components`) from the run's rollout policy,
  transition and factory; the tree, sampling and success settings are the
  run's, with one generation per node and no early termination.
  """

  policy: Any  # the run's `EnginePolicy` or `TeamPolicy`: its engines, stop ids, padding
  transition: Any
  factory: Any
  tree: TreeConfig
  sampling: SamplingConfig
  success_threshold: float  # the run's resolved `eval.success_threshold`
  workers: Any = None  # the run's `rollout.workers.StepWorkers` (None: a thread pool per call)

  def __call__(
      self, params, tasks: Sequence[dict], *, greedy: bool, key, samples: int = 1
  ) -> dict[str, float]:
    """Mean success, outcome, return, turns, masked and cut fraction over `tasks`, and with
    several agents each one's own grade (`agent_local_means`).

    `cut_fraction`: the share of episodes the tree cut at its last turn (the
    environment would have gone on); their outcome is the cut's grade
    (`Environment.on_cut`, default the failure outcome), not a silent 0.

    `samples` > 1 rolls each task that many times (independent attempts; use
    greedy=False) and adds `pass@{samples}`: the fraction of tasks that any of
    their attempts solved. The means are over all attempts.
    """
    if samples < 1:
      raise ValueError(f"evaluate samples={samples}; allowed: an int >= 1")
    tree_cfg = dataclasses.replace(
        self.tree,
        num_generations=1,
        termination_threshold=None,
        advantage_mode="mean",
        advantage_std_norm=False,
    )
    sampling = dataclasses.replace(self.sampling, greedy=greedy)
    if not greedy:
      sampling = dataclasses.replace(sampling, temperature=1.0, top_p=1.0, top_k=0)
    policy = self.policy.like(params, sampling, self.tree.num_generations)
    # Several processes: each rolls its own block of tasks, the per-root results
    # come back in process order (the single-process order) and every process
    # computes the same means.
    mine = list(tasks)[distributed.share(len(tasks))]
    roots = self.transition.root_states(self.factory, [t for t in mine for _ in range(samples)])
    tree = expand_tree(tree_cfg, policy, self.transition, roots, key, executor=self.workers)
    res = distributed.gather_lists(path_results(tree))
    solved = [r["ended"] and r["outcome"] > self.success_threshold for r in res]
    out = {
        "success": float(np.mean(solved)),
        "outcome": float(np.mean([r["outcome"] for r in res])),
        "return": float(np.mean([r["return"] for r in res])),
        "turns": float(np.mean([r["turns"] for r in res])),
        "masked": float(np.mean([r["masked"] for r in res])),
        "cut_fraction": float(np.mean([r["cut"] for r in res])),
    }
    if samples > 1:
      out[f"pass@{samples}"] = float(
          np.mean([any(solved[i : i + samples]) for i in range(0, len(solved), samples)])
      )
    return {**out, **agent_local_means(res, self.tree.num_agents)}


def agent_local_means(results: Sequence[dict], num_agents: int) -> dict[str, float]:
  """`agent_<a>/local`: agent a's mean local reward of the ending joint action (its own
  grade: `Grade.agent_scores`), over the paths whose ending action graded it alone; absent
  for an agent never graded alone, and for one agent. With a team reward an agent can
  free-ride on (coop's `team_reward='any'`), this tells a lazy agent from a team that
  succeeds through its partner."""
  if num_agents < 2:
    return {}
  out = {}
  for a in range(num_agents):
    graded = [r["local"][a] for r in results if not r["masked"] and r["local_graded"][a]]
    if graded:
      out[f"agent_{a}/local"] = float(np.mean(graded))
  return out


def indexed(source, count: int, start: int = 0) -> list[dict]:
  """Tasks `start .. start+count-1` of a task source (clipped to its length), each with
  its `task_index` (a task that is not a mapping is passed on: its root is masked)."""
  tasks = [source[i] for i in range(start, min(start + count, len(source)))]
  return [
      dict(t, task_index=start + k) if isinstance(t, Mapping) else t for k, t in enumerate(tasks)
  ]
