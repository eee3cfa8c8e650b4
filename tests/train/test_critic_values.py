"""A value-head critic: packed values equal node-by-node values, and the update with a
value loss equals an independent reference (one batch and micro-batches)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mtrl_jax import losses, models, testing
from mtrl_jax.rollout.batching import BatchConfig, critic_values
from mtrl_jax.rollout.train_batch import has_values
from mtrl_jax.train import OptimConfig, StepConfig, TrainStep, make_optimizer
from mtrl_jax.train.objectives import PolicyObjective

from tests.rollout.test_tree_packing import random_tree

CFG = models.get_preset("tiny").replace(value_head=True)
FAST = StepConfig(compiler_options=(("xla_backend_optimization_level", 0),))
# eps 1e-2: Adam's first update is lr * g / (|g| + eps), so it keeps the gradient's
# magnitude, and a rounding difference in g (another summation order) moves a parameter
# by at most lr / eps = 0.1 times itself (eps 1e-4 would amplify it 10x).
OPT = OptimConfig(learning_rate=1e-3, eps=1e-2, grad_clip_norm=0.0)


def _model(seed=0):
  """A model whose value head is random (a fresh one is zero, which would hide errors)."""
  model = models.create_model(CFG, seed=seed)
  w = np.random.RandomState(seed).randn(CFG.d_model).astype(np.float32)
  model.value_head[...] = jnp.asarray(w)
  return model


@pytest.fixture(scope="module")
def critic():
  """A tree with sub-steps and faults, a model with a random value head, one TrainStep."""
  tree = random_tree(4, turns=3, gens=2, agents=2, mode="cross", substeps=True)
  model = _model()
  step = TrainStep(model, losses.LossConfig(), OPT, step_cfg=FAST)
  return tree, model, step


def _plain_values(model, paths):
  """The value head after a plain causal forward of each path: [len(paths), L] in float64
  (row b, position t: the value of paths[b][:t + 1]).

  Every path is padded on the right to one length, so one program serves them all; a
  causal row's positions never see the padding after them."""
  length = max(map(len, paths))
  tokens = np.zeros((len(paths), length), np.int32)
  for b, path in enumerate(paths):
    tokens[b, : len(path)] = path
  graphdef, params = nnx.split(model, nnx.Param)
  hidden = jax.jit(lambda p, t: nnx.merge(graphdef, p).hidden(t))(params, jnp.asarray(tokens))
  w = np.asarray(model.value_head[...], np.float64)
  return np.asarray(hidden, np.float64) @ w


@pytest.mark.parametrize("packing,target", [("tree", "v"), ("tree", "q"), ("rows", "v")])
def test_packed_values_equal_node_by_node_values(critic, packing, target):
  tree, model, step = critic
  params = nnx.state(model, nnx.Param)
  cfg = BatchConfig(packing=packing, length_buckets=(64, 128), values=target)
  got = critic_values(tree, cfg, lambda b: jax.device_get(step.values(params, b)), per_agent=False)
  keys, paths = [], []
  for k, node in enumerate(tree.nodes):
    for i in range(tree.cfg.num_agents):
      for g, comp in enumerate(node.completions[i]):
        if node.weight_NxG[i, g] == 0:
          assert got[k][i, g] == 0.0
          continue
        keys.append((k, i, g))
        paths.append(list(node.prompts[i]) + list(comp.ids))
  assert len(keys) > 20
  plain = _plain_values(model, paths)
  for b, ((k, i, g), path) in enumerate(zip(keys, paths)):
    # V: the value before the action (its prompt's last token); Q: after it.
    at = len(tree.nodes[k].prompts[i]) - 1 if target == "v" else len(path) - 1
    np.testing.assert_allclose(got[k][i, g], plain[b, at], rtol=1e-5, atol=1e-5)


def _value_batch(seed, rows=8, length=16):
  """Rows with a critic's value fields at each row's first trained token."""
  r = np.random.RandomState(seed)
  mask = np.zeros((rows, length), bool)
  for b in range(rows):
    mask[b, 4 + b % 3 : length - b % 2] = True
  batch = testing.rows_batch(
      {
          "tokens_BxL": r.randint(0, CFG.vocab_size, (rows, length)).astype(np.int32),
          "loss_mask_BxL": mask,
          "old_logp_BxL": (-5.0 + 0.3 * r.randn(rows, length)).astype(np.float32),
          "adv_B": r.randn(rows).astype(np.float32),
      }
  )
  k = batch.prev_BxK.shape[1]
  first = np.zeros((rows, k), bool)
  first[:, 0] = True
  return batch.replace(
      value_pos_BxK=np.where(first, batch.prev_BxK, 0).astype(np.int32),
      value_mask_BxK=first,
      value_target_BxK=np.where(first, r.randn(rows, k), 0).astype(np.float32),
      old_value_BxK=np.where(first, 0.3 * r.randn(rows, k), 0).astype(np.float32),
  )


def _reference(model, batch, loss_cfg, coef, clip):
  """loss = policy_loss + coef * mean over value slots of the clipped squared error / 2,
  from a plain causal forward, jax.grad and optax (no objective, no train step)."""
  graphdef, params = nnx.split(model, nnx.Param)
  b = jax.tree.map(jnp.asarray, batch)
  mask = b.loss_mask_BxK & (b.row_weight_B > 0)[:, None]
  vmask = b.value_mask_BxK

  def loss_fn(p):
    m = nnx.merge(graphdef, p)
    hidden = m.hidden(b.tokens_BxL)
    logp_BxL = losses.token_logprobs(m.project(hidden), b.tokens_BxL)
    logp = jnp.take_along_axis(logp_BxL, b.prev_BxK + 1, axis=1)
    pg, _ = losses.policy_loss(
        logp, b.old_logp_BxK, None, b.adv_BxK, mask, loss_cfg, action_ids=b.action_BxK
    )
    v = jnp.take_along_axis(
        jnp.einsum("bld,d->bl", hidden, m.value_head[...]), b.value_pos_BxK, axis=1
    )
    err = (v - b.value_target_BxK) ** 2
    clipped = b.old_value_BxK + jnp.clip(v - b.old_value_BxK, -clip, clip)
    err = jnp.maximum(err, (clipped - b.value_target_BxK) ** 2)
    return pg + coef * 0.5 * jnp.sum(jnp.where(vmask, err, 0)) / vmask.sum()

  @jax.jit  # one program for the whole reference
  def update(p):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    tx = make_optimizer(OPT)
    updates, _ = tx.update(grads, tx.init(p), p)
    return loss, optax.apply_updates(p, updates)

  loss, new = update(params)
  return float(loss), jax.tree.leaves(new)


LOSS_CFG = losses.LossConfig(algorithm="reinforce", aggregation="seq-mean-token-mean")


@pytest.fixture(scope="module")
def value_reference():
  """The batch and the reference's (loss, updated parameters) on `_model(1)`."""
  batch = _value_batch(3)
  return batch, _reference(_model(1), batch, LOSS_CFG, coef=0.5, clip=0.2)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_update_with_value_loss_equals_independent_reference(value_reference, microbatches):
  model = _model(1)
  batch, (want_loss, want_params) = value_reference
  assert has_values(batch)
  objective = PolicyObjective(LOSS_CFG, value_coef=0.5, value_clip=0.2)
  step = TrainStep(
      model, objective, OPT, step_cfg=dataclasses.replace(FAST, num_microbatches=microbatches)
  )
  state, m = step(step.init_state(model), None, batch)
  m = step.fetch_metrics(m)
  assert m["loss"] == pytest.approx(want_loss, rel=1e-5, abs=1e-6)
  assert m["value_loss"] > 0 and 0 < m["pg_loss"] + 1e3
  for got, want in zip(jax.tree.leaves(state.params), want_params):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


def test_value_head_loads_zero_and_is_never_exported(tmp_path):
  from mtrl_jax.models import loading

  plain = models.create_model(CFG.replace(value_head=False), seed=0)
  loading.save_pretrained(_model(), str(tmp_path / "with_head"))  # the head is dropped
  loading.save_pretrained(plain, str(tmp_path / "plain"))
  back = loading.from_pretrained(str(tmp_path / "with_head"), value_head=True)
  assert back.cfg.value_head and float(jnp.abs(back.value_head[...]).max()) == 0.0
  a = nnx.state(loading.from_pretrained(str(tmp_path / "with_head")), nnx.Param)
  assert "value_head" not in a


def test_value_slots_follow_every_agent_when_an_earlier_agent_has_none():
  # Agent 0 packs nothing: agent 2's value slots must still come after agent 1's actions.
  from mtrl_jax.rollout.tree_packing import Action, pack_actions

  def act(prompt, ids):
    n = len(ids)
    return Action(
        prompt=prompt,
        ids=np.asarray(ids, np.int32),
        logprobs=np.zeros(n, np.float32),
        trainable=np.ones(n, bool),
        advantage=0.0,
    )

  per_agent = [[], [act([5, 6], [7]), act([5, 6], [8, 9])], [act([4], [3, 2])]]
  batch, stats = pack_actions(per_agent, length=16, values="q")
  slots = stats["value_slots"]
  assert len(slots) == 3
  for (row, slot), a in zip(slots, [a for per in per_agent for a in per]):
    assert batch.target_BxK[row, slot] == a.ids[0]  # the action's first trained token
    assert batch.tokens_BxL[row, batch.value_pos_BxK[row, slot]] == a.ids[-1]  # Q: its last
