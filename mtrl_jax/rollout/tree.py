"""Tree bookkeeping: nodes, their recorded actions, returns and advantages (pure numpy).

A tree rollout has one root per task. At every node each of the N agents has G
sampled completions; joint actions combine one sample per agent (`align`: the
g-th of every agent; `cross`: the Cartesian product, agent 0 slowest;
`marginal`: the Cartesian product graded, only the aligned combinations
branched). Each joint action j has a reward r_j and possibly a child node.
Post-order:

  leaf (last turn, terminated node, or an action the environment stopped):
      R_j = r_j
  inner:  R_j = r_j + gamma * mean_k R^{child_j}_k

Per agent the G sample returns are the joint returns (align) or the sum / mean
over the G^(N-1) joint actions containing the sample (cross), or the
marginal-contribution return (`rollout.credit`); advantages use the sibling
baseline of `TreeConfig.advantage_mode`, optionally standardised
(`rollout.returns`). With local grades each agent has its own reward
(`TreeConfig.team_weight`, `rollout.credit.mix_rewards`) and runs the same
recursion on it; `rewards_B` and `returns_B` stay the team's.

Under `branch_on='user_turn'` a joint action may span several environment
steps (tool sub-steps): r_j is the sum of their rewards and the action's
`Completion` holds every sampled segment with the context between them.

With `TreeConfig(shape='chain')` only the root branches: it samples G per
agent, every later node ONE, so a root holds G independent trajectories.
Returns follow the same recursion (a child mean over one action is that
action's return), the root's G trajectory returns get the sibling baseline,
and every action of trajectory j carries the root's advantage of j.

A last-turn action whose environment goes on is a cut, graded as ended (`Transition.cut`).

Infrastructure faults make a joint action invalid: it is excluded from child
means and baselines, and every sample in it gets weight 0 (never rewarded,
never penalised). Node ids are canonical (`Tree.renumber`: level by level), so
parents precede children and a reverse sweep is a post-order.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from mtrl_jax.rollout.completion import Completion
from mtrl_jax.rollout.config import TreeConfig
from mtrl_jax.rollout.records import ActionRecord, StepRecord
from mtrl_jax.rollout import credit
from mtrl_jax.rollout.returns import (
    advantages,
    agent_returns,
    child_slots,
    joint_actions,
    should_terminate,
)

__all__ = [
    "Completion",
    "Node",
    "Tree",
    "advantages",
    "agent_returns",
    "joint_actions",
    "should_terminate",
]


@dataclasses.dataclass
class Node:
  """One tree node: N agents x G samples, B joint actions and their outcomes.

  Attributes:
    node_id: index in `Tree.nodes`: level by level, a level in (parent,
      action) order, roots by task (`Tree.renumber` fixes it whatever order
      the engine created the nodes in).
    root: index of the task this tree belongs to.
    parent_id: parent node id, -1 for a root.
    parent_action: joint action of the parent that spawned this node, -1 for a root.
    turn: depth t (0 at the root).
    prompts: per agent, the prompt token ids (full context) the samples continue.
    full_id: the node's id in the complete tree of the rollout (every branch
      continued to depth T, roots of every process counted): a name that does
      not depend on which other branches ended, so sampling keys and
      environment seeds derived from it do not depend on timing.
    state: opaque environment state of the node (per-agent threads), used by
      the engine only.
    completions: per agent, G Completions (None until sampled); under
      branch_on='user_turn' each holds every segment of its action.
    rewards_B: (team) reward of each joint action.
    local_BxN: per joint action each agent's local reward (the team reward where
      no grade scored it alone); local_graded_BxN: where one did.
    agent_rewards_BxN: each agent's reward, lambda * team + (1 - lambda) * local.
    valid_B: False where the joint action hit an infrastructure fault.
    children_B: child node id per joint action, -1 when none.
    terminated: the mean reward exceeded the termination threshold.
    actions: per joint action, its `ActionRecord` (None until stepped).
    substeps_B: continuation segments sampled per joint action (sub-steps
      within the turn; always 0 under branch_on='every_turn').
    returns_B, returns_BxN (per agent), agent_returns_NxG, advantages_NxG,
      weight_NxG: set by `Tree.finalize`.
  """

  node_id: int
  root: int
  parent_id: int
  parent_action: int
  turn: int
  prompts: list
  full_id: int = -1
  state: Any = None
  completions: Optional[list] = None
  rewards_B: Optional[np.ndarray] = None
  valid_B: Optional[np.ndarray] = None
  children_B: Optional[np.ndarray] = None
  terminated: bool = False
  actions: Optional[list] = None
  substeps_B: Optional[np.ndarray] = None
  local_BxN: Optional[np.ndarray] = None
  local_graded_BxN: Optional[np.ndarray] = None
  agent_rewards_BxN: Optional[np.ndarray] = None
  returns_B: Optional[np.ndarray] = None
  returns_BxN: Optional[np.ndarray] = None
  agent_returns_NxG: Optional[np.ndarray] = None
  advantages_NxG: Optional[np.ndarray] = None
  weight_NxG: Optional[np.ndarray] = None
  recorded: bool = False


class Tree:
  """The nodes of a batch of trees (one per root), built level by level."""

  def __init__(self, cfg: TreeConfig):
    self.cfg = cfg
    self.nodes: list[Node] = []
    self.joint_BxN = joint_actions(cfg)
    self.slot_B = child_slots(cfg)
    # Below a chain's root every agent has one sample: one joint action.
    self._joint_below_1xN = np.zeros((1, cfg.num_agents), np.int64)
    self.num_roots = 0
    self.finalized = False

  def node_joint(self, node: Node) -> np.ndarray:
    """Sample index of every agent in every joint action of `node`, int [B, N]."""
    if self.cfg.shape == "chain" and node.turn > 0:
      return self._joint_below_1xN
    return self.joint_BxN

  def child_slot(self, node: Node, action: int) -> int:
    """Which child of `node` joint action `action` spawns (`returns.child_slots`): -1
    for a marginal node's unaligned combinations, which are graded, never branched."""
    if self.cfg.shape == "chain" and node.turn > 0:
      return action
    return int(self.slot_B[action])

  # ------------------------------------------------------------ building
  def add_root(
      self, prompts: Sequence[Sequence[int]], state: Any = None, full_id: Optional[int] = None
  ) -> Node:
    """Adds the root of a new task with one prompt per agent."""
    node = self._new_node(
        self.num_roots, -1, -1, 0, prompts, state, self.num_roots if full_id is None else full_id
    )
    self.num_roots += 1
    return node

  def add_child(
      self,
      parent: Node,
      action: int,
      prompts: Sequence[Sequence[int]],
      state: Any = None,
      full_id: int = -1,
  ) -> Node:
    """Adds the child spawned by joint action `action` of `parent` (once it is stepped)."""
    if parent.actions is None or parent.actions[action] is None:
      raise ValueError(
          f"node {parent.node_id} action {action} has no recorded outcome; record it first"
      )
    if parent.children_B[action] >= 0:
      raise ValueError(f"node {parent.node_id} action {action} already has a child")
    if self.child_slot(parent, action) < 0:
      raise ValueError(
          f"node {parent.node_id} action {action} is an unaligned combination "
          "of a marginal node: graded, never branched"
      )
    node = self._new_node(
        parent.root, parent.node_id, action, parent.turn + 1, prompts, state, full_id
    )
    parent.children_B[action] = node.node_id
    return node

  def _new_node(self, root, parent_id, parent_action, turn, prompts, state, full_id) -> Node:
    if len(prompts) != self.cfg.num_agents:
      raise ValueError(
          f"a node needs one prompt per agent ({self.cfg.num_agents}), got {len(prompts)}"
      )
    if turn >= self.cfg.num_turns:
      raise ValueError(f"turn {turn} is past num_turns={self.cfg.num_turns}")
    b, n = self.cfg.actions_at(turn), self.cfg.num_agents
    node = Node(
        node_id=len(self.nodes),
        root=root,
        parent_id=parent_id,
        parent_action=parent_action,
        turn=turn,
        prompts=[list(map(int, p)) for p in prompts],
        full_id=int(full_id),
        state=state,
        rewards_B=np.zeros(b, np.float64),
        valid_B=np.ones(b, bool),
        children_B=np.full(b, -1, np.int64),
        actions=[None] * b,
        substeps_B=np.zeros(b, np.int64),
        local_BxN=np.zeros((b, n)),
        local_graded_BxN=np.zeros((b, n), bool),
        agent_rewards_BxN=np.zeros((b, n)),
    )
    self.nodes.append(node)
    return node

  def set_completions(self, node: Node, completions: Sequence[Sequence[Completion]]):
    """Stores the N x G sampled completions of a node."""
    g, n = self.cfg.generations_at(node.turn), self.cfg.num_agents
    if len(completions) != n or any(len(c) != g for c in completions):
      raise ValueError(f"node {node.node_id}: expected {n} agents x {g} completions")
    node.completions = [list(c) for c in completions]

  def record_action(self, node: Node, action: int, record: ActionRecord) -> None:
    """Stores joint action `action`'s outcome (reward, validity, sub-steps)."""
    if not isinstance(record, ActionRecord):
      raise TypeError(f"record_action: {type(record).__name__}; expected ActionRecord")
    if node.actions[action] is not None:
      raise ValueError(f"node {node.node_id} action {action} is already recorded")
    reward = record.reward
    if record.valid and not np.isfinite(reward):
      raise ValueError(f"node {node.node_id} action {action}: non-finite reward {reward}")
    node.actions[action] = record
    node.rewards_B[action] = reward
    node.valid_B[action] = record.valid
    node.substeps_B[action] = record.substeps
    n = self.cfg.num_agents
    node.local_BxN[action] = record.local_rewards(n)
    node.local_graded_BxN[action] = record.local_graded(n)
    node.agent_rewards_BxN[action] = credit.mix_rewards(
        node.rewards_B[action], node.local_BxN[action], self.cfg.team_weight
    )

  def close_node(self, node: Node) -> bool:
    """Decides termination once every joint action of `node` is recorded.

    Returns:
      True when the node may have children: turn < T - 1 and not terminated.
    """
    missing = [j for j, a in enumerate(node.actions) if a is None]
    if missing:
      raise ValueError(f"node {node.node_id}: actions {missing} are not recorded")
    node.terminated = should_terminate(self.cfg, node.rewards_B, node.valid_B)
    node.recorded = True
    return self.may_expand(node)

  def may_expand(self, node: Node) -> bool:
    """Children are allowed: not the last turn, and (once recorded) not terminated."""
    return node.turn < self.cfg.num_turns - 1 and not node.terminated

  def record(
      self,
      node: Node,
      rewards_B: Sequence[float],
      valid_B: Optional[Sequence[bool]] = None,
      actions: Optional[Sequence[ActionRecord]] = None,
  ) -> bool:
    """Records every joint action of `node` at once and decides termination.

    Args:
      node: the node whose actions were stepped.
      rewards_B: (team) reward of each joint action.
    local_BxN: per joint action each agent's local reward (the team reward where
      no grade scored it alone); local_graded_BxN: where one did.
    agent_rewards_BxN: each agent's reward, lambda * team + (1 - lambda) * local.
      valid_B: False where an action hit an infrastructure fault (default: all valid).
      actions: per joint action its `ActionRecord` (default: one step each, with
        the given reward and validity); its rewards and validity must be the
        given ones.

    Returns:
      True when the node may have children (`close_node`).
    """
    b = self.cfg.actions_at(node.turn)
    rewards_B = np.asarray(rewards_B, np.float64)
    valid_B = np.ones(b, bool) if valid_B is None else np.asarray(valid_B, bool)
    if rewards_B.shape != (b,) or valid_B.shape != (b,):
      raise ValueError(
          f"node {node.node_id}: expected {b} rewards/valid flags, got "
          f"{rewards_B.shape}/{valid_B.shape}"
      )
    if actions is None:
      actions = [ActionRecord((StepRecord(float(r), bool(v)),)) for r, v in zip(rewards_B, valid_B)]
    if not np.isfinite(rewards_B[valid_B]).all():
      raise ValueError(f"node {node.node_id}: non-finite reward {rewards_B.tolist()}")
    if [a.valid for a in actions] != valid_B.tolist():
      raise ValueError(
          f"node {node.node_id}: valid_B {valid_B.tolist()} differs from the "
          f"actions' validity {[a.valid for a in actions]}"
      )
    for j, record in enumerate(actions):
      self.record_action(node, j, record)
    return self.close_node(node)

  def renumber(self) -> None:
    """Puts the nodes in canonical order: level by level, roots by task, a level's
    nodes by (parent, action). The engine creates nodes as their parents' steps
    return, in an order that depends on timing; this order does not."""
    order, by_parent = [], {}
    for node in self.nodes:
      by_parent.setdefault(node.parent_id, []).append(node)
    level = sorted(by_parent.get(-1, []), key=lambda n: n.root)
    while level:
      order.extend(level)
      level = [
          c
          for n in level
          for c in sorted(by_parent.get(n.node_id, []), key=lambda c: c.parent_action)
      ]
    if len(order) != len(self.nodes):
      raise ValueError("Tree.renumber: some nodes are not reachable from a root")
    new_id = {n.node_id: k for k, n in enumerate(order)}
    for n in order:
      n.node_id = new_id[n.node_id]
      if n.parent_id >= 0:
        n.parent_id = new_id[n.parent_id]
      n.children_B = np.asarray([new_id[c] if c >= 0 else -1 for c in n.children_B], np.int64)
    self.nodes = order

  # ------------------------------------------------------------ returns
  def finalize(self) -> "Tree":
    """Computes returns (post-order), per-agent returns, advantages and weights."""
    cfg = self.cfg
    for node in self.nodes:
      if not node.recorded:
        raise ValueError(f"node {node.node_id} is not recorded; record() every node first")
    for node in reversed(self.nodes):  # children always have larger ids
      valid_B = node.valid_B.copy()
      # Channel 0 is the team, channel 1 + i agent i: the same recursion on each.
      rewards_BxK = np.column_stack([node.rewards_B, node.agent_rewards_BxN])
      cont_BxK = np.zeros_like(rewards_BxK)
      child_B = np.zeros(valid_B.shape, bool)
      for j, child_id in enumerate(node.children_B):
        if child_id < 0 or not valid_B[j]:
          continue
        child = self.nodes[child_id]
        if not child.valid_B.any():  # every child action faulted: no value estimate
          valid_B[j] = False
          continue
        child_B[j] = True
        cont_BxK[j] = cfg.discount * credit.node_values(child)
      returns_BxK = rewards_BxK.copy()
      returns_BxK[child_B] += cont_BxK[child_B]
      if cfg.joint_mode == "marginal":
        open_B = (
            valid_B
            & ~child_B
            & np.asarray([a is not None and not a.ended for a in node.actions])
            & self.may_expand(node)
        )
        returns_BxK = credit.impute_open(returns_BxK, cont_BxK, child_B, open_B)
      node.returns_B = np.where(valid_B, returns_BxK[:, 0], 0.0)
      node.returns_BxN = np.where(valid_B[:, None], returns_BxK[:, 1:], 0.0)
      node.valid_B = valid_B
      g = cfg.generations_at(node.turn)
      if cfg.joint_mode == "marginal":
        node.agent_returns_NxG, valid_NxG = credit.marginal_returns(
            self.node_joint(node), node.agent_rewards_BxN, cont_BxK[:, 1:], valid_B, self.slot_B, g
        )
      else:
        node.agent_returns_NxG, valid_NxG = agent_returns(
            cfg, self.node_joint(node), node.returns_BxN, valid_B, g
        )
      node.advantages_NxG = np.stack(
          [
              advantages(
                  node.agent_returns_NxG[i],
                  valid_NxG[i],
                  cfg.advantage_mode,
                  cfg.advantage_std_norm,
              )
              for i in range(cfg.num_agents)
          ]
      )
      node.weight_NxG = valid_NxG.astype(np.float64)
    if cfg.shape == "chain":
      self._chain_advantages()
    self.finalized = True
    return self

  def _chain_advantages(self) -> None:
    """Every action of a chain gets its root action's advantage (the group baseline
    over the root's G trajectories). A fault anywhere on a chain has already made
    its root action invalid (weight 0); the chain's other actions are masked too."""
    agents = np.arange(self.cfg.num_agents)
    origin = {}  # node id -> (root node, the root action the node descends from)
    for node in self.nodes:  # parents precede children
      if node.parent_id < 0:
        continue
      parent = self.nodes[node.parent_id]
      root, j = (parent, node.parent_action) if parent.parent_id < 0 else origin[parent.node_id]
      origin[node.node_id] = (root, j)
      samples_N = self.joint_BxN[j]
      keep_N = (node.weight_NxG[:, 0] > 0) & (root.weight_NxG[agents, samples_N] > 0)
      node.weight_NxG = keep_N.astype(np.float64)[:, None]
      node.advantages_NxG = np.where(keep_N, root.advantages_NxG[agents, samples_N], 0.0)[:, None]

  # ------------------------------------------------------------ views
  def level(self, turn: int) -> list[Node]:
    return [n for n in self.nodes if n.turn == turn]

  def counts(self) -> dict[str, int]:
    """Nodes, generations and environment steps this rollout actually spent.

    A sub-step (continuation segment) is one more generation and one more
    environment step.
    """
    cfg = self.cfg
    sampled = sum(
        cfg.num_agents * cfg.generations_at(n.turn) for n in self.nodes if n.completions is not None
    )
    substeps = self.num_substeps()
    return {
        "nodes": len(self.nodes),
        "generations": sampled + substeps,
        "reward_calls": int(sum(np.size(n.rewards_B) for n in self.nodes if n.recorded)) + substeps,
    }

  def sampled_tokens(self) -> int:
    """Tokens the policy generated over the whole rollout (context tokens excluded):
    the budget axis of tree-vs-chain comparisons."""
    return int(
        sum(
            c.sampled_mask.sum() for n in self.nodes for agent in n.completions or [] for c in agent
        )
    )

  def num_substeps(self) -> int:
    """Continuation segments sampled over the whole tree."""
    return int(sum(n.substeps_B.sum() for n in self.nodes if n.recorded))

  def metrics(self) -> dict[str, float]:
    """Per-turn mean reward / return and tree counts, for logging."""
    out = {
        "tree/nodes": float(len(self.nodes)),
        "tree/terminated": float(sum(n.terminated for n in self.nodes)),
        "tree/masked_actions": float(sum((~n.valid_B).sum() for n in self.nodes if n.recorded)),
        "tree/substeps": float(self.num_substeps()),
        "tree/sampled_tokens": float(self.sampled_tokens()),
    }
    for t in range(self.cfg.num_turns):
      nodes = [n for n in self.level(t) if n.recorded]
      if not nodes:
        continue
      r = np.concatenate([n.rewards_B[n.valid_B] for n in nodes])
      out[f"turn_{t}/mean_reward"] = float(r.mean()) if r.size else float("nan")
      if self.finalized:
        ret = np.concatenate([n.returns_B[n.valid_B] for n in nodes])
        out[f"turn_{t}/mean_return"] = float(ret.mean()) if ret.size else float("nan")
    return out
