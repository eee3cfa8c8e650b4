"""The token ledger: the exact token sequence of a conversation, one record per token.

A ledger is the single source of truth for what the policy saw and produced
(docs/design.md invariant 1): sampled tokens are stored as sampled with their
logprobs, everything else is tokenised once when appended, and nothing already
appended ever changes. Training rows are packed straight from `to_arrays()`.

Tree rollouts fork a ledger G times per node, so `copy()` shares the prefix
instead of copying it: the appended records live in immutable chunks that
parent and children share, plus a private mutable tail.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

_FIELDS = ("ids", "roles", "trainable", "logprobs", "turn")


class TokenLedger:
  """Append-only parallel records `ids`, `roles`, `trainable`, `logprobs`, `turn`.

  The five fields read as tuples (read-only, so nobody can edit history by
  accident); write only through `extend`. `open_turn` is the assistant turn
  begun by `ChatRenderer.begin_assistant` that still awaits its completion.
  """

  def __init__(self):
    # Shared with copies, never mutated: each chunk is a tuple of the five field tuples.
    self._chunks: tuple = ()
    self._tail = tuple([] for _ in _FIELDS)
    self._len = 0
    self._cache: Optional[tuple] = None
    self.open_turn: Optional[int] = None

  def __len__(self) -> int:
    return self._len

  @property
  def num_turns(self) -> int:
    """One more than the last turn index appended (0 when empty)."""
    return self._last_turn() + 1

  def _last_turn(self) -> int:
    if self._tail[4]:
      return self._tail[4][-1]
    return self._chunks[-1][4][-1] if self._chunks else -1

  def extend(
      self,
      ids: Sequence[int],
      *,
      role: str,
      turn: int,
      trainable: Union[bool, Sequence[bool]] = False,
      logprobs: Optional[Sequence[float]] = None,
  ) -> None:
    """Appends tokens of one turn.

    Args:
      ids: token ids, stored exactly as given.
      role: the role of the turn these tokens belong to.
      turn: turn index; never smaller than the last one appended.
      trainable: one flag for all tokens, or one per token.
      logprobs: sampling logprob per token; default 0.0 (not sampled).
    """
    ids = [int(i) for i in ids]
    n = len(ids)
    if isinstance(trainable, (bool, np.bool_)):
      flags = [bool(trainable)] * n
    else:
      flags = [bool(t) for t in trainable]
    lps = [0.0] * n if logprobs is None else [float(x) for x in logprobs]
    if len(flags) != n or len(lps) != n:
      raise ValueError(
          f"TokenLedger.extend: {n} ids but {len(flags)} trainable flags and "
          f"{len(lps)} logprobs"
      )
    if not isinstance(role, str) or not role:
      raise ValueError(f"TokenLedger.extend: role must be a non-empty string, got {role!r}")
    turn = int(turn)
    if turn < max(self._last_turn(), 0):
      raise ValueError(
          f"TokenLedger.extend: turn={turn} is before the last turn "
          f"{self._last_turn()} (the ledger is append-only)"
      )
    if any(i < 0 for i in ids):
      raise ValueError(f"TokenLedger.extend: negative token id in {ids}")
    if not n:
      return
    t_ids, t_roles, t_train, t_lps, t_turn = self._tail
    t_ids.extend(ids)
    t_roles.extend([role] * n)
    t_train.extend(flags)
    t_lps.extend(lps)
    t_turn.extend([turn] * n)
    self._len += n
    self._cache = None

  def _seal(self) -> None:
    """Moves the tail into a shared immutable chunk."""
    if self._tail[0]:
      self._chunks = self._chunks + (tuple(tuple(f) for f in self._tail),)
      self._tail = tuple([] for _ in _FIELDS)

  def copy(self) -> "TokenLedger":
    """An independent ledger with the same records; O(number of chunks), not O(length)."""
    self._seal()
    other = TokenLedger()
    other._chunks = self._chunks
    other._len = self._len
    other._cache = self._cache
    other.open_turn = self.open_turn
    return other

  def _materialise(self) -> tuple:
    if self._cache is None:
      fields = []
      for k in range(len(_FIELDS)):
        seq = []
        for chunk in self._chunks:
          seq.extend(chunk[k])
        seq.extend(self._tail[k])
        fields.append(tuple(seq))
      self._cache = tuple(fields)
    return self._cache

  @property
  def ids(self) -> tuple:
    return self._materialise()[0]

  @property
  def roles(self) -> tuple:
    return self._materialise()[1]

  @property
  def trainable(self) -> tuple:
    return self._materialise()[2]

  @property
  def logprobs(self) -> tuple:
    return self._materialise()[3]

  @property
  def turn(self) -> tuple:
    return self._materialise()[4]

  def to_arrays(self) -> dict:
    """Numpy copies: `ids`/`turn` int32, `roles` str, `trainable` bool, `logprobs` float32."""
    ids, roles, trainable, logprobs, turn = self._materialise()
    return {
        "ids": np.asarray(ids, dtype=np.int32),
        "roles": np.asarray(roles, dtype=str),
        "trainable": np.asarray(trainable, dtype=bool),
        "logprobs": np.asarray(logprobs, dtype=np.float32),
        "turn": np.asarray(turn, dtype=np.int32),
    }

  def __repr__(self) -> str:
    return (
        f"TokenLedger(len={self._len}, turns={self.num_turns}, "
        f"trainable={sum(self.trainable)}, open_turn={self.open_turn})"
    )
