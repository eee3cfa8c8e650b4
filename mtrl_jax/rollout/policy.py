"""Policy samplers for the tree engine: the protocol, the real adapter, a fake.

The engine asks for a whole tree level at once:
`sample(prompts, agent_ids, G, key) -> list (per prompt) of G Completion`.
`SamplerPolicy` serves it with `mtrl_jax.sampling.Sampler`: a shared policy
(role prompts tell the agents apart) makes one `generate` call per level;
separate policies given as `StackedStates` (parameters stacked on an agent
axis) make one `generate_stacked` call per level, every agent's prompts with
its own parameters in one compiled program; a list of per-agent states makes
one call per agent. Each prompt is prefilled once and forked into G
continuations; agent a samples with `fold_in(key, a)` in both separate forms.
`FakePolicySampler` is a deterministic, batching-independent stand-in for
tests of the tree bookkeeping.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class StackedStates:
  """Separate policies' parameters, stacked on a leading agent axis (one sampler program)."""

  params: Any
  num_agents: int


class SamplerPolicy:
  """Adapter from `mtrl_jax.sampling.Sampler` to the engine's `PolicySampler`.

  Args:
    sampler: a `mtrl_jax.sampling.Sampler`.
    states: the parameter state of a shared policy, `StackedStates` (separate
      policies of one graph, sampled by one call per level), or a list/tuple
      with one state per agent (one call per agent).
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
    self.stacked = states if isinstance(states, StackedStates) else None
    self.separate = self.stacked is not None or isinstance(states, (list, tuple))
    if self.stacked is not None:
      self.states = [None] * self.stacked.num_agents
    else:
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
    agent_prompts = lambda s: [list(prompts[p]) for p in groups.get(s, [])]
    if self.stacked is not None:  # every agent in one call
      agents = range(self.stacked.num_agents)
      results = self.sampler.generate_stacked(
          self.stacked.params, [agent_prompts(s) for s in agents], g, self.sampling,
          jax.numpy.stack([jax.random.fold_in(key, s) for s in agents]), self.stop_ids,
          self.pad_id)
      self.num_generate_calls += 1
      calls = [(s, results[s]) for s in sorted(groups)]
    else:
      calls = []
      for s in sorted(groups):
        calls.append((s, self.sampler.generate(
            self.states[s], agent_prompts(s), g, self.sampling, jax.random.fold_in(key, s),
            self.stop_ids, self.pad_id)))
        self.num_generate_calls += 1
    for s, res in calls:
      tokens = np.asarray(res.tokens)
      logprobs = np.asarray(res.logprobs)
      lengths = np.asarray(res.lengths)
      for m, p in enumerate(groups[s]):
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
