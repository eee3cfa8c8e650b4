"""Separate policies stacked on an agent axis: one program equals N single-agent updates."""

import dataclasses
import functools

import jax
import numpy as np
import pytest

from mtrl_jax import losses, models
from mtrl_jax.rollout.train_batch import from_rows, pad_batch, stack
from mtrl_jax.train import OptimConfig, StepConfig, TrainStep
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.stacked import StackedTrainStep, agent_slice

CFG = models.get_preset("tiny")
LOSS = losses.LossConfig(algorithm="grpo", kl_coef=0.05, aggregation="seq-mean-token-mean")
# eps 1e-4: see tests/train/test_train_step.py (keeps Adam from amplifying rounding).
OPT = OptimConfig(learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=1.0)
RATES = (1e-3, 3e-3)
FAST = (("xla_backend_optimization_level", 0),)
L = 16


def _batch(seed, rows):
  r = np.random.RandomState(seed)
  mask = np.zeros((rows, L), bool)
  for b in range(rows):
    mask[b, 3 + b % 3 : L - b % 2] = True
  return from_rows(
      r.randint(0, CFG.vocab_size, (rows, L)).astype(np.int32),
      mask,
      old_logp_BxL=(-2.0 + 0.3 * r.randn(rows, L)).astype(np.float32),
      adv=r.randn(rows).astype(np.float32),
      num_logits=L,
  )


def _models():
  return [models.create_model(CFG, seed=s) for s in (0, 1)]


def _stacked(batches):
  rows = max(b.tokens_BxL.shape[0] for b in batches)
  return stack([pad_batch(b, rows, L, L) for b in batches])


@functools.cache
def _stacked_step():
  """One StackedTrainStep of LOSS, shared by the tests that run it: the same batch shapes
  reuse its compiled program (the frozen-agent tests compare against it too)."""
  return StackedTrainStep(
      _models()[0], LOSS, OPT, RATES, step_cfg=StepConfig(compiler_options=FAST)
  )


def _run_stacked(batches, steps=2):
  st = _stacked_step()
  state = st.init_state(_models(), seed=0)
  ref = st.copy_params(state.params)
  stacked = _stacked(batches)
  for _ in range(steps):
    state, m = st(state, ref, stacked)
  return state, st.fetch_metrics(m), st


@pytest.mark.slow
def test_stacked_update_equals_independent_single_agent_updates():
  # Agent 1 has fewer rows: its batch is padded to agent 0's, which must not matter.
  batches = [_batch(0, 8), _batch(1, 6)]
  before = _stacked_step().num_compiles  # shared: count this test's own compiles
  state, metrics, st = _run_stacked(batches)
  assert st.num_compiles - before <= 1  # one program for both agents and both updates
  for a, model in enumerate(_models()):
    single = TrainStep(
        model,
        LOSS,
        dataclasses.replace(OPT, learning_rate=RATES[a]),
        step_cfg=StepConfig(compiler_options=FAST),
    )
    s = single.init_state(model, seed=0)
    ref = single.copy_params(s.params)
    for _ in range(2):
      s, m = single(s, ref, batches[a])
    m = single.fetch_metrics(m)
    ours = jax.tree.leaves(agent_slice(state.params, a))
    theirs = jax.tree.leaves(s.params)
    for x, y in zip(ours, theirs):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    for k in ("loss", "kl", "grad_norm", "learning_rate"):
      assert metrics[a][k] == pytest.approx(m[k], rel=1e-5, abs=1e-6), (a, k)
    assert metrics[a]["learning_rate"] == pytest.approx(RATES[a], rel=1e-6)


@pytest.mark.parametrize("changed", [1, 0])
def test_one_agents_tokens_never_change_the_others_update(changed):
  kept = 1 - changed
  base = [_batch(0, 8), _batch(1, 8)]
  other = list(base)
  other[changed] = _batch(7, 8).replace(adv_BxK=-base[changed].adv_BxK)
  s1, _, _ = _run_stacked(base, steps=1)
  s2, _, _ = _run_stacked(other, steps=1)
  for x, y in zip(
      jax.tree.leaves(agent_slice(s1.params, kept)), jax.tree.leaves(agent_slice(s2.params, kept))
  ):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))  # bit-identical
  assert any(
      not np.array_equal(np.asarray(x), np.asarray(y))
      for x, y in zip(
          jax.tree.leaves(agent_slice(s1.params, changed)),
          jax.tree.leaves(agent_slice(s2.params, changed)),
      )
  )


def test_stacked_step_refuses_bad_inputs():
  ms = _models()
  with pytest.raises(ValueError, match="learning_rates"):
    StackedTrainStep(ms[0], LOSS, OPT, (1e-3, -1.0))
  st = StackedTrainStep(ms[0], LOSS, OPT, RATES, step_cfg=StepConfig(compiler_options=FAST))
  state = st.init_state(ms)
  one_agent = jax.tree.map(lambda v: v[:1], _stacked([_batch(0, 8), _batch(1, 8)]))
  with pytest.raises(ValueError, match="2 agents"):
    st(state, st.copy_params(state.params), one_agent)


@pytest.mark.slow
def test_several_updates_per_batch_use_each_agents_own_old_logprobs():
  # rl.updates_per_step > 1 with separate policies: each agent's clipped ratio
  # reads its own trainer logprobs before the first update, as alone.
  objective = PolicyObjective(LOSS, recompute_old=True)
  batches = [_batch(0, 8), _batch(1, 6)]
  stacked = _stacked(batches)
  ms = _models()
  st = StackedTrainStep(ms[0], objective, OPT, RATES, step_cfg=StepConfig(compiler_options=FAST))
  st.precompile(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), stacked))
  assert st.num_compiles == 2  # the old-logprob forward and the update
  state = st.init_state(ms, seed=0)
  ref = st.copy_params(state.params)
  stacked = st.old_logprobs(state.params, stacked)
  for _ in range(3):
    state, m = st(state, ref, stacked)
  assert st.num_compiles == 2
  metrics = st.fetch_metrics(m)
  for a, model in enumerate(_models()):
    single = TrainStep(
        model,
        objective,
        dataclasses.replace(OPT, learning_rate=RATES[a]),
        step_cfg=StepConfig(compiler_options=FAST),
    )
    s = single.init_state(model, seed=0)
    r = single.copy_params(s.params)
    batch = single.old_logprobs(s.params, batches[a])
    rows = batches[a].tokens_BxL.shape[0]
    np.testing.assert_allclose(
        np.asarray(stacked.trainer_old_logp_BxK[a, :rows]),
        np.asarray(batch.trainer_old_logp_BxK),
        rtol=1e-6,
        atol=1e-6,
    )
    for _ in range(3):
      s, one = single(s, r, batch)
    one = single.fetch_metrics(one)
    for x, y in zip(jax.tree.leaves(agent_slice(state.params, a)), jax.tree.leaves(s.params)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
    for k in ("loss", "ratio_mean", "clip_frac"):
      assert metrics[a][k] == pytest.approx(one[k], rel=1e-5, abs=1e-6), (a, k)
    assert abs(metrics[a]["ratio_mean"] - 1.0) > 1e-5  # third update: the policy moved
