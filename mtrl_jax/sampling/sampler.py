"""Jitted branching KV-cache sampler: prefill each prompt once, decode G continuations.

Layout of one `Sampler.generate` call (all of it is ONE jitted call):
  * The P prompts are left-padded to a bucketed length Lp, so every row's last
    prompt token sits in slot Lp - 1; RoPE positions count valid tokens only
    (cumsum of the valid mask, minus one), and a query attends to the valid
    slots at or before its own.
  * Prefill runs once per prompt ([P_bucket, Lp] rows) into a cache of
    S = Lp + N slots (N = bucketed number of new tokens).
  * Branch: the prefilled cache and the last-position logits are gathered
    along the batch into B = bucket(P * G) rows, row p * G + g reading prompt p.
  * Decode runs in one `lax.while_loop`: sample a token per row, feed it back
    through `forward_cached` at slot Lp + t; it stops when every row finished
    (stop token or max_new_tokens) or max_new_tokens steps were taken. Rows
    that finished keep emitting `pad_id` with logprob 0. The KV cache is
    created and consumed inside the call, so it never crosses the jit boundary
    (XLA updates it in place; nothing to donate).

Randomness: the uniform that drives the token of row r at step t is
`uniform(fold_in(fold_in(key, r), t))`, where r = p * G + g is the row's index
in the result (with several processes: among every process's real rows, in
process order, so the rows of a 2-process run draw what the same rows of a
1-process run draw). A row's samples therefore depend only on (key, r, t, its
prompt), not on the batch layout: P prompts x G branches give the same tokens
as the P * G repeated prompts with G = 1 (up to float rounding of the batch
size), which the tests check. With `prompt_keys` (one key per prompt) row
p * G + g uses `fold_in(prompt_keys[p], g)` instead, so a prompt's samples
depend only on its own key, never on which other prompts share the call (the
judges' and user simulators' per-call keys, `generation.LocalLLM`).

Separate policies of one graph (`generate_stacked`, `sampling/stacked.py`):
their parameters are stacked on a leading agent axis and the same program is
mapped over it, so ONE compiled call samples every agent's prompts of a tree
level.

Compilation: shapes are bucketed (prompt rows, prompt length, decode rows,
new-token slots, number of stop ids) and temperature, top_p, max_new_tokens,
G, pad_id and the stop ids are traced, so only the bucket sizes and the
static choices (greedy, top_k, whether top_p < 1) select a compiled program.
`Sampler.num_compiles` counts traces of the jitted function (one per compiled
program).

Sharding: with a mesh, parameters are placed with `SAMPLE_RULES` (no FSDP:
weights are gathered once per call, not per step) and every batch-sized array
and the KV cache are sharded over (data, fsdp) on the batch axis; the cache's
KV-head axis follows the `kv_heads` rule so the cache update is sharded like
its operand. With several processes (`mtrl_jax.distributed`) each process
brings its own prompts: prompt counts and lengths are agreed across processes
(a host all-gather), every process pads its block of rows to the common
bucket, the blocks form global arrays, and each process reads back its own
block of results. A process with no prompts still takes part. (Stacked calls
are single-process: separate policies are refused with several processes.)
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

# models before sharding: `import mtrl_jax.sharding` first is a circular import.
from mtrl_jax.models.config import ModelConfig
from mtrl_jax.models.transformer import KVCache, Transformer, init_cache
from mtrl_jax import sharding  # pylint: disable=g-bad-import-order
from mtrl_jax import distributed
from mtrl_jax.buckets import bucket_or_pow2, next_pow2, round_up
from mtrl_jax.sampling.config import SampleResult, SamplingConfig  # noqa: F401  (public here)
from mtrl_jax.sampling.filters import choose_tokens
from mtrl_jax.sampling.stacked import StackedSampling


def _check_buckets(buckets, name):
  if buckets is None:
    return None
  buckets = tuple(buckets)
  if not buckets or any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) or b < 1
                        for b in buckets):
    raise ValueError(f"Sampler.{name}={buckets!r}; allowed: None (powers of two) or a "
                     "non-empty sequence of positive ints")
  return tuple(sorted(int(b) for b in buckets))


class Sampler(StackedSampling):
  """Branching KV-cache sampler for one model graph (weights passed per call)."""

  def __init__(self, model_cfg: ModelConfig, *, mesh: Optional[jax.sharding.Mesh] = None,
               batch_buckets: Optional[Sequence[int]] = None,
               prompt_buckets: Optional[Sequence[int]] = None,
               decode_buckets: Optional[Sequence[int]] = None,
               decode_chunk: Optional[int] = None,
               agent_map: Optional[str] = None,
               rules=sharding.SAMPLE_RULES):
    """Builds the sampler; nothing is compiled until the first `generate`.

    Args:
      model_cfg: the model's hyper-parameters (fixes the graph).
      mesh: optional (data, fsdp, tensor) mesh; its axes are used as Auto.
      batch_buckets: allowed row counts for prefill (P) and decode (P * G);
        None: powers of two. Decode rows are also rounded up to a multiple of
        the data x fsdp size so the batch shards evenly.
      prompt_buckets: allowed padded prompt lengths; None: powers of two >= 16.
      decode_buckets: allowed numbers of new-token slots (cache length =
        prompt bucket + decode bucket); None: powers of two >= 16.
      decode_chunk: decode steps per iteration of the device loop. The loop
        checks "every row done?" once per iteration, and on a GPU that
        predicate travels to the host each time, so a chunk of k unrolled steps
        syncs k times less often (at most k - 1 wasted steps at the end, their
        writes discarded). None: 1 on CPU (no sync to save, and unrolling
        multiplies compile time), 8 elsewhere.
      agent_map: how `generate_stacked` maps the program over the agent axis:
        'vmap' (agents batched into each op: one decode loop in lockstep,
        batched matmuls) or 'map' (`lax.map`: the agents' loops one after the
        other inside the one program; each agent's arithmetic is exactly its
        single-agent program's, so samples are bit-identical to `generate`).
        None: 'map' on CPU (measured faster there, docs/performance.md), 'vmap'
        elsewhere. 'vmap' matches `generate` up to float rounding of batched
        matmuls (the same tokens unless a uniform sits within that rounding
        of a token boundary).
      rules: logical-axis rules for parameters while sampling.
    """
    # Decoding attends one query at a time over a cache: the masked einsum
    # serves every device (cuDNN's fused attention is for training forwards).
    self.model_cfg = model_cfg = model_cfg.replace(attention="xla")
    self.batch_buckets = _check_buckets(batch_buckets, "batch_buckets")
    self.prompt_buckets = _check_buckets(prompt_buckets, "prompt_buckets")
    self.decode_buckets = _check_buckets(decode_buckets, "decode_buckets")
    if decode_chunk is None:
      decode_chunk = 1 if jax.default_backend() == "cpu" else 8
    if isinstance(decode_chunk, bool) or not isinstance(decode_chunk, int) or decode_chunk < 1:
      raise ValueError(f"Sampler.decode_chunk={decode_chunk!r}; allowed: None or an int >= 1")
    self.decode_chunk = decode_chunk
    if agent_map is None:
      agent_map = "map" if jax.default_backend() == "cpu" else "vmap"
    if agent_map not in ("vmap", "map"):
      raise ValueError(f"Sampler.agent_map={agent_map!r}; allowed: None, 'vmap' or 'map'")
    self.agent_map = agent_map
    if mesh is not None and any(t != AxisType.Auto for t in mesh.axis_types):
      # Explicit axes would make the cache update's sharding part of its type.
      mesh = jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                               axis_types=(AxisType.Auto,) * len(mesh.axis_names))
    self.mesh = mesh
    abstract_mesh = mesh if mesh is not None else sharding.single_device_mesh()
    model_rules = sharding.rules_for(model_cfg, abstract_mesh, rules)
    with jax.set_mesh(abstract_mesh), nnx.logical_axis_rules(model_rules):
      abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
      self._graphdef, abstract_state = nnx.split(abstract)
      self._state_shardings = (nnx.get_named_sharding(abstract_state, mesh)
                               if mesh is not None else None)
    self._kv_axis = dict(model_rules).get("kv_heads")
    self._num_traces = 0
    static = ("num_new", "greedy", "top_k", "use_top_p")
    self._jitted = jax.jit(self._generate_impl, static_argnames=static)
    self._jitted_stacked = jax.jit(self._generate_stacked_impl, static_argnames=static)

  @property
  def num_compiles(self) -> int:
    """How many programs were traced and compiled so far."""
    return self._num_traces

  @property
  def num_batch_shards(self) -> int:
    if self.mesh is None:
      return 1
    return self.mesh.shape["data"] * self.mesh.shape["fsdp"]

  # ------------------------------------------------------------- host side
  def generate(self, state: nnx.State, prompts: Sequence[Sequence[int]], num_generations: int,
               sampling: SamplingConfig, key: jax.Array, stop_ids: Sequence[int],
               pad_id: int, *, prompt_keys: Optional[jax.Array] = None) -> SampleResult:
    """Samples `num_generations` completions of every prompt.

    Args:
      state: parameters, `nnx.split(model)[1]` of a model built from `model_cfg`.
      prompts: P lists of token ids (each non-empty).
      num_generations: G >= 1 branches per prompt.
      sampling: temperature / filters / length limit.
      key: PRNG key; row r, step t uses fold_in(fold_in(key, r), t).
      stop_ids: ids that end a completion (part of it); may be empty.
      pad_id: id written after a row's end.
      prompt_keys: optional P keys (a typed key array of shape [P]); then row
        p * G + g, step t uses fold_in(fold_in(prompt_keys[p], g), t) and
        `key` is not used.
    Returns:
      SampleResult with rows ordered p * G + g.
    """
    prompts, stop = self._check(prompts, num_generations, sampling, stop_ids, pad_id,
                                allow_empty=jax.process_count() > 1)
    n_prompts, g = len(prompts), int(num_generations)
    n_rows, max_new = n_prompts * g, sampling.max_new_tokens
    args, static = self._prepare(prompts, g, sampling, key, stop, pad_id, prompt_keys)
    out = self._jitted(self._put_state(state), *args, **static)
    tokens, logp, lengths, stopped = (distributed.local_rows(x) for x in out)
    return SampleResult(
        tokens=np.asarray(tokens[:n_rows, :max_new]),
        logprobs=np.asarray(logp[:n_rows, :max_new]),
        lengths=np.asarray(lengths[:n_rows]),
        finish_reason=["stop" if s else "length" for s in stopped[:n_rows]])

  def _check(self, prompts, num_generations, sampling, stop_ids, pad_id, name="prompts",
             allow_empty=False):
    """Validated prompts (int64 arrays) and stop ids of a call (`allow_empty`: a process
    with nothing to sample still takes part in a multi-process call)."""
    if not isinstance(sampling, SamplingConfig):
      raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    vocab = self.model_cfg.vocab_size
    if isinstance(num_generations, bool) or not isinstance(num_generations, (int, np.integer)) \
        or num_generations < 1:
      raise ValueError(f"num_generations={num_generations!r}; allowed: an int >= 1")
    if not isinstance(pad_id, (int, np.integer)) or not 0 <= pad_id < vocab:
      raise ValueError(f"pad_id={pad_id!r}; allowed: an int in [0, {vocab})")
    stop = [int(s) for s in stop_ids]
    if any(not 0 <= s < vocab for s in stop):
      raise ValueError(f"stop_ids={stop}; allowed: ints in [0, {vocab})")
    if len(prompts) == 0 and not allow_empty:
      raise ValueError(f"{name} is empty; allowed: a non-empty list of token-id lists")
    prompts = [np.asarray(p, dtype=np.int64).reshape(-1) for p in prompts]
    for i, p in enumerate(prompts):
      if p.size == 0:
        raise ValueError(f"{name}[{i}] is empty; every prompt needs at least one token")
      if p.min() < 0 or p.max() >= vocab:
        raise ValueError(f"{name}[{i}] has ids outside [0, {vocab})")
    return prompts, stop

  def _prepare(self, prompts, g: int, sampling: SamplingConfig, key, stop: list, pad_id: int,
               prompt_keys=None):
    """The jitted call's device arguments and static choices for these prompts."""
    # Several processes: each brings its own prompts; every process compiles
    # and runs the same program, so counts and lengths are agreed (max) and
    # each process pads its block of rows to the common bucket. Row r of this
    # process draws its randomness as row `offset + r` of every process's real
    # rows, so a row samples the same tokens whatever the process count.
    counts = distributed.allgather((len(prompts), max((p.size for p in prompts), default=1)))
    offset = sum(c[0] for c in counts[:jax.process_index()]) * g
    host, static = self._layout(prompts, g, sampling, stop, pad_id,
                                rows_for=max(max(c[0] for c in counts), 1),
                                len_for=max(c[1] for c in counts), key_offset=offset)
    n_prompts, p_rows, rows = len(prompts), host[0].shape[0], host[2].shape[0]
    put, rep = self._put_batch, self._put_replicated
    if prompt_keys is not None:
      prompt_keys = jnp.asarray(prompt_keys)
      if prompt_keys.shape != (n_prompts,) or not jax.dtypes.issubdtype(
          prompt_keys.dtype, jax.dtypes.prng_key):
        raise ValueError(f"prompt_keys: a typed key array of shape ({n_prompts},) expected, got "
                         f"{prompt_keys.dtype}{tuple(prompt_keys.shape)}")
      if jax.process_count() > 1:
        raise ValueError("Sampler.generate(prompt_keys=...) with several processes: per-call "
                         "model services (judges, user simulators) need a process-local mesh")
      # Padding prompts reuse the last key; their rows are inactive.
      prompt_keys = rep(prompt_keys[np.minimum(np.arange(p_rows), n_prompts - 1)])
      branch_B = rep(np.asarray(np.arange(rows) % g, np.uint32))
      key = (prompt_keys, branch_B)
    prompt_PxL, valid_PxL, src_B, active_B, keyrow_B, stop_arr = host
    args = (put(prompt_PxL), put(valid_PxL), put(src_B), put(active_B), put(keyrow_B),
            rep(stop_arr), key if prompt_keys is not None else rep(key))
    args += self._scalars(sampling, pad_id)
    return args, static

  def _scalars(self, sampling: SamplingConfig, pad_id: int) -> tuple:
    rep = self._put_replicated
    return (rep(np.float32(sampling.temperature)), rep(np.float32(sampling.top_p)),
            rep(np.int32(sampling.max_new_tokens)), rep(np.int32(pad_id)))

  def _layout(self, prompts, g: int, sampling: SamplingConfig, stop: list, pad_id: int, *,
              rows_for: Optional[int] = None, len_for: Optional[int] = None,
              active: bool = True, key_offset: int = 0):
    """Host arrays (prompt_PxL, valid_PxL, src_B, active_B, keyrow_B, stop ids) and
    static choices.

    Buckets follow `rows_for` prompts of `len_for` tokens when given (a stacked
    call lays every agent out in the largest agent's buckets; several processes
    lay out the largest process's); `active=False` marks every row inactive (an
    agent with nothing to sample in a stacked call); row r draws its randomness
    as row `key_offset + r`. With several processes the arrays are this
    process's block of the global rows.
    """
    n_prompts = len(prompts)
    rows_for = n_prompts if rows_for is None else rows_for
    len_for = max(p.size for p in prompts) if len_for is None else len_for
    max_new = sampling.max_new_tokens
    p_rows = bucket_or_pow2(rows_for, self.batch_buckets, "prompts (Sampler.batch_buckets)")
    procs = jax.process_count() if self.mesh is not None else 1
    shards = self.num_batch_shards // procs  # this process's batch shards
    if procs > 1:  # a process's block must split over its own devices
      p_rows = round_up(p_rows, shards)
    # Decode rows follow the prompt bucket, not the exact P * G, so the program
    # is a function of the prompt bucket alone (same sizes for power-of-two
    # buckets, fewer programs for custom ones), unless no bucket is that large.
    if self.batch_buckets is None or p_rows * g <= self.batch_buckets[-1]:
      rows = bucket_or_pow2(p_rows * g, self.batch_buckets, "rows (Sampler.batch_buckets)")
    else:
      rows = bucket_or_pow2(rows_for * g, self.batch_buckets, "rows (Sampler.batch_buckets)")
    rows = round_up(rows, shards)
    lp = bucket_or_pow2(len_for, self.prompt_buckets,
                        "prompt length (Sampler.prompt_buckets)", minimum=16)
    num_new = bucket_or_pow2(max_new, self.decode_buckets,
                             "max_new_tokens (Sampler.decode_buckets)", minimum=16)
    num_stop = next_pow2(len(stop), 4)

    prompt_PxL = np.full((p_rows, lp), pad_id, np.int32)
    valid_PxL = np.zeros((p_rows, lp), bool)
    for i, p in enumerate(prompts):
      prompt_PxL[i, lp - p.size:] = p
      valid_PxL[i, lp - p.size:] = True
    valid_PxL[n_prompts:, -1] = True  # padding prompts: one dummy token, never read
    # Row r continues its prompt r // g: global prompt row `first + r // g`.
    first = 0
    if procs > 1:
      total = p_rows * procs
      first = distributed.row_block(sharding.batch_sharding(self.mesh, 2, total), total)[0]
    src_B = (first + np.minimum(np.arange(rows) // g, max(n_prompts - 1, 0))).astype(np.int32)
    active_B = (np.arange(rows) < n_prompts * g) & active
    keyrow_B = (key_offset + np.arange(rows)).astype(np.uint32)
    stop_arr = np.full((num_stop,), -1, np.int32)
    stop_arr[:len(stop)] = stop
    static = dict(num_new=num_new, greedy=sampling.greedy, top_k=sampling.top_k,
                  use_top_p=sampling.top_p < 1.0)
    return (prompt_PxL, valid_PxL, src_B, active_B, keyrow_B, stop_arr), static

  def precompile(self, state: nnx.State, num_prompts: int, prompt_len: int,
                 num_generations: int, sampling: SamplingConfig, num_stop_ids: int = 1,
                 key: Optional[jax.Array] = None) -> None:
    """Compiles the program a `generate` call of this size would use, without running it.

    The program is keyed by the buckets of `num_prompts` and `prompt_len`, the
    decode bucket of `sampling.max_new_tokens`, the number of stop ids, the
    static sampling choices and the key's type (`key`, default a raw
    `PRNGKey` as the rollout policies pass); a later `generate` in the same buckets reuses it
    (jax.jit's cache), so an RL loop can compile every bucket before its
    first step and then never again (DESIGN.md invariant 5).
    """
    prompts = [np.ones(prompt_len, np.int64)] * num_prompts
    key = jax.random.PRNGKey(0) if key is None else key
    args, static = self._prepare(prompts, int(num_generations), sampling, key,
                                 [0] * num_stop_ids, 0)
    self._jitted.lower(self._put_state(state), *args, **static).compile()

  def _put_state(self, state):
    if self.mesh is None:
      return state
    return jax.device_put(state, self._state_shardings)

  def _put_batch(self, x):
    """This process's block of rows `x` as a global array sharded on its rows."""
    if self.mesh is None:
      return jnp.asarray(x)
    rows = x.shape[0] * jax.process_count()
    return distributed.global_rows(x, sharding.batch_sharding(self.mesh, x.ndim, rows))

  def _put_replicated(self, x):
    if self.mesh is None:
      return jnp.asarray(x)
    return distributed.replicated_value(x, sharding.replicated(self.mesh))

  # ------------------------------------------------------------- device side
  def _constrain_rows(self, x):
    """Shards the leading (row) axis of `x` over data x fsdp (when it divides)."""
    if self.mesh is None:
      return x
    return jax.lax.with_sharding_constraint(
        x, sharding.batch_sharding(self.mesh, x.ndim, x.shape[0]))

  def _constrain_cache(self, cache: KVCache) -> KVCache:
    if self.mesh is None:
      return cache
    rows = cache.batch
    batch_axes = sharding.batch_sharding(self.mesh, 2, rows).spec[0]
    spec = NamedSharding(self.mesh, P(batch_axes, None, self._kv_axis, None))
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, spec), cache)

  def _generate_impl(self, state, prompt_PxL, valid_PxL, src_B, active_B, keyrow_B, stop_ids,
                     key, temperature, top_p, max_new, pad_id, *, num_new, greedy, top_k,
                     use_top_p):
    self._num_traces += 1  # runs once per trace, i.e. per compiled program
    model = nnx.merge(self._graphdef, state)
    n_p, lp = prompt_PxL.shape
    n_b = src_B.shape[0]
    s = lp + num_new
    slots_S = jnp.arange(s, dtype=jnp.int32)

    # Prefill the P prompts once.
    valid_PxS = jnp.concatenate([valid_PxL, jnp.ones((n_p, num_new), bool)], axis=1)
    positions_PxL = jnp.maximum(jnp.cumsum(valid_PxL, axis=1, dtype=jnp.int32) - 1, 0)
    causal_LxS = slots_S[None, :] <= jnp.arange(lp, dtype=jnp.int32)[:, None]
    mask_PxLxS = valid_PxS[:, None, :] & causal_LxS[None]
    cache = self._constrain_cache(init_cache(self.model_cfg, n_p, s))
    last_PxV, cache = model.forward_cached(prompt_PxL, positions_PxL, mask_PxLxS, cache, 0,
                                           last_only=True)

    # Branch: row r continues prompt src_B[r].
    cache = self._constrain_cache(jax.tree.map(lambda x: x[src_B], cache))
    logits_BxV = self._constrain_rows(last_PxV[src_B])
    valid_BxS = self._constrain_rows(valid_PxS[src_B])
    next_pos_B = self._constrain_rows(jnp.sum(valid_PxL, axis=1, dtype=jnp.int32)[src_B])

    steps_N = jnp.arange(num_new, dtype=jnp.uint32)
    if isinstance(key, tuple):  # per-prompt keys: row p * G + g folds in g
      prompt_keys_P, branch_B = key
      row_keys = jax.vmap(jax.random.fold_in)(prompt_keys_P[src_B], branch_B)
    else:
      row_keys = jax.vmap(lambda r: jax.random.fold_in(key, r))(keyrow_B)
    u_BxN = jax.vmap(lambda k: jax.vmap(
        lambda t: jax.random.uniform(jax.random.fold_in(k, t)))(steps_N))(row_keys)
    u_BxN = self._constrain_rows(u_BxN)
    choose = functools.partial(choose_tokens, temperature=temperature, top_p=top_p,
                               greedy=greedy, top_k=top_k, use_top_p=use_top_p)

    def record(t, logits_BxV, carry):
      tokens_BxN, logp_BxN, done_B, stopped_B, length_B = carry
      u_B = jax.lax.dynamic_index_in_dim(u_BxN, t, axis=1, keepdims=False)
      tok_B, logq_B = choose(logits_BxV, u_B)
      tok_B = jnp.where(done_B, pad_id, tok_B)
      logq_B = jnp.where(done_B, 0.0, logq_B)
      # Steps past the buffer (the tail of a decode chunk) must not write: a
      # dynamic update would clamp onto the last column.
      inside = t < num_new
      tokens_BxN = jnp.where(inside, jax.lax.dynamic_update_index_in_dim(
          tokens_BxN, tok_B, t, axis=1), tokens_BxN)
      logp_BxN = jnp.where(inside, jax.lax.dynamic_update_index_in_dim(
          logp_BxN, logq_B, t, axis=1), logp_BxN)
      hit_B = jnp.any(tok_B[:, None] == stop_ids[None, :], axis=-1) & ~done_B
      length_B = length_B + (~done_B).astype(jnp.int32)
      stopped_B = stopped_B | hit_B
      done_B = done_B | hit_B | (t + 1 >= max_new)
      return tok_B, (tokens_BxN, logp_BxN, done_B, stopped_B, length_B)

    out0 = (self._constrain_rows(jnp.full((n_b, num_new), pad_id, jnp.int32)),
            self._constrain_rows(jnp.zeros((n_b, num_new), jnp.float32)),
            ~active_B, jnp.zeros((n_b,), bool), jnp.zeros((n_b,), jnp.int32))
    tok_B, out0 = record(jnp.int32(0), logits_BxV, out0)

    def cond(loop):
      t, _, _, out = loop
      return (t < max_new) & ~jnp.all(out[2])

    def step(loop):
      t, tok_B, cache, out = loop
      slot = lp + t - 1  # slot of the token sampled at step t - 1
      mask_Bx1xS = (valid_BxS & (slots_S[None, :] <= slot))[:, None, :]
      # A chunk's steps past the last real one write slot S - 1 (the update
      # clamps there), which no real step reads: real steps use slots <= S - 2.
      logits_Bx1xV, cache = model.forward_cached(
          tok_B[:, None], (next_pos_B + t - 1)[:, None], mask_Bx1xS, cache, slot)
      tok_B, out = record(t, logits_Bx1xV[:, 0, :], out)
      return t + 1, tok_B, self._constrain_cache(cache), out

    def body(loop):
      for _ in range(self.decode_chunk):  # unrolled: one loop predicate per chunk
        loop = step(loop)
      return loop

    _, _, _, out = jax.lax.while_loop(cond, body, (jnp.int32(1), tok_B, cache, out0))
    tokens_BxN, logp_BxN, _, stopped_B, length_B = out
    # Rows stay on their devices: each process reads back its own block.
    return tuple(self._constrain_rows(x) for x in (tokens_BxN, logp_BxN, length_B, stopped_B))
