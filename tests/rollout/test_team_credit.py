"""Per-agent credit on hand-built two-agent trees, against a float64 reference written here.

Team / local reward mixing (`agents.team_weight`), marginal-contribution returns
(`joint_mode='marginal'`), influence, with masked actions, ended combinations and
early termination. The reference below recomputes every quantity from the spec of a
tree with plain loops (docs: `mtrl_jax/rollout/credit.py`).
"""

import itertools

import numpy as np
import pytest

from mtrl_jax.rollout import Tree, TreeConfig
from mtrl_jax.rollout.credit import credit_metrics, influence, mix_rewards
from mtrl_jax.rollout.records import ActionRecord, StepRecord
from mtrl_jax.rollout.stats import path_success

GAMMA = 0.9


def _joint(mode, g, n):
  if mode == "align":
    return [(k,) * n for k in range(g)]
  return list(itertools.product(range(g), repeat=n))


def _node(team, local=None, valid=None, ended=None, children=None):
  """A spec node: team rewards, local rewards per agent ([B][N] or None), validity,
  which actions ended the episode, and {action: child spec}."""
  b = len(team)
  return {
      "team": list(map(float, team)),
      "local": None if local is None else [list(map(float, row)) for row in local],
      "valid": [True] * b if valid is None else list(valid),
      "ended": [False] * b if ended is None else list(ended),
      "children": children or {},
  }


def _reference(spec, mode, lam, g, n, turn, num_turns, tau=None):
  """Returns, sample returns and advantages ('mean' baseline) of a spec tree, float64.

  Result per node (pre-order list): dict with value_team, value (per agent),
  returns_team [B], returns [B][N], R [N][G], ok [N][G], adv [N][G].
  """
  joint = _joint(mode, g, n)
  b = len(joint)
  team, valid = spec["team"], list(spec["valid"])
  local = spec["local"] if spec["local"] is not None else [[t] * n for t in team]
  r = [
      [t if loc == t else lam * t + (1 - lam) * loc for loc in local[j]] for j, t in enumerate(team)
  ]
  ok_team = [t for t, v in zip(team, valid) if v]
  terminated = tau is not None and bool(ok_team) and np.mean(ok_team) > tau
  expand = turn < num_turns - 1 and not terminated
  cont_team, cont = [0.0] * b, [[0.0] * n for _ in range(b)]
  has_child = [False] * b
  out = []
  for j, child in sorted(spec["children"].items()):
    sub = _reference(child, mode, lam, g, n, turn + 1, num_turns, tau)
    out.extend(sub)
    if not valid[j]:
      continue
    if sub[0]["value_team"] is None:
      valid[j] = False
      continue
    has_child[j] = True
    cont_team[j] = GAMMA * sub[0]["value_team"]
    cont[j] = [GAMMA * v for v in sub[0]["value"]]
  ret_team = [team[j] + cont_team[j] for j in range(b)]
  ret = [[r[j][i] + cont[j][i] for i in range(n)] for j in range(b)]
  if mode == "marginal" and any(has_child):
    kids = [j for j in range(b) if has_child[j]]
    mean_team = sum(cont_team[j] for j in kids) / len(kids)
    mean_i = [sum(cont[j][i] for j in kids) / len(kids) for i in range(n)]
    for j in range(b):
      if valid[j] and not has_child[j] and not spec["ended"][j] and expand:
        ret_team[j] += mean_team
        ret[j] = [ret[j][i] + mean_i[i] for i in range(n)]
  vj = [j for j in range(b) if valid[j]]
  node = {
      "value_team": sum(ret_team[j] for j in vj) / len(vj) if vj else None,
      "value": [sum(ret[j][i] for j in vj) / len(vj) for i in range(n)] if vj else None,
      "returns_team": [ret_team[j] if valid[j] else 0.0 for j in range(b)],
      "returns": [[ret[j][i] if valid[j] else 0.0 for i in range(n)] for j in range(b)],
      "R": [[0.0] * g for _ in range(n)],
      "ok": [[False] * g for _ in range(n)],
      "terminated": terminated,
  }
  for i in range(n):
    for k in range(g):
      mine = [j for j in range(b) if joint[j][i] == k]
      if mode == "align":
        node["ok"][i][k] = valid[mine[0]]
        node["R"][i][k] = ret[mine[0]][i] if valid[mine[0]] else 0.0
      elif mode == "cross":  # cross_return='sum'
        node["ok"][i][k] = all(valid[j] for j in mine)
        node["R"][i][k] = sum(ret[j][i] for j in mine) if node["ok"][i][k] else 0.0
      else:
        aligned = joint.index((k,) * n)
        if valid[aligned]:
          graded = [r[j][i] for j in mine if valid[j]]
          node["R"][i][k] = sum(graded) / len(graded) + cont[aligned][i]
          node["ok"][i][k] = True
  node["adv"] = [[0.0] * g for _ in range(n)]
  for i in range(n):
    vals = [node["R"][i][k] for k in range(g) if node["ok"][i][k]]
    if vals and any(v != vals[0] for v in vals):
      mean = sum(vals) / len(vals)
      node["adv"][i] = [node["R"][i][k] - mean if node["ok"][i][k] else 0.0 for k in range(g)]
  return [node] + out


def _build(cfg, spec):
  """The spec as a recorded, finalized Tree (pre-order list of its nodes)."""
  tree = Tree(cfg)
  order = []

  def grow(node, s):
    order.append(node)
    acts = []
    for j, (t, v, e) in enumerate(zip(s["team"], s["valid"], s["ended"])):
      loc = () if s["local"] is None else tuple(s["local"][j])
      acts.append(ActionRecord((StepRecord(t if v else 0.0, v, done=e, local_rewards=loc),)))
    tree.record(node, [a.reward for a in acts], s["valid"], acts)
    for j, child in sorted(s["children"].items()):
      grow(tree.add_child(node, j, [[2]] * cfg.num_agents), child)

  grow(tree.add_root([[1]] * cfg.num_agents), spec)
  tree.finalize()
  return tree, order


def _check(cfg, spec):
  tree, nodes = _build(cfg, spec)
  ref = _reference(
      spec,
      cfg.joint_mode,
      cfg.team_weight,
      cfg.num_generations,
      cfg.num_agents,
      0,
      cfg.num_turns,
      cfg.termination_threshold,
  )
  assert len(ref) == len(nodes)
  for node, want in zip(nodes, ref):
    np.testing.assert_allclose(node.returns_B, want["returns_team"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(node.returns_BxN, want["returns"], rtol=0, atol=1e-12)
    np.testing.assert_allclose(node.agent_returns_NxG, want["R"], rtol=0, atol=1e-12)
    np.testing.assert_array_equal(node.weight_NxG > 0, want["ok"])
    np.testing.assert_allclose(node.advantages_NxG, want["adv"], rtol=0, atol=1e-12)
    assert node.terminated == want["terminated"]
  return tree, nodes


def test_team_and_local_rewards_mix_per_agent_align_g2():
  # T=2, G=2, N=2, lambda=0.5. Root action 0: team 1, agent 0 alone right (local 1),
  # agent 1 wrong (0): r = [1, 0.5]. Action 1: team 0, locals (1, 0): r = [0.5, 0].
  # Child of 0 (last turn): team [1, 0], no local grades: r_i = team.
  #   agent values 0.5, 0.5; root R_00 = 1 + 0.9 * 0.5 = 1.45, R_01 = 0.5 + 0.45 = 0.95.
  # Child of 1: team [0, 0], locals agent 1 right once: r = [[0, 0], [0, 0.5]]
  #   -> values (0, 0.25): R_10 = 0.5, R_11 = 0 + 0.9 * 0.25 = 0.225.
  # Agent 0: R = [1.45, 0.5] -> A = [0.475, -0.475];
  # agent 1: R = [0.95, 0.225] -> A = [0.3625, -0.3625].
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=GAMMA, team_weight=0.5)
  spec = _node(
      [1, 0],
      local=[[1, 0], [1, 0]],
      children={0: _node([1, 0]), 1: _node([0, 0], local=[[0, 0], [0, 1]])},
  )
  tree, (root, c0, c1) = _check(cfg, spec)
  np.testing.assert_allclose(root.agent_rewards_BxN, [[1, 0.5], [0.5, 0]], atol=1e-12)
  np.testing.assert_allclose(root.advantages_NxG, [[0.475, -0.475], [0.3625, -0.3625]], atol=1e-12)
  np.testing.assert_allclose(root.returns_B, [1 + 0.9 * 0.5, 0.0], atol=1e-12)  # the team's
  m = credit_metrics(tree)
  # Valid actions: root (2), c0 (2), c1 (2). Team mean (1+0+1+0+0+0)/6; agent 1's local:
  # (0 + 0 + [c0: team 1, 0] + 0 + 1) / 6.
  assert m["agent_0/reward/team"] == pytest.approx(2 / 6)
  assert m["agent_1/reward/local"] == pytest.approx(2 / 6)
  assert m["agent_1/reward/total"] == pytest.approx((0.5 + 0 + 1 + 0 + 0 + 0.5) / 6)
  assert m["agent_0/reward/local_graded"] == pytest.approx(4 / 6)
  assert "agent_0/influence" not in m  # align grades no combinations


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_mixing_against_reference_cross_g3_with_faults(lam):
  rng = np.random.default_rng(3)
  b = 9

  def rand(valid=None):
    return _node(
        np.round(rng.normal(size=b), 2), local=np.round(rng.normal(size=(b, 2)), 2), valid=valid
    )

  valid = [True] * b
  valid[4] = False  # a masked combination: samples (1, .) and (., 1) lose weight
  spec = rand(valid)
  spec["children"] = {0: rand(), 2: rand([False] * b), 8: rand()}  # 2: all masked
  _check(
      TreeConfig(
          num_turns=2,
          num_generations=3,
          num_agents=2,
          joint_mode="cross",
          discount=GAMMA,
          team_weight=lam,
      ),
      spec,
  )


def test_team_weight_one_reproduces_the_joint_arrays_bit_for_bit():
  """Local grades with lambda = 1 give exactly the arrays of an environment that grades
  only jointly (which is what every tree computed before local grades)."""
  rng = np.random.default_rng(0)
  for mode, g in (("align", 2), ("align", 3), ("cross", 2), ("cross", 3)):
    b = g if mode == "align" else g * g
    spec = _node(
        rng.normal(size=b), local=rng.normal(size=(b, 2)).tolist(), valid=rng.random(b) > 0.2
    )
    spec["children"] = {
        j: _node(rng.normal(size=b), local=rng.normal(size=(b, 2)).tolist())
        for j in range(b)
        if spec["valid"][j] and rng.random() > 0.3
    }
    joint_only = {
        **spec,
        "local": None,
        "children": {j: {**c, "local": None} for j, c in spec["children"].items()},
    }
    cfg = TreeConfig(
        num_turns=2,
        num_generations=g,
        num_agents=2,
        joint_mode=mode,
        discount=GAMMA,
        team_weight=1.0,
    )
    _, with_local = _build(cfg, spec)
    _, plain = _build(cfg, joint_only)
    for x, y in zip(with_local, plain):
      for name in (
          "returns_B",
          "returns_BxN",
          "agent_returns_NxG",
          "advantages_NxG",
          "weight_NxG",
          "agent_rewards_BxN",
      ):
        np.testing.assert_array_equal(getattr(x, name), getattr(y, name))
      # Every agent's reward is the team reward itself.
      np.testing.assert_array_equal(x.agent_rewards_BxN, np.repeat(x.rewards_B[:, None], 2, 1))
    if mode == "align":  # the joint recursion, written out: R = r + gamma * mean(child R)
      root = plain[0]
      want = np.asarray(spec["team"], np.float64).copy()
      for k, (j, child) in enumerate(sorted(spec["children"].items())):
        want[j] = want[j] + GAMMA * plain[1 + k].returns_B[plain[1 + k].valid_B].mean()
      np.testing.assert_array_equal(root.returns_B, np.where(root.valid_B, want, 0.0))
      np.testing.assert_array_equal(
          root.agent_returns_NxG, np.stack([root.returns_B, root.returns_B])
      )


def test_mix_rewards_is_the_team_reward_where_there_is_no_local_grade():
  team = np.array([0.1, 0.7, 1 / 3])
  local = np.array([[0.1, 0.0], [0.7, 0.7], [1 / 3, 1.0]])
  out = mix_rewards(team[:, None], local, 0.3)
  np.testing.assert_array_equal(out[:, 0], team)  # no local grade: exactly the team's
  assert out[2, 1] == pytest.approx(0.3 / 3 + 0.7)


def test_marginal_g2_one_turn_by_hand():
  # Combinations (0,0), (0,1), (1,0), (1,1): team r = [1, 0, 1, 1] (node mean 0.75).
  # Agent 0: sample 0 -> mean(1, 0) = 0.5, sample 1 -> mean(1, 1) = 1: A = [-0.25, 0.25].
  # Agent 1: sample 0 -> mean(1, 1) = 1, sample 1 -> mean(0, 1) = 0.5: A = [0.25, -0.25].
  cfg = TreeConfig(num_turns=1, num_generations=2, num_agents=2, joint_mode="marginal")
  tree, (root,) = _check(cfg, _node([1, 0, 1, 1], ended=[True] * 4))
  np.testing.assert_allclose(root.advantages_NxG, [[-0.25, 0.25], [0.25, -0.25]], atol=1e-12)
  # Influence: per-sample means (0.5, 1) and (1, 0.5), variance 1/16 each over Var r = 3/16.
  m = credit_metrics(tree)
  assert m["agent_0/influence"] == pytest.approx(1 / 3)
  assert m["agent_1/influence"] == pytest.approx(1 / 3)


def test_marginal_g3_two_turns_masks_ends_and_termination():
  """G=3, T=3: the aligned combinations (0,0) and (1,1) branch, (2,2) ends the episode;
  (0,2) is masked, (1,2) ends; a continuing unaligned combination gets the mean
  continuation; (0,0)'s child terminates early (a trained leaf)."""
  rng = np.random.default_rng(7)
  b = 9
  aligned = [0, 4, 8]

  def rand(**kw):
    return _node(
        np.round(rng.uniform(size=b), 2), local=np.round(rng.uniform(size=(b, 2)), 2).tolist(), **kw
    )

  root = rand(valid=[j != 2 for j in range(b)], ended=[j in (5, 8) for j in range(b)])
  root["team"] = [min(t, 0.6) for t in root["team"]]  # mean below tau: the root expands
  done = _node([0.95] * b, ended=[True] * b)  # mean 0.95 > tau: terminated
  mid = rand()
  mid["team"] = [min(t, 0.6) for t in mid["team"]]
  mid["children"] = {4: rand(ended=[True] * b)}
  root["children"] = {0: done, 4: mid}
  cfg = TreeConfig(
      num_turns=3,
      num_generations=3,
      num_agents=2,
      joint_mode="marginal",
      discount=GAMMA,
      team_weight=0.5,
      termination_threshold=0.9,
  )
  tree, nodes = _check(cfg, root)
  assert nodes[1].terminated and not nodes[0].terminated
  assert tree.child_slot(nodes[0], 4) == 1 and tree.child_slot(nodes[0], 3) == -1
  assert [tree.child_slot(nodes[0], j) for j in aligned] == [0, 1, 2]
  # Samples of agent 0: (0, .) contains the masked (0, 2) but its aligned (0, 0) is valid.
  np.testing.assert_array_equal(nodes[0].weight_NxG, np.ones((2, 3)))
  with pytest.raises(ValueError, match="unaligned combination"):
    tree.add_child(nodes[0], 3, [[2], [2]])
  # Influence against the definition, averaged over the four nodes.
  shares = [_influence(n) for n in nodes]
  want = np.mean([s for s in shares if s is not None], axis=0)
  m = credit_metrics(tree)
  assert m["credit/varied_nodes"] == sum(s is not None for s in shares) / len(nodes)
  np.testing.assert_allclose([m["agent_0/influence"], m["agent_1/influence"]], want, atol=1e-12)
  assert 0.0 <= path_success(tree, 0.5) <= 1.0


def _influence(node):
  """The definition over one G=3 node; None where its rewards do not vary."""
  joint = _joint("cross", 3, 2)
  r = [node.rewards_B[j] for j in range(9) if node.valid_B[j]]
  if max(r) == min(r):
    return None
  out = []
  for i in range(2):
    means = []
    for k in range(3):
      mine = [node.rewards_B[j] for j in range(9) if node.valid_B[j] and joint[j][i] == k]
      if mine:
        means.append(sum(mine) / len(mine))
    out.append(np.var(means) / np.var(r))
  return out


def test_influence_shows_a_lazy_agent_and_skips_nodes_that_say_nothing():
  # Agent 0's choice decides the reward, agent 1's never does; a second node has no
  # variance (undefined: left out of the mean, not counted as 0 for both).
  joint = np.asarray(_joint("cross", 2, 2))
  np.testing.assert_allclose(
      influence(joint, np.array([1.0, 1, 0, 0]), np.ones(4, bool), 2), [1.0, 0.0]
  )
  assert influence(joint, np.full(4, 0.5), np.ones(4, bool), 2) is None
  assert influence(joint, np.zeros(4), np.zeros(4, bool), 2) is None
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, joint_mode="cross")
  spec = _node([1, 1, 0, 0], children={0: _node([0.5] * 4)})
  tree, _ = _build(cfg, spec)
  m = credit_metrics(tree)
  assert (m["agent_0/influence"], m["agent_1/influence"]) == (1.0, 0.0)
  assert m["credit/varied_nodes"] == 0.5
  # A team that always scores alike: no node varies, so no influence is reported.
  tree, _ = _build(cfg, _node([1.0] * 4, children={0: _node([1.0] * 4)}))
  m = credit_metrics(tree)
  assert m["credit/varied_nodes"] == 0.0 and "agent_0/influence" not in m


def test_marginal_plan_counts_align_nodes_and_cross_grades():
  from mtrl_jax.rollout import plan_tree

  marginal = TreeConfig(num_turns=2, num_generations=3, num_agents=2, joint_mode="marginal")
  align, cross = marginal.replace(joint_mode="align"), marginal.replace(joint_mode="cross")
  p_m, p_a, p_c = (plan_tree(c, 1, 8, 8) for c in (marginal, align, cross))
  assert (p_m.nodes, p_m.generations) == (p_a.nodes, p_a.generations) == (4, 24)
  assert p_m.reward_calls == 4 * 9 and p_c.reward_calls == 10 * 9


class _OneRightAgent0:
  """Agent 0's sample 0 answers the joint code, its sample 1 does not; agent 1 always
  answers it. Built on the test fakes of the engine."""

  @staticmethod
  def make():
    import re

    from mtrl_jax.testing import FakePolicy, byte_renderer

    renderer = byte_renderer()
    tok = renderer.tokenizer

    class Policy(FakePolicy):

      def completion(self, req, g):
        first = re.findall(r"<\|user\|>(.*?)<\|end\|>", tok.decode(list(req.prompt)))[0]
        task = Policy.tasks[first]
        text = task["target"] if (req.agent == 1 or g == 0) else "00"
        ids = tok.encode(f"<answer>{text}</answer>") + [renderer.fmt.stop_ids[0]]
        return np.asarray(ids, np.int32), np.zeros(len(ids), np.float32), "stop"

    return Policy, renderer


@pytest.mark.parametrize("mode", ["align", "marginal", "cross"])
def test_coop_tree_per_agent_credit_on_the_engine(mode):
  """On the coop task: the marginal tree has the align tree's nodes and samples, grades
  every combination, and credits agent 0 alone for the choice that decides the reward."""
  import jax

  from mtrl_jax.envs import RewardConfig
  from mtrl_jax.rollout import expand_tree, node_records
  from mtrl_jax.rollout.env_transition import EnvTransition
  from mtrl_jax.tasks import coop

  policy_cls, renderer = _OneRightAgent0.make()
  tasks = [coop.make_task("eval", i) for i in range(2)]
  policy_cls.tasks = {coop.first_prompt(t, a): t for t in tasks for a in (0, 1)}
  transition = EnvTransition(
      renderer, num_agents=2, reward_cfg=RewardConfig(outcome_weight=1.0, shaping_weight=1.0)
  )
  cfg = TreeConfig(
      num_turns=2, num_generations=2, num_agents=2, joint_mode=mode, discount=GAMMA, team_weight=0.5
  )
  roots = [transition.root_state(coop.CoopEnv(t)) for t in tasks]
  tree = expand_tree(cfg, policy_cls(), transition, roots, jax.random.key(0))
  per_root = 1 + cfg.branching
  assert len(tree.nodes) == 2 * per_root
  root = tree.nodes[0]
  assert root.rewards_B.size == cfg.actions_per_node
  # Team reward: 1 exactly where agent 0 plays its sample 0; agent 0's local reward too,
  # agent 1's is always 1.
  j0 = tree.node_joint(root)[:, 0]
  np.testing.assert_array_equal(root.rewards_B, (j0 == 0).astype(float))
  np.testing.assert_array_equal(root.local_BxN[:, 1], np.ones(root.rewards_B.size))
  leaf = tree.nodes[-1]
  if mode != "align":
    # Agent 0's choice explains all of the variance, agent 1's none.
    m = credit_metrics(tree)
    assert (m["agent_0/influence"], m["agent_1/influence"]) == (1.0, 0.0)
    # At a leaf: agent 0's sample means over partners (1, 0) -> A = (0.5, -0.5) (cross
    # sums: (2, 0) -> (1, -1)); agent 1's means (0.75, 0.75) -> 0.
    scale = 2.0 if mode == "cross" else 1.0
    np.testing.assert_allclose(
        leaf.advantages_NxG, [[0.5 * scale, -0.5 * scale], [0.0, 0.0]], atol=1e-12
    )
  rec = node_records(tree)[0]
  assert len(rec["agent_rewards"]) == cfg.actions_per_node and len(rec["local_rewards"][0]) == 2
