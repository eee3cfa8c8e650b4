"""Low-rank adapters (`mtrl_jax.models.lora`): zero adapters are the base bit for bit; the
adapted forward and its gradients equal float64 numpy references; the cached decode path
and merged weights agree with the unmerged forward."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models
from mtrl_jax.models import init_cache, lora
from mtrl_jax.models.config import LORA_TARGETS, LoraConfig

B, T = 2, 7
# One adapter configuration for every test: its programs (and the eager
# initialisers of its shapes) are compiled once.
LORA = LoraConfig(rank=2, alpha=4.0)
CFG = models.get_preset("tiny").replace(lora=LORA)


def _tokens(cfg, seed=0):
  return np.random.RandomState(seed).randint(0, cfg.vocab_size, (B, T)).astype(np.int32)


def _random_adapters(adapters, seed=1, std=0.3):
  """Adapters with non-zero B (trained-looking), deterministic."""
  r = np.random.RandomState(seed)
  return jax.tree.map(lambda x: jnp.asarray(r.randn(*x.shape) * std, x.dtype), adapters)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, states, tokens):
  """The full forward of the model `nnx.merge(graphdef, *states)`."""
  return nnx.merge(graphdef, *states)(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef, states, tokens):
  """Every token's logits through forward_cached: one causal prefill into slots 0..T-1."""
  model = nnx.merge(graphdef, *states)
  cache = init_cache(model.cfg, B, T)
  attn = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
  write = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  logits, _ = model.forward_cached(tokens, write, attn, cache, write)
  return logits


def _run(fn, model, tokens):
  graphdef, *states = nnx.split(model)
  return np.asarray(fn(graphdef, tuple(states), jnp.asarray(tokens)))


def test_zero_initialised_adapters_give_the_base_logits_bit_for_bit():
  cfg = models.get_preset("tiny")
  base = models.create_model(cfg, seed=4)
  adapted = lora.attach(base, LORA, seed=4)
  scratch = models.create_model(CFG, seed=4)
  _, a, _ = lora.split(adapted)
  _, a_scratch, _ = lora.split(scratch)
  assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(a_scratch)))
  assert all(not np.any(b) for (_, b) in lora.pairs(a).values())
  assert len(lora.pairs(a)) == cfg.num_layers * len(LORA_TARGETS)
  tokens = _tokens(cfg)
  want = _run(_logits, base, tokens)
  np.testing.assert_array_equal(_run(_logits, adapted, tokens), want)
  np.testing.assert_array_equal(_run(_logits, scratch, tokens), want)
  np.testing.assert_array_equal(_run(_prefill, adapted, tokens), _run(_prefill, base, tokens))


def _np_silu(x):
  return x / (1 + np.exp(-x))


def test_mlp_adapters_forward_and_gradients_equal_a_float64_numpy_reference():
  cfg = CFG
  model = models.create_model(cfg, seed=0)
  graphdef, adapters, base = lora.split(model.blocks[0].mlp)
  adapters = _random_adapters(adapters)
  x = np.random.RandomState(1).randn(B, T, cfg.d_model).astype(np.float32)
  r = np.random.RandomState(2).randn(B, T, cfg.d_model).astype(np.float32)

  def loss(adapters):
    return jnp.sum(nnx.merge(graphdef, adapters, base)(x) * r)

  got_loss, got = jax.jit(jax.value_and_grad(loss))(adapters)

  s = cfg.lora.scale
  f64 = lambda v: np.asarray(v, np.float64)
  w = {n: f64(base[n][...]) for n in ("gate", "up", "down")}
  ab = {
      n: (f64(adapters[f"{n}_lora"]["lora_a"][...]), f64(adapters[f"{n}_lora"]["lora_b"][...]))
      for n in ("gate", "up", "down")
  }
  xs, rs = f64(x).reshape(-1, cfg.d_model), f64(r).reshape(-1, cfg.d_model)
  lin = lambda v, n: v @ w[n] + s * (v @ ab[n][0]) @ ab[n][1]
  g, u = lin(xs, "gate"), lin(xs, "up")
  h = _np_silu(g) * u
  y = lin(h, "down")
  np.testing.assert_allclose(float(got_loss), np.sum(y * rs), rtol=1e-5)
  # Backward by hand: y = h @ (Wd + s Ad Bd), h = silu(g) * u.
  grads = {"down": (s * h.T @ (rs @ ab["down"][1].T), s * (h @ ab["down"][0]).T @ rs)}
  dh = rs @ w["down"].T + s * (rs @ ab["down"][1].T) @ ab["down"][0].T
  sig = 1 / (1 + np.exp(-g))
  dg = dh * u * sig * (1 + g * (1 - sig))
  du = dh * _np_silu(g)
  for n, d in (("gate", dg), ("up", du)):
    grads[n] = (s * xs.T @ (d @ ab[n][1].T), s * (xs @ ab[n][0]).T @ d)
  for n, (da, db) in grads.items():
    np.testing.assert_allclose(got[f"{n}_lora"]["lora_a"][...], da, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(got[f"{n}_lora"]["lora_b"][...], db, rtol=1e-4, atol=1e-4)


def test_model_adapters_equal_merged_weights_and_their_gradients_the_chain_rule():
  """The adapted model's logits are the plain model's at W + s A B (merged in float64 numpy),
  and dL/dA = s dL/dW B^T, dL/dB = s A^T dL/dW for every adapted weight."""
  cfg = CFG
  graphdef, adapters, base = lora.split(models.create_model(cfg, seed=2))
  adapters = _random_adapters(adapters, std=0.2)
  tokens = _tokens(cfg, seed=3)
  r = np.random.RandomState(4).randn(B, T, cfg.vocab_size).astype(np.float32)
  s = cfg.lora.scale

  merged = jax.tree.map(lambda x: x, base)
  for (i, t), (a, b) in lora.pairs(adapters).items():
    var = merged["blocks"][i][lora.MODULE_OF[t]][t]
    w = np.asarray(var[...], np.float64)
    delta = s * np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    var.set_value(jnp.asarray(w + delta.reshape(w.shape), jnp.float32))
  plain_graph = lora.base_graphdef(cfg)

  def lora_loss(a):
    logits = nnx.merge(graphdef, a, base)(tokens)
    return jnp.sum(logits * r), logits

  def plain_loss(p):
    logits = nnx.merge(plain_graph, p)(tokens)
    return jnp.sum(logits * r), logits

  (_, logits_lora), got = jax.jit(jax.value_and_grad(lora_loss, has_aux=True))(adapters)
  (_, logits_plain), g_w = jax.jit(jax.value_and_grad(plain_loss, has_aux=True))(merged)
  np.testing.assert_allclose(logits_lora, logits_plain, atol=2e-4, rtol=0)
  # The library's merge agrees with the numpy one.
  ours = lora.merge(base, adapters, cfg.lora)
  for x, y in zip(jax.tree.leaves(ours), jax.tree.leaves(merged)):
    np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)

  for (i, t), (a, b) in lora.pairs(adapters).items():
    gw = np.asarray(g_w["blocks"][i][lora.MODULE_OF[t]][t][...], np.float64)
    gw = gw.reshape(a.shape[0], b.shape[1])
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    ga, gb = lora.pairs(got)[(i, t)]
    scale = np.abs(gw).max() * s
    np.testing.assert_allclose(ga, s * gw @ b64.T, atol=2e-4 * scale, rtol=1e-3)
    np.testing.assert_allclose(gb, s * a64.T @ gw, atol=2e-4 * scale, rtol=1e-3)


def test_cached_decode_with_adapters_equals_the_full_forward():
  cfg = CFG
  graphdef, adapters, base = lora.split(models.create_model(cfg, seed=5))
  model = nnx.merge(graphdef, _random_adapters(adapters, seed=6), base)
  tokens = _tokens(cfg, seed=7)
  full = _run(_logits, model, tokens)
  np.testing.assert_allclose(_run(_prefill, model, tokens), full, atol=5e-5, rtol=0)
  plain = _logits(lora.base_graphdef(cfg), (base,), jnp.asarray(tokens))
  assert np.abs(full - np.asarray(plain)).max() > 1e-2


def test_unmerge_restores_the_base():
  cfg = CFG
  _, adapters, base = lora.split(models.create_model(cfg, seed=8))
  adapters = _random_adapters(adapters, seed=9)
  back = lora.unmerge(lora.merge(base, adapters, cfg.lora), adapters, cfg.lora)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(base)):
    np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(rank=-1), "model.lora.rank"),
        (dict(rank=4, alpha=0.0), "model.lora.alpha"),
        (dict(rank=4, targets=("q", "embed")), "model.lora.targets"),
        (dict(rank=4, targets=()), "model.lora.targets"),
    ],
)
def test_bad_lora_config_is_refused_in_one_line_naming_the_field(kw, field):
  with pytest.raises(ValueError) as e:
    LoraConfig(**kw)
  assert field in str(e.value) and "allowed" in str(e.value) and "\n" not in str(e.value)
