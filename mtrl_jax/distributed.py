"""Multi-host runs on JAX's own multi-controller runtime (`jax.distributed`).

One process per host; the mesh spans every device of every process
(docs/design.md section 7). This module is the whole of what a process needs to
know about the others:

  * `DistributedConfig` (`config.distributed`) and `initialize`: off by
    default; 'auto' calls `jax.distributed.initialize()` with no arguments
    (TPU pods, SLURM); 'explicit' passes the coordinator address, process
    count and index (the local launcher, anything else). The coordinator's
    heartbeat stops the others when one process dies.
  * shares: process p takes the contiguous block `share(n)` of n items (roots
    of a step, held-out tasks, rows of an SFT batch), in process order, so
    the concatenation of every process's block is the single-process list.
  * `allgather`: small host objects (counts, per-root results, finalized
    trees) through the coordination service's key-value store: no XLA
    program, so nothing compiles per call and the compile census stays flat.
  * global arrays: `global_rows` builds a batch-sharded global array from
    each process's rows (`jax.make_array_from_process_local_data`); the rows
    of process p are the block of global rows on its devices (`row_block`),
    and `local_rows` reads that block back.
  * `is_writer`: process 0 alone writes files (metrics, TensorBoard, dumps,
    plots, config.json, summary.json); Orbax checkpoints take every process.

With one process every helper is the identity (`allgather(x) == [x]`,
`global_rows` is `device_put`), so single-host runs take the same code path.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from typing import Any, Sequence

import jax
import numpy as np

MODES = ("off", "auto", "explicit")


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  """How the process joins a multi-process run (`config.distributed`).

  Attributes:
    mode: 'off' (one process), 'auto' (`jax.distributed.initialize()` detects
      TPU pod slices and SLURM) or 'explicit' (the three fields below).
    coordinator_address: 'host:port' of process 0's coordinator ('explicit').
    num_processes: process count ('explicit').
    process_id: this process's index in [0, num_processes) ('explicit').
    heartbeat_timeout_s: a process silent this long is declared dead and the
      others stop with an error (instead of hanging in a collective).
    initialization_timeout_s: how long to wait for every process to join.
    gather_timeout_s: how long a host all-gather waits for the other processes.
  """

  mode: str = "off"
  coordinator_address: str = ""
  num_processes: int = 0
  process_id: int = -1
  heartbeat_timeout_s: int = 100
  initialization_timeout_s: int = 300
  gather_timeout_s: int = 600

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f"config distributed.mode={self.mode!r}; allowed: {list(MODES)}")
    for name in ("heartbeat_timeout_s", "initialization_timeout_s", "gather_timeout_s"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"config distributed.{name}={v!r}; allowed: an integer >= 1")
    if self.mode != "explicit":
      return
    host, _, port = self.coordinator_address.rpartition(":")
    if not host or not port.isdigit():
      raise ValueError(
          f"config distributed.coordinator_address={self.coordinator_address!r}; "
          "allowed: 'host:port' (mode='explicit')"
      )
    n = self.num_processes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
      raise ValueError(
          f"config distributed.num_processes={n!r}; allowed: an integer >= 1 (mode='explicit')"
      )
    i = self.process_id
    if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n:
      raise ValueError(
          f"config distributed.process_id={i!r}; allowed: an integer in "
          f"[0, {n}) (mode='explicit')"
      )


def initialize(cfg: DistributedConfig) -> None:
  """Joins the multi-process run `cfg` describes (nothing for mode='off').

  Must run before anything touches a JAX backend. CPU processes exchange
  collectives through gloo. Calling it again after a successful join is a no-op.
  """
  if cfg.mode == "off" or _client() is not None:
    return
  if os.environ.get("JAX_PLATFORMS", "") == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  kw = dict(
      initialization_timeout=cfg.initialization_timeout_s,
      heartbeat_timeout_seconds=cfg.heartbeat_timeout_s,
  )
  if cfg.mode == "explicit":
    kw.update(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes,
        process_id=cfg.process_id,
    )
  jax.distributed.initialize(**kw)
  global _GATHER_TIMEOUT_MS
  _GATHER_TIMEOUT_MS = cfg.gather_timeout_s * 1000


def process_index() -> int:
  return jax.process_index()


def process_count() -> int:
  return jax.process_count()


def is_writer() -> bool:
  """Process 0 alone writes the run's files."""
  return jax.process_index() == 0


def share(n: int, index: int | None = None, count: int | None = None) -> slice:
  """Process `index`'s contiguous block of `n` items (balanced; earlier blocks
  take the remainder), so the blocks in process order are `range(n)`."""
  index = jax.process_index() if index is None else index
  count = jax.process_count() if count is None else count
  per, extra = divmod(n, count)
  start = index * per + min(index, extra)
  return slice(start, start + per + (index < extra))


# ------------------------------------------------------------------ host all-gather
_GATHER_TIMEOUT_MS = 600_000
_round = 0


def _client():
  from jax._src import distributed as jax_distributed  # the runtime's own client

  return jax_distributed.global_state.client


def allgather(obj: Any) -> list:
  """Every process's `obj` (pickled), in process order; `[obj]` with one process.

  Every process must call it the same number of times in the same order (it
  is a collective). Round k's keys are deleted at round k + 1, once every
  process has posted (and so finished reading round k).
  """
  if jax.process_count() == 1:
    return [obj]
  global _round
  client, me, n = _client(), jax.process_index(), jax.process_count()
  _round += 1
  client.key_value_set_bytes(f"mtrl_jax/gather/{_round}/{me}", pickle.dumps(obj))
  out = []
  for p in range(n):
    if p == me:
      out.append(obj)
      continue
    try:
      data = client.blocking_key_value_get_bytes(
          f"mtrl_jax/gather/{_round}/{p}", _GATHER_TIMEOUT_MS
      )
    except Exception as e:  # the runtime raises its own status errors
      raise RuntimeError(
          f"process {me}: no answer from process {p} in all-gather round "
          f"{_round} within {_GATHER_TIMEOUT_MS // 1000} s (did it die?): "
          f"{e}"
      ) from e
    out.append(pickle.loads(data))
  if _round > 1:
    client.key_value_delete(f"mtrl_jax/gather/{_round - 1}/{me}")
  return out


def any_process(flag: bool) -> bool:
  """True when `flag` holds on some process (a loop every process must run together)."""
  return any(allgather(bool(flag)))


# ------------------------------------------------------------------ global arrays
def local_batch_shards(mesh) -> int:
  """How many batch shards (data x fsdp) sit on this process's devices."""
  return max(1, mesh.shape["data"] * mesh.shape["fsdp"] // jax.process_count())


def row_block(sharding, global_rows: int) -> tuple[int, int]:
  """[start, stop) of the global rows held by this process's devices."""
  if jax.process_count() == 1:
    return 0, global_rows
  idx = sharding.addressable_devices_indices_map((global_rows,))
  starts = [(s[0].start or 0) for s in idx.values()]
  stops = [global_rows if s[0].stop is None else s[0].stop for s in idx.values()]
  start, stop = min(starts), max(stops)
  if (stop - start) * jax.process_count() != global_rows:
    raise ValueError(
        f"the batch sharding gives process {jax.process_index()} rows "
        f"[{start}, {stop}) of {global_rows}: not a 1/{jax.process_count()} block "
        "(the data x fsdp axes must be split evenly by process)"
    )
  return start, stop


def global_rows(local, sharding):
  """The global array whose rows on this process's devices are `local` (numpy).

  Every process passes the same number of rows (pad first), so the global
  array has `process_count() * len(local)` rows. One process: `device_put`.
  """
  local = np.asarray(local)
  if jax.process_count() == 1:
    return jax.device_put(local, sharding)
  shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
  return jax.make_array_from_process_local_data(sharding, local, shape)


def local_rows(x) -> np.ndarray:
  """This process's block of rows of a global array (all rows with one process)."""
  if jax.process_count() == 1 or x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  start, stop = row_block(x.sharding, x.shape[0])
  out = np.empty((stop - start,) + x.shape[1:], x.dtype)
  for shard in x.addressable_shards:
    rows = shard.index[0] if shard.index else slice(None)
    lo = rows.start or 0
    hi = x.shape[0] if rows.stop is None else rows.stop
    lo, hi = max(lo, start), min(hi, stop)
    data = np.asarray(shard.data)
    out[lo - start : hi - start] = data[lo - (rows.start or 0) : hi - (rows.start or 0)]
  return out


def replicated_value(x, sharding):
  """A host value placed identically on every device of `sharding` (every process
  passes the same value)."""
  if jax.process_count() == 1:
    return jax.device_put(x, sharding)
  x = np.asarray(x) if not isinstance(x, jax.Array) else np.asarray(jax.device_get(x))
  return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def gather_lists(items: Sequence) -> list:
  """Every process's list, concatenated in process order."""
  return [x for part in allgather(list(items)) for x in part]


def take_rows(batch, mesh):
  """A host batch every process holds in full (e.g. an SFT batch; any pytree of
  [rows, ...] arrays) as global arrays, each process contributing only its
  `share` of the rows; the batch itself with one process."""
  if jax.process_count() == 1:
    return batch
  from mtrl_jax import sharding  # same layer

  def one(x):
    rows = x.shape[0]
    s = sharding.batch_sharding(mesh, x.ndim, rows)
    start, stop = row_block(s, rows)
    return global_rows(x[start:stop], s)

  return jax.tree.map(one, batch)
