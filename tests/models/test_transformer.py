"""The NNX transformer's own invariants: KV-cache decoding equals the full
forward, padding is invisible, bf16 runs, remat changes nothing.

Parity with the reference implementation (transformers) is in test_loading.py.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models
from mtrl_jax import sharding
from mtrl_jax.models import Transformer, init_cache

# Same float32 math in a different order (cache slots vs. full sequence):
# differences come from summation order only, ~1e-6 at logits of magnitude ~5.
TOL = 1e-5
B, T = 3, 10


def _cfg(**kw):
  return models.get_preset("tiny", **kw)


def _batch(cfg, lengths=(10, 6, 3), seed=0):
  """Left-padded tokens [B, T], validity mask and RoPE positions."""
  rng = np.random.RandomState(seed)
  tokens = rng.randint(0, cfg.vocab_size, (B, T)).astype(np.int32)
  mask = np.arange(T)[None, :] >= (T - np.asarray(lengths))[:, None]
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions, mask):
  return nnx.merge(graphdef, state)(tokens, positions, mask)


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, state, tokens, positions, attn, cache, first_slot):
  """Writes the new tokens' keys/values into consecutive slots from `first_slot`."""
  write = jnp.broadcast_to(first_slot + jnp.arange(tokens.shape[1]), tokens.shape)
  return nnx.merge(graphdef, state).forward_cached(tokens, positions, attn, cache, write)


def _cached_logits(model, tokens, mask, positions, prompt_len, cache_size, cache):
  """Prefill `prompt_len` tokens, then decode the rest one token at a time."""
  valid_BxS = np.zeros((B, cache_size), bool)
  valid_BxS[:, :T] = mask
  slots = np.arange(cache_size)
  # Query i may attend to valid slots j <= i.
  attn = (slots[None, :] <= np.arange(prompt_len)[:, None])[None] & valid_BxS[:, None, :]
  graphdef, state = nnx.split(model)
  logits, cache = _step(
      graphdef, state, tokens[:, :prompt_len], positions[:, :prompt_len], attn, cache, 0
  )
  out = [np.asarray(logits)]
  for t in range(prompt_len, T):
    attn = ((slots <= t)[None] & valid_BxS)[:, None, :]
    logits, cache = _step(
        graphdef, state, tokens[:, t : t + 1], positions[:, t : t + 1], attn, cache, t
    )
    out.append(np.asarray(logits))
  return np.concatenate(out, axis=1)


def test_forward_cached_equals_full_forward():
  cfg = _cfg()
  model = models.create_model(cfg, seed=1)
  tokens, mask, positions = _batch(cfg)
  full = np.asarray(_forward(*nnx.split(model), tokens, positions, mask))

  size = T + 4  # unused slots at the end must stay invisible too
  # A cache full of finite garbage: only the slots the mask allows may matter.
  garbage = init_cache(cfg, B, size)
  garbage = jax.tree.map(
      lambda x: jax.random.normal(jax.random.key(3), x.shape, x.dtype) * 5, garbage
  )
  for cache in (init_cache(cfg, B, size), garbage):
    got = _cached_logits(model, tokens, mask, positions, 6, size, cache)
    np.testing.assert_allclose(got[mask], full[mask], atol=TOL, rtol=0)
  assert np.abs(full[mask]).max() > 1.0


def test_padding_and_future_tokens_do_not_change_valid_logits():
  cfg = _cfg()
  model = models.create_model(cfg, seed=2)
  tokens, mask, positions = _batch(cfg)
  graphdef, state = nnx.split(model)
  fwd = functools.partial(_forward, graphdef, state)
  base = np.asarray(fwd(tokens, positions, mask))

  # Left padding: other ids under the mask leave every valid position unchanged.
  other = np.where(mask, tokens, (tokens + 17) % cfg.vocab_size).astype(np.int32)
  np.testing.assert_array_equal(np.asarray(fwd(other, positions, mask))[mask], base[mask])

  # Right padding (no mask needed): causality hides later tokens from earlier ones.
  later = tokens.copy()
  later[:, 7:] = (later[:, 7:] + 5) % cfg.vocab_size
  changed = np.asarray(fwd(later, positions, mask))
  early = mask.copy()
  early[:, 7:] = False  # padded queries attend to nothing valid: their logits are arbitrary
  np.testing.assert_array_equal(changed[early], base[early])
  assert np.abs(changed[:, 7:] - base[:, 7:]).max() > 1e-3  # and later ones do see them


def test_bfloat16_params_and_compute():
  # Weights that bf16 represents exactly, held by a float32 model (the
  # reference) and by a bf16-param, bf16-compute model of the same graph.
  model32 = models.create_model(_cfg(), seed=0)
  state16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), nnx.state(model32))
  nnx.update(model32, jax.tree.map(lambda x: x.astype(jnp.float32), state16))
  cfg16 = models.get_preset("tiny", dtype="bfloat16")  # both param_dtype and dtype
  assert (cfg16.param_dtype, cfg16.dtype) == ("bfloat16", "bfloat16")
  assert cfg16.replace(param_dtype="float32") == models.get_preset(
      "tiny", dtype="bfloat16", param_dtype="float32"
  )  # an explicit field wins
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg16, mesh)):
    graphdef16 = nnx.split(nnx.eval_shape(lambda: Transformer(cfg16, rngs=nnx.Rngs(0))))[0]
  assert state16["blocks"][0]["attn"]["q"][...].dtype == jnp.bfloat16

  tokens, mask, positions = _batch(cfg16)
  got = np.asarray(_forward(graphdef16, state16, tokens, positions, mask))
  assert got.dtype == np.float32 and np.isfinite(got).all()
  want = np.asarray(_forward(*nnx.split(model32), tokens, positions, mask))
  # bf16 keeps 8 mantissa bits (relative rounding 2^-9 = 0.2% per op); through
  # two blocks the logits drift by about 1% of their scale (measured 0.4%).
  scale = np.abs(want[mask]).max()
  err = np.abs(got[mask] - want[mask]).max()
  assert 0 < err < 0.02 * scale, (err, scale)  # > 0: bf16 compute really happened

  # The cached path runs in bf16 too (bf16 cache) and agrees with the full one.
  cache = init_cache(cfg16, B, T)
  assert cache.k[0].dtype == jnp.bfloat16
  slots = np.arange(T)
  attn = (slots[None, :] <= slots[:, None])[None] & mask[:, None, :]
  cached, _ = _step(graphdef16, state16, tokens, positions, attn, cache, 0)
  np.testing.assert_allclose(np.asarray(cached)[mask], want[mask], atol=0.02 * scale, rtol=0)


def test_remat_same_logits_and_gradients():
  tokens, mask, positions = _batch(_cfg())
  results = []
  for remat in (False, True):
    model = models.create_model(_cfg(remat=remat), seed=5)
    graphdef, state = nnx.split(model)

    def loss_fn(state):
      logits = nnx.merge(graphdef, state)(tokens, positions, mask)
      logp = jax.nn.log_softmax(logits[:, :-1])
      picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
      return -(picked * mask[:, 1:]).sum() / mask[:, 1:].sum(), logits

    (loss, logits), grads = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(state)
    results.append((loss, logits, grads))
  (l0, z0, g0), (l1, z1, g1) = results
  np.testing.assert_allclose(np.asarray(z1), np.asarray(z0), atol=1e-6, rtol=0)
  np.testing.assert_allclose(float(l1), float(l0), rtol=1e-6)
  flat0, flat1 = dict(nnx.to_flat_state(g0)), dict(nnx.to_flat_state(g1))
  assert flat0.keys() == flat1.keys()
  for p in flat0:
    a, b = np.asarray(flat0[p].get_value()), np.asarray(flat1[p].get_value())
    np.testing.assert_allclose(b, a, atol=1e-6 * max(1.0, np.abs(a).max()), rtol=0, err_msg=str(p))
  # Gradients are not trivially zero (the comparison means something).
  assert np.abs(np.asarray(flat0[("blocks", 0, "attn", "q")].get_value())).max() > 1e-4


def test_a_fresh_tied_model_with_scaled_embeddings_starts_with_logits_of_unit_scale():
  """`embed_init='scaled'` draws the embedding with std 1/sqrt(d_model), so a fresh model's
  tied head gives logits of about unit scale and a high-entropy first policy; 'unit' (std
  1) gives logits of std about sqrt(d_model) and a near-one-hot policy."""
  for preset in ("tiny", "small"):
    for init, want_std in (("scaled", 1 / np.sqrt(preset_d(preset))), ("unit", 1.0)):
      cfg = models.get_preset(preset).replace(embed_init=init)
      assert cfg.tie_embeddings
      model = models.create_model(cfg, seed=0)
      embed = np.asarray(model.embed[...], np.float64)
      assert abs(embed.std() - want_std) < 0.05 * want_std, (preset, init, embed.std())
      tokens, mask, positions = _batch(cfg)
      graphdef, state = nnx.split(model)
      logits = np.asarray(_forward(graphdef, state, tokens, positions, mask), np.float64)[mask]
      p = np.exp(logits - logits.max(-1, keepdims=True))
      p /= p.sum(-1, keepdims=True)
      entropy = -(p * np.log(p)).sum(-1).mean()  # of the next-token distribution
      if init == "scaled":
        assert 0.5 < logits.std() < 2.0, (preset, logits.std())
        assert entropy > 0.7 * np.log(cfg.vocab_size), (preset, entropy)
      else:
        assert logits.std() > 0.5 * np.sqrt(cfg.d_model), (preset, logits.std())
        assert entropy < 0.3 * np.log(cfg.vocab_size), (preset, entropy)
  with pytest.raises(ValueError, match=r"embed_init='normal'; allowed: \['unit', 'scaled'\]"):
    models.get_preset("tiny").replace(embed_init="normal")


def preset_d(name):
  return models.get_preset(name).d_model
