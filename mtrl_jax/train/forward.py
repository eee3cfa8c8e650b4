"""The policy forward of training: per-token logprobs of a `TrainBatch`.

One function serves the train step, the old-logprob pass of several updates
per batch and the stacked (one policy per agent) step. The forward uses the
batch's attention structure (`rollout.train_batch`: packed trees, or causal
rows) and the LM head runs only at `prev_BxK`, each trained token's
predecessor, giving [B, K] logprobs of `target_BxK`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtrl_jax import losses


def forward_logprobs(graphdef, params, batch, chunk_size: int, want_entropy: bool,
                     temperature: float):
  """Per-token logprobs [B, K] (and entropies, without gradient) of one parameter state.

  Args:
    graphdef, params: the model (`nnx.split`).
    batch: a `rollout.train_batch.TrainBatch` (its forward fields).
    chunk_size: > 0: the LM head's logsumexp runs over vocabulary chunks
      (`losses.chunked_target_logprobs`), never materialising [B, K, V]
      logits (no entropy then).
    want_entropy: also return the entropy of each scored distribution.
    temperature: logprobs of softmax(logits / temperature).
  Returns:
    (logp_BxK, entropy_BxK or None).
  """
  model = nnx.merge(graphdef, params)
  hidden = model.hidden(batch.tokens_BxL, batch.positions_BxL, tree_ends_BxL=batch.ends_BxL)
  if chunk_size:
    h = jnp.take_along_axis(hidden, batch.prev_BxK[..., None].astype(jnp.int32), axis=1)
    logp = losses.chunked_target_logprobs(h, model.head_weight(), batch.target_BxK,
                                          chunk_size, temperature=temperature)
    return logp, None
  logits_BxKxV = model.logits_at(hidden, batch.prev_BxK)
  logp = losses.target_logprobs(logits_BxKxV, batch.target_BxK, temperature=temperature)
  entropy = None
  if want_entropy:
    entropy = losses.target_entropy(jax.lax.stop_gradient(logits_BxKxV),
                                    temperature=temperature)
  return logp, entropy
