"""Optimizer: config validation, schedules, AdamW + clipping against a numpy float64 reference."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtrl_jax.train import OptimConfig, make_optimizer, make_schedule


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("schedule", "linear", "schedule='linear'; allowed: \\['constant', 'cosine'\\]"),
        ("learning_rate", 0.0, "learning_rate=0.0"),
        ("learning_rate", float("nan"), "learning_rate=nan"),
        ("warmup_steps", -1, "warmup_steps=-1"),
        ("total_steps", 0, "total_steps=0"),
        ("weight_decay", -0.1, "weight_decay"),
        ("b2", 1.0, "b2=1.0"),
        ("eps", 0.0, "eps=0.0"),
        ("grad_clip_norm", -1.0, "grad_clip_norm"),
    ],
)
def test_config_rejects_bad_values(field, value, match):
  with pytest.raises(ValueError, match=match):
    OptimConfig(**{field: value})


def test_cosine_needs_warmup_below_total():
  with pytest.raises(ValueError, match="warmup_steps=10"):
    OptimConfig(schedule="cosine", warmup_steps=10, total_steps=10)


def test_schedules():
  const = make_schedule(OptimConfig(learning_rate=0.1, warmup_steps=4))
  np.testing.assert_allclose(
      [float(const(s)) for s in (0, 2, 4, 100)], [0, 0.05, 0.1, 0.1], rtol=1e-6
  )
  cos = make_schedule(
      OptimConfig(learning_rate=0.1, warmup_steps=10, total_steps=110, schedule="cosine")
  )
  # Halfway through the 100 decay steps: 0.1 * (1 + cos(pi / 2)) / 2 = 0.05.
  np.testing.assert_allclose(
      [float(cos(s)) for s in (5, 10, 60, 110)], [0.05, 0.1, 0.05, 0.0], atol=1e-7
  )
  assert float(make_schedule(OptimConfig(learning_rate=0.3))(0)) == pytest.approx(0.3)


def _numpy_adamw(params, grads_seq, cfg: OptimConfig):
  """AdamW with global-norm clipping, float64, decay on matrices only."""
  p = {k: v.astype(np.float64) for k, v in params.items()}
  m = {k: np.zeros_like(v) for k, v in p.items()}
  v2 = {k: np.zeros_like(v) for k, v in p.items()}
  for t, grads in enumerate(grads_seq):
    g = {k: x.astype(np.float64) for k, x in grads.items()}
    norm = math.sqrt(sum((x * x).sum() for x in g.values()))
    if norm > cfg.grad_clip_norm:
      g = {k: x * cfg.grad_clip_norm / norm for k, x in g.items()}
    lr = cfg.learning_rate * min(1.0, t / cfg.warmup_steps)  # linear warm-up, then constant
    for k in p:
      m[k] = cfg.b1 * m[k] + (1 - cfg.b1) * g[k]
      v2[k] = cfg.b2 * v2[k] + (1 - cfg.b2) * g[k] ** 2
      mhat = m[k] / (1 - cfg.b1 ** (t + 1))
      vhat = v2[k] / (1 - cfg.b2 ** (t + 1))
      update = mhat / (np.sqrt(vhat) + cfg.eps)
      if p[k].ndim >= 2:
        update = update + cfg.weight_decay * p[k]
      p[k] = p[k] - lr * update
  return p


def test_adamw_matches_numpy_float64():
  cfg = OptimConfig(
      learning_rate=0.1,
      warmup_steps=2,
      weight_decay=0.1,
      b1=0.8,
      b2=0.95,
      eps=1e-6,
      grad_clip_norm=2.0,
  )
  r = np.random.RandomState(0)
  params = {"w": r.randn(3, 4).astype(np.float32), "b": r.randn(4).astype(np.float32)}
  # Step 2's gradient has norm > 2 (clipped); the others are below it.
  grads_seq = [
      {"w": 0.1 * r.randn(3, 4), "b": 0.1 * r.randn(4)},
      {"w": 3.0 * r.randn(3, 4), "b": 3.0 * r.randn(4)},
      {"w": 0.2 * r.randn(3, 4), "b": 0.2 * r.randn(4)},
  ]
  grads_seq = [{k: v.astype(np.float32) for k, v in g.items()} for g in grads_seq]
  tx = make_optimizer(cfg)

  @jax.jit
  def run(p, grads_seq):
    state = tx.init(p)
    for g in grads_seq:
      updates, state = tx.update(g, state, p)
      p = optax.apply_updates(p, updates)
    return p

  p = run(params, grads_seq)
  want = _numpy_adamw(params, grads_seq, cfg)
  for k in params:
    np.testing.assert_allclose(np.asarray(p[k]), want[k], rtol=1e-6, atol=1e-6, err_msg=k)
  assert not np.allclose(want["b"], params["b"])  # the test really moves the weights


def test_no_clipping_when_disabled():
  cfg = OptimConfig(learning_rate=1.0, grad_clip_norm=0.0, b1=0.0, b2=0.0, eps=1e-12)
  tx = make_optimizer(cfg)
  p = {"w": jnp.zeros((2, 2))}
  updates, _ = tx.update({"w": jnp.full((2, 2), 100.0)}, tx.init(p), p)
  # b1 = b2 = 0: Adam's update is g / |g| = 1 per element, whatever the norm.
  np.testing.assert_allclose(np.asarray(updates["w"]), -1.0, rtol=1e-6)
