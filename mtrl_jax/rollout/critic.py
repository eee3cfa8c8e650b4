"""Value-critic advantages and value targets on a finalized tree (pure numpy).

An independent critic per agent (CoMLRL's IAC) gives, for every (node, agent,
sample), a value v_ig: with `target='v'` V_i(h) of the history before agent
i's action at the node (one value per agent and node), with `target='q'`
Q_i(h, a_g) of the history plus that sample's action. This module turns those
values and the tree's rewards into advantages for a REINFORCE policy loss and
targets for the critic's squared-error loss. Everything is per agent i, on its
own reward channel `Node.agent_rewards_BxN[:, i]`, so `agents.team_weight`
carries over.

Recursion (post-order; children have larger node ids). For a node s, its
joint action c and agent i:

    Vbar_i(s) = mean over s's valid joint actions c of v_i(sample of i in c)
    J_i(c)    = r_i(c) + gamma * ((1 - lambda) Vbar_i(child_c) + lambda Jbar_i(child_c))
    Jbar_i(s) = mean over s's valid joint actions of J_i(c)

(the continuation is 0 without a child: the episode ended, a fault, the last
turn). A sample's target y_ig aggregates J over the joint actions that
contain it exactly as the tree aggregates returns: align: its own joint
action; cross: the mean over them (`returns.agent_returns` with
cross_return='mean': a sum is not on the value scale); marginal: the mean
immediate reward over the valid combinations containing it plus the
continuation of its aligned combination (`credit.marginal_returns`, with the
open unbranched combinations imputed by `credit.impute_open`). Then

    A_ig = y_ig - v_ig,      value target = y_ig.

`estimator='td0'` is lambda = 0: y = r + gamma Vbar(child), A the TD error
delta_ig (CoMLRL's). `estimator='gae'` is GAE(lambda) generalised to the
tree: A_ig = delta_ig + gamma lambda Abar_i(child), Abar_i(child) = Jbar_i -
Vbar_i = the mean over the child's valid joint actions of agent i's
advantage (in align: over its valid samples), and y the lambda-return. At
lambda = 1, J is the tree's return recursion (`Tree.finalize`), so A_ig =
`agent_returns_NxG` - v_ig and the target is the mean of the children's
returns, a lower-variance Monte-Carlo target than one rollout. With G = 1 (a
chain below its root) the critic is the only baseline, so each action gets
its own advantage (not the root's, as the sibling-baseline chain does).

'v' and 'q' share the formula; 'v' reads V_i(s) as the mean of the agent's
G values at the node (they are one history's value). The Q variant follows
CoMLRL 1.4.3 (`comlrl/trainers/actor_critic/iac.py`,
`IACTrainer._collect_rollouts_multi_turn`; `ac_base.py`,
`ActorCriticTrainerBase._prepare_advantages`): target = r_t + discount *
old_value_{t+1} (the critic's value of the next turn's sample, Q(h', a')
under critic_type='q'; r_T at the last turn or after early termination),
advantage = target - old_value_t, i.e. r + gamma Q(h', a') - Q(h, a) with no
sibling baseline. With G samples at the child, Q(h', a') becomes the mean
over the child's valid joint actions (expected SARSA), as Vbar above.

Normalisation (`normalize`, CoMLRL's `advantage_normalization`): CoMLRL
normalises each agent's buffer turn by turn (`_process_buffer` groups by
`turn_idx`, `_prepare_advantages` per group): (A - mean) / max(std, 1e-6),
population std, only where the group has more than one sample. Here a group
is (agent, turn) over the tree's trained samples (weight > 0) of all roots.

Fault-masked samples (weight 0) get advantage 0 and target v (so a squared
error on them is 0 whether or not the loss masks them).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtrl_jax.rollout import credit
from mtrl_jax.rollout.returns import agent_returns
from mtrl_jax.rollout.tree import Tree

ESTIMATORS = ("td0", "gae")
TARGETS = ("v", "q")
_STD_FLOOR = 1e-6  # CoMLRL's std.clamp(min=1e-6)


@dataclasses.dataclass(frozen=True)
class CriticConfig:
  """How critic values become advantages and value targets.

  Attributes:
    target: 'v' (V(h), one value per agent and node) or 'q' (Q(h, a), per sample).
    estimator: 'td0' (one-step TD error, CoMLRL's) or 'gae' (GAE(lambda) over the tree).
    gae_lambda: lambda in [0, 1], used by 'gae'.
    normalize: standardise advantages per (agent, turn) over the trained samples.
  """

  target: str = "v"
  estimator: str = "td0"
  gae_lambda: float = 0.95
  normalize: bool = True

  def __post_init__(self):
    if self.target not in TARGETS:
      raise ValueError(f"CriticConfig.target={self.target!r}; allowed: {list(TARGETS)}")
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"CriticConfig.estimator={self.estimator!r}; allowed: {list(ESTIMATORS)}")
    lam = self.gae_lambda
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= lam <= 1.0:
      raise ValueError(f"CriticConfig.gae_lambda={lam!r}; allowed: a float in [0, 1]")
    if not isinstance(self.normalize, bool):
      raise ValueError(f"CriticConfig.normalize={self.normalize!r}; allowed: True, False")

  @property
  def lam(self) -> float:
    """The lambda the estimator uses: 0 for 'td0'."""
    return float(self.gae_lambda) if self.estimator == "gae" else 0.0


def _check_values(tree: Tree, values) -> list[np.ndarray]:
  if not tree.finalized:
    raise ValueError("critic_advantages needs a finalized tree (Tree.finalize())")
  if len(values) != len(tree.nodes):
    raise ValueError(f"critic_advantages: {len(values)} value arrays for {len(tree.nodes)} nodes")
  out = []
  n = tree.cfg.num_agents
  for node, v in zip(tree.nodes, values):
    v_NxG = np.asarray(v, np.float64)
    shape = (n, tree.cfg.generations_at(node.turn))
    if v_NxG.shape != shape:
      raise ValueError(
          f"critic_advantages: node {node.node_id} values have shape "
          f"{v_NxG.shape}, expected {shape}"
      )
    if not np.isfinite(v_NxG).all():
      raise ValueError(f"critic_advantages: node {node.node_id} has non-finite values")
    out.append(v_NxG)
  return out


def _normalize(tree: Tree, adv: list[np.ndarray]) -> None:
  """(A - mean) / max(std, 1e-6) per (agent, turn) over trained samples, in place."""
  n = tree.cfg.num_agents
  for turn in range(tree.cfg.num_turns):
    nodes = [node for node in tree.nodes if node.turn == turn]
    for i in range(n):
      a = np.concatenate(
          [adv[node.node_id][i][node.weight_NxG[i] > 0] for node in nodes] or [np.zeros(0)]
      )
      if a.size <= 1:  # CoMLRL leaves a one-sample group as it is
        continue
      mean, std = a.mean(), max(a.std(), _STD_FLOOR)
      for node in nodes:
        keep_G = node.weight_NxG[i] > 0
        adv[node.node_id][i] = np.where(keep_G, (adv[node.node_id][i] - mean) / std, 0.0)


def critic_advantages(
    tree: Tree, values: list[np.ndarray], cfg: CriticConfig
) -> tuple[list[np.ndarray], list[np.ndarray]]:
  """Critic advantages and value targets of every (node, agent, sample).

  Args:
    tree: a finalized tree (`Tree.finalize`: valid_B, weight_NxG set).
    values: values[k] float [N, G_k], the critic's value of each sample of
      tree.nodes[k] (V(h) repeated over the G samples, or Q(h, a)).
    cfg: target, estimator, lambda, normalisation.

  Returns:
    (advantages per node [N, G_k] float64, value targets per node [N, G_k]
    float64); fault-masked samples (weight 0) get advantage 0 and target v.
  """
  values = _check_values(tree, values)
  tcfg = tree.cfg
  # A sample's target is a value, so a cross sample averages its joint actions.
  agg_cfg = tcfg.replace(cross_return="mean") if tcfg.joint_mode == "cross" else tcfg
  gamma, lam, n = float(tcfg.discount), cfg.lam, tcfg.num_agents
  agents_N = np.arange(n)
  vbar_N, jbar_N = {}, {}  # node id -> Vbar_i, Jbar_i (only nodes with a valid action)
  adv, targets = [None] * len(tree.nodes), [None] * len(tree.nodes)
  for node in reversed(tree.nodes):  # children always have larger ids
    k, g = node.node_id, tcfg.generations_at(node.turn)
    v_NxG = values[k]
    if cfg.target == "v":  # one history's value: the mean absorbs rounding between copies
      v_NxG = np.repeat(v_NxG.mean(axis=1, keepdims=True), g, axis=1)
    joint_BxN, valid_B = tree.node_joint(node), node.valid_B
    rewards_BxN = node.agent_rewards_BxN
    cont_BxN = np.zeros_like(rewards_BxN)
    child_B = np.zeros(valid_B.shape, bool)
    for j, child_id in enumerate(node.children_B):
      # finalize already invalidated an action whose child has no valid action.
      if child_id < 0 or not valid_B[j] or child_id not in vbar_N:
        continue
      child_B[j] = True
      cont_BxN[j] = gamma * ((1.0 - lam) * vbar_N[child_id] + lam * jbar_N[child_id])
    ret_BxN = rewards_BxN + cont_BxN
    if tcfg.joint_mode == "marginal":
      open_B = (
          valid_B
          & ~child_B
          & np.asarray([a is not None and not a.ended for a in node.actions])
          & tree.may_expand(node)
      )
      ret_BxN = credit.impute_open(ret_BxN, cont_BxN, child_B, open_B)
      y_NxG, _ = credit.marginal_returns(joint_BxN, rewards_BxN, cont_BxN, valid_B, tree.slot_B, g)
    else:
      y_NxG, _ = agent_returns(agg_cfg, joint_BxN, ret_BxN, valid_B, g)
    if valid_B.any():
      # v_i of the sample agent i plays in each joint action, [B, N].
      vsel_BxN = v_NxG[agents_N[None, :], joint_BxN]
      vbar_N[k] = vsel_BxN[valid_B].mean(axis=0)
      jbar_N[k] = ret_BxN[valid_B].mean(axis=0)
    keep_NxG = node.weight_NxG > 0
    adv[k] = np.where(keep_NxG, y_NxG - np.where(keep_NxG, v_NxG, 0.0), 0.0)
    targets[k] = np.where(keep_NxG, y_NxG, v_NxG)
  if cfg.normalize:
    _normalize(tree, adv)
  return adv, targets
