"""Tree-rollout configuration and its size plan, computed before any compute.

`TreeConfig` fixes the tree semantics of a multi-agent multi-turn rollout (the
CoMLRL / MAGRPO tree): T turns, G generations per agent per node, N agents,
`align` (G joint actions per node) or `cross` (G^N) joint actions, early
termination by mean sibling reward, discounted returns and the sibling
baseline. `plan_tree` turns a config into counts (nodes, generations, reward
calls, training rows, tokens) so an over-budget run fails before launch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

JOINT_MODES = ("align", "cross")
ADVANTAGE_MODES = ("mean", "raw", "max", "rloo")
CROSS_RETURNS = ("sum", "mean")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Semantics of one tree rollout; hashable, validated at construction.

  Attributes:
    num_turns: T, depth of the tree (turns per episode), >= 1.
    num_generations: G, completions sampled per agent at every node, >= 1.
    num_agents: N, agents acting at every node (N = 1 is plain GRPO).
    joint_mode: 'align' pairs the g-th sample of every agent (G joint actions);
      'cross' takes the Cartesian product (G^N, agent 0 slowest).
    termination_threshold: tau; a node whose mean reward is strictly above tau
      becomes a leaf (still trained on). None disables early termination.
    discount: gamma in R_j = r_j + gamma * mean(child returns).
    advantage_mode: sibling baseline: 'mean' (R - mean R), 'raw' (R),
      'max' (R - max R), 'rloo' ((G R - sum R) / (G - 1)).
    advantage_std_norm: after the baseline, (A - mean A) / max(std_pop(A), 1e-6).
    cross_return: how a sample's return is built from the G^(N-1) joint
      actions that contain it in cross mode: 'sum' (CoMLRL) or 'mean'.
  """

  num_turns: int
  num_generations: int
  num_agents: int = 1
  joint_mode: str = "align"
  termination_threshold: Optional[float] = None
  discount: float = 0.9
  advantage_mode: str = "mean"
  advantage_std_norm: bool = False
  cross_return: str = "sum"

  def __post_init__(self):
    for name in ("num_turns", "num_generations", "num_agents"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TreeConfig.{name}={value!r}; must be an int >= 1")
    _check_choice("joint_mode", self.joint_mode, JOINT_MODES)
    _check_choice("advantage_mode", self.advantage_mode, ADVANTAGE_MODES)
    _check_choice("cross_return", self.cross_return, CROSS_RETURNS)
    if self.advantage_mode == "rloo" and self.num_generations < 2:
      raise ValueError(
          f"TreeConfig.advantage_mode='rloo' needs num_generations >= 2, got "
          f"{self.num_generations}")
    if not isinstance(self.discount, (int, float)) or not 0.0 <= self.discount <= 1.0:
      raise ValueError(f"TreeConfig.discount={self.discount!r}; must be a float in [0, 1]")
    tau = self.termination_threshold
    if tau is not None and (not isinstance(tau, (int, float)) or math.isnan(tau)):
      raise ValueError(
          f"TreeConfig.termination_threshold={tau!r}; must be a float or None")
    if not isinstance(self.advantage_std_norm, bool):
      raise ValueError(
          f"TreeConfig.advantage_std_norm={self.advantage_std_norm!r}; must be a bool")

  @property
  def branching(self) -> int:
    """Joint actions per node, B: G (align) or G^N (cross)."""
    if self.joint_mode == "cross":
      return self.num_generations ** self.num_agents
    return self.num_generations

  def replace(self, **kw) -> "TreeConfig":
    return dataclasses.replace(self, **kw)


def _check_choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"TreeConfig.{name}={value!r}; allowed: {list(allowed)}")


@dataclasses.dataclass(frozen=True)
class TreePlan:
  """Worst-case (no early termination) size of one rollout step.

  Attributes:
    nodes: tree nodes over all roots, sum_{t<T} B^t per root.
    generations: completions sampled, nodes * N * G.
    reward_calls: environment steps (one per joint action), nodes * B.
    rows: training rows, one per (node, agent, sample) = generations.
    tokens: rows * (max_prompt_len + max_new_tokens), the packed batch size.
    level_nodes: nodes per tree level over all roots (level t: roots * B^t).
    max_level_generations: completions of the largest level, i.e. the largest
      single sampler call.
  """

  nodes: int
  generations: int
  reward_calls: int
  rows: int
  tokens: int
  level_nodes: tuple
  max_level_generations: int


def plan_tree(cfg: TreeConfig, num_roots: int, max_prompt_len: int, max_new_tokens: int, *,
              max_generations: Optional[int] = None,
              max_tokens: Optional[int] = None) -> TreePlan:
  """Counts the work of one tree rollout before launch and checks a budget.

  Args:
    cfg: the tree semantics.
    num_roots: tasks (trees) rolled out together.
    max_prompt_len: longest prompt context any node may have, in tokens.
    max_new_tokens: longest completion.
    max_generations: budget on sampled completions per step (None: no limit).
    max_tokens: budget on packed training tokens per step (None: no limit).

  Returns:
    The TreePlan (exact counts without early termination; upper bounds with it).

  Raises:
    ValueError: a size argument is invalid or the plan exceeds a budget.
  """
  for name, value in (("num_roots", num_roots), ("max_prompt_len", max_prompt_len),
                      ("max_new_tokens", max_new_tokens)):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"plan_tree {name}={value!r}; must be an int >= 1")
  b, n, g = cfg.branching, cfg.num_agents, cfg.num_generations
  level_nodes = tuple(num_roots * b ** t for t in range(cfg.num_turns))
  nodes = sum(level_nodes)
  generations = nodes * n * g
  plan = TreePlan(
      nodes=nodes,
      generations=generations,
      reward_calls=nodes * b,
      rows=generations,
      tokens=generations * (max_prompt_len + max_new_tokens),
      level_nodes=level_nodes,
      max_level_generations=level_nodes[-1] * n * g,
  )
  shape = (f"T={cfg.num_turns}, G={g}, N={n}, joint_mode={cfg.joint_mode!r}, "
           f"roots={num_roots}")
  if max_generations is not None and plan.generations > max_generations:
    raise ValueError(
        f"tree rollout ({shape}) samples {plan.generations} completions per step, over the "
        f"budget max_generations={max_generations}; lower num_generations, num_turns or the "
        f"number of roots, or use joint_mode='align'")
  if max_tokens is not None and plan.tokens > max_tokens:
    raise ValueError(
        f"tree rollout ({shape}) packs {plan.rows} rows x "
        f"{max_prompt_len + max_new_tokens} tokens = {plan.tokens} tokens per step, over the "
        f"budget max_tokens={max_tokens}; lower the tree size or the prompt/completion lengths")
  return plan
