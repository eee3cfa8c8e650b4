"""Off-policy corrections in the train step.

With several updates per batch (`PolicyObjective(recompute_old=True)`) the
clipped ratio is taken against the trainer's own logprobs before the first
update (`TrainStep.old_logprobs`) and the sampler's logprobs enter only the
importance weights; with one update and a correction, pi_old is the current
policy. Each update's loss equals `policy_loss` evaluated on the same arrays.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import losses, testing
from mtrl_jax.train import OptimConfig, StepConfig, TrainStep
from mtrl_jax.train.objectives import PolicyObjective

B, L = 8, 16
FAST = (("xla_backend_optimization_level", 0),)
OPT = OptimConfig(learning_rate=3e-2, grad_clip_norm=1.0)


@functools.cache
def _batch():
  """Rows of the seed-0 model's own tokens with a sampler's logprobs, and the model's
  logprobs of them (numpy; the tests only read them)."""
  model = testing.tiny_model()
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, model.cfg.vocab_size, (B, L)).astype(np.int32)
  mask = np.zeros((B, L), bool)
  mask[:, 5:] = True
  logp = np.asarray(_logprobs(model, tokens))
  # A sampler that disagrees with the trainer: ratios far outside [1/2, 2] on some tokens.
  sampler = (logp + rng.normal(0, 0.8, (B, L))).astype(np.float32)
  return {
      "tokens_BxL": tokens,
      "loss_mask_BxL": mask,
      "old_logp_BxL": sampler,
      "adv_B": rng.randn(B).astype(np.float32),
      "row_weight_B": np.ones(B, np.float32),
  }, logp


@nnx.jit  # the references below run as one program each (op by op, every op compiles)
def _logprobs(model, tokens_BxL):
  return losses.token_logprobs(model(tokens_BxL), tokens_BxL)


@functools.partial(jax.jit, static_argnames="cfg")
def _policy_loss(params, arrays, old, cfg):
  graphdef = nnx.split(testing.tiny_model(), nnx.Param)[0]
  logp = losses.token_logprobs(
      nnx.merge(graphdef, params)(arrays["tokens_BxL"]), arrays["tokens_BxL"]
  )
  mask = arrays["loss_mask_BxL"] & (arrays["row_weight_B"] > 0)[:, None]
  return losses.policy_loss(
      logp,
      old,
      None,
      arrays["adv_B"],
      mask.at[:, 0].set(False),
      cfg,
      sampler_logp=arrays["old_logp_BxL"],
  )


def _direct_loss(params, batch, old, cfg):
  loss, m = _policy_loss(params, {k: jnp.asarray(v) for k, v in batch.items()}, old, cfg)
  return float(loss), m


@pytest.mark.slow
def test_updates_use_the_trainers_old_logprobs_and_correct_the_sampler_gap():
  cfg = losses.LossConfig("grpo", 0.2, 0.28, is_correction="tis", is_cap=2.0)
  model = testing.tiny_model()
  ts = TrainStep(
      model,
      PolicyObjective(cfg, recompute_old=True),
      OPT,
      step_cfg=StepConfig(compiler_options=FAST),
  )
  state = ts.init_state(model)
  rows, logp0 = _batch()
  batch = ts.old_logprobs(state.params, testing.rows_batch(rows))
  old = testing.dense_rows(batch, batch.trainer_old_logp_BxK)
  np.testing.assert_allclose(old[:, 5:], logp0[:, 5:], atol=2e-5)
  gap = np.abs(logp0 - rows["old_logp_BxL"])[:, 5:].mean()
  losses_seen = []
  for update in range(3):
    want, _ = _direct_loss(state.params, rows, old, cfg)
    state, m = ts(state, None, batch)
    m = ts.fetch_metrics(m)
    np.testing.assert_allclose(m["loss"], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["sampler_gap"], gap, rtol=1e-4)
    assert 0 < m["is_truncated_frac"] < 1 and m["is_masked_frac"] == 0
    if update == 0:
      assert abs(m["ratio_mean"] - 1.0) < 1e-5  # pi_old is the trainer itself
    else:
      assert abs(m["ratio_mean"] - 1.0) > 1e-4  # the policy moved; the ratio sees it
    losses_seen.append(m["loss"])
  assert len(set(losses_seen)) == 3


def test_one_update_with_masked_is_takes_the_current_policy_as_old():
  cfg = losses.LossConfig("grpo", 0.2, 0.28, is_correction="mis_token", is_cap=2.0)
  model = testing.tiny_model()
  ts = TrainStep(model, PolicyObjective(cfg), OPT, step_cfg=StepConfig(compiler_options=FAST))
  state = ts.init_state(model)
  rows, logp0 = _batch()
  want, direct = _direct_loss(state.params, rows, jnp.asarray(logp0), cfg)
  _, m = ts(state, None, testing.rows_batch(rows))
  m = ts.fetch_metrics(m)
  np.testing.assert_allclose(m["loss"], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(m["is_masked_frac"], float(direct["is_masked_frac"]), atol=1e-6)
  assert 0 < m["is_masked_frac"] < 1 and m["clip_frac"] == 0


def test_precompile_covers_the_old_logprobs_forward_and_the_step_that_reads_them():
  cfg = losses.LossConfig("grpo", 0.2, 0.28, is_correction="mis_action", is_cap=2.0)
  model = testing.tiny_model()
  ts = TrainStep(
      model,
      PolicyObjective(cfg, recompute_old=True),
      OPT,
      step_cfg=StepConfig(compiler_options=FAST),
  )
  batch = testing.rows_batch(_batch()[0])
  ts.precompile(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), batch))
  compiled = ts.num_compiles
  assert compiled == 2  # the forward and the update
  state = ts.init_state(model)
  batch = ts.old_logprobs(state.params, batch)
  state, m = ts(state, None, batch)
  assert ts.num_compiles == compiled
  assert np.isfinite(ts.fetch_metrics(m)["loss"])
