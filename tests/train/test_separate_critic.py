"""A critic model of its own: joint rows (MAAC's input) by hand, values equal plain per-row
forwards, the value-only update equals an independent reference, the config refusals, and
a centralized-critic run that checkpoints its critic and resumes exactly."""

import dataclasses
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from configs import coop as coop_config
from mtrl_jax import metrics as metrics_lib, models
from mtrl_jax.rollout import Tree, TreeConfig, joint_rows
from mtrl_jax.rollout.completion import Completion
from mtrl_jax.losses import LossConfig
from mtrl_jax.rollout.batching import BatchConfig, critic_values
from mtrl_jax.rollout.critic import CriticConfig, critic_advantages
from mtrl_jax.train import OptimConfig, StepConfig, TrainStep, make_optimizer
from mtrl_jax.run import critic_config, experiment, shapes
from mtrl_jax.train.compile import lower_values
from mtrl_jax.train.objectives import PolicyObjective, ValueObjective
from mtrl_jax.train.separate_critic import SeparateCritic
from mtrl_jax.run.shapes import ShapePlan

from tests.rollout.test_tree_packing import random_tree
from tests.train.test_separate_policies import run_on_one_device  # one CPU device

CFG = models.get_preset("tiny").replace(value_head=True)
FAST = StepConfig(compiler_options=(("xla_backend_optimization_level", 0),))
OPT = OptimConfig(learning_rate=1e-3, eps=1e-4, grad_clip_norm=0.0)


def _hand_tree():
  """One root, 2 agents, G = 2 (align), T = 2; joint action 1 of the root is an
  infrastructure fault, joint action 0 has a child."""
  tree = Tree(TreeConfig(num_turns=2, num_generations=2, num_agents=2, discount=0.9))
  root = tree.add_root([[1, 2], [3]])
  tree.set_completions(
      root,
      [
          [
              Completion(np.array([10, 11]), np.zeros(2, np.float32)),
              Completion(np.array([12]), np.zeros(1, np.float32)),
          ],
          [
              Completion(np.array([20]), np.zeros(1, np.float32)),
              Completion(np.array([21, 22, 23]), np.zeros(3, np.float32)),
          ],
      ],
  )
  tree.record(root, np.array([0.5, 1.0]), np.array([True, False]))
  child = tree.add_child(root, 0, [[1, 2, 10, 11, 7], [3, 20, 8]])
  tree.set_completions(
      child,
      [
          [
              Completion(np.array([30]), np.zeros(1, np.float32)),
              Completion(np.array([31]), np.zeros(1, np.float32)),
          ],
          [
              Completion(np.array([40]), np.zeros(1, np.float32)),
              Completion(np.array([41]), np.zeros(1, np.float32)),
          ],
      ],
  )
  tree.record(child, np.array([1.0, 0.0]), np.array([True, True]))
  return tree.finalize()


def test_joint_rows_concatenate_every_agents_context_by_hand():
  tree = _hand_tree()
  v = joint_rows.joint_rows(tree, "v")
  assert [(r.node, r.sample, r.tokens.tolist()) for r in v] == [
      (0, -1, [1, 2, 3]),
      (1, -1, [1, 2, 10, 11, 7, 3, 20, 8]),
  ]
  q = joint_rows.joint_rows(tree, "q")  # the root's joint action 1 is masked: no row
  assert [(r.node, r.sample, r.tokens.tolist()) for r in q] == [
      (0, 0, [1, 2, 10, 11, 3, 20]),
      (1, 0, [1, 2, 10, 11, 7, 30, 3, 20, 8, 40]),
      (1, 1, [1, 2, 10, 11, 7, 31, 3, 20, 8, 41]),
  ]
  # Targets per node [N, G]: a row's is the mean over its trained samples.
  targets = [np.array([[1.0, 9.0], [3.0, 9.0]]), np.array([[2.0, 4.0], [6.0, 8.0]])]
  np.testing.assert_allclose(joint_rows.row_targets(tree, q, targets), [2.0, 4.0, 6.0])
  np.testing.assert_allclose(joint_rows.row_targets(tree, v, targets), [2.0, 5.0])
  per_node = joint_rows.values_per_node(tree, q, [0.5, -1.0, 2.0])
  np.testing.assert_array_equal(per_node[0], [[0.5, 0.0], [0.5, 0.0]])
  np.testing.assert_array_equal(per_node[1], [[-1.0, 2.0], [-1.0, 2.0]])
  batch = joint_rows.rows_batch(
      q,
      pad_id=0,
      row_multiple=2,
      min_length=8,
      targets_R=[2.0, 4.0, 6.0],
      old_values_R=[0.5, -1.0, 2.0],
  )
  assert batch.tokens_BxL.shape == (4, 16) and batch.value_pos_BxK[:, 0].tolist() == [5, 9, 9, 0]
  assert batch.value_mask_BxK[:, 0].tolist() == [True, True, True, False]
  assert batch.row_weight_B.tolist() == [1.0, 1.0, 1.0, 0.0]
  with pytest.raises(ValueError, match="joint_mode='cross'"):
    cross = Tree(TreeConfig(num_turns=1, num_generations=2, num_agents=2, joint_mode="cross"))
    cross.finalized = True
    joint_rows.joint_rows(cross, "q")


def _model(seed=0):
  """A model whose value head is random (a fresh one is zero, which would hide errors)."""
  model = models.create_model(CFG, seed=seed)
  model.value_head[...] = jnp.asarray(np.random.RandomState(seed).randn(CFG.d_model), jnp.float32)
  return model


@nnx.jit
def _last_value(model, tokens_1xL):
  hidden = model.hidden(tokens_1xL)
  return jnp.dot(hidden[0, -1], model.value_head[...])


def _plain_value(model, tokens):
  """The value head at the last token of a plain causal forward of one unpadded row (one
  program per row length: run op by op, each op would compile for each length)."""
  return float(_last_value(model, jnp.asarray([tokens], jnp.int32)))


@pytest.mark.slow
@pytest.mark.parametrize("target", ["v", "q"])
def test_joint_values_equal_plain_forwards_of_each_joint_history(target):
  tree = random_tree(5, turns=2, gens=2, agents=2, mode="align")
  model = _model()
  step = TrainStep(model, ValueObjective(), OPT, step_cfg=FAST)
  params = nnx.state(model, nnx.Param)
  got, rows = joint_rows.joint_values(
      tree, target, lambda b: jax.device_get(step.values(params, b))
  )
  assert len(rows) >= 4  # 2 roots and their children
  for row in rows:
    want = _plain_value(model, row.tokens.tolist())
    g = slice(None) if row.sample < 0 else row.sample
    np.testing.assert_allclose(got[row.node][:, g], want, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_value_only_update_equals_an_independent_reference():
  model = _model(1)
  tree = random_tree(6, turns=2, gens=2, agents=2, mode="align", roots=1)
  rows = joint_rows.joint_rows(tree, "q")
  assert len(rows) >= 3
  r = np.random.RandomState(0)
  targets, old = r.randn(len(rows)), 0.3 * r.randn(len(rows))
  batch = joint_rows.rows_batch(rows, targets_R=targets, old_values_R=old)
  coef, clip = 0.6, 0.2
  graphdef, params = nnx.split(model, nnx.Param)

  def loss_fn(p):  # coef * mean over rows of the clipped squared error / 2, row by row
    m = nnx.merge(graphdef, p)
    total = 0.0
    for row, y, v_old in zip(rows, targets, old):
      hidden = m.hidden(jnp.asarray([row.tokens], jnp.int32))
      v = jnp.dot(hidden[0, -1], m.value_head[...])
      clipped = v_old + jnp.clip(v - v_old, -clip, clip)
      total += 0.5 * jnp.maximum((v - y) ** 2, (clipped - y) ** 2)
    return coef * total / len(rows)

  tx = make_optimizer(OPT)

  @jax.jit  # one program (op by op, each optax op would compile on its own)
  def reference(p):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    return loss, optax.apply_updates(p, tx.update(grads, tx.init(p), p)[0])

  want_loss, want = reference(params)
  step = TrainStep(model, ValueObjective(value_coef=coef, value_clip=clip), OPT, step_cfg=FAST)
  state, m = step(step.init_state(model), None, batch)
  m = step.fetch_metrics(m)
  np.testing.assert_allclose(m["loss"], want_loss, rtol=1e-5)
  assert m["value_slots"] == len(rows) and m["empty_batch"] == 0.0
  # Row by row vs one padded batch: float32 sums in another order; atol is 1% of lr.
  for got_leaf, want_leaf in zip(jax.tree.leaves(state.params), jax.tree.leaves(want)):
    np.testing.assert_allclose(got_leaf, want_leaf, rtol=1e-4, atol=1e-5)
  # No value slot: nothing changes.
  empty = batch.replace(value_mask_BxK=np.zeros_like(batch.value_mask_BxK))
  before = jax.device_get(state.params)
  state, m = step(state, None, empty)
  assert step.fetch_metrics(m)["empty_batch"] == 1.0
  for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "changes,field",
    [
        ({"critic.kind": "centralized", "critic.model": "head"}, "critic.model"),
        ({"critic.kind": "centralized", "tree.num_agents": 1}, "tree.num_agents"),
        (
            {"critic.kind": "centralized", "critic.target": "q", "tree.joint_mode": "cross"},
            "tree.joint_mode",
        ),
        ({"critic.kind": "centralized", "agents.team_weight": 0.5}, "agents.team_weight"),
        ({"critic.model": "critic"}, "critic.model"),
        ({"critic.learning_rate": 0.0}, "critic.learning_rate"),
        ({"critic.preset": "tiny", "critic.path": "/x"}, "critic.preset"),
        ({"critic.preset": "huge"}, "critic.preset"),
        ({"critic.model": "head", "critic.preset": "tiny"}, "critic.model"),
    ],
)
def test_bad_separate_critic_configs_are_refused_in_one_line(changes, field):
  c = coop_config.get_config("smoke=True")
  c.critic.kind, c.critic.model = "independent", "separate"
  for key, value in changes.items():
    group, name = key.split(".")
    c[group][name] = value
  with pytest.raises(experiment.ConfigError) as err:
    experiment.validate(c)
  msg = str(err.value)
  assert "\n" not in msg and field in msg, msg


def _config(steps):
  c = coop_config.get_config("smoke=True")
  c.critic.kind, c.critic.model, c.critic.target = "centralized", "separate", "q"
  c.critic.learning_rate = 1e-2
  # Penalties make returns differ from the zero-initialised values: the critic learns.
  c.reward.step_penalty, c.reward.tool_penalty = -0.05, -0.1
  c.rl.steps, c.checkpoint.every = steps, 1
  c.sft.steps = 0  # the warm-up is not what this run checks (its own programs, its own time)
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


@pytest.mark.slow
def test_centralized_critic_run_learns_and_resumes_exactly(tmp_path):
  full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
  job = {"config": ["tests.train.test_separate_critic", "_config", [2]], "workdir": full}
  # The run as it stood after step 1 (its step-1 checkpoint is what a run stopped there
  # saves), continued to step 2 (`resume_of`), equals the uninterrupted run.
  run_on_one_device([job, dict(job, workdir=resumed, resume_of=[full, 1])])
  rows = _rows(full)
  last = rows[-1]
  assert last["critic/value_slots"] > 0 and last["critic/value_loss"] > 0
  assert last["critic/grad_norm"] > 0 and last["critic/value_mean"] != 0.0  # it moved
  assert "train/value_loss" not in last  # the policy's update has no value term
  bound = tuple(metrics_lib.RUN_BOUND_PREFIXES)
  got, want = _rows(resumed)[-1], rows[-1]
  assert got["step"] == want["step"] == 2
  keys = [k for k in want if not k.startswith(bound)]
  assert [k for k in keys if k.startswith("critic/")]
  assert {k: got.get(k) for k in keys} == {k: want[k] for k in keys}


def test_precompiled_critic_programs_are_the_ones_a_rollout_uses():
  """docs/design.md invariant 5: an independent separate critic's value pass and update
  compile before step 1 (`shapes.precompile` with the critic, two programs at a time) for the
  buckets its batches take, and a head's value pass too (`compile.lower_values`):
  running them compiles nothing."""
  tree = random_tree(7, turns=2, gens=2, agents=2, mode="align")
  bcfg = BatchConfig(packing="rows", length_buckets=(64,), row_buckets=(32, 64))
  plan = ShapePlan(
      engine=None, samplings=(), fanout=2, train_rows=(32, 64), train_lens=(64,), packing="rows"
  )
  exp = types.SimpleNamespace(
      critic=critic_config.CriticGroup(kind="independent", model="separate"),
      optim=OPT,
      rl=types.SimpleNamespace(updates_per_step=1),
      step=FAST,
      seed=0,
  )
  critic = SeparateCritic(exp, _model(), None, bcfg)
  assert shapes.precompile(plan, [], [], train_threads=2, critic=critic)["train_programs"] == 4
  compiled = critic.step.num_compiles
  state = critic.init_state()
  values, rows = critic.values(state.params, tree)
  _, targets = critic_advantages(tree, values, CriticConfig())
  state, m = critic.update(state, critic.batch(tree, values, targets, rows))
  assert m["critic/value_slots"] > 0 and critic.step.num_compiles == compiled
  # A value head's pass on the policy's step.
  model = _model()
  step = TrainStep(model, PolicyObjective(LossConfig(), value_coef=0.5), OPT, step_cfg=FAST)
  for spec in dataclasses.replace(plan, values=True).train_specs():
    lower_values(step, spec, step.rules).compile()
  compiled, params = step.num_compiles, step.init_state(model).params
  got = critic_values(
      tree,
      dataclasses.replace(bcfg, values="v"),
      lambda b: jax.device_get(step.values(params, b)),
      per_agent=False,
  )
  assert any(np.any(v != 0) for v in got) and step.num_compiles == compiled
