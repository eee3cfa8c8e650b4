"""Critic advantages and value targets (`rollout.critic`) against a float64 path reference.

The reference below never uses the module's recursion: it enumerates every path
below a joint action (each child action drawn uniformly among the child's valid
ones) and sums the discounted TD errors along it, A = sum_t (gamma lambda)^t
E[delta_t]; a sample's advantage is the mean over the valid joint actions
containing it. Trees are hand-built specs: two agents, align and cross, G = 2
and 3, chains with G = 1 below the root, masked actions, ended actions and
early termination.
"""

import itertools
import zlib

import numpy as np
import pytest

from mtrl_jax.rollout import Tree, TreeConfig
from mtrl_jax.rollout.critic import CriticConfig, critic_advantages
from mtrl_jax.rollout.records import ActionRecord, StepRecord

GAMMA = 0.9


def _joint(mode, g, n):
  if mode == "align" or g == 1:
    return [(k,) * n for k in range(g)]
  return list(itertools.product(range(g), repeat=n))


def _spec(team, values, valid=None, ended=None, children=None, local=None):
  """A spec node: team rewards [B], critic values [N][G], validity, ended actions,
  {action: child spec}, optional local rewards [B][N]."""
  b = len(team)
  return {
      "team": [float(t) for t in team],
      "values": np.asarray(values, np.float64),
      "valid": [True] * b if valid is None else list(valid),
      "ended": [False] * b if ended is None else list(ended),
      "children": children or {},
      "local": local,
  }


def _build(cfg, spec):
  """The spec as a recorded, finalized Tree, and the values list in node order."""
  tree, specs = Tree(cfg), {}

  def grow(node, s):
    specs[node.node_id] = s
    acts = []
    for j, (t, v, e) in enumerate(zip(s["team"], s["valid"], s["ended"])):
      loc = () if s["local"] is None else tuple(s["local"][j])
      acts.append(ActionRecord((StepRecord(t if v else 0.0, v, done=e, local_rewards=loc),)))
    tree.record(node, [a.reward for a in acts], s["valid"], acts)
    for j, child in sorted(s["children"].items()):
      grow(tree.add_child(node, j, [[2]] * cfg.num_agents), child)

  grow(tree.add_root([[1]] * cfg.num_agents), spec)
  tree.finalize()
  return tree, [specs[k]["values"] for k in range(len(tree.nodes))], specs


# ------------------------------------------------------------------ reference
def _prepare(s, mode, n, lam_mix):
  """Annotates a spec in place (post-order): mixed rewards r[B][N], effective validity
  (an action whose child has no valid action is masked), joint actions, turn-free."""
  for child in s["children"].values():
    _prepare(child, mode, n, lam_mix)
  g = s["values"].shape[1]
  s["joint"] = _joint(mode, g, n)
  local = s["local"] or [[t] * n for t in s["team"]]
  s["r"] = [
      [t if loc == t else lam_mix * t + (1 - lam_mix) * loc for loc in local[j]]
      for j, t in enumerate(s["team"])
  ]
  s["ok"] = [
      v and (j not in s["children"] or any(s["children"][j]["ok"]))
      for j, v in enumerate(s["valid"])
  ]


def _vbar(s, i):
  """Agent i's value of a node: mean over its valid joint actions of its sample's value."""
  ok = [j for j, v in enumerate(s["ok"]) if v]
  return sum(s["values"][i][s["joint"][j][i]] for j in ok) / len(ok)


def _paths(s, j):
  """Every path (list of (spec, action)) below joint action j of s, with its probability."""
  child = s["children"].get(j)
  if child is None or not s["ok"][j]:
    return [([(s, j)], 1.0)]
  ok = [c for c, v in enumerate(child["ok"]) if v]
  return [([(s, j)] + p, w / len(ok)) for c in ok for p, w in _paths(child, c)]


def _delta(s, j, i):
  child = s["children"].get(j)
  cont = _vbar(child, i) if child is not None and s["ok"][j] else 0.0
  return s["r"][j][i] + GAMMA * cont - s["values"][i][s["joint"][j][i]]


def _reference(spec, mode, n, lam, lam_mix=1.0):
  """{id(spec): (adv [N][G], target [N][G], trained [N][G])} of every spec node."""
  _prepare(spec, mode, n, lam_mix)
  out = {}

  def walk(s):
    g = s["values"].shape[1]
    adv, tgt, ok = np.zeros((n, g)), np.array(s["values"]), np.zeros((n, g), bool)
    for i in range(n):
      for k in range(g):
        mine = [j for j, jt in enumerate(s["joint"]) if jt[i] == k]
        if not all(s["ok"][j] for j in mine):
          continue
        ok[i, k] = True
        per_action = []
        for j in mine:
          total = 0.0
          for path, w in _paths(s, j):
            total += w * sum(
                (GAMMA * lam) ** t * _delta(node, a, i) for t, (node, a) in enumerate(path)
            )
          per_action.append(total)
        adv[i, k] = sum(per_action) / len(per_action)
        tgt[i, k] = adv[i, k] + s["values"][i][k]
    out[id(s)] = (adv, tgt, ok)
    for child in s["children"].values():
      walk(child)

  walk(spec)
  return out


def _check(cfg, spec, ccfg, lam_mix=1.0):
  tree, values, specs = _build(cfg, spec)
  adv, tgt = critic_advantages(tree, values, ccfg)
  ref = _reference(spec, cfg.joint_mode, cfg.num_agents, ccfg.lam, lam_mix)
  for node in tree.nodes:
    want_adv, want_tgt, want_ok = ref[id(specs[node.node_id])]
    np.testing.assert_array_equal(node.weight_NxG > 0, want_ok)
    np.testing.assert_allclose(adv[node.node_id], want_adv, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tgt[node.node_id], want_tgt, rtol=0, atol=1e-12)
    assert adv[node.node_id].dtype == np.float64 and tgt[node.node_id].dtype == np.float64
  return tree, values, adv, tgt


def _random_spec(rng, mode, g, n, turns, *, p_mask=0.15, p_end=0.2, target="q", turn=0):
  b = len(_joint(mode, g, n))
  values = rng.normal(size=(n, g))
  if target == "v":
    values = np.repeat(values[:, :1], g, axis=1)
  valid = rng.random(b) > p_mask
  ended = rng.random(b) < p_end
  children = {}
  if turn < turns - 1:
    children = {
        j: _random_spec(
            rng, mode, g, n, turns, p_mask=p_mask, p_end=p_end, target=target, turn=turn + 1
        )
        for j in range(b)
        if not ended[j]
    }
  return _spec(np.round(rng.normal(size=b), 3), values, valid, ended, children)


# ------------------------------------------------------------------ hand-worked
def test_td0_align_g2_by_hand():
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=GAMMA)
  # Root: V = (1.0, 0.5) per agent; action 0 -> child (V 2.0 / 1.0), action 1 ended.
  child = _spec([1.0, 3.0], [[2.0, 2.0], [1.0, 1.0]])
  root = _spec([0.5, 2.0], [[1.0, 1.0], [0.5, 0.5]], ended=[False, True], children={0: child})
  tree, values, _ = _build(cfg, root)
  adv, tgt = critic_advantages(tree, values, CriticConfig(normalize=False))
  # Root, agent 0: 0.5 + 0.9 * 2.0 - 1.0 = 1.3 ; 2.0 - 1.0 = 1.0. Agent 1: V' = 1.0, V = 0.5.
  np.testing.assert_allclose(adv[0], [[1.3, 1.0], [0.9, 1.5]], atol=1e-12)
  np.testing.assert_allclose(tgt[0], [[2.3, 2.0], [1.4, 2.0]], atol=1e-12)
  # Child (last turn): r - V.
  np.testing.assert_allclose(adv[1], [[-1.0, 1.0], [0.0, 2.0]], atol=1e-12)
  # GAE(0.5) at the root: + 0.9 * 0.5 * mean child advantage (0 for agent 0, 1 for agent 1).
  adv_g, _ = critic_advantages(
      tree, values, CriticConfig(estimator="gae", gae_lambda=0.5, normalize=False)
  )
  np.testing.assert_allclose(adv_g[0], [[1.3, 1.0], [0.9 + 0.45, 1.5]], atol=1e-12)


@pytest.mark.parametrize("mode,g", [("align", 2), ("align", 3), ("cross", 2), ("cross", 3)])
@pytest.mark.parametrize("target", ["v", "q"])
@pytest.mark.parametrize("estimator,lam", [("td0", 0.95), ("gae", 0.6), ("gae", 1.0)])
def test_against_path_reference(mode, g, target, estimator, lam):
  rng = np.random.default_rng(zlib.crc32(repr((mode, g, target, estimator, lam)).encode()))
  turns = 3 if (mode == "align" or g == 2) else 2
  cfg = TreeConfig(
      num_turns=turns,
      num_generations=g,
      num_agents=2,
      joint_mode=mode,
      discount=GAMMA,
      cross_return="mean",
  )
  spec = _random_spec(rng, mode, g, 2, turns, target=target)
  _check(
      cfg, spec, CriticConfig(target=target, estimator=estimator, gae_lambda=lam, normalize=False)
  )


def test_masked_actions_and_a_fully_masked_child():
  cfg = TreeConfig(num_turns=3, num_generations=2, num_agents=2, joint_mode="cross", discount=GAMMA)
  v = [[0.3, -0.2], [0.1, 0.4]]
  dead = _spec([1, 1, 1, 1], v, valid=[False] * 4)  # every action faulted
  mid = _spec(
      [0.5, -1, 2, 0],
      v,
      valid=[True, False, True, True],
      children={
          0: _spec([1, 0, 0, 1], v),
          2: _spec([0, 0, 1, 1], v, valid=[True, True, False, True]),
      },
  )
  root = _spec([1, 0, 2, 1], v, children={0: mid, 1: dead, 3: _spec([1, 2, 3, 4], v)})
  tree, values, adv, tgt = _check(
      cfg, root, CriticConfig(target="q", estimator="gae", gae_lambda=0.7, normalize=False)
  )
  by_root = tree.nodes[0]
  # Action 1's child is all masked: action 1 is masked, so agent 0's sample 0 and agent 1's
  # sample 1 (both in action 1 = (0, 1)) train nothing.
  assert not by_root.valid_B[1]
  np.testing.assert_array_equal(by_root.weight_NxG, [[0, 1], [1, 0]])
  np.testing.assert_array_equal(adv[0][[0, 1], [0, 1]], [0.0, 0.0])
  np.testing.assert_array_equal(tgt[0][[0, 1], [0, 1]], np.asarray(v)[[0, 1], [0, 1]])


def test_early_termination_ends_the_recursion():
  cfg = TreeConfig(
      num_turns=3, num_generations=2, num_agents=2, discount=GAMMA, termination_threshold=0.8
  )
  v = [[0.2, 0.2], [0.6, 0.6]]
  done = _spec([0.9, 1.0], v)  # mean 0.95 > 0.8: terminated, no children
  root = _spec(
      [0.0, 0.5],
      v,
      children={
          0: done,
          1: _spec([0.1, 0.2], v, children={0: _spec([1, 0], v), 1: _spec([0, 0], v)}),
      },
  )
  tree, _, adv, _ = _check(
      cfg, root, CriticConfig(estimator="gae", gae_lambda=0.9, normalize=False)
  )
  assert tree.nodes[1].terminated and (tree.nodes[1].children_B < 0).all()


def test_team_weight_uses_each_agents_channel():
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=GAMMA, team_weight=0.25)
  v = [[0.0, 0.0], [0.5, 0.5]]
  child = _spec([1.0, 0.0], v, local=[[0.2, 1.0], [0.0, 0.4]])
  root = _spec([0.5, 1.0], v, children={1: child}, local=[[1.0, 0.0], [0.3, 1.0]])
  _, _, adv, _ = _check(cfg, root, CriticConfig(normalize=False), lam_mix=0.25)
  # Root action 0, agent 0: 0.25 * 0.5 + 0.75 * 1.0 - 0 (last action ends: no child).
  assert adv[0][0, 0] == pytest.approx(0.875)


def test_chain_g1_critic_is_the_baseline():
  cfg = TreeConfig(num_turns=3, num_generations=3, num_agents=2, shape="chain", discount=GAMMA)
  rng = np.random.default_rng(3)

  def link(turn):
    v = rng.normal(size=(2, 1))
    kids = {0: link(turn + 1)} if turn < 2 else {}
    return _spec([rng.normal()], v, children=kids)

  v_root = np.repeat(rng.normal(size=(2, 1)), 3, axis=1)
  root = _spec(
      rng.normal(size=3), v_root, ended=[False, True, False], children={0: link(1), 2: link(1)}
  )
  tree, values, adv, _ = _check(cfg, root, CriticConfig(normalize=False))
  below = [node for node in tree.nodes if node.turn > 0]
  assert all(a.shape == (2, 1) for a in adv[1:])
  # Each action has its own TD error: non-zero and different from the root's advantage.
  assert all(np.abs(adv[node.node_id]).min() > 1e-6 for node in below)
  assert not np.allclose(adv[1][:, 0], adv[0][:, 0])
  _check(cfg, root, CriticConfig(target="q", estimator="gae", gae_lambda=0.8, normalize=False))


# ------------------------------------------------------------------ lambda limits
@pytest.mark.parametrize(
    "mode,shape", [("align", "tree"), ("cross", "tree"), ("marginal", "tree"), ("align", "chain")]
)
def test_lambda_one_is_returns_minus_values(mode, shape):
  rng = np.random.default_rng(7)
  g, n, turns = 2, 2, 3
  cfg = TreeConfig(
      num_turns=turns,
      num_generations=g,
      num_agents=n,
      joint_mode=mode,
      discount=GAMMA,
      cross_return="mean",
      shape=shape,
  )
  tree = Tree(cfg)

  def grow(node):
    b = cfg.actions_at(node.turn)
    valid = rng.random(b) > 0.1
    ended = rng.random(b) < 0.2
    acts = [
        ActionRecord((StepRecord(float(rng.normal()) if ok else 0.0, bool(ok), done=bool(e)),))
        for ok, e in zip(valid, ended)
    ]
    if tree.record(node, [a.reward for a in acts], valid, acts):
      for j in range(b):
        if not ended[j] and tree.child_slot(node, j) >= 0:
          grow(tree.add_child(node, j, [[2]] * n))

  grow(tree.add_root([[1]] * n))
  tree.renumber()
  tree.finalize()
  values = [rng.normal(size=(n, cfg.generations_at(node.turn))) for node in tree.nodes]
  adv, tgt = critic_advantages(
      tree, values, CriticConfig(target="q", estimator="gae", gae_lambda=1.0, normalize=False)
  )
  for node, v_NxG, a_NxG, y_NxG in zip(tree.nodes, values, adv, tgt):
    keep_NxG = node.weight_NxG > 0
    np.testing.assert_allclose(
        a_NxG[keep_NxG], (node.agent_returns_NxG - v_NxG)[keep_NxG], rtol=0, atol=1e-12
    )
    np.testing.assert_allclose(
        y_NxG[keep_NxG], node.agent_returns_NxG[keep_NxG], rtol=0, atol=1e-12
    )


def test_lambda_zero_is_td0():
  rng = np.random.default_rng(11)
  cfg = TreeConfig(
      num_turns=3,
      num_generations=3,
      num_agents=2,
      joint_mode="cross",
      discount=GAMMA,
      cross_return="mean",
  )
  tree, values, _ = _build(cfg, _random_spec(rng, "cross", 3, 2, 2))
  for target in ("v", "q"):
    td0 = critic_advantages(tree, values, CriticConfig(target=target))
    gae0 = critic_advantages(
        tree, values, CriticConfig(target=target, estimator="gae", gae_lambda=0.0)
    )
    for a, b in zip(td0[0] + td0[1], gae0[0] + gae0[1]):
      np.testing.assert_array_equal(a, b)


# ------------------------------------------------------------------ normalisation
def test_normalize_per_agent_and_turn_over_trained_samples():
  rng = np.random.default_rng(5)
  cfg = TreeConfig(num_turns=3, num_generations=2, num_agents=2, discount=GAMMA)
  tree, values, _ = _build(cfg, _random_spec(rng, "align", 2, 2, 3, p_mask=0.2, p_end=0.1))
  raw, tgt_raw = critic_advantages(tree, values, CriticConfig(normalize=False))
  adv, tgt = critic_advantages(tree, values, CriticConfig())
  masked = 0
  for turn in range(3):
    for i in range(2):
      nodes = [node for node in tree.nodes if node.turn == turn]
      a = np.concatenate([raw[node.node_id][i][node.weight_NxG[i] > 0] for node in nodes])
      if a.size <= 1:
        continue
      for node in nodes:
        keep = node.weight_NxG[i] > 0
        masked += int((~keep).sum())
        want = (raw[node.node_id][i][keep] - a.mean()) / max(a.std(), 1e-6)
        np.testing.assert_allclose(adv[node.node_id][i][keep], want, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(adv[node.node_id][i][~keep], 0.0)
  assert masked > 0  # the case is exercised
  for y, y_raw in zip(tgt, tgt_raw):  # targets are never normalised
    np.testing.assert_array_equal(y, y_raw)
  flat = np.concatenate([a[0][n.weight_NxG[0] > 0] for a, n in zip(adv, tree.nodes) if n.turn == 2])
  assert flat.size > 2 and abs(flat.mean()) < 1e-12 and abs(flat.std() - 1) < 1e-9


def test_equal_advantages_normalise_to_zero_not_nan():
  cfg = TreeConfig(num_turns=1, num_generations=3, num_agents=2, discount=GAMMA)
  tree, values, _ = _build(cfg, _spec([1, 1, 1], [[0.5] * 3, [0.5] * 3]))
  adv, _ = critic_advantages(tree, values, CriticConfig())
  for a in adv:
    np.testing.assert_array_equal(a, 0.0)


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    "kw,field",
    [
        ({"target": "a"}, "target"),
        ({"estimator": "mc"}, "estimator"),
        ({"gae_lambda": 1.5}, "gae_lambda"),
        ({"gae_lambda": -0.1}, "gae_lambda"),
        ({"gae_lambda": "0.9"}, "gae_lambda"),
        ({"normalize": 1}, "normalize"),
    ],
)
def test_bad_config_is_refused_in_one_line(kw, field):
  with pytest.raises(ValueError) as err:
    CriticConfig(**kw)
  msg = str(err.value)
  assert "\n" not in msg and f"CriticConfig.{field}=" in msg and "allowed" in msg


def test_bad_values_are_refused():
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=GAMMA)
  tree, values, _ = _build(
      cfg, _spec([0, 1], [[0, 0], [0, 0]], children={0: _spec([1, 1], [[0, 0], [0, 0]])})
  )
  with pytest.raises(ValueError, match="value arrays"):
    critic_advantages(tree, values[:1], CriticConfig())
  with pytest.raises(ValueError, match="shape"):
    critic_advantages(tree, [values[0], np.zeros((2, 3))], CriticConfig())
  with pytest.raises(ValueError, match="non-finite"):
    critic_advantages(tree, [values[0], np.full((2, 2), np.nan)], CriticConfig())
  tree.finalized = False
  with pytest.raises(ValueError, match="finalized"):
    critic_advantages(tree, values, CriticConfig())
