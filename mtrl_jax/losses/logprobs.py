"""Per-token logprobs and entropies from a forward pass, aligned with the tokens.

Alignment (`docs/internals.md`, "Shapes and alignment"): the value at [b, t]
describes token t given tokens[b, :t], so it comes from the logits at t - 1:

  logp[b, t] = log_softmax(logits[b, t - 1])[tokens[b, t]],   logp[b, 0] = 0.

`chunked_target_logprobs` (and its row alignment `chunked_token_logprobs`)
computes the same numbers from the final hidden states and the LM-head
weight, one vocabulary chunk at a time, so the full [B, L, V] logits never
exist at once (forward or backward).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _float(x):
  return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _shift_pad(x_BxLm1):
  """Puts the [B, L-1] values of positions 1..L-1 into [B, L] with 0 at t = 0."""
  return jnp.pad(x_BxLm1, ((0, 0), (1, 0)))


def _check(name, x, tokens_BxL, ndim):
  if x.ndim != ndim or x.shape[:2] != tokens_BxL.shape:
    raise ValueError(f"{name}: shape {x.shape} does not match tokens_BxL {tokens_BxL.shape}")


def token_logprobs(logits_BxLxV, tokens_BxL, *, temperature: float = 1.0):
  """Logprob of each token under the logits of the previous position.

  Args:
    logits_BxLxV: model output (any float dtype; computed in >= float32).
    tokens_BxL: int token ids in [0, V).
    temperature: the logits are divided by it (match the sampler's setting to
      compare with its behaviour logprobs).

  Returns:
    logp_BxL, float32 (float64 for float64 logits), logp[:, 0] = 0.
  """
  _check("token_logprobs: logits_BxLxV", logits_BxLxV, tokens_BxL, 3)
  logits = _float(logits_BxLxV[:, :-1])
  if temperature != 1.0:
    logits = logits / temperature
  targets = tokens_BxL[:, 1:, None].astype(jnp.int32)
  picked = jnp.take_along_axis(logits, targets, axis=-1)[..., 0]
  return _shift_pad(picked - jax.nn.logsumexp(logits, axis=-1))


def target_logprobs(logits_BxKxV, targets_BxK, *, temperature: float = 1.0):
  """log_softmax(logits[b, k] / temperature)[targets[b, k]]: no shift.

  Packed trees gather the logits of each trained token's predecessor on its
  path (`rollout.tree_packing`), so logits and targets already line up.
  """
  if logits_BxKxV.ndim != 3 or logits_BxKxV.shape[:2] != targets_BxK.shape:
    raise ValueError(
        f"target_logprobs: logits shape {logits_BxKxV.shape} does not match "
        f"targets {targets_BxK.shape}"
    )
  logits = _float(logits_BxKxV)
  if temperature != 1.0:
    logits = logits / temperature
  picked = jnp.take_along_axis(logits, targets_BxK[..., None].astype(jnp.int32), axis=-1)[..., 0]
  return picked - jax.nn.logsumexp(logits, axis=-1)


def target_entropy(logits_BxKxV, *, temperature: float = 1.0):
  """Entropy of softmax(logits[b, k] / temperature): no shift."""
  logits = _float(logits_BxKxV)
  if temperature != 1.0:
    logits = logits / temperature
  logq = jax.nn.log_softmax(logits, axis=-1)
  q = jnp.exp(logq)
  return -jnp.sum(q * jnp.where(q > 0, logq, 0), axis=-1)


def token_entropy(logits_BxLxV, *, temperature: float = 1.0):
  """Entropy of the next-token distribution, aligned like `token_logprobs`.

  Args:
    logits_BxLxV: model output.
    temperature: the logits are divided by it.

  Returns:
    entropy_BxL, entropy[:, t] = H(softmax(logits[:, t - 1])), entropy[:, 0] = 0.
  """
  if logits_BxLxV.ndim != 3:
    raise ValueError(f"token_entropy: logits_BxLxV has shape {logits_BxLxV.shape}")
  logits = _float(logits_BxLxV[:, :-1])
  if temperature != 1.0:
    logits = logits / temperature
  logq = jax.nn.log_softmax(logits, axis=-1)
  q = jnp.exp(logq)
  # 0 * log 0 = 0 for tokens with -inf logits (e.g. a masked vocabulary).
  logq = jnp.where(q > 0, logq, 0)
  return _shift_pad(-jnp.sum(q * logq, axis=-1))


def chunked_token_logprobs(
    hidden_BxLxD, weight_DxV, tokens_BxL, chunk_size: int, *, temperature: float = 1.0
):
  """`token_logprobs(hidden @ weight, tokens)` without materialising [B, L, V]
  (`chunked_target_logprobs` with the row alignment: logp[:, 0] = 0).

  Args:
    hidden_BxLxD: final hidden states after the final norm.
    weight_DxV: LM-head weight (`embed.T` for tied embeddings).
    tokens_BxL: int token ids in [0, V).
    chunk_size: vocabulary entries per chunk; need not divide V.
    temperature: the logits are divided by it.

  Returns:
    logp_BxL, float32, logp[:, 0] = 0.
  """
  _check("chunked_token_logprobs: hidden_BxLxD", hidden_BxLxD, tokens_BxL, 3)
  return _shift_pad(
      chunked_target_logprobs(
          hidden_BxLxD[:, :-1], weight_DxV, tokens_BxL[:, 1:], chunk_size, temperature=temperature
      )
  )


def chunked_target_logprobs(
    hidden_BxKxD, weight_DxV, targets_BxK, chunk_size: int, *, temperature: float = 1.0
):
  """`target_logprobs(hidden @ weight, targets)` without materialising [B, K, V].

  The log-normaliser is a running logsumexp over vocabulary chunks inside a
  rematerialised `lax.scan`, so the backward pass recomputes one chunk of
  logits at a time instead of storing them all.

  Args:
    hidden_BxKxD: final hidden states (after the final norm) of the positions
      whose next token is scored; their dtype is the matmul's compute dtype,
      accumulated in float32 like `Transformer.project`.
    weight_DxV: LM-head weight (`embed.T` for tied embeddings).
    targets_BxK: int token ids in [0, V): the token after each position.
    chunk_size: vocabulary entries per chunk; need not divide V.
    temperature: the logits are divided by it.

  Returns:
    logp_BxK, float32.
  """
  if hidden_BxKxD.ndim != 3 or hidden_BxKxD.shape[:2] != targets_BxK.shape:
    raise ValueError(
        f"chunked_target_logprobs: hidden shape {hidden_BxKxD.shape} does not "
        f"match targets {targets_BxK.shape}"
    )
  if weight_DxV.ndim != 2 or weight_DxV.shape[0] != hidden_BxKxD.shape[-1]:
    raise ValueError(
        f"chunked_target_logprobs: weight_DxV shape {weight_DxV.shape} does not "
        f"match hidden width {hidden_BxKxD.shape[-1]}"
    )
  if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size <= 0:
    raise ValueError(f"chunked_target_logprobs: chunk_size={chunk_size!r}; needs a positive int")
  h = hidden_BxKxD
  targets = targets_BxK.astype(jnp.int32)
  vocab = weight_DxV.shape[1]

  def add_chunk(carry, start, size):
    run_max, run_sum, picked = carry
    w = jax.lax.dynamic_slice_in_dim(weight_DxV, start, size, axis=1)
    logits = jnp.einsum("bld,dv->blv", h, w.astype(h.dtype), preferred_element_type=jnp.float32)
    if temperature != 1.0:
      logits = logits / temperature
    # The shift only stabilises exp; the result does not depend on it.
    new_max = jnp.maximum(run_max, jax.lax.stop_gradient(logits.max(-1)))
    run_sum = run_sum * jnp.exp(run_max - new_max) + jnp.exp(logits - new_max[..., None]).sum(-1)
    local = targets - start
    inside = (local >= 0) & (local < size)
    hit = jnp.take_along_axis(logits, jnp.clip(local, 0, size - 1)[..., None], axis=-1)[..., 0]
    return new_max, run_sum, picked + jnp.where(inside, hit, 0.0)

  shape = targets.shape
  carry = (
      jnp.full(shape, -jnp.inf, jnp.float32),
      jnp.zeros(shape, jnp.float32),
      jnp.zeros(shape, jnp.float32),
  )
  num_full, tail = divmod(vocab, chunk_size)
  if num_full:
    body = jax.checkpoint(lambda c, i: (add_chunk(c, i * chunk_size, chunk_size), None))
    carry, _ = jax.lax.scan(body, carry, jnp.arange(num_full))
  if tail:
    carry = jax.checkpoint(lambda c: add_chunk(c, num_full * chunk_size, tail))(carry)
  run_max, run_sum, picked = carry
  return picked - (run_max + jnp.log(run_sum))
