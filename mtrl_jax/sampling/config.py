"""How tokens are chosen: `SamplingConfig`."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SamplingConfig:
  """How tokens are chosen. Hashable; see `mtrl_jax.sampling.filters` for the order.

  Attributes:
    temperature: > 0; logits are divided by it.
    top_p: in (0, 1]; 1 disables the nucleus filter.
    top_k: >= 0; 0 disables the top-k filter.
    max_new_tokens: >= 1; completion length limit (stop token included).
    greedy: take the most likely token instead of sampling.
  """

  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  max_new_tokens: int = 64
  greedy: bool = False

  def __post_init__(self):
    def bad(field, allowed):
      return ValueError(f"SamplingConfig.{field}={getattr(self, field)!r}; allowed: {allowed}")

    if (
        isinstance(self.temperature, bool)
        or not isinstance(self.temperature, (int, float))
        or not self.temperature > 0
        or not np.isfinite(self.temperature)
    ):
      raise bad("temperature", "a finite number > 0 (use greedy=True for argmax)")
    if (
        isinstance(self.top_p, bool)
        or not isinstance(self.top_p, (int, float))
        or not 0 < self.top_p <= 1
    ):
      raise bad("top_p", "a number in (0, 1]")
    if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
      raise bad("top_k", "an int >= 0 (0 disables top-k)")
    if (
        isinstance(self.max_new_tokens, bool)
        or not isinstance(self.max_new_tokens, int)
        or self.max_new_tokens < 1
    ):
      raise bad("max_new_tokens", "an int >= 1")
    if not isinstance(self.greedy, bool):
      raise bad("greedy", "True or False")
