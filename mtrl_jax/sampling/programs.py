"""The rollout engine's device programs: admit (prefill into slots) and decode (k steps).

The KV pool of `DecodeEngine` is one array per layer for keys and one for
values, each [D, A, S1, K, C, Dh]: D batch shards (data x fsdp; one block per
device, so a shard's slots never leave its device), A parameter sets (1 for a
shared policy, N for separate policies stacked on an agent axis), S1 = S
slots + 1 scratch slot per (shard, agent), K key/value heads, C cache
columns, Dh head width (heads before columns: a decode step reads each
head's columns in place). A slot's cache is contiguous from column 0: the token
at column c has RoPE position c. Column C - 1 is never valid content: writes
that must land nowhere (padding tokens, rows that already finished) go there.

Beside the pool, `SlotRows` holds each slot's decoding state on the device
([D, A, S1] arrays: next input token, its column, tokens drawn, finished), so
one decode call follows another without the host reading the first's
results: the engine dispatches a chunk before it reads the previous one.

Both programs gather the rows they work on ([D, A, R] slot indices; padding
rows name the scratch slot S1 - 1), run the model on them, and scatter the
rows back, so the pool and the slot state (both donated) are updated in place:

  admit   rows `src` read, E new tokens each written at columns
          [start, start + n) (prefill of a prompt's tail on top of a cached
          prefix; n may be 0), then the row is written to up to F `dst`
          slots (a fork: G siblings share one prefill; src may be one of them),
          whose state starts a sample: the prompt's last token as input at
          column start + n, nothing drawn, not finished.
          No LM head: the last prompt token is fed by the first decode step.
  decode  up to `steps` decode steps for every row whose slot has not
          finished: feed the row's input token at its column, sample the next
          token from the logits with the uniform of (key, row, t)
          (`sample_uniform`), finish on a stop id or the row's token budget.
          Runs over the first `window` columns only (a bucket of each row's
          prompt plus budget), so attention costs what the contexts are long,
          not what the pool can hold. A row that finished in an earlier call
          (the host names it before it has read that call) takes no step and
          writes only column `window` - 1, past its sample.

Separate policies: with agent_map 'map' each agent's rows run through its own
parameters one agent after another inside the program; 'vmap' batches the
agents into each op.
"""

from __future__ import annotations

import functools

import flax
import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from mtrl_jax import sharding
from mtrl_jax.models.cache import KVCache
from mtrl_jax.sampling.filters import choose_tokens


def sample_uniform(key_2, row, t):
  """The uniform that picks token t of a sample: uniform(fold_in(fold_in(key, row), t)).

  `key_2` is raw key data (uint32 [2]); a request's samples differ by `row`.
  """
  return jax.random.uniform(jax.random.fold_in(jax.random.fold_in(key_2, row), t))


@flax.struct.dataclass
class SlotRows:
  """Each slot's decoding state on the device, [D, A, S1] per field (the scratch slot's
  is garbage): what the next decode step of the slot's sample feeds and where."""

  # int32: the next input token (the prompt's last, then the last sampled).
  token: jax.Array
  # int32: the column (and RoPE position) it is written at.
  pos: jax.Array
  # int32: tokens the sample has drawn (the `t` of its next uniform).
  t: jax.Array
  # bool: the sample drew a stop id or its whole budget.
  done: jax.Array


@flax.struct.dataclass
class DecodeCarry:
  """The decode loop's state over one agent's N rows (`Programs._decode`)."""

  # Decode steps run so far: the column of `tokens_NxS` the next step writes.
  step: jax.Array
  # The rows' caches over the decode window ([N, K, window, Dh] per layer).
  cache: KVCache
  # [N] each row's next input token: its last sampled token (its prompt's last at first).
  token_N: jax.Array
  # [N] the column (and RoPE position) the next input token is written at.
  pos_N: jax.Array
  # [N] tokens the sample has drawn so far: the `t` of its next uniform.
  t_N: jax.Array
  # [N] rows that take no more steps: padding, stopped, or out of budget.
  done_N: jax.Array
  # [N] rows that sampled a stop id.
  stopped_N: jax.Array
  # [N] tokens sampled by this call.
  count_N: jax.Array
  # [N, steps] the token sampled at each step (the pad id where a row took none).
  tokens_NxS: jax.Array
  # [N, steps] its log q (0 where a row took none).
  logq_NxS: jax.Array


class Programs:
  """Jitted admit / decode over a KV pool for one model graph (see the module docstring).

  Args:
    graphdef: the model's graph (`nnx.split(model)[0]`).
    mesh: the sampling mesh (Auto axes).
    kv_axis: the mesh axis of the pool's K axis (the `kv_heads` rule), or None.
    agent_map: 'map' or 'vmap' (separate policies; see the module docstring).
  """

  def __init__(self, graphdef, mesh, kv_axis, agent_map: str):
    self.graphdef, self.mesh, self.kv_axis, self.agent_map = graphdef, mesh, kv_axis, agent_map
    self.num_traces = 0
    self.admit = jax.jit(self._admit, static_argnames=("stacked",), donate_argnums=(1, 2))
    self.decode = jax.jit(
        self._decode,
        donate_argnums=(1, 2),
        static_argnames=("stacked", "window", "steps", "greedy", "top_k", "use_top_p"),
    )

  # ------------------------------------------------------------ layout helpers
  def _shard(self, x):
    """Constrains `x` to be split over data x fsdp on axis 0 (the shard axis D)."""
    spec = [sharding.BATCH_AXES] + [None] * (x.ndim - 1)
    if x.ndim == 6:  # pool layers [D, A, S1, K, C, Dh] and gathered rows [D, A, R, K, W, Dh]
      spec[3] = self.kv_axis
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, P(*spec)))

  @staticmethod
  def _gather(pool_layer, rows_DxAxR, window):
    """[D, A, R, K, window, Dh]: the rows' first `window` columns (a per-shard gather)."""

    def one_shard(p_AxSxKxCxE, r_AxR):
      agents = jnp.arange(r_AxR.shape[0])[:, None]
      return p_AxSxKxCxE[agents, r_AxR, :, :window]

    return jax.vmap(one_shard)(pool_layer, rows_DxAxR)

  @staticmethod
  def _get_rows(x_DxAxS, rows_DxAxR):
    """[D, A, R]: each row's entry of a per-slot array."""

    def one_shard(x_AxS, r_AxR):
      return x_AxS[jnp.arange(r_AxR.shape[0])[:, None], r_AxR]

    return jax.vmap(one_shard)(x_DxAxS, rows_DxAxR)

  @staticmethod
  def _set_rows(x_DxAxS, rows_DxAxR, vals_DxAxR):
    """A per-slot array with each row's entry set (padding rows all set the scratch slot's)."""

    def one_shard(x_AxS, r_AxR, v_AxR):
      return x_AxS.at[jnp.arange(r_AxR.shape[0])[:, None], r_AxR].set(v_AxR)

    return jax.vmap(one_shard)(x_DxAxS, rows_DxAxR, vals_DxAxR)

  def _put_state(self, state: SlotRows, rows_DxAxR, rows: SlotRows) -> SlotRows:
    """`state` with the rows' slots set to `rows` ([D, A, R] per field)."""
    return jax.tree.map(lambda x, v: self._shard(self._set_rows(x, rows_DxAxR, v)), state, rows)

  @staticmethod
  def _scatter(pool_layer, rows_DxAxR, window, vals):
    """`pool_layer` with the rows' first `window` columns set to `vals` [D, A, R, K, window, Dh]."""

    def one_shard(p, r_AxR, v):
      agents = jnp.arange(r_AxR.shape[0])[:, None]
      return p.at[agents, r_AxR, :, :window].set(v, mode="promise_in_bounds")

    return jax.vmap(one_shard)(pool_layer, rows_DxAxR, vals)

  def _per_agent(self, fn, params, stacked: bool, *args):
    """Runs fn(params_a, *args_a) for every agent; args are [A, ...] arrays (or pytrees).

    Returns fn's outputs stacked on a leading agent axis.
    """
    if not stacked:
      out = fn(params, *jax.tree.map(lambda x: x[0], args))
      return jax.tree.map(lambda x: x[None], out)
    if self.agent_map == "vmap":
      return jax.vmap(fn)(params, *args)
    num = jax.tree.leaves(args)[0].shape[0]
    outs = [
        fn(jax.tree.map(lambda x, a=a: x[a], params), *jax.tree.map(lambda x, a=a: x[a], args))
        for a in range(num)
    ]
    return jax.tree.map(lambda *x: jnp.stack(x), *outs)

  def _rows_cache(self, pool: KVCache, rows_DxAxR, window) -> KVCache:
    """The gathered rows as one cache per agent: [A, D * R, K, window, Dh] per layer."""

    def flat(layer):
      g = self._shard(self._gather(layer, rows_DxAxR, window))
      d, a, r = g.shape[:3]
      return jnp.swapaxes(g, 0, 1).reshape((a, d * r) + g.shape[3:])

    return KVCache(k=tuple(flat(x) for x in pool.k), v=tuple(flat(x) for x in pool.v))

  def _put_back(self, pool: KVCache, rows_DxAxR, window, cache: KVCache) -> KVCache:
    d, a, r = rows_DxAxR.shape

    def unflat(layer, vals):
      vals = jnp.swapaxes(vals.reshape((a, d, r) + vals.shape[2:]), 0, 1)
      return self._shard(self._scatter(layer, rows_DxAxR, window, vals))

    return KVCache(
        k=tuple(unflat(x, y) for x, y in zip(pool.k, cache.k)),
        v=tuple(unflat(x, y) for x, y in zip(pool.v, cache.v)),
    )

  @staticmethod
  def _flat(x_DxAx):
    """[D, A, R, ...] -> [A, D * R, ...] (the model's batch is every shard's rows)."""
    d, a = x_DxAx.shape[:2]
    return jnp.swapaxes(x_DxAx, 0, 1).reshape((a, d * x_DxAx.shape[2]) + x_DxAx.shape[3:])

  @staticmethod
  def _unflat(x_AxN, d):
    a, n = x_AxN.shape[:2]
    return jnp.swapaxes(x_AxN.reshape((a, d, n // d) + x_AxN.shape[2:]), 0, 1)

  # ------------------------------------------------------------ admit
  def _admit(
      self,
      params,
      pool: KVCache,
      state: SlotRows,
      src_DxAxE,
      dst_DxAxExF,
      tokens_DxAxExX,
      start_DxAxE,
      count_DxAxE,
      last_DxAxE,
      *,
      stacked: bool,
  ):
    """Prefills `tokens` (the first `count` of each row) on top of `src`'s columns
    [0, start) and writes the rows to their `dst` slots, whose state starts a sample
    that feeds `last` (the prompt's last token) at column start + count."""
    self.num_traces += 1
    width = pool.k[0].shape[4]
    x = tokens_DxAxExX.shape[-1]
    cache = self._rows_cache(pool, src_DxAxE, width)
    tokens, start, count = (self._flat(v) for v in (tokens_DxAxExX, start_DxAxE, count_DxAxE))

    def one(params_a, cache_a, tokens_NxX, start_N, count_N):
      model = nnx.merge(self.graphdef, params_a)
      q = jnp.arange(x, dtype=jnp.int32)
      pos_NxX = start_N[:, None] + q[None, :]
      cols = jnp.arange(width, dtype=jnp.int32)
      mask = cols[None, None, :] <= pos_NxX[:, :, None]
      write = jnp.where(q[None, :] < count_N[:, None], pos_NxX, width - 1)
      _, cache_a = model.forward_cached(tokens_NxX, pos_NxX, mask, cache_a, write, head="none")
      return cache_a

    cache = self._per_agent(one, params, stacked, cache, tokens, start, count)
    zero = jnp.zeros_like(start_DxAxE)
    fresh = SlotRows(last_DxAxE, start_DxAxE + count_DxAxE, zero, zero.astype(bool))
    for f in range(dst_DxAxExF.shape[-1]):  # one scatter per fork target, no repeated copy
      dst = dst_DxAxExF[..., f]
      pool = self._put_back(pool, dst, width, cache)
      state = self._put_state(state, dst, fresh)
    return pool, state

  # ------------------------------------------------------------ decode
  def _decode(
      self,
      params,
      pool: KVCache,
      state: SlotRows,
      rows_DxAxR,
      key_DxAxRx2,
      keyrow_DxAxR,
      max_new_DxAxR,
      live_DxAxR,
      stop_ids,
      temperature,
      top_p,
      pad_id,
      *,
      stacked: bool,
      window: int,
      steps: int,
      greedy: bool,
      top_k: int,
      use_top_p: bool,
  ):
    """Up to `steps` decode steps of every live row whose sample has not finished; returns
    (pool, state, tokens [D, A, R, steps], logprobs, sampled counts [D, A, R], stopped
    [D, A, R], finished [D, A, R], steps run)."""
    self.num_traces += 1
    d = rows_DxAxR.shape[0]
    cache = self._rows_cache(pool, rows_DxAxR, window)
    now = jax.tree.map(lambda x: self._get_rows(x, rows_DxAxR), state)
    flat = [
        self._flat(v)
        for v in (
            now.token,
            now.pos,
            key_DxAxRx2,
            keyrow_DxAxR,
            now.t,
            max_new_DxAxR,
            live_DxAxR & ~now.done,
        )
    ]
    choose = functools.partial(
        choose_tokens,
        temperature=temperature,
        top_p=top_p,
        greedy=greedy,
        top_k=top_k,
        use_top_p=use_top_p,
    )
    cols = jnp.arange(window, dtype=jnp.int32)

    def one(params_a, cache_a, tok_N, pos_N, key_Nx2, keyrow_N, t_N, max_new_N, live_N):
      model = nnx.merge(self.graphdef, params_a)
      n = tok_N.shape[0]

      def cond(c: DecodeCarry):
        return (c.step < steps) & ~jnp.all(c.done_N)

      def body(c: DecodeCarry) -> DecodeCarry:
        go_N = ~c.done_N
        mask = (cols[None, :] <= c.pos_N[:, None])[:, None, :]
        write = jnp.where(go_N, c.pos_N, window - 1)[:, None]
        logits_NxV, cache_a = model.forward_cached(
            c.token_N[:, None], c.pos_N[:, None], mask, c.cache, write, head="last"
        )
        u_N = jax.vmap(sample_uniform)(key_Nx2, keyrow_N, c.t_N)
        new_N, logq_N = choose(logits_NxV, u_N)
        new_N = jnp.where(go_N, new_N, pad_id)
        logq_N = jnp.where(go_N, logq_N, 0.0)
        tokens_NxS = jax.lax.dynamic_update_index_in_dim(c.tokens_NxS, new_N, c.step, axis=1)
        logq_NxS = jax.lax.dynamic_update_index_in_dim(c.logq_NxS, logq_N, c.step, axis=1)
        hit_N = jnp.any(new_N[:, None] == stop_ids[None, :], axis=-1) & go_N
        step_N = go_N.astype(jnp.int32)
        t_N = c.t_N + step_N
        return DecodeCarry(
            step=c.step + 1,
            cache=cache_a,
            token_N=jnp.where(go_N, new_N, c.token_N),
            pos_N=c.pos_N + step_N,
            t_N=t_N,
            done_N=c.done_N | hit_N | (t_N >= max_new_N),
            stopped_N=c.stopped_N | hit_N,
            count_N=c.count_N + step_N,
            tokens_NxS=tokens_NxS,
            logq_NxS=logq_NxS,
        )

      init = DecodeCarry(
          step=jnp.int32(0),
          cache=cache_a,
          token_N=tok_N,
          pos_N=pos_N,
          t_N=t_N,
          done_N=~live_N,
          stopped_N=jnp.zeros((n,), bool),
          count_N=jnp.zeros((n,), jnp.int32),
          tokens_NxS=jnp.full((n, steps), pad_id, jnp.int32),
          logq_NxS=jnp.zeros((n, steps), jnp.float32),
      )
      c = jax.lax.while_loop(cond, body, init)
      ends = (c.token_N, c.pos_N, c.t_N, c.done_N)
      return c.cache, c.tokens_NxS, c.logq_NxS, c.count_N, c.stopped_N, ends, c.step

    cache, out_tok, out_lp, count, stopped, ends, ran = self._per_agent(
        one, params, stacked, cache, *flat
    )
    pool = self._put_back(pool, rows_DxAxR, window, cache)
    # Padding rows (not live) count as finished; their state lands in the scratch slot.
    token, pos, t, finished = (self._shard(self._unflat(x, d)) for x in ends)
    state = self._put_state(state, rows_DxAxR, SlotRows(token, pos, t, finished))
    outs = tuple(self._shard(self._unflat(x, d)) for x in (out_tok, out_lp, count, stopped))
    return (pool, state) + outs + (finished, jnp.max(ran))
