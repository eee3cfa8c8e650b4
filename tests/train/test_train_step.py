"""Train step: sharded == single device, micro-batches == full batch, skips, compiles."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from mtrl_jax import losses, models, sharding, testing
from mtrl_jax.train import NonFiniteError, OptimConfig, StepConfig, TrainStep, make_optimizer

CFG = models.get_preset("tiny")
LOSS = losses.LossConfig(algorithm="grpo", kl_coef=0.05, aggregation="seq-mean-token-mean")
# Adam's first update is lr * g / (|g| + eps): for tiny |g| it multiplies the
# gradient's float32 reduction-order noise (~5e-9 here) by up to lr / eps.
# eps = 1e-4 keeps that factor at 10, so updated parameters are compared at
# 1e-6 / 1e-5 on what the step computes, not on amplified rounding.
OPT = OptimConfig(learning_rate=1e-3, eps=1e-4, weight_decay=0.01, grad_clip_norm=1.0)
B, L = 8, 16
# LLVM -O0 halves the CPU compile time of each step; the program is the same.
FAST = (("xla_backend_optimization_level", 0),)


@functools.cache
def _sampler_logp(seed):
  """Logprobs of the seed-0 policy on the batch's tokens (what a sampler reports)."""
  tokens = np.random.RandomState(seed).randint(0, CFG.vocab_size, (B, L)).astype(np.int32)
  graphdef, params = nnx.split(testing.tiny_model(), nnx.Param)
  fwd = jax.jit(
      lambda p, t: losses.token_logprobs(nnx.merge(graphdef, p)(t), t), compiler_options=dict(FAST)
  )
  return tokens, np.asarray(fwd(params, tokens))


def make_rows(seed=0):
  # old_logp = the policy's own logprobs plus noise, as after a few updates:
  # ratios near 1 (some clipped). Unrelated old_logp would make ratios of
  # e^±15 that turn the gradient into float32 rounding noise.
  tokens, logp = _sampler_logp(seed)
  tokens = tokens.copy()
  r = np.random.RandomState(seed + 1)
  mask = np.zeros((B, L), bool)
  for b in range(B):
    mask[b, 4 + b % 3 : L - b % 2] = True
  row_weight = np.ones(B, np.float32)
  row_weight[-1] = 0.0  # a padding row whose loss_mask is (wrongly) on: must not count
  return {
      "tokens_BxL": tokens,
      "loss_mask_BxL": mask,
      "old_logp_BxL": (logp + 0.15 * r.randn(B, L)).astype(np.float32),
      "adv_B": r.randn(B).astype(np.float32),
      "row_weight_B": row_weight,
      "node_B": np.arange(B, dtype=np.int32),
  }


def make_batch(seed=0):
  """`make_rows` as the step's `TrainBatch` (each row one causal path)."""
  return testing.rows_batch(make_rows(seed))


def _mesh(shape):
  return sharding.make_mesh(shape, devices=jax.devices()[: int(np.prod(shape))])


@functools.cache
def _trainer(shape, num_microbatches):
  model = testing.tiny_model()
  step_cfg = StepConfig(num_microbatches=num_microbatches, compiler_options=FAST)
  return model, TrainStep(model, LOSS, OPT, _mesh(shape), step_cfg)


@functools.cache
def _run(shape, num_microbatches):
  """One step from the seed-0 model: (host metrics, new params as numpy arrays)."""
  model, ts = _trainer(shape, num_microbatches)
  state = ts.init_state(model)
  ref = ts.copy_params(state.params)
  state, metrics = ts(state, ref, make_batch())
  split = 0
  for leaf, want in zip(jax.tree.leaves(state.params), jax.tree.leaves(ts.param_shardings)):
    assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    split += not leaf.sharding.is_fully_replicated
  # FSDP / tensor axes really split the weights (data parallelism alone replicates them).
  assert (split > 0) == (shape[1] * shape[2] > 1)
  return ts.fetch_metrics(metrics), [np.asarray(x) for x in jax.tree.leaves(state.params)]


def _reference_step():
  """Independent single-device reference: policy_loss + jax.grad + optax."""
  graphdef, params = nnx.split(testing.tiny_model(), nnx.Param)
  b = {k: jnp.asarray(v) for k, v in make_rows().items()}
  mask = b["loss_mask_BxL"] & (b["row_weight_B"] > 0)[:, None]
  tx = make_optimizer(OPT)

  def logp_of(p):
    return losses.token_logprobs(nnx.merge(graphdef, p)(b["tokens_BxL"]), b["tokens_BxL"])

  def step(p):
    ref_logp = logp_of(p)  # the reference is the initial policy
    loss_fn = lambda q: losses.policy_loss(
        logp_of(q), b["old_logp_BxL"], ref_logp, b["adv_B"], mask, LOSS
    )
    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(p)
    updates, _ = tx.update(grads, tx.init(p), p)
    return loss, optax.tree.norm(grads), metrics, optax.apply_updates(p, updates)

  loss, gnorm, metrics, new = jax.jit(step, compiler_options=dict(FAST))(params)
  return float(loss), float(gnorm), metrics, [np.asarray(x) for x in jax.tree.leaves(new)]


def test_single_device_step_matches_independent_reference():
  metrics, params = _run((1, 1, 1), 1)
  loss, gnorm, ref_metrics, ref_params = _reference_step()
  np.testing.assert_allclose(metrics["loss"], loss, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(metrics["grad_norm"], gnorm, rtol=1e-5)
  np.testing.assert_allclose(metrics["kl"], float(ref_metrics["kl"]), atol=1e-7)
  assert metrics["rows"] == B - 1  # the padding row is folded out of the mask
  assert 0 < metrics["clip_frac"] < 0.5
  assert metrics["skipped"] == 0 and metrics["learning_rate"] == pytest.approx(1e-3)
  for got, want in zip(params, ref_params):
    np.testing.assert_allclose(got, want, atol=1e-6)


@pytest.mark.several_devices
# Pure data parallelism (every run's default mesh), and all three axes at once.
@pytest.mark.parametrize("shape", [(8, 1, 1), (2, 2, 2)])
def test_sharded_step_matches_single_device(shape):
  single, single_params = _run((1, 1, 1), 1)
  metrics, params = _run(shape, 1)
  for key in ("loss", "grad_norm", "kl", "clip_frac", "entropy"):
    np.testing.assert_allclose(metrics[key], single[key], atol=1e-5, rtol=1e-5, err_msg=key)
  for got, want in zip(params, single_params):
    np.testing.assert_allclose(got, want, atol=1e-5)


@pytest.mark.several_devices
# (2, 2, 2) with 2 micro-batches: each micro-batch is split over the 4 batch shards.
@pytest.mark.parametrize("shape,num_microbatches", [((2, 2, 2), 2)])
def test_microbatch_accumulation_equals_full_batch(shape, num_microbatches):
  full, full_params = _run(shape, 1)
  acc, acc_params = _run(shape, num_microbatches)
  for key in ("loss", "grad_norm", "kl", "clip_frac", "tokens", "rows", "adv_min", "adv_max"):
    np.testing.assert_allclose(acc[key], full[key], atol=1e-6, rtol=1e-6, err_msg=key)
  # One token's ratio exp(logp - old_logp): a [4, L] and an [8, L] forward
  # agree on logp (|logp| up to ~20) to a few float32 ulps, ~2e-6 each.
  np.testing.assert_allclose(acc["ratio_min"], full["ratio_min"], rtol=1e-5)
  np.testing.assert_allclose(acc["ratio_max"], full["ratio_max"], rtol=1e-5)
  for got, want in zip(acc_params, full_params):
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_chunked_logprobs_and_remat_match_the_plain_step():
  """Vocabulary-chunked logprobs (64 does not divide V=300) + remat: same update."""
  plain, plain_params = _run((1, 1, 1), 1)
  model = models.create_model(CFG.replace(remat=True), seed=0)
  ts = TrainStep(
      model, LOSS, OPT, _mesh((1, 1, 1)), StepConfig(logprob_chunk_size=64, compiler_options=FAST)
  )
  state = ts.init_state(model)
  state, metrics = ts(state, ts.copy_params(state.params), make_batch())
  m = ts.fetch_metrics(metrics)
  assert "entropy" not in m  # needs the full logits, which chunking never builds
  for key in ("loss", "kl", "clip_frac"):
    np.testing.assert_allclose(m[key], plain[key], rtol=1e-6, atol=1e-7, err_msg=key)
  np.testing.assert_allclose(m["grad_norm"], plain["grad_norm"], rtol=1e-5)
  for got, want in zip(jax.tree.leaves(state.params), plain_params):
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-6)


def test_loss_decreases_without_recompiling():
  model, ts = _trainer((1, 1, 1), 1)
  _run((1, 1, 1), 1)  # make sure the step is compiled for this shape
  compiles = ts.num_compiles
  state = ts.init_state(model)
  ref = ts.copy_params(state.params)
  batch = make_batch()
  seen = []
  for _ in range(6):
    state, metrics = ts(state, ref, batch)
    seen.append(ts.fetch_metrics(metrics)["pg_loss"])
  assert ts.num_compiles == compiles == 1
  assert seen[-1] < seen[0] - 0.05, seen
  assert int(state.step) == 6


def test_nonfinite_batch_skips_update_and_is_counted():
  model, ts = _trainer((1, 1, 1), 1)
  state = ts.init_state(model)
  ref = ts.copy_params(state.params)
  before = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
  bad = make_rows()
  bad["old_logp_BxL"][2, 10] = np.nan  # a trainable position
  state, metrics = ts(state, ref, testing.rows_batch(bad))
  m = ts.fetch_metrics(metrics)  # 'skip' does not raise
  assert m["skipped"] == 1 and m["num_skipped"] == 1 and not np.isfinite(m["loss"])
  after = [np.asarray(x) for x in jax.tree.leaves((state.params, state.opt_state))]
  for x, y in zip(before, after):
    np.testing.assert_array_equal(x, y)
  assert int(state.step) == 1 and int(state.num_skipped) == 1
  state, metrics = ts(state, ref, make_batch())  # training goes on
  m = ts.fetch_metrics(metrics)
  assert m["skipped"] == 0 and m["num_skipped"] == 1
  assert ts.num_compiles == 1


def test_halt_raises_on_fetch_after_lr_blowup():
  mesh = _mesh((1, 1, 1))
  model = models.create_model(CFG.replace(num_layers=1), seed=0, mesh=mesh)
  huge = OptimConfig(learning_rate=1e30, grad_clip_norm=0.0)
  ts = TrainStep(
      model, losses.LossConfig(), huge, mesh, StepConfig(nonfinite="halt", compiler_options=FAST)
  )
  state = ts.init_state(model)
  state, metrics = ts(state, None, make_batch())
  assert ts.fetch_metrics(metrics)["skipped"] == 0  # finite, but weights are now ~1e30
  exploded = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  state, metrics = ts(state, None, make_batch())
  with pytest.raises(NonFiniteError, match="nonfinite='halt'"):
    ts.fetch_metrics(metrics)
  for x, y in zip(exploded, jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(x, np.asarray(y))


def test_padding_rows_and_empty_batches_change_nothing():
  model, ts = _trainer((1, 1, 1), 1)
  base, _ = _run((1, 1, 1), 1)
  state = ts.init_state(model)
  ref = ts.copy_params(state.params)
  batch = make_batch()
  batch.tokens_BxL[-1] = 7  # the row_weight-0 row
  batch.old_logp_BxK[-1] = 1e4
  batch.adv_BxK[-1] = 1e6
  batch.loss_mask_BxK[-1] = True  # (wrongly) on: row_weight 0 must still drop it
  state, metrics = ts(state, ref, batch)
  m = ts.fetch_metrics(metrics)
  assert m["loss"] == base["loss"] and m["grad_norm"] == base["grad_norm"]

  state = ts.init_state(model)
  before = [np.asarray(x) for x in jax.tree.leaves(state.params)]
  empty = make_batch()
  empty.row_weight_B[:] = 0.0
  state, metrics = ts(state, ref, empty)
  m = ts.fetch_metrics(metrics)
  assert m["empty_batch"] == 1 and m["skipped"] == 0 and m["loss"] == 0
  for x, y in zip(before, jax.tree.leaves(state.params)):
    np.testing.assert_array_equal(x, np.asarray(y))
  assert ts.num_compiles == 1


def test_bad_inputs_raise_clear_errors():
  with pytest.raises(ValueError, match="nonfinite"):
    StepConfig(nonfinite="ignore")
  with pytest.raises(ValueError, match="num_microbatches"):
    StepConfig(num_microbatches=0)
  model, ts = _trainer((1, 1, 1), 4)
  state = ts.init_state(model)
  batch = make_batch()
  with pytest.raises(ValueError, match="num_microbatches=4"):
    ts(state, state.params, jax.tree.map(lambda v: v[:6], batch))
  with pytest.raises(TypeError, match="allowed: rollout.train_batch.TrainBatch"):
    ts(state, state.params, make_rows())
  with pytest.raises(ValueError, match="ref_params is None"):
    ts(state, None, make_batch())
  bad = make_batch()
  bad.tokens_BxL[0, 3] = CFG.vocab_size
  with pytest.raises(ValueError, match="vocab_size=300"):
    ts(state, state.params, bad)


@pytest.mark.parametrize(
    "shape", [(1, 1, 1), pytest.param((2, 2, 2), marks=pytest.mark.several_devices)]
)
def test_precompiled_shapes_run_without_compiling(shape):
  from mtrl_jax.metrics import CompileCensus
  from mtrl_jax.rollout.train_batch import batch_spec

  model = testing.tiny_model()
  ts = TrainStep(model, LOSS, OPT, _mesh(shape), StepConfig(compiler_options=FAST))
  ts.precompile(batch_spec(B, L, L))
  assert ts.num_compiles == 1
  state = ts.init_state(model)
  ref = ts.copy_params(state.params)
  batch = make_batch()  # (its logprobs come from a jitted forward: compile it first)
  assert batch.shape == (B, L, L)
  census = CompileCensus()
  census.register("train_step", ts)
  state, metrics = ts(state, ref, batch)
  jax.block_until_ready(metrics)
  assert census.counts() == {"compiles/train_step": 1, "compiles/backend_total": 0}
  assert np.isfinite(ts.fetch_metrics(metrics)["loss"])


def test_bfloat16_params_keep_dtype_and_float32_moments_without_recompiling():
  cfg = models.get_preset("tiny", param_dtype="bfloat16", dtype="bfloat16")
  model = models.create_model(cfg, seed=0)
  ts = TrainStep(model, LOSS, OPT, step_cfg=StepConfig(compiler_options=FAST))
  state = ts.init_state(model)
  ref = ts.copy_params(state.params)
  tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (B, L)).astype(np.int32)
  batch = testing.rows_batch({**make_rows(), "tokens_BxL": tokens})
  for _ in range(2):
    state, metrics = ts(state, ref, batch)
  assert np.isfinite(ts.fetch_metrics(metrics)["loss"])
  assert ts.num_compiles == 1
  assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype(jnp.bfloat16)}
  moments = [x for x in jax.tree.leaves(state.opt_state) if x.ndim >= 1]
  assert moments and all(x.dtype == jnp.float32 for x in moments)


@pytest.mark.slow
def test_policy_objective_at_the_sampler_temperature_is_on_policy():
  # Sampled at temperature 1.7, the sampler reports log q = log softmax(z / 1.7).
  # An objective at the same temperature recomputes exactly those logprobs:
  # no gap, every ratio 1, nothing clipped. At temperature 1 the step scores
  # the untempered model instead and the gap is the temperature's effect.
  from mtrl_jax.sampling import DecodeEngine, EngineConfig, Request, SamplingConfig
  from mtrl_jax.train import PolicyObjective

  tau, g, n_new = 1.7, 2, L - 4
  model = testing.tiny_model()
  prompts = np.random.RandomState(3).randint(1, CFG.vocab_size, (B // g, 4)).tolist()
  engine = DecodeEngine(CFG, EngineConfig(slots=B, capacity=2 * L))
  engine.start(
      nnx.state(model), SamplingConfig(temperature=tau, max_new_tokens=n_new), [], 0, fanout=g
  )
  key = np.asarray(jax.random.key_data(jax.random.key(0)), np.uint32)
  for p, prompt in enumerate(prompts):
    engine.submit(Request(p, prompt, key, [p * g, p * g + 1]))
  samples, busy = [], True
  while busy:
    out, busy = engine.step()
    samples += out
  samples.sort(key=lambda s: (s.tag, s.index))  # row p * g + k
  tokens = np.concatenate(
      [np.repeat(np.asarray(prompts), g, 0), np.stack([s.ids for s in samples])], 1
  )
  mask = np.zeros((B, L), bool)
  mask[:, 4:] = True
  old_logp = np.zeros((B, L), np.float32)
  old_logp[:, 4:] = np.stack([s.logprobs for s in samples])
  batch = testing.rows_batch(
      {
          "tokens_BxL": tokens.astype(np.int32),
          "loss_mask_BxL": mask,
          "old_logp_BxL": old_logp,
          "adv_B": np.random.RandomState(4).randn(B).astype(np.float32),
      }
  )
  gaps = {}
  for temperature in (tau, 1.0):
    ts = TrainStep(
        model,
        PolicyObjective(LOSS, temperature=temperature),
        OPT,
        step_cfg=StepConfig(compiler_options=FAST),
    )
    state = ts.init_state(model)
    _, metrics = ts(state, ts.copy_params(state.params), batch)
    m = ts.fetch_metrics(metrics)
    gaps[temperature] = m["logp_gap"], m["clip_frac"]
    assert m["kl"] == pytest.approx(0.0, abs=1e-6)  # the reference is tempered alike
  assert gaps[tau][0] < 1e-5 and gaps[tau][1] == 0
  # Measured 0.21 and 5% clipped: tempering moves the tiny init's distribution a lot.
  assert gaps[1.0][0] > 0.1 and gaps[1.0][1] > 0, gaps
  with pytest.raises(ValueError, match="temperature"):
    PolicyObjective(LOSS, temperature=0.0)
