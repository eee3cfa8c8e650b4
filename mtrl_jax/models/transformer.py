"""Flax NNX decoder-only transformer for the Llama / Qwen2 / Qwen3 family.

One graph serves the policy and the frozen reference model: they are two
parameter states of the same `Transformer` (see `nnx.split`). Parameters carry
logical axis names (`out_sharding=`) that `mtrl_jax.sharding` maps onto the
device mesh.

Entry points:
  * `model(tokens_BxL, positions_BxL=None, mask_BxL=None) -> logits_BxLxV`,
    the full causal forward;
  * `model.hidden(tokens_BxL, positions_BxL, mask_BxL, tree_ends_BxL=)` ->
    final hidden states [B, L, D] (after the final norm), causal or with the
    packed-tree attention structure (see `tree_attention_mask`), and
    `model.logits_at(hidden_BxLxD, index_BxK)` -> logits [B, K, V] of chosen
    positions only: the train step computes the LM head where a loss needs it;
  * `model.forward_cached(tokens_BxL, positions_BxL, attn_mask_BxLxS, cache,
    write_BxL) -> (logits, cache)`, used by the rollout engine: the keys/values
    of new token l of row b are written into cache slot `write_BxL[b, l]` and
    the queries attend over the S slots `attn_mask_BxLxS` allows.

With `cfg.lora`: `nnx.LoRA` adapters on the targeted weights (`mtrl_jax.models.lora`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from mtrl_jax.models.cache import KVCache
from mtrl_jax.models.config import ModelConfig

_NEG_INF = -1e30


def rope_inv_freq(cfg: ModelConfig) -> jax.Array:
  """Inverse frequencies [Dh/2], with Llama-3 long-context scaling if configured."""
  dh = cfg.head_dim
  inv = 1.0 / (cfg.rope_theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
  if cfg.rope_scaling is None:
    return inv
  sc = dict(cfg.rope_scaling)
  factor = float(sc["factor"])
  low, high = float(sc["low_freq_factor"]), float(sc["high_freq_factor"])
  old_len = float(sc["original_max_position_embeddings"])
  low_wavelen, high_wavelen = old_len / low, old_len / high
  wavelen = 2 * math.pi / inv
  scaled = jnp.where(wavelen > low_wavelen, inv / factor, inv)
  smooth = (old_len / wavelen - low) / (high - low)
  smoothed = (1 - smooth) * scaled / factor + smooth * scaled
  is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
  return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x_BxLxHxDh: jax.Array, positions_BxL: jax.Array, inv_freq: jax.Array):
  """Rotary embedding, HF 'rotate_half' layout (first half / second half)."""
  angles = positions_BxL[..., None].astype(jnp.float32) * inv_freq  # [B, L, Dh/2]
  sin = jnp.sin(angles)[:, :, None, :]
  cos = jnp.cos(angles)[:, :, None, :]
  x = x_BxLxHxDh.astype(jnp.float32)
  x1, x2 = jnp.split(x, 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxHxDh.dtype)


def tree_attention_mask(ends_BxL: jax.Array) -> jax.Array:
  """Ancestor-only attention of packed trees: mask[b, q, k] = k <= q < ends[b, k].

  Packed trees are laid out in depth-first pre-order, so the subtree of token
  k is the contiguous range [k, ends[k]); token q may attend to k exactly
  when k is q itself or one of its ancestors, i.e. when q falls in k's
  subtree. Several trees in one row and padding (ends[k] = k + 1: a padding
  token sees only itself) need nothing more. A causal row is ends = L.
  Returns bool [B, L, L]; memory is bounded by the row bucket.
  """
  l = ends_BxL.shape[-1]
  idx = jnp.arange(l, dtype=jnp.int32)
  q = idx[None, :, None]
  k = idx[None, None, :]
  return (k <= q) & (q < ends_BxL[:, None, :])


class RMSNorm(nnx.Module):
  """RMSNorm computed in float32 (Llama/Qwen convention: weight * normed)."""

  def __init__(self, dim: int, eps: float, param_dtype, *, rngs: nnx.Rngs):
    del rngs
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=("norm",))

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = x32 * jax.lax.rsqrt(var + self.eps)
    return (normed * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def _dense(rngs, shape, fan_in, axes, dtype):
  init = nnx.initializers.normal(stddev=1.0 / math.sqrt(fan_in))
  return nnx.Param(init(rngs.params(), shape, dtype), out_sharding=axes)


def _add_adapters(block, cfg: ModelConfig, rngs):
  """`nnx.LoRA` A [in, r], B [r, out] (float32, B zero) on the block's targeted weights."""
  for name in cfg.lora.targets:
    module = block.attn if name in ("q", "k", "v", "o") else block.mlp
    shape = getattr(module, name).shape
    n = 2 if name == "o" else 1  # input axes: q is [D, H, Dh], o is [H, Dh, D]
    adapter = nnx.LoRA(
        math.prod(shape[:n]),
        cfg.lora.rank,
        math.prod(shape[n:]),
        dtype=cfg.jnp_dtype,
        param_dtype=jnp.float32,
        rngs=rngs,
    )
    setattr(module, f"{name}_lora", adapter)


def _with_lora(cfg: ModelConfig, adapter, x_BxLxI, y_BxLx_):
  """y + scale * x @ A @ B (x's features flat, the delta shaped like y); y without adapter."""
  if adapter is None:
    return y_BxLx_
  delta = adapter(x_BxLxI) * jnp.asarray(cfg.lora.scale, cfg.jnp_dtype)
  return y_BxLx_ + delta.reshape(y_BxLx_.shape).astype(y_BxLx_.dtype)


class Attention(nnx.Module):
  """Grouped-query attention with optional q/k/v bias and per-head q/k norm."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, h, k, dh = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    pd = cfg.jnp_param_dtype
    self.q = _dense(rngs, (d, h, dh), d, ("embed", "q_heads", "head_dim"), pd)
    self.k = _dense(rngs, (d, k, dh), d, ("embed", "kv_heads", "head_dim"), pd)
    self.v = _dense(rngs, (d, k, dh), d, ("embed", "kv_heads", "head_dim"), pd)
    self.o = _dense(rngs, (h, dh, d), h * dh, ("q_heads", "head_dim", "embed"), pd)
    if cfg.qkv_bias:
      self.q_bias = nnx.Param(jnp.zeros((h, dh), pd), out_sharding=("q_heads", "head_dim"))
      self.k_bias = nnx.Param(jnp.zeros((k, dh), pd), out_sharding=("kv_heads", "head_dim"))
      self.v_bias = nnx.Param(jnp.zeros((k, dh), pd), out_sharding=("kv_heads", "head_dim"))
    if cfg.o_bias:
      self.o_bias = nnx.Param(jnp.zeros((d,), pd), out_sharding=("embed",))
    if cfg.qk_norm:
      self.q_norm = RMSNorm(dh, cfg.rms_eps, pd, rngs=rngs)
      self.k_norm = RMSNorm(dh, cfg.rms_eps, pd, rngs=rngs)
    self.q_lora = self.k_lora = self.v_lora = self.o_lora = nnx.data(None)

  def project_qkv(self, x_BxLxD, positions_BxL, inv_freq):
    cfg, dt = self.cfg, self.cfg.jnp_dtype
    x = x_BxLxD.astype(dt)
    q = jnp.einsum("bld,dhe->blhe", x, self.q[...].astype(dt))
    k = jnp.einsum("bld,dke->blke", x, self.k[...].astype(dt))
    v = jnp.einsum("bld,dke->blke", x, self.v[...].astype(dt))
    q, k, v = (
        _with_lora(cfg, self.q_lora, x, q),
        _with_lora(cfg, self.k_lora, x, k),
        _with_lora(cfg, self.v_lora, x, v),
    )
    if cfg.qkv_bias:
      q = q + self.q_bias[...].astype(dt)
      k = k + self.k_bias[...].astype(dt)
      v = v + self.v_bias[...].astype(dt)
    if cfg.qk_norm:
      q, k = self.q_norm(q), self.k_norm(k)
    q = apply_rope(q, positions_BxL, inv_freq)
    k = apply_rope(k, positions_BxL, inv_freq)
    return q, k, v

  def attend(self, q_BxLxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxLxS):
    cfg = self.cfg
    b, l, h, dh = q_BxLxHxDh.shape
    kh = cfg.num_kv_heads
    if cfg.attention == "cudnn":
      out = jax.nn.dot_product_attention(
          q_BxLxHxDh,
          k_BxSxKxDh.astype(q_BxLxHxDh.dtype),
          v_BxSxKxDh.astype(q_BxLxHxDh.dtype),
          mask=mask_BxLxS[:, None, :, :],
          implementation="cudnn",
      )
    else:
      q = q_BxLxHxDh.reshape(b, l, kh, h // kh, dh)
      scores = jnp.einsum(
          "blkgd,bskd->bkgls", q, k_BxSxKxDh, preferred_element_type=jnp.float32
      ) / math.sqrt(dh)
      scores = jnp.where(mask_BxLxS[:, None, None, :, :], scores, _NEG_INF)
      probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
      out = jnp.einsum("bkgls,bskd->blkgd", probs, v_BxSxKxDh)
    return self.output(out.reshape(b, l, h, dh))

  def attend_cached(self, q_BxLxHxDh, k_BxKxSxDh, v_BxKxSxDh, mask_BxLxS):
    """`attend` over a KV cache in its heads-major layout [B, K, S, Dh].

    One query per row (a decode step) is written as products summed over Dh
    and over slots rather than as einsums: per (row, head) those are
    matrix-vector products, which XLA's CPU backend runs as many tiny batched
    GEMMs, 4x slower than these fused reductions (both read each slot once).
    """
    b, l, h, dh = q_BxLxHxDh.shape
    kh = self.cfg.num_kv_heads
    q = q_BxLxHxDh.reshape(b, l, kh, h // kh, dh)
    if l == 1:
      q_BxKxGxDh = q[:, 0].astype(jnp.float32)
      scores = jnp.sum(q_BxKxGxDh[:, :, :, None, :] * k_BxKxSxDh[:, :, None, :, :], axis=-1)[
          :, :, :, None, :
      ] / math.sqrt(
          dh
      )  # [B, K, G, 1, S]
    else:
      scores = jnp.einsum(
          "blkgd,bksd->bkgls", q, k_BxKxSxDh, preferred_element_type=jnp.float32
      ) / math.sqrt(dh)
    scores = jnp.where(mask_BxLxS[:, None, None, :, :], scores, _NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(v_BxKxSxDh.dtype)
    if l == 1:
      out = jnp.sum(probs[:, :, :, 0, :, None] * v_BxKxSxDh[:, :, None, :, :], axis=-2)[
          :, None
      ]  # [B, 1, K, G, Dh]
    else:
      out = jnp.einsum("bkgls,bksd->blkgd", probs, v_BxKxSxDh)
    return self.output(out.reshape(b, l, h, dh))

  def output(self, out_BxLxHxDh):
    y = jnp.einsum("blhe,hed->bld", out_BxLxHxDh, self.o[...].astype(out_BxLxHxDh.dtype))
    y = _with_lora(self.cfg, self.o_lora, out_BxLxHxDh.reshape(*y.shape[:2], -1), y)
    if self.cfg.o_bias:
      y = y + self.o_bias[...].astype(y.dtype)
    return y


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    d, f, pd = cfg.d_model, cfg.mlp_dim, cfg.jnp_param_dtype
    self.gate = _dense(rngs, (d, f), d, ("embed", "mlp"), pd)
    self.up = _dense(rngs, (d, f), d, ("embed", "mlp"), pd)
    self.down = _dense(rngs, (f, d), f, ("mlp", "embed"), pd)
    self.gate_lora = self.up_lora = self.down_lora = nnx.data(None)

  def _linear(self, x, name: str):
    return _with_lora(
        self.cfg, getattr(self, f"{name}_lora"), x, x @ getattr(self, name)[...].astype(x.dtype)
    )

  def __call__(self, x_BxLxD):
    x = x_BxLxD.astype(self.cfg.jnp_dtype)
    return self._linear(jax.nn.silu(self._linear(x, "gate")) * self._linear(x, "up"), "down")


class Block(nnx.Module):
  """Pre-norm residual block: x + attn(norm(x)); x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    pd = cfg.jnp_param_dtype
    self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, pd, rngs=rngs)
    self.attn = Attention(cfg, rngs=rngs)
    self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, pd, rngs=rngs)
    self.mlp = MLP(cfg, rngs=rngs)

  def __call__(self, x, positions, mask_BxLxS, inv_freq, kv=None, write_BxL=None):
    """Returns (x, (k, v)); with `kv` the new keys/values are written into its
    slots `write_BxL` (one per new token) and attention runs over the cache."""
    q, k, v = self.attn.project_qkv(self.attn_norm(x), positions, inv_freq)
    if kv is None:
      y = self.attn.attend(q, k, v, mask_BxLxS)
    else:  # the cache is [B, K, S, Dh]: [rows, :, slots] selects [B, L, K, Dh] blocks
      ck, cv = kv
      rows_Bx1 = jnp.arange(ck.shape[0], dtype=jnp.int32)[:, None]
      k = ck.at[rows_Bx1, :, write_BxL].set(k.astype(ck.dtype), mode="promise_in_bounds")
      v = cv.at[rows_Bx1, :, write_BxL].set(v.astype(cv.dtype), mode="promise_in_bounds")
      y = self.attn.attend_cached(q, k, v, mask_BxLxS)
    x = x + y.astype(x.dtype)
    x = x + self.mlp(self.mlp_norm(x)).astype(x.dtype)
    return x, (k, v)


class Transformer(nnx.Module):
  """Decoder-only LM: tokens [B, L] -> logits [B, L, V] (float32)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    pd = cfg.jnp_param_dtype
    # `embed_init`: with tied embeddings this table is also the LM head, so 'scaled'
    # (std 1/sqrt(d_model)) gives a unit-RMS hidden state logits of about unit scale;
    # 'unit' (std 1) gives logits of std ~sqrt(d_model) (docs/internals.md, "Initialisation").
    std = 1.0 / math.sqrt(cfg.d_model) if cfg.embed_init == "scaled" else 1.0
    self.embed = nnx.Param(
        nnx.initializers.normal(stddev=std)(rngs.params(), (cfg.vocab_size, cfg.d_model), pd),
        out_sharding=("vocab", "embed"),
    )
    self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.d_model, cfg.rms_eps, pd, rngs=rngs)
    if not cfg.tie_embeddings:
      self.lm_head = _dense(
          rngs, (cfg.d_model, cfg.vocab_size), cfg.d_model, ("embed", "vocab"), pd
      )
    if cfg.lora is not None and cfg.lora.enabled:  # drawn last: the base's weights stay put
      for block in self.blocks:
        _add_adapters(block, cfg, rngs)
    if cfg.value_head:  # zero: a fresh critic predicts 0 (advantages start as returns)
      self.value_head = nnx.Param(jnp.zeros((cfg.d_model,), jnp.float32), out_sharding=("embed",))

  # ------------------------------------------------------------ pieces
  def embed_tokens(self, tokens_BxL):
    return jnp.take(self.embed[...], tokens_BxL, axis=0).astype(self.cfg.jnp_dtype)

  def head(self, x_BxLxD):
    """Final norm + LM head; logits in float32."""
    return self.project(self.final_norm(x_BxLxD))

  def hidden(self, tokens_BxL, positions_BxL=None, mask_BxL=None, *, tree_ends_BxL=None):
    """Forward up to and including the final norm: [B, L, D].

    Args:
      tokens_BxL: int token ids.
      positions_BxL: RoPE positions; default 0..L-1 per row.
      mask_BxL: optional bool validity mask (False = padding, never attended).
      tree_ends_BxL: packed trees (`tree_attention_mask`): token q attends to
        key k iff k <= q < tree_ends_BxL[k]; None: causal.
    """
    b, l = tokens_BxL.shape
    if positions_BxL is None:
      positions_BxL = jnp.broadcast_to(jnp.arange(l, dtype=jnp.int32), (b, l))
    if tree_ends_BxL is None:
      mask = jnp.tril(jnp.ones((l, l), dtype=bool))[None]
    else:
      mask = tree_attention_mask(tree_ends_BxL)
    if mask_BxL is not None:
      mask = mask & mask_BxL[:, None, :].astype(bool)
    mask = jnp.broadcast_to(mask, (b, l, l))
    inv_freq = rope_inv_freq(self.cfg)
    x = self.embed_tokens(tokens_BxL)
    for block in self.blocks:
      if self.cfg.remat:
        x, _ = nnx.remat(lambda blk, x: blk(x, positions_BxL, mask, inv_freq))(block, x)
      else:
        x, _ = block(x, positions_BxL, mask, inv_freq)
    return self.final_norm(x)

  def head_weight(self):
    """The LM head as [D, V] (the transposed embedding when tied)."""
    return self.embed[...].T if self.cfg.tie_embeddings else self.lm_head[...]

  def logits_at(self, hidden_BxLxD, index_BxK):
    """Logits [B, K, V] (float32) of the positions `index_BxK` of `hidden`."""
    h = jnp.take_along_axis(hidden_BxLxD, index_BxK[..., None].astype(jnp.int32), axis=1)
    return self.project(h)

  def values_at(self, hidden_BxLxD, index_BxK):
    """The value head (`cfg.value_head`) at the positions `index_BxK` of the final-normed
    hidden states: [B, K] float32."""
    h = jnp.take_along_axis(hidden_BxLxD, index_BxK[..., None].astype(jnp.int32), axis=1)
    return jnp.einsum("bkd,d->bk", h.astype(jnp.float32), self.value_head[...])

  def project(self, normed_BxLxD):
    """LM head of final-normed hidden states; logits in float32."""
    w = self.head_weight()
    return jnp.einsum(
        "bld,dv->blv",
        normed_BxLxD,
        w.astype(normed_BxLxD.dtype),
        preferred_element_type=jnp.float32,
    )

  def __call__(self, tokens_BxL, positions_BxL=None, mask_BxL=None):
    """Full causal forward.

    Args:
      tokens_BxL: int token ids.
      positions_BxL: RoPE positions; defaults to 0..L-1 per row.
      mask_BxL: optional bool validity mask (False = padding, never attended).
    Returns:
      logits_BxLxV in float32.
    """
    return self.project(self.hidden(tokens_BxL, positions_BxL, mask_BxL))

  def forward_cached(
      self,
      tokens_BxL,
      positions_BxL,
      attn_mask_BxLxS,
      cache: KVCache,
      write_BxL,
      *,
      head: str = "all",
  ):
    """Forward of L new tokens against a KV cache (a prefill extension or a decode step).

    Args:
      tokens_BxL: new token ids.
      positions_BxL: their RoPE positions.
      attn_mask_BxLxS: which cache slots each new token may attend to (the
        caller includes the new tokens' own slots, causally).
      cache: KV cache with S slots.
      write_BxL: int slot of each new token's keys/values (in [0, S); two
        tokens of a row may share a slot only where the caller discards it).
      head: 'all' (logits of every new token), 'last' (of the last one: a
        decode step) or 'none' (no LM head: a prefill that only fills the cache).
    Returns:
      (logits_BxLxV float32 | logits_BxV | None, updated cache).
    """
    inv_freq = rope_inv_freq(self.cfg)
    x = self.embed_tokens(tokens_BxL)
    new_k, new_v = [], []
    for i, block in enumerate(self.blocks):
      x, (k, v) = block(
          x,
          positions_BxL,
          attn_mask_BxLxS,
          inv_freq,
          kv=(cache.k[i], cache.v[i]),
          write_BxL=write_BxL,
      )
      new_k.append(k)
      new_v.append(v)
    cache = KVCache(k=tuple(new_k), v=tuple(new_v))
    if head == "none":
      return None, cache
    if head == "last":
      return self.head(x[:, -1:, :])[:, 0, :], cache
    return self.head(x), cache
