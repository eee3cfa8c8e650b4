"""Tree-rollout configuration and its size plan, computed before any compute.

`TreeConfig` fixes the tree semantics of a multi-agent multi-turn rollout (the
CoMLRL / MAGRPO tree): T turns, G generations per agent per node, N agents,
`align` (G joint actions per node), `cross` (G^N) or `marginal` (G^N graded,
the G aligned ones branched; `rollout.credit`) joint actions, early
termination by mean sibling reward, discounted returns and the sibling
baseline. `branch_on` says what a tree turn is: every policy message
('every_turn', CoMLRL), or a user turn ('user_turn': the policy's tool calls
and their results within one user turn are sub-steps of one action, which
does not branch). `shape` picks the tree ('tree': every node branches into
G) or its chain baseline ('chain': G independent trajectories per root that
branch only at the root, with one sample per agent at every later turn and the
root's group baseline over the G trajectories). `plan_tree` turns a config
into counts (nodes, generations, reward calls, training rows, tokens) so an
over-budget run fails before launch.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from mtrl_jax.rollout.returns import BASELINES

JOINT_MODES = ("align", "cross", "marginal")
ADVANTAGE_MODES = tuple(BASELINES)
CROSS_RETURNS = ("sum", "mean")
BRANCH_ON = ("every_turn", "user_turn")
SHAPES = ("tree", "chain")
SCHEDULES = ("continuous", "barrier")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
  """Semantics of one tree rollout; hashable, validated at construction.

  Attributes:
    num_turns: T, depth of the tree (turns per episode), >= 1.
    num_generations: G, completions sampled per agent at every node, >= 1.
    num_agents: N, agents acting at every node (N = 1 is plain GRPO).
    joint_mode: 'align' pairs the g-th sample of every agent (G joint actions);
      'cross' takes the Cartesian product (G^N, agent 0 slowest); 'marginal'
      grades the Cartesian product but branches (creates children) only for
      its G aligned combinations, and each sample's return is its mean reward
      over the partners' samples plus its aligned action's continuation
      (`rollout.credit`); needs num_agents >= 2.
    termination_threshold: tau; a node whose mean reward is strictly above tau
      becomes a leaf (still trained on). None disables early termination.
    discount: gamma in R_j = r_j + gamma * mean(child returns).
    advantage_mode: sibling baseline: 'mean' (R - mean R), 'raw' (R),
      'max' (R - max R), 'rloo' ((G R - sum R) / (G - 1)).
    advantage_std_norm: after the baseline, (A - mean A) / max(std_pop(A), 1e-6);
      only with 'mean' or 'rloo' (the re-centring would undo 'raw' and 'max').
    cross_return: how a sample's return is built from the G^(N-1) joint
      actions that contain it in cross mode: 'sum' (CoMLRL) or 'mean'.
    branch_on: 'every_turn': every policy message is a tree turn (each
      sampled completion is an action, every continuing environment step
      spawns a child). 'user_turn': a tree turn ends when the environment
      hands over to the user (or stops); while it answers with tool turns
      only (`ActionOutcome.continues_turn`), the action's sample is continued
      by ONE more sampled segment per sub-step, without branching. Needs
      num_agents = 1: the agents of a joint action could wait on tools for
      different numbers of sub-steps, and a cross-mode sample belongs to
      several joint actions, so one continuation per action is undefined.
    max_substeps: 'user_turn' only: continuation segments allowed per
      action (an action has at most 1 + max_substeps environment steps); an
      environment still asking for one after that ends the action as a
      truncation (no child).
    schedule: how the rollout engine orders the work (never what the tree
      is): 'continuous' (an action's environment step starts when its own
      samples are done, its child's requests when the step returns) or
      'barrier' (level by level: every sample of a level, then every step,
      then each sub-step round, then the next level).
    team_weight: lambda in [0, 1] (config `agents.team_weight`): agent i's
      reward is lambda * team + (1 - lambda) * local_i, local_i its own grade
      (`Grade.agent_scores`), the team reward where it has none.
    shape: 'tree' (every node branches into its joint actions) or 'chain'
      (only the root branches: G independent trajectories per root, one
      sample per agent at every later node; needs joint_mode='align').
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
  branch_on: str = "every_turn"
  max_substeps: int = 4
  shape: str = "tree"
  schedule: str = "continuous"
  team_weight: float = 1.0

  def __post_init__(self):
    for name in ("num_turns", "num_generations", "num_agents"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"TreeConfig.{name}={value!r}; must be an int >= 1")
    _check_choice("joint_mode", self.joint_mode, JOINT_MODES)
    _check_choice("advantage_mode", self.advantage_mode, ADVANTAGE_MODES)
    _check_choice("cross_return", self.cross_return, CROSS_RETURNS)
    _check_choice("branch_on", self.branch_on, BRANCH_ON)
    _check_choice("shape", self.shape, SHAPES)
    _check_choice("schedule", self.schedule, SCHEDULES)
    if self.joint_mode == "marginal" and self.num_agents < 2:
      raise ValueError(
          f"TreeConfig.joint_mode='marginal' needs num_agents >= 2 (config "
          f"tree.num_agents={self.num_agents}); allowed with one agent: "
          "'align', 'cross'"
      )
    w = self.team_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
      raise ValueError(
          f"config agents.team_weight={w!r}; allowed: a number in [0, 1] "
          "(1: the team reward only)"
      )
    if self.shape == "chain" and self.joint_mode != "align":
      raise ValueError(
          f"TreeConfig.shape='chain' needs joint_mode='align', got "
          f"{self.joint_mode!r}: a chain is G independent trajectories"
      )
    if (
        isinstance(self.max_substeps, bool)
        or not isinstance(self.max_substeps, int)
        or self.max_substeps < 1
    ):
      raise ValueError(f"TreeConfig.max_substeps={self.max_substeps!r}; must be an int >= 1")
    if self.branch_on == "user_turn" and self.num_agents != 1:
      raise ValueError(
          f"TreeConfig.branch_on='user_turn' needs num_agents=1, got {self.num_agents}: "
          "sub-steps (tool continuations within a turn) are defined for one agent; use "
          "branch_on='every_turn' for multi-agent trees"
      )
    if self.advantage_mode == "rloo" and self.num_generations < 2:
      raise ValueError(
          f"TreeConfig.advantage_mode='rloo' needs num_generations >= 2, got "
          f"{self.num_generations}"
      )
    if not isinstance(self.discount, (int, float)) or not 0.0 <= self.discount <= 1.0:
      raise ValueError(f"TreeConfig.discount={self.discount!r}; must be a float in [0, 1]")
    tau = self.termination_threshold
    if tau is not None and (not isinstance(tau, (int, float)) or math.isnan(tau)):
      raise ValueError(f"TreeConfig.termination_threshold={tau!r}; must be a float or None")
    if not isinstance(self.advantage_std_norm, bool):
      raise ValueError(f"TreeConfig.advantage_std_norm={self.advantage_std_norm!r}; must be a bool")
    if self.advantage_std_norm and self.advantage_mode in ("raw", "max"):
      raise ValueError(
          f"TreeConfig.advantage_std_norm=True with advantage_mode={self.advantage_mode!r}: "
          "std-norm re-centres the advantages, which turns that baseline into 'mean'; "
          "allowed with std-norm: 'mean', 'rloo'"
      )

  @property
  def substeps(self) -> bool:
    """True when tool continuations are sub-steps of an action (branch_on='user_turn')."""
    return self.branch_on == "user_turn"

  @property
  def branching(self) -> int:
    """Children per node, B: G (align, marginal) or G^N (cross)."""
    if self.joint_mode == "cross":
      return self.num_generations**self.num_agents
    return self.num_generations

  @property
  def actions_per_node(self) -> int:
    """Joint actions graded per node: G (align) or G^N (cross, marginal)."""
    if self.joint_mode in ("cross", "marginal"):
      return self.num_generations**self.num_agents
    return self.num_generations

  def generations_at(self, turn: int) -> int:
    """Samples per agent at a node of depth `turn`: G, or 1 below a chain's root."""
    return self.num_generations if self.shape == "tree" or turn == 0 else 1

  def branching_at(self, turn: int) -> int:
    """Children of a node of depth `turn` (B at a tree node or a root)."""
    return self.branching if self.shape == "tree" or turn == 0 else 1

  def actions_at(self, turn: int) -> int:
    """Joint actions of a node of depth `turn` (`actions_per_node`, 1 below a chain's root)."""
    return self.actions_per_node if self.shape == "tree" or turn == 0 else 1

  def replace(self, **kw) -> "TreeConfig":
    return dataclasses.replace(self, **kw)


def _check_choice(name, value, allowed):
  if value not in allowed:
    raise ValueError(f"TreeConfig.{name}={value!r}; allowed: {list(allowed)}")


@dataclasses.dataclass(frozen=True)
class TreePlan:
  """Worst-case (no early termination) size of one rollout step.

  With branch_on='user_turn' every action may take `max_substeps` more
  sampled segments and environment steps; the counts below assume it does.

  Attributes:
    nodes: tree nodes over all roots, sum_{t<T} B^t per root.
    generations: sampled segments, nodes * N * G (* (1 + max_substeps)
      under 'user_turn').
    reward_calls: environment steps, nodes * joint actions per node
      (`actions_at`; * (1 + max_substeps)).
    rows: training rows, one per (node, agent, sample): nodes * N * G.
    tokens: rows * (max_prompt_len + max_new_tokens), the packed batch size.
    level_nodes: nodes per tree level over all roots (level t: roots * B^t).
    max_level_generations: completions of the largest level, i.e. the largest
      single sampler call (a sub-step round samples one segment per action,
      never more than the level's first call).
  """

  nodes: int
  generations: int
  reward_calls: int
  rows: int
  tokens: int
  level_nodes: tuple
  max_level_generations: int


def generations_per_root(cfg: TreeConfig) -> int:
  """Segments one root samples without early termination or sub-steps:
  N (G + G^2 + ... + G^T) for a tree (align; N G (B^0 + ... + B^(T-1)) in
  cross mode), N G T for a chain. Use it to match budgets between shapes."""
  nodes = 1
  total = 0
  for t in range(cfg.num_turns):
    total += nodes * cfg.num_agents * cfg.generations_at(t)
    nodes *= cfg.branching_at(t)
  return total


def plan_tree(
    cfg: TreeConfig,
    num_roots: int,
    max_prompt_len: int,
    max_new_tokens: int,
    *,
    max_generations: Optional[int] = None,
    max_tokens: Optional[int] = None,
) -> TreePlan:
  """Counts the work of one tree rollout before launch and checks a budget.

  Args:
    cfg: the tree semantics.
    num_roots: tasks (trees) rolled out together.
    max_prompt_len: longest prompt context any node may have, in tokens.
    max_new_tokens: longest completion; under branch_on='user_turn' the
      longest whole action (every segment and the tool turns between them).
    max_generations: budget on sampled completions per step (None: no limit).
    max_tokens: budget on packed training tokens per step (None: no limit).

  Returns:
    The TreePlan (exact counts without early termination; upper bounds with it).

  Raises:
    ValueError: a size argument is invalid or the plan exceeds a budget.
  """
  for name, value in (
      ("num_roots", num_roots),
      ("max_prompt_len", max_prompt_len),
      ("max_new_tokens", max_new_tokens),
  ):
    if not isinstance(value, int) or value < 1:
      raise ValueError(f"plan_tree {name}={value!r}; must be an int >= 1")
  n, g = cfg.num_agents, cfg.num_generations
  level_nodes, width = [], num_roots
  for t in range(cfg.num_turns):
    level_nodes.append(width)
    width *= cfg.branching_at(t)
  level_nodes = tuple(level_nodes)
  nodes = sum(level_nodes)
  steps = 1 + cfg.max_substeps if cfg.substeps else 1  # env steps (segments) per action
  # Per level: samples (rows) and joint actions (environment steps).
  rows = sum(k * n * cfg.generations_at(t) for t, k in enumerate(level_nodes))
  actions = sum(k * cfg.actions_at(t) for t, k in enumerate(level_nodes))
  plan = TreePlan(
      nodes=nodes,
      generations=rows * steps,
      reward_calls=actions * steps,
      rows=rows,
      tokens=rows * (max_prompt_len + max_new_tokens),
      level_nodes=level_nodes,
      max_level_generations=max(k * n * cfg.generations_at(t) for t, k in enumerate(level_nodes)),
  )
  shape = (
      f"T={cfg.num_turns}, G={g}, N={n}, joint_mode={cfg.joint_mode!r}, "
      f"branch_on={cfg.branch_on!r}, shape={cfg.shape!r}, roots={num_roots}"
  )
  if max_generations is not None and plan.generations > max_generations:
    raise ValueError(
        f"tree rollout ({shape}) samples {plan.generations} completions (segments) per "
        f"step, over the budget max_generations={max_generations}; lower num_generations, "
        f"num_turns, max_substeps or the number of roots, or use joint_mode='align'"
    )
  if max_tokens is not None and plan.tokens > max_tokens:
    raise ValueError(
        f"tree rollout ({shape}) packs {plan.rows} rows x "
        f"{max_prompt_len + max_new_tokens} tokens = {plan.tokens} tokens per step, over the "
        f"budget max_tokens={max_tokens}; lower the tree size or the prompt/completion lengths"
    )
  return plan
