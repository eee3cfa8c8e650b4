"""Separate policies of one graph sampled in ONE compiled call (`Sampler.generate_stacked`).

The agents' parameters are stacked on a leading agent axis A and the program
of `Sampler.generate` is mapped over it: `jax.vmap`, or `lax.map` (the
`Sampler(agent_map=...)` choice; `'map'` runs each agent's exact single-agent
arithmetic, so its samples are bit-identical to sampling that agent alone).
Every agent is laid out in the largest agent's buckets, so one call samples
every agent's prompts of a tree level, each with its own parameters and key.

`StackedSampling` holds these methods for `Sampler` (its base class); the
layout, the buckets and the device-side decode loop are the sampler's own.
Stacked calls are single-process (separate policies are refused with several
processes).
"""

from __future__ import annotations

from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mtrl_jax import sharding
from mtrl_jax.sampling.config import SampleResult, SamplingConfig


class StackedSampling:
  """`Sampler`'s stacked calls (a base class: it uses the sampler's layout and program)."""

  def generate_stacked(self, states, prompts: Sequence[Sequence[Sequence[int]]],
                       num_generations: int, sampling: SamplingConfig, keys: jax.Array,
                       stop_ids: Sequence[int], pad_id: int) -> list[SampleResult]:
    """One compiled call samples every agent's prompts with its own parameters.

    Separate policies of this graph, their parameters stacked on a leading
    agent axis A: the program of `generate` is mapped over A (`agent_map`), so
    agent a's rows equal `generate(states[a], prompts[a], ..., keys[a], ...)`
    laid out in the same buckets. Every agent is laid out in the buckets of
    the largest agent's prompt count and longest prompt; an agent with no
    prompts gets inactive padding rows.

    Args:
      states: parameters with a leading agent axis A on every leaf.
      prompts: A lists of prompts (token-id lists); a list may be empty.
      num_generations, sampling, stop_ids, pad_id: as for `generate`.
      keys: A PRNG keys (raw uint32[A, 2]); agent a's row r, step t uses
        fold_in(fold_in(keys[a], r), t).
    Returns:
      One SampleResult per agent (rows p * G + g of its own prompts).
    """
    num_agents = len(prompts)
    leading = {np.shape(x)[0] for x in jax.tree.leaves(states)}
    if num_agents < 1 or leading != {num_agents}:
      raise ValueError(f"generate_stacked: {num_agents} prompt lists for states with leading "
                       f"sizes {sorted(leading)}; allowed: one list per stacked agent")
    if all(len(p) == 0 for p in prompts):
      raise ValueError("generate_stacked: every agent's prompt list is empty")
    checked = []
    for a, agent_prompts in enumerate(prompts):
      if len(agent_prompts):
        checked.append(self._check(agent_prompts, num_generations, sampling, stop_ids,
                                   pad_id, name=f"prompts[{a}]"))
      else:
        checked.append(([np.asarray([pad_id], np.int64)], [int(s) for s in stop_ids]))
    stop = next(c[1] for c, p in zip(checked, prompts) if len(p))
    g = int(num_generations)
    rows_for = max(len(p) for p in prompts)
    len_for = max(p.size for agent, _ in checked for p in agent)
    host = [self._layout(agent, g, sampling, stop, pad_id, rows_for=rows_for, len_for=len_for,
                         active=len(prompts[a]) > 0)
            for a, (agent, _) in enumerate(checked)]
    static = host[0][1]
    stacked = [np.stack([h[0][i] for h in host]) for i in range(5)]
    keys = self._check_keys(keys, num_agents)
    put = self._put_stacked
    out = self._jitted_stacked(self._put_stacked_state(states), *[put(x) for x in stacked],
                               self._put_replicated(host[0][0][5]), self._put_replicated(keys),
                               *self._scalars(sampling, pad_id), **static)
    tokens, logp, lengths, stopped = jax.device_get(out)
    max_new, results = sampling.max_new_tokens, []
    for a, agent_prompts in enumerate(prompts):
      n_rows = len(agent_prompts) * g
      results.append(SampleResult(
          tokens=np.asarray(tokens[a, :n_rows, :max_new]),
          logprobs=np.asarray(logp[a, :n_rows, :max_new]),
          lengths=np.asarray(lengths[a, :n_rows]),
          finish_reason=["stop" if s else "length" for s in stopped[a, :n_rows]]))
    return results

  @staticmethod
  def _check_keys(keys, num_agents: int):
    keys = jnp.asarray(keys)
    typed = jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key)
    if keys.shape != ((num_agents,) if typed else (num_agents, 2)):
      raise ValueError(f"generate_stacked: keys {keys.dtype}{tuple(keys.shape)}; allowed: one "
                       f"PRNG key per agent ({num_agents} typed keys or uint32[{num_agents}, 2])")
    return keys

  def precompile_stacked(self, states, num_prompts: int, prompt_len: int,
                         num_generations: int, sampling: SamplingConfig,
                         num_stop_ids: int = 1, key: Optional[jax.Array] = None) -> None:
    """`precompile` for `generate_stacked`: every agent `num_prompts` prompts of
    `prompt_len` tokens; `states` stacked (arrays or ShapeDtypeStructs)."""
    num_agents = {np.shape(x)[0] for x in jax.tree.leaves(states)}.pop()
    prompts = [np.ones(prompt_len, np.int64)] * num_prompts
    host, static = self._layout(prompts, int(num_generations), sampling, [0] * num_stop_ids, 0)
    key = jax.random.PRNGKey(0) if key is None else key
    keys = jnp.stack([key] * num_agents)
    put = self._put_stacked
    self._jitted_stacked.lower(
        self._put_stacked_state(states), *[put(np.stack([x] * num_agents)) for x in host[:5]],
        self._put_replicated(host[5]), self._put_replicated(keys),
        *self._scalars(sampling, 0), **static).compile()

  def _put_stacked_state(self, states):
    if self.mesh is None:
      return states
    sh = jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), self._state_shardings)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(states)):
      return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                          states, sh)
    return jax.device_put(states, sh)

  def _put_stacked(self, x):
    """An [A, rows, ...] array, sharded like a batch on its row axis."""
    if self.mesh is None:
      return jnp.asarray(x)
    spec = sharding.batch_sharding(self.mesh, x.ndim - 1, x.shape[1]).spec
    return jax.device_put(x, NamedSharding(self.mesh, P(None, *spec)))

  def _generate_stacked_impl(self, states_A, prompt_AxPxL, valid_AxPxL, src_AxB, active_AxB,
                             keyrow_AxB, stop_ids, keys_A, temperature, top_p, max_new, pad_id,
                             **static):
    def one(state, prompt_PxL, valid_PxL, src_B, active_B, keyrow_B, key):
      return self._generate_impl(state, prompt_PxL, valid_PxL, src_B, active_B, keyrow_B,
                                 stop_ids, key, temperature, top_p, max_new, pad_id, **static)
    args = (states_A, prompt_AxPxL, valid_AxPxL, src_AxB, active_AxB, keyrow_AxB, keys_A)
    if self.agent_map == "vmap":
      return jax.vmap(one)(*args)
    return jax.lax.map(lambda a: one(*a), args)
