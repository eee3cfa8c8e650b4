"""The rollout engine's KV cache: per-layer key/value buffers that outlive a call.

`Transformer.forward_cached` writes each new token's keys and values into the
cache slots it is given and attends over the slots a mask allows
(`mtrl_jax.sampling` owns which slot holds what).
"""

from __future__ import annotations

import flax.struct
import jax.numpy as jnp

from mtrl_jax.models.config import ModelConfig


@flax.struct.dataclass
class KVCache:
  """Per-layer key/value buffers, each [B, K, S, Dh]: heads before slots, so a decode
  step's attention reads each head's slots in place (no transpose of the cache)."""

  k: tuple
  v: tuple

  @property
  def size(self) -> int:
    return self.k[0].shape[2]

  @property
  def batch(self) -> int:
    return self.k[0].shape[0]


def init_cache(cfg: ModelConfig, batch: int, size: int, dtype=None) -> KVCache:
  """An all-zero cache of `size` slots for `batch` rows."""
  dtype = dtype or cfg.jnp_dtype
  shape = (batch, cfg.num_kv_heads, size, cfg.head_dim)
  zeros = tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))
  return KVCache(k=zeros, v=tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))
