"""A scripted token-level environment for benchmarks: no text, no tools, fixed shapes.

`TokenTransition` drives `expand_tree` directly on token ids. Each of the N
agents' histories starts as a random prompt; an action appends every agent's
completion and a fixed observation of `obs_len` token ids, and is rewarded
with the mean parity of the agents' first completion tokens. It never ends an
episode early, so a tree has exactly the planned number of nodes, which makes
it the workload of `experiments/bench_rollout.py` and `experiments/bench_rl.py`.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtrl_jax.rollout.engine import ActionOutcome


@dataclasses.dataclass(frozen=True)
class TokenState:
  histories: tuple  # one tuple of token ids per agent


class TokenTransition:
  """Scripted environment on token ids (see the module docstring)."""

  def __init__(self, vocab: int, obs_len: int = 8, low: int = 12):
    self.observation = tuple(range(3, 3 + obs_len))
    self.vocab, self.low = vocab, low

  def roots(self, num_roots: int, num_agents: int, prompt_len: int, seed: int = 0,
            system_len: int = 0):
    """Random prompts of `prompt_len` ids after a `system_len`-token system prompt
    that every root shares (the same ids whatever the seed, like a tool schema)."""
    system = tuple(np.random.default_rng(12345).integers(self.low, self.vocab,
                                                         system_len).tolist())
    rng = np.random.default_rng(seed)
    return [TokenState(tuple(system + tuple(rng.integers(self.low, self.vocab,
                                                         prompt_len).tolist())
                             for _ in range(num_agents))) for _ in range(num_roots)]

  def prompts(self, state: TokenState):
    return [list(h) for h in state.histories]

  def step(self, state: TokenState, actions):
    reward = float(np.mean([int(c.ids[0]) % 2 if len(c.ids) else 0 for c in actions]))
    hist = tuple(h + tuple(c.ids.tolist()) + self.observation
                 for h, c in zip(state.histories, actions))
    return ActionOutcome(TokenState(hist), reward)
