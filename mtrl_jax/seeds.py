"""`call_seed`: the seed of one model call, named by what the call is for.

Model calls inside environments (LLM user simulators, judges that sample,
expert edits) must not draw randomness from call order or a shared counter:
environment steps run on a thread pool, so the order varies from run to run
and a resumed run would replay other replies. Instead each call's seed is a
hash of its identity, e.g. (step key, root, node, action) in the rollout
engine, then (agent, turn) in the transition, then a purpose like
'user_sim'. Plain Python (no jax import), so the environment layer and the
sandbox stay free of it.
"""

from __future__ import annotations

import hashlib
from typing import Any

SEED_BITS = 63
SEED_MASK = (1 << SEED_BITS) - 1


def _part_bytes(part: Any) -> bytes:
  if isinstance(part, (bytes, bytearray)):
    return b"b" + bytes(part)
  if isinstance(part, str):
    return b"s" + part.encode()
  if isinstance(part, bool):
    raise TypeError(f"call_seed: part {part!r} is a bool; pass an int, str, bytes or PRNG key")
  if isinstance(part, int) or type(part).__name__ in ("int32", "int64", "uint32", "uint64"):
    return b"i" + str(int(part)).encode()
  dtype = getattr(part, "dtype", None)
  if dtype is not None:
    import jax  # only when a key is given: callers below `sampling` pass ints
    import numpy as np

    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      return b"k" + np.asarray(jax.random.key_data(part)).tobytes()
    if np.dtype(dtype) == np.uint32:  # a raw PRNGKey (uint32 [2])
      return b"k" + np.asarray(part).tobytes()
  raise TypeError(f"call_seed: part {part!r} is not an int, str, bytes or PRNG key")


def call_seed(*parts: Any) -> int:
  """A 63-bit seed determined by `parts` (ints, strings, bytes or jax PRNG keys).

  Equal parts give equal seeds in every process (blake2b, not Python's
  salted `hash`); a PRNG key counts by its key data. Chain it: the engine
  calls `call_seed(step_key, root, node, action, substep)`, the transition
  `call_seed(that, agent, turn)`, a user simulator `call_seed(that, 'user_sim')`.
  """
  h = hashlib.blake2b(digest_size=8)
  for part in parts:
    data = _part_bytes(part)
    h.update(len(data).to_bytes(4, "little") + data)
  return int.from_bytes(h.digest(), "little") & SEED_MASK
