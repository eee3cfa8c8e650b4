"""The policy forward of training: per-token logprobs of a row or tree-packed batch.

One function serves the train step, the old-logprob pass of several updates
per batch and the stacked (one policy per agent) step, so the layouts they
read are named once (`forward_keys`).
"""

from __future__ import annotations

import jax
from flax import nnx

from mtrl_jax import losses
from mtrl_jax.train.objectives import is_tree_batch


def forward_logprobs(graphdef, params, batch, chunk_size: int, want_entropy: bool,
                     temperature: float):
  """Per-token logprobs (and entropies, without gradient) of one parameter state.

  Row batches: every position of `tokens_BxL`, aligned as `losses.token_logprobs`;
  `chunk_size` > 0 computes them in sequence chunks without the full
  [B, L, V] logits (no entropy then). Tree-packed batches: the forward uses the
  packed attention structure and the LM head runs only at `prev_BxK` (each
  trained token's predecessor), giving [B, K] logprobs of `target_BxK`.
  """
  model = nnx.merge(graphdef, params)
  tokens_BxL = batch["tokens_BxL"]
  if is_tree_batch(batch):
    if chunk_size:
      raise ValueError("StepConfig.logprob_chunk_size is not supported for tree-packed "
                       "batches (their logits are already limited to trained tokens)")
    hidden = model.hidden(tokens_BxL, batch["positions_BxL"], tree_ends_BxL=batch["ends_BxL"])
    logits_BxKxV = model.logits_at(hidden, batch["prev_BxK"])
    logp = losses.target_logprobs(logits_BxKxV, batch["target_BxK"], temperature=temperature)
    entropy = None
    if want_entropy:
      entropy = losses.target_entropy(jax.lax.stop_gradient(logits_BxKxV),
                                      temperature=temperature)
    return logp, entropy
  if chunk_size:
    hidden = model.hidden(tokens_BxL)
    logp = losses.chunked_token_logprobs(hidden, model.head_weight(), tokens_BxL,
                                         chunk_size, temperature=temperature)
    return logp, None
  logits_BxLxV = model(tokens_BxL)
  logp = losses.token_logprobs(logits_BxLxV, tokens_BxL, temperature=temperature)
  entropy = None
  if want_entropy:
    entropy = losses.token_entropy(jax.lax.stop_gradient(logits_BxLxV), temperature=temperature)
  return logp, entropy


def forward_keys(batch) -> tuple:
  """The entries a forward pass of `batch` reads (row or tree-packed layout)."""
  if is_tree_batch(batch):
    return ("tokens_BxL", "positions_BxL", "ends_BxL", "prev_BxK", "target_BxK")
  return ("tokens_BxL",)
