"""Policy samplers for the tree engine: the protocol, the real adapter, a fake.

The engine asks for a whole tree level at once:
`sample(prompts, agent_ids, G, key) -> list (per prompt) of G Completion`.
`SamplerPolicy` serves it with `mtrl_jax.sampling.Sampler.generate`: one call
per parameter state per level (one state for a shared policy with role
prompts, one per agent for separate policies), each prompt prefilled once and
forked into G continuations. `FakePolicySampler` is a deterministic,
batching-independent stand-in for tests of the tree bookkeeping.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any, Optional, Protocol, Sequence

import jax
import numpy as np

from mtrl_jax.rollout.tree import Completion


class PolicySampler(Protocol):
  """What the tree engine needs from a policy."""

  def sample(self, prompts: Sequence[Sequence[int]], agent_ids: Sequence[int],
             num_generations: int, key: jax.Array) -> list[list[Completion]]:
    """G completions for every prompt; prompt p is continued by agent `agent_ids[p]`."""
    ...


def _check_request(prompts, agent_ids, num_generations):
  if len(prompts) != len(agent_ids):
    raise ValueError(f"sample: {len(prompts)} prompts but {len(agent_ids)} agent ids")
  if num_generations < 1:
    raise ValueError(f"sample: num_generations={num_generations}; must be >= 1")
  for p, prompt in enumerate(prompts):
    if len(prompt) == 0:
      raise ValueError(f"sample: prompt {p} is empty")


class SamplerPolicy:
  """Adapter from `mtrl_jax.sampling.Sampler` to the engine's `PolicySampler`.

  Args:
    sampler: a `mtrl_jax.sampling.Sampler`.
    states: the parameter state of a shared policy, or a list/tuple with one
      state per agent (separate policies of one graph).
    sampling: the `SamplingConfig` (temperature, top_p, top_k, max_new_tokens).
    stop_ids: token ids that end a completion (kept in the completion).
    pad_id: padding id of the sampler's prompt batches.
  """

  def __init__(self, sampler, states, sampling, *, stop_ids: Sequence[int], pad_id: int):
    self.sampler = sampler
    self.sampling = sampling
    self.stop_ids = tuple(int(s) for s in stop_ids)
    self.pad_id = int(pad_id)
    self.set_states(states)
    self.num_generate_calls = 0

  def set_states(self, states) -> None:
    """Swaps in new parameters (after an update); shapes are unchanged, so no recompile."""
    self.separate = isinstance(states, (list, tuple))
    self.states = list(states) if self.separate else [states]

  def state_index(self, agent_id: int) -> int:
    if not self.separate:
      return 0
    if not 0 <= agent_id < len(self.states):
      raise ValueError(f"agent id {agent_id} has no parameter state; "
                       f"{len(self.states)} states given")
    return agent_id

  def sample(self, prompts, agent_ids, num_generations, key):
    _check_request(prompts, agent_ids, num_generations)
    groups: dict[int, list[int]] = {}
    if jax.process_count() > 1:  # every process calls the sampler once per state
      groups = {s: [] for s in range(len(self.states))}
    for p, a in enumerate(agent_ids):
      groups.setdefault(self.state_index(int(a)), []).append(p)
    out: list[Optional[list[Completion]]] = [None] * len(prompts)
    g = num_generations
    for s in sorted(groups):
      members = groups[s]
      res = self.sampler.generate(
          self.states[s], [list(prompts[p]) for p in members], g, self.sampling,
          jax.random.fold_in(key, s), self.stop_ids, self.pad_id)
      self.num_generate_calls += 1
      tokens = np.asarray(res.tokens)
      logprobs = np.asarray(res.logprobs)
      lengths = np.asarray(res.lengths)
      for m, p in enumerate(members):
        comps = []
        for k in range(g):
          row = m * g + k
          n = int(lengths[row])
          comps.append(Completion(ids=tokens[row, :n].astype(np.int32),
                                  logprobs=logprobs[row, :n].astype(np.float32),
                                  finish_reason=str(res.finish_reason[row])))
        out[p] = comps
    return out


class TimedPolicy(SamplerPolicy):
  """SamplerPolicy that accumulates the wall time of its sampler calls."""

  seconds = 0.0

  def sample(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = super().sample(*args, **kwargs)
    self.seconds += time.perf_counter() - t0
    return out

  def pop_seconds(self) -> float:
    """Seconds spent sampling since the last call (and resets the count)."""
    s, self.seconds = self.seconds, 0.0
    return s


def _key_bytes(key) -> bytes:
  if isinstance(key, (int, np.integer)):
    return int(key).to_bytes(8, "little", signed=True)
  arr = key
  if jax.dtypes.issubdtype(getattr(key, "dtype", None), jax.dtypes.prng_key):
    arr = jax.random.key_data(key)
  return np.asarray(arr).tobytes()


class FakePolicySampler:
  """Deterministic sampler: each completion is a pure function of its request.

  Completion (prompt, agent, g, key) draws its length and tokens from a numpy
  generator seeded by a hash of all four, so results do not depend on how
  prompts are batched, and two runs with the same key agree bit for bit.

  Args:
    vocab: token ids are drawn from [low, vocab).
    max_new_tokens: longest completion.
    stop_id: appended to completions that finish with 'stop'; None: never stop.
    low: smallest token id drawn (keeps special tokens out of the body).
    stop_prob: probability that a completion ends with the stop token.
  """

  def __init__(self, vocab: int = 256, max_new_tokens: int = 8, stop_id: Optional[int] = None,
               low: int = 1, stop_prob: float = 0.8):
    if not 0 <= low < vocab:
      raise ValueError(f"FakePolicySampler low={low} must be in [0, vocab={vocab})")
    self.vocab, self.low = vocab, low
    self.max_new_tokens = max_new_tokens
    self.stop_id, self.stop_prob = stop_id, stop_prob
    self.calls: list[dict[str, Any]] = []

  def completion(self, prompt, agent_id: int, g: int, key_bytes: bytes) -> Completion:
    h = hashlib.blake2b(digest_size=16)
    h.update(key_bytes)
    h.update(np.asarray([agent_id, g], np.int64).tobytes())
    h.update(np.asarray(prompt, np.int64).tobytes())
    rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    n = int(rng.integers(1, self.max_new_tokens + 1))
    ids = rng.integers(self.low, self.vocab, size=n).astype(np.int32)
    stop = self.stop_id is not None and rng.random() < self.stop_prob
    if stop:
      ids[-1] = self.stop_id
    logprobs = -rng.exponential(1.0, size=n).astype(np.float32)
    return Completion(ids=ids, logprobs=logprobs, finish_reason="stop" if stop else "length")

  def sample(self, prompts, agent_ids, num_generations, key):
    _check_request(prompts, agent_ids, num_generations)
    self.calls.append({"prompts": len(prompts), "agent_ids": list(agent_ids),
                       "num_generations": num_generations})
    kb = _key_bytes(key)
    return [[self.completion(p, int(a), g, kb) for g in range(num_generations)]
            for p, a in zip(prompts, agent_ids)]
