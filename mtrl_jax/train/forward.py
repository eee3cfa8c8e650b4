"""The policy forward of training: per-token logprobs of a `TrainBatch`.

One function serves the train step, the old-logprob pass of several updates
per batch and the stacked (one policy per agent) step. The forward uses the
batch's attention structure (`rollout.train_batch`: packed trees, or causal
rows) and the LM head runs only at `prev_BxK`, each trained token's
predecessor, giving [B, K] logprobs of `target_BxK`. With a critic's value
fields (`value_pos_BxK`) the same pass also reads the value head there
(`forward_values`): values for every action of a packed tree from one forward.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from mtrl_jax import losses


def forward_values(graphdef, params, batch):
  """The value head at `batch.value_pos_BxK` ([B, K] float32; meaningful on
  `value_mask_BxK`), without the LM head: the rollout's value pass."""
  model = nnx.merge(graphdef, params)
  hidden = model.hidden(batch.tokens_BxL, batch.positions_BxL, tree_ends_BxL=batch.ends_BxL)
  return model.values_at(hidden, batch.value_pos_BxK)


def forward_logprobs(
    graphdef, params, batch, chunk_size: int, want_entropy: bool, temperature: float
):
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
    (logp_BxK, entropy_BxK or None, values_BxK or None): values from the value
    head where the batch has a critic's value fields.
  """
  model = nnx.merge(graphdef, params)
  hidden = model.hidden(batch.tokens_BxL, batch.positions_BxL, tree_ends_BxL=batch.ends_BxL)
  values = None
  if batch.value_pos_BxK is not None:
    values = model.values_at(hidden, batch.value_pos_BxK)
  if chunk_size:
    h = jnp.take_along_axis(hidden, batch.prev_BxK[..., None].astype(jnp.int32), axis=1)
    logp = losses.chunked_target_logprobs(
        h, model.head_weight(), batch.target_BxK, chunk_size, temperature=temperature
    )
    return logp, None, values
  logits_BxKxV = model.logits_at(hidden, batch.prev_BxK)
  logp = losses.target_logprobs(logits_BxKxV, batch.target_BxK, temperature=temperature)
  entropy = None
  if want_entropy:
    entropy = losses.target_entropy(jax.lax.stop_gradient(logits_BxKxV), temperature=temperature)
  return logp, entropy, values
