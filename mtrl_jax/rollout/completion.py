"""`Completion`: one action of one agent, its tokens exactly as sampled, with their logprobs."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class Completion:
  """One action of one agent: the sampled tokens exactly as sampled, with their logprobs.

  Under `branch_on='every_turn'` an action is one sampled segment. Under
  'user_turn' an action continues after the environment's tool turns: each
  continuation appends the context the environment rendered (the end of the
  previous message, the tool turns, the next assistant header) and the next
  sampled segment (`continued`). Only sampled tokens are trainable.

  Attributes:
    ids: int32 [n] tokens (each segment's stop token included when it stopped).
    logprobs: float32 [n] sampling log-probability of each sampled token; 0.0
      on context tokens.
    finish_reason: 'stop' | 'length' of the last segment.
    trainable: bool [n], True where the token was sampled; None when every
      token was (a one-segment completion).
  """

  ids: np.ndarray
  logprobs: np.ndarray
  finish_reason: str = "stop"
  trainable: Optional[np.ndarray] = None

  def __post_init__(self):
    if len(self.ids) != len(self.logprobs):
      raise ValueError(
          f"Completion ids ({len(self.ids)}) and logprobs "
          f"({len(self.logprobs)}) differ in length"
      )
    if self.trainable is not None:
      mask = np.asarray(self.trainable, bool)
      if mask.shape != (len(self.ids),):
        raise ValueError(
            f"Completion trainable has shape {mask.shape}; expected ({len(self.ids)},)"
        )
      if np.any(np.asarray(self.logprobs)[~mask] != 0):
        raise ValueError("Completion context tokens (trainable False) must have logprob 0")
      object.__setattr__(self, "trainable", mask)

  @property
  def sampled_mask(self) -> np.ndarray:
    """bool [n]: True on sampled (trainable) tokens."""
    if self.trainable is None:
      return np.ones(len(self.ids), bool)
    return self.trainable

  def spans(self) -> list[tuple[int, int, bool]]:
    """Maximal runs `(start, stop, sampled)` of sampled and context tokens, in order."""
    mask = self.sampled_mask
    cuts = [0] + [k for k in range(1, len(mask)) if mask[k] != mask[k - 1]] + [len(mask)]
    return [(a, b, bool(mask[a])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]

  @property
  def num_segments(self) -> int:
    """Sampled segments (runs of sampled tokens)."""
    return sum(sampled for _, _, sampled in self.spans())

  def continued(self, context_ids: Sequence[int], segment: "Completion") -> "Completion":
    """This completion + non-trainable `context_ids` + the sampled `segment`."""
    if segment.trainable is not None and not segment.trainable.all():
      raise ValueError("Completion.continued: the new segment must be sampled tokens only")
    context = np.asarray(context_ids, np.int32).reshape(-1)
    return Completion(
        ids=np.concatenate(
            [np.asarray(self.ids, np.int32), context, np.asarray(segment.ids, np.int32)]
        ),
        logprobs=np.concatenate(
            [
                np.asarray(self.logprobs, np.float32),
                np.zeros(len(context), np.float32),
                np.asarray(segment.logprobs, np.float32),
            ]
        ),
        finish_reason=segment.finish_reason,
        trainable=np.concatenate(
            [self.sampled_mask, np.zeros(len(context), bool), np.ones(len(segment.ids), bool)]
        ),
    )
