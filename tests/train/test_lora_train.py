"""Training low-rank adapters over a frozen base (`model.lora`): only the adapters move
and carry AdamW state, the KL reference is the base with the adapters off, and N agents'
adapters stacked over one base update as N independent single-agent steps."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import losses, models, testing
from mtrl_jax.models import lora
from mtrl_jax.models.config import LoraConfig
from mtrl_jax.train import OptimConfig, StepConfig, TrainStep
from mtrl_jax.run import defaults, experiment
from mtrl_jax.train.sft import SFTObjective
from mtrl_jax.rollout.train_batch import stack
from mtrl_jax.train.stacked import StackedTrainStep, agent_slice

CFG = models.get_preset("tiny")
LORA = LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "o", "up", "down"))
LOSS = losses.LossConfig(algorithm="grpo", kl_coef=0.1, aggregation="seq-mean-token-mean")
OPT = OptimConfig(learning_rate=1e-2, eps=1e-4, weight_decay=0.1, grad_clip_norm=0.5)
FAST = StepConfig(compiler_options=(("xla_backend_optimization_level", 0),))
L = 12


def _rows(seed, rows=4):
  r = np.random.RandomState(seed)
  mask = np.zeros((rows, L), bool)
  for b in range(rows):
    mask[b, 2 + b % 3 : L - b % 2] = True
  return {
      "tokens_BxL": r.randint(0, CFG.vocab_size, (rows, L)).astype(np.int32),
      "loss_mask_BxL": mask,
      "old_logp_BxL": (-5.0 + 0.3 * r.randn(rows, L)).astype(np.float32),
      "adv_B": r.randn(rows).astype(np.float32),
      "row_weight_B": np.ones(rows, np.float32),
  }


def _batch(seed, rows=4):
  return testing.rows_batch(_rows(seed, rows))


def _adapted(seed=0, adapter_seed=1):
  """An adapted model of a fixed base whose adapters are non-zero (trained-looking)."""
  model = lora.attach(models.create_model(CFG, seed=seed), LORA, seed=seed)
  graphdef, adapters, base = lora.split(model)
  leaves, treedef = jax.tree.flatten(adapters)
  keys = jax.random.split(jax.random.key(adapter_seed), len(leaves))
  adapters = jax.tree.unflatten(
      treedef, [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  )
  return nnx.merge(graphdef, adapters, base)


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow
def test_a_lora_step_moves_only_the_adapters_as_a_plain_jax_adamw_reference():
  model = _adapted()
  step = TrainStep(model, SFTObjective(), OPT, step_cfg=FAST)
  state = step.init_state(model)
  graphdef, a0, base = lora.split(model)
  base_before = _leaves(step.base)
  # AdamW's state covers the adapters alone: mu and nu are shaped like them.
  n_adapter = sum(x.size for x in jax.tree.leaves(a0))
  n_opt = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim)
  assert n_opt == 2 * n_adapter < sum(x.size for x in jax.tree.leaves(base))
  batch = _rows(0)
  state, m = step(state, None, testing.rows_batch(batch))

  # Reference: the adapted forward, token-mean NLL, global-norm clip, one AdamW step.
  def nll(adapters):
    logits = nnx.merge(graphdef, adapters, base)(batch["tokens_BxL"])
    logp = losses.token_logprobs(logits, batch["tokens_BxL"])
    mask = batch["loss_mask_BxL"] & (np.arange(L) > 0)
    return -jnp.sum(jnp.where(mask, logp, 0.0)) / mask.sum()

  loss, g = jax.jit(jax.value_and_grad(nll))(a0)
  g = [np.asarray(x, np.float64) for x in jax.tree.leaves(g)]
  norm = np.sqrt(sum(np.sum(x * x) for x in g))
  clip = min(1.0, OPT.grad_clip_norm / norm)
  want = []
  for p, gi in zip(_leaves(a0), g):
    gi = gi * clip
    m_hat, v_hat = gi, gi * gi  # first step: bias-corrected moments are g and g^2
    upd = m_hat / (np.sqrt(v_hat) + OPT.eps) + OPT.weight_decay * p
    want.append(p - OPT.learning_rate * upd)
  np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-5)
  np.testing.assert_allclose(float(m["grad_norm"]), norm, rtol=1e-4)
  for got, w in zip(_leaves(state.params), want):
    np.testing.assert_allclose(got, w, atol=2e-5, rtol=1e-4)
  for got, w in zip(_leaves(step.base), base_before):
    np.testing.assert_array_equal(got, w)


def test_kl_against_the_adapters_off_base_equals_kl_against_an_explicit_base_copy():
  model = _adapted()
  step = TrainStep(model, LOSS, OPT, step_cfg=FAST)
  state = step.init_state(model)
  batch = _batch(1)
  # The same policy with merged weights, trained in full against a copy of the base.
  merged = step.merged(state.params)
  plain = nnx.merge(lora.base_graphdef(CFG), merged)
  full = TrainStep(plain, LOSS, OPT, step_cfg=FAST)
  full_state = full.init_state(plain)
  base_copy = full.copy_params(step.base)
  _, m_lora = step(state, None, batch)
  _, m_full = full(full_state, base_copy, batch)
  m_lora, m_full = step.fetch_metrics(m_lora), full.fetch_metrics(m_full)
  assert m_full["kl"] > 1e-4  # the adapters moved the policy away from the base
  for k in ("kl", "loss", "pg_loss"):
    np.testing.assert_allclose(m_lora[k], m_full[k], rtol=1e-4, atol=1e-6)


def test_stacked_lora_update_equals_independent_updates_and_agents_never_mix():
  models_ = [_adapted(adapter_seed=1), _adapted(adapter_seed=2)]  # one base, two adapter sets
  rates = (1e-2, 3e-2)
  st = StackedTrainStep(models_[0], LOSS, OPT, rates, step_cfg=FAST)
  batches = [_batch(2), _batch(3)]
  stacked = stack(batches)
  state, m = st(st.init_state(models_), None, stacked)
  assert st.num_compiles == 1

  for a in range(2):
    one = TrainStep(
        models_[a],
        LOSS,
        OPT.__class__(**{**OPT.__dict__, "learning_rate": rates[a]}),
        step_cfg=FAST,
    )
    s1, m1 = one(one.init_state(models_[a]), None, batches[a])
    for got, want in zip(_leaves(agent_slice(state.params, a)), _leaves(s1.params)):
      np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)
    np.testing.assert_allclose(float(m["loss"][a]), float(m1["loss"]), rtol=1e-5)

  # Agent 1's batch changes: agent 0's new adapters do not move by one bit.
  other = stacked.replace(
      adv_BxK=stacked.adv_BxK.copy(),
      tokens_BxL=stacked.tokens_BxL.copy(),
      target_BxK=stacked.target_BxK.copy(),
  )
  other.adv_BxK[1] *= -3.0
  other.target_BxK[1] = (other.target_BxK[1] + 7) % CFG.vocab_size
  other.tokens_BxL[1] = (other.tokens_BxL[1] + 7) % CFG.vocab_size
  state2, _ = st(st.init_state(models_), None, other)
  for x, y in zip(_leaves(agent_slice(state.params, 0)), _leaves(agent_slice(state2.params, 0))):
    np.testing.assert_array_equal(x, y)
  assert any(
      not np.array_equal(x, y)
      for x, y in zip(_leaves(agent_slice(state.params, 1)), _leaves(agent_slice(state2.params, 1)))
  )


@pytest.mark.parametrize(
    "key, value, field",
    [
        ("rank", -1, "model.lora.rank"),
        ("alpha", 0.0, "model.lora.alpha"),
        ("targets", ("q", "embed"), "model.lora.targets"),
        ("rnk", 3, "model.lora"),
    ],
)
def test_a_bad_lora_group_is_refused_in_one_line_before_anything_is_built(key, value, field):
  c = defaults.base_config()
  c.model.lora[key] = value
  with pytest.raises(experiment.ConfigError) as e:
    experiment.validate(c)
  msg = str(e.value)
  assert field in msg and "allowed" in msg and "\n" not in msg
