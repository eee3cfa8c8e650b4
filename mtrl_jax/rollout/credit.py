"""Per-agent credit in a multi-agent tree: team and local rewards, marginal returns, influence.

Team and local rewards. Every joint action has the team reward r (the joint
grades, composed) and, per agent, a local reward l_i (the same grades judged
for agent i alone, `Grade.agent_scores`; the team reward where no grade
scores agent i alone). Agent i's reward is

    r_i = lambda * r + (1 - lambda) * l_i          lambda = agents.team_weight

and its returns, sample returns and advantages follow from r_i alone (the
tree's recursion per agent). Where l_i = r (joint grading only) r_i is r
exactly, and lambda = 1 reproduces the team-only arrays bit for bit. Early
termination and the logged per-turn rewards stay the team's.

Marginal credit (`TreeConfig.joint_mode='marginal'`). At a node every agent
samples G completions and all G^N combinations are graded (cross's grading
cost), but only the G aligned ones (g, ..., g) get children (align's
generation cost). Agent i's sample k gets the return

    R_ik = mean_{valid c containing (i, k)} r_i(c)  +  C_i(k)

with C_i(k) = gamma * (agent i's value of the child of the aligned
combination (k, ..., k)), 0 when it has none (it ended the episode, the last
turn, a terminated node, a truncation). The first term is the marginal
contribution of the sample to the immediate reward, the partners' samples
averaged out (CCPO-style); the second is the future of the one trajectory the
tree continued for it, as in align mode: the partners' k-th samples are
independent draws of their policies, so it is an unbiased one-sample
estimate, which the mean over partners cannot improve without branching
every combination. The sibling baseline (`advantage_mode`; 'mean': minus the
mean over the agent's samples, which is the node's mean) turns R into the
advantage. A sample is valid iff its aligned combination is (its future needs
it); masked combinations are left out of the means.

What a combination's return is (the dump's `returns`, and the node's value,
their mean over valid combinations, that the parent's continuation reads): an
aligned one r + its continuation, as in align mode; a combination the
environment continued but the tree did not branch, r + the mean continuation
of the node's branched combinations (the only estimate of its future); one
that ended, r. When every combination continues, the node's value is the mean
reward of all G^N graded combinations plus the mean aligned continuation.

Influence (cross and marginal, N >= 2): at a node, the share of the team
reward's variance over its valid combinations that agent a's choice explains,
Var_k(mean over the combinations with agent a's sample k) / Var(r);
`agent_<a>/influence` averages it over the nodes whose valid combinations'
team rewards differ (`credit/varied_nodes`: their share of the nodes with a
valid combination). A node where every combination scored alike says nothing
about who mattered: counting it as 0 would make a team that always succeeds
(or always fails) read as two lazy agents. An agent whose samples make no
difference where the outcome varies (a lazy agent) reads 0; the shares of all
agents and the interaction add up to 1 on a full grid.
"""

from __future__ import annotations

from typing import Optional

import numpy as np


def mix_rewards(team, local, team_weight: float) -> np.ndarray:
  """Agent rewards lambda * team + (1 - lambda) * local, exactly `team` where local equals
  it (an agent without a local grade) and everywhere when lambda = 1.

  Args:
    team: team rewards, broadcast against `local`.
    local: local rewards, e.g. [B, N].
    team_weight: lambda in [0, 1].
  """
  local = np.asarray(local, np.float64)
  team = np.broadcast_to(np.asarray(team, np.float64), local.shape)
  if team_weight == 1.0:
    return team.copy()
  mixed = team_weight * team + (1.0 - team_weight) * local
  return np.where(local == team, team, mixed)


def node_values(node) -> np.ndarray:
  """A finalized node's value per channel, the team's then each agent's: the mean return
  of its valid joint actions (what its parent's continuation reads)."""
  valid_B = node.valid_B
  return np.asarray(
      [node.returns_B[valid_B].mean()]
      + [node.returns_BxN[:, i][valid_B].mean() for i in range(node.returns_BxN.shape[1])]
  )


def impute_open(
    returns_BxK: np.ndarray, cont_BxK: np.ndarray, child_B: np.ndarray, open_B: np.ndarray
) -> np.ndarray:
  """Marginal mode: a combination the environment continued but the tree did not branch
  (`open_B`) gets the mean continuation of the node's combinations that have a child
  (`child_B`); none: no estimate, it stays a leaf (its reward). Returns a new array."""
  out = returns_BxK.copy()
  if child_B.any() and open_B.any():
    out[open_B] += cont_BxK[child_B].mean(axis=0)
  return out


def marginal_returns(
    joint_BxN: np.ndarray,
    rewards_BxN: np.ndarray,
    cont_BxN: np.ndarray,
    valid_B: np.ndarray,
    slot_B: np.ndarray,
    g: int,
) -> tuple[np.ndarray, np.ndarray]:
  """Per-agent sample returns of a marginal node (see the module docstring).

  Args:
    joint_BxN: sample index of each agent in each combination.
    rewards_BxN: agent i's reward of each combination (column i).
    cont_BxN: agent i's continuation of each combination (0 without a child).
    valid_B: valid combinations (an aligned one whose child is all masked is not).
    slot_B: g for the aligned combination (g, ..., g), -1 for the others.
    g: samples per agent.

  Returns:
    (returns_NxG float64, valid_NxG bool); invalid samples have return 0.
  """
  n = joint_BxN.shape[1]
  out_NxG = np.zeros((n, g), np.float64)
  valid_NxG = np.zeros((n, g), bool)
  for k in range(g):
    aligned = np.flatnonzero(slot_B == k)
    if aligned.size != 1 or not valid_B[aligned[0]]:
      continue
    a = int(aligned[0])
    for i in range(n):
      members_B = valid_B & (joint_BxN[:, i] == k)
      out_NxG[i, k] = rewards_BxN[members_B, i].mean() + cont_BxN[a, i]
      valid_NxG[i, k] = True
  return out_NxG, valid_NxG


def influence(
    joint_BxN: np.ndarray, rewards_B: np.ndarray, valid_B: np.ndarray, g: int
) -> Optional[np.ndarray]:
  """Per agent, the share of the variance of the valid combinations' rewards explained by
  its choice: Var_k(mean reward of the combinations with its sample k) / Var(r), over
  its samples in some valid combination. None where it is undefined: no valid
  combination, or all of them scored alike (Var(r) = 0).

  Returns:
    float64 [N], or None.
  """
  r = rewards_B[valid_B]
  n = joint_BxN.shape[1]
  if r.size == 0 or np.all(r == r[0]):
    return None
  total = r.var()
  out = np.zeros(n)
  for i in range(n):
    means = [
        rewards_B[valid_B & (joint_BxN[:, i] == k)].mean()
        for k in range(g)
        if (valid_B & (joint_BxN[:, i] == k)).any()
    ]
    out[i] = np.var(means) / total
  return out


def credit_metrics(tree) -> dict[str, float]:
  """Per agent, over the tree's valid joint actions: `agent_<a>/reward/team`, `.../local`
  (its local reward, the team reward where it had none), `.../total` (the mixed reward
  it is trained on), `.../local_graded` (share of actions that scored it alone), and in
  cross and marginal modes `credit/varied_nodes` and, where some node's rewards varied,
  `agent_<a>/influence`. {} for one agent."""
  cfg = tree.cfg
  n = cfg.num_agents
  nodes = [node for node in tree.nodes if node.recorded and node.valid_B.any()]
  if n < 2 or not nodes:
    return {}
  team_M = np.concatenate([node.rewards_B[node.valid_B] for node in nodes])
  local_MxN = np.concatenate([node.local_BxN[node.valid_B] for node in nodes])
  total_MxN = np.concatenate([node.agent_rewards_BxN[node.valid_B] for node in nodes])
  graded_MxN = np.concatenate([node.local_graded_BxN[node.valid_B] for node in nodes])
  out = {}
  for a in range(n):
    out.update(
        {
            f"agent_{a}/reward/team": float(team_M.mean()),
            f"agent_{a}/reward/local": float(local_MxN[:, a].mean()),
            f"agent_{a}/reward/total": float(total_MxN[:, a].mean()),
            f"agent_{a}/reward/local_graded": float(graded_MxN[:, a].mean()),
        }
    )
  if cfg.joint_mode in ("cross", "marginal"):
    shares = [
        influence(
            tree.node_joint(node), node.rewards_B, node.valid_B, cfg.generations_at(node.turn)
        )
        for node in nodes
    ]
    varied = [s for s in shares if s is not None]
    out["credit/varied_nodes"] = len(varied) / len(shares)
    if varied:
      mean_N = np.mean(varied, axis=0)
      out.update({f"agent_{a}/influence": float(mean_N[a]) for a in range(n)})
  return out
