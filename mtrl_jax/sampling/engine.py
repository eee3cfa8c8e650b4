"""The rollout engine: a pool of decode slots whose KV cache persists between calls.

Callers `submit` requests (a prompt, G samples, per-sample keys, optionally
the `Handle` of a finished sample whose cache holds a prefix of the prompt)
and call `step` repeatedly; each step admits queued requests into free slots
(one prefill of the prompt's uncached tail, forked into G slots) and runs one
decode chunk of `EngineConfig.chunk` steps over every decoding slot. Each
slot's input token, column and draws stay on the device (`programs.SlotRows`),
so with `EngineConfig.overlap` a step dispatches its chunk before it reads the
previous step's: the device decodes while the host books tokens and admits,
and a sample comes back one step after the chunk it finished in. A
finished sample keeps its slot (parked) and comes back with a `Handle`; a
request that names it continues from that cache: a child node of a tree, or
a tool continuation, prefills only the environment's new tokens. The caller
`release`s a handle when no more requests will name it.

Correctness never depends on the cache being there. A request extends its
parent's cache from the longest common prefix of the cached ids and its
prompt (a history rewrite, a truncated ledger), and when slots run short the
least recently used parked slots are evicted: a request whose parent was
evicted is prefilled from scratch. Only speed changes.

Randomness is per sample: token t of a sample with key k and row r is chosen
with `uniform(fold_in(fold_in(k, r), t))` (`programs.sample_uniform`), so a
sample depends on its request alone, never on its slot, its batch-mates or
when it was admitted.

Several processes (`mtrl_jax.distributed`): each process owns the slots on
its devices and schedules its own requests; every `step` is collective (the
processes agree on the shapes of the step's admit and decode calls through a
host all-gather and run them together, a process without work bringing
padding rows), so `step` must be called in lockstep until it reports that no
process has work left.

Compilation and rounding: every call has a fixed shape chosen from the
row's own state, never from its batch-mates' (`sampling.calls`). Admit
programs are keyed by the new-token bucket, decode programs by the window
bucket and the static sampling choices; `precompile` compiles them up front.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import time
from typing import Optional, Sequence

import jax
import numpy as np

from mtrl_jax.models.config import ModelConfig
from mtrl_jax.models.cache import KVCache
from mtrl_jax import sharding  # pylint: disable=g-bad-import-order
from mtrl_jax import distributed
from mtrl_jax.buckets import bucket, next_pow2
from mtrl_jax.sampling.admission import Admission, SlotTable
from mtrl_jax.sampling.calls import admit_arrays, decode_arrays, split_calls
from mtrl_jax.sampling.config import SamplingConfig
from mtrl_jax.sampling.layout import DeviceLayout
from mtrl_jax.sampling.programs import Programs, SlotRows
from mtrl_jax.sampling.slots import EngineConfig, EngineStats, Handle, Request, Row, Sample

__all__ = ["DecodeEngine"]


@dataclasses.dataclass(frozen=True)
class RunSettings:
  """What `DecodeEngine.start` fixes for a run.

  Attributes:
    sampling: how tokens are chosen.
    pad: the pad id.
    fanout: the most samples a request of the run asks for.
    stacked: parameters are stacked on a leading agent axis.
    scalars: the decode program's replicated (stop ids, temperature, top_p, pad id).
  """

  sampling: SamplingConfig
  pad: int
  fanout: int
  stacked: bool
  scalars: tuple

  @property
  def static(self) -> dict:
    """The decode program's static sampling choices."""
    sp = self.sampling
    return dict(greedy=sp.greedy, top_k=sp.top_k, use_top_p=sp.top_p < 1.0)


class DecodeEngine:
  """Decode slots over one model graph; parameters and sampling settings per run (`start`).

  Args:
    model_cfg: the model's hyper-parameters (fixes the graph).
    cfg: slots, capacity, chunk and buckets (`EngineConfig`).
    mesh: optional (data, fsdp, tensor) mesh (its axes are used as Auto);
      slots are split over data x fsdp, parameters placed with `rules`.
    num_agents: parameter sets (A): 1 for a shared policy, N for separate
      policies stacked on an agent axis.
    rules: logical-axis rules of the parameters while sampling.
  """

  def __init__(
      self,
      model_cfg: ModelConfig,
      cfg: EngineConfig,
      *,
      mesh: Optional[jax.sharding.Mesh] = None,
      num_agents: int = 1,
      rules=sharding.SAMPLE_RULES,
  ):
    self.model_cfg = model_cfg = model_cfg.replace(attention="xla")
    self.cfg = cfg
    self.layout = layout = DeviceLayout(model_cfg, mesh, num_agents, rules)
    self.mesh, self.num_agents = layout.mesh, layout.num_agents
    self.num_shards, self.local_shards = layout.num_shards, layout.local_shards
    agent_map = cfg.agent_map or ("map" if jax.default_backend() == "cpu" else "vmap")
    self.programs = Programs(layout.graphdef, layout.mesh, layout.kv_axis, agent_map)
    self._pool: Optional[KVCache] = None
    self._slot_rows: Optional[SlotRows] = None  # beside the pool, allocated and dropped with it
    self._inflight: list = []  # decode calls dispatched, not read yet: (placed rows, outputs)
    self._params = None
    self._run: Optional[RunSettings] = None
    self._stats = EngineStats()

  @property
  def stats(self) -> dict:
    """The run's counters so far, by metric name (`EngineStats`)."""
    return self._stats.as_dict()

  @property
  def num_compiles(self) -> int:
    """Programs traced and compiled so far."""
    return self.programs.num_traces

  # ------------------------------------------------------------ runs
  def start(
      self, params, sampling: SamplingConfig, stop_ids: Sequence[int], pad_id: int, *, fanout: int
  ) -> None:
    """Begins a run of requests: parameters (stacked on a leading agent axis when the engine
    has several agents), how tokens are chosen, stop ids, pad id, and `fanout`, the
    most samples a request of this run asks for."""
    if not isinstance(sampling, SamplingConfig):
      raise TypeError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
    vocab = self.model_cfg.vocab_size
    stop = [int(s) for s in stop_ids]
    if any(not 0 <= s < vocab for s in stop):
      raise ValueError(f"stop_ids={stop}; allowed: ids in [0, {vocab})")
    if not isinstance(pad_id, (int, np.integer)) or not 0 <= pad_id < vocab:
      raise ValueError(f"pad_id={pad_id!r}; allowed: an int in [0, {vocab})")
    if not 1 <= fanout <= self.cfg.slots:
      raise ValueError(
          f"fanout={fanout}: a request's samples need as many slots; the "
          f"engine has {self.cfg.slots} per shard (EngineConfig.slots)"
      )
    if sampling.max_new_tokens + 2 > self.cfg.capacity:
      raise ValueError(
          f"max_new_tokens={sampling.max_new_tokens} does not fit a slot of "
          f"{self.cfg.capacity} columns (EngineConfig.capacity)"
      )
    if self._run is not None and self.busy:
      raise RuntimeError("DecodeEngine.start: the previous run still has work")
    leading = {np.shape(x)[0] for x in jax.tree.leaves(params)}
    stacked = self.num_agents > 1
    if stacked and leading != {self.num_agents}:
      raise ValueError(
          f"DecodeEngine.start: {self.num_agents} agents but parameters with "
          f"leading sizes {sorted(leading)}"
      )
    self._params = self.layout.put_params(params, stacked)
    stop_arr = np.full((next_pow2(len(stop), 4),), -1, np.int32)
    stop_arr[: len(stop)] = stop
    rep = self.layout.replicated
    self._run = RunSettings(
        sampling=sampling,
        pad=int(pad_id),
        fanout=int(fanout),
        stacked=stacked,
        scalars=(
            rep(stop_arr),
            rep(np.float32(sampling.temperature)),
            rep(np.float32(sampling.top_p)),
            rep(np.int32(pad_id)),
        ),
    )
    self._allocate()
    self._slots = SlotTable(self.local_shards, self.num_agents, self.cfg.slots, self.cfg.reuse)
    self._rows: dict = {}  # (shard, agent, slot) -> Row
    self._queue: list[Request] = []
    self._stats = EngineStats()

  def _allocate(self) -> None:
    if self._pool is None:  # allocating them compiles programs of their own
      self._pool = self.layout.new_pool(self.cfg.slots, self.cfg.capacity)
      self._slot_rows = self.layout.new_slot_rows(self.cfg.slots)

  def free(self) -> None:
    """Drops the KV pool and the slot state (device memory) until the next run."""
    self._pool = self._slot_rows = None

  @property
  def busy(self) -> bool:
    """This process has queued or decoding requests, or decode calls it has not read."""
    return bool(self._queue or self._rows or self._inflight)

  # ------------------------------------------------------------ requests
  def submit(self, req: Request) -> None:
    """Queues `req`; its samples come back from later `step` calls."""
    s = self._run
    if s is None:
      raise RuntimeError("DecodeEngine.submit before start()")
    prompt = np.asarray(req.prompt, np.int64).reshape(-1)
    if prompt.size == 0:
      raise ValueError(f"request {req.tag!r}: empty prompt; every prompt needs a token")
    if prompt.min() < 0 or prompt.max() >= self.model_cfg.vocab_size:
      raise ValueError(f"request {req.tag!r}: ids outside [0, {self.model_cfg.vocab_size})")
    rows = np.asarray(req.rows, np.uint32).reshape(-1)
    if not 1 <= rows.size <= s.fanout:
      raise ValueError(
          f"request {req.tag!r}: {rows.size} samples; allowed: 1 .. "
          f"{s.fanout} (the run's fanout)"
      )
    max_new = s.sampling.max_new_tokens if req.max_new is None else int(req.max_new)
    if prompt.size + max_new + 1 > self.cfg.capacity:
      raise ValueError(
          f"request {req.tag!r}: a prompt of {prompt.size} tokens plus "
          f"{max_new} new ones does not fit a slot of {self.cfg.capacity} "
          "columns (EngineConfig.capacity)"
      )
    if not 0 <= req.agent < self.num_agents:
      raise ValueError(
          f"request {req.tag!r}: agent {req.agent}; the engine has "
          f"{self.num_agents} parameter sets"
      )
    key = np.asarray(req.key, np.uint32).reshape(2)
    if req.parent is not None:
      self._slots.add_ref(req.parent)
    self._queue.append(
        dataclasses.replace(
            req, prompt=prompt.astype(np.int32), rows=rows, key=key, max_new=max_new
        )
    )
    self._stats.requests += 1

  def release(self, handle: Handle) -> None:
    """The caller will name `handle` in no further request; its slot frees once no
    queued request names it."""
    self._slots.release(handle)

  # ------------------------------------------------------------ one step
  def step(self, expect_more: bool = False) -> tuple[list[Sample], bool]:
    """Admits what fits, dispatches one decode chunk, then reads this chunk (or, with
    `EngineConfig.overlap`, the previous step's).

    Args:
      expect_more: this process will submit more requests later (it waits on
        environments); with several processes it keeps the others stepping.
    Returns:
      (samples finished in the chunk read, whether any process has work left or
      expects more: the caller steps again while it is True).
    """
    self._slots.begin_step()  # released since the last step: nothing reads them any more
    plans, self._queue = self._slots.plan(self._queue, self._stats)
    groups: dict = collections.defaultdict(list)
    for plan in plans:
      groups[bucket(len(plan.ext), self.cfg.extends, "admitted tokens")].append(plan)
    calls = {
        x: split_calls(g, lambda p: (p.shard, p.agent), self.cfg.admit_rows)
        for x, g in groups.items()
    }
    for plan in plans:  # the rows now decode
      for g, slot in enumerate(plan.dst):
        self._rows[(plan.shard, plan.agent, slot)] = Row(
            plan.req, g, plan.shard, plan.agent, slot, plan.ctx, plan.req.max_new
        )
    by_window: dict = collections.defaultdict(list)
    for row in self._rows.values():
      by_window[self._window(row)].append(row)
    decode = {
        w: split_calls(rows, lambda row: (row.shard, row.agent), self.cfg.rows)
        for w, rows in by_window.items()
    }
    mine = {
        "admit": {x: len(c) for x, c in calls.items()},
        "decode": {w: len(c) for w, c in decode.items()},
        "more": bool(expect_more or self.busy),
    }
    everyone = [mine] if self.layout.process_local else distributed.allgather(mine)
    t0 = time.perf_counter()
    for x in sorted({x for m in everyone for x in m["admit"]}):
      for k in range(max(m["admit"].get(x, 0) for m in everyone)):
        own = calls.get(x, [])
        self._admit(own[k] if k < len(own) else [], x)
    self._slots.flush()  # sources this step's admits have read
    decoding, parked = len(self._rows), self._slots.parked()  # beside this chunk
    dispatched = []
    for w in sorted({w for m in everyone for w in m["decode"]}):
      own = decode.get(w, [])
      for k in range(max(m["decode"].get(w, 0) for m in everyone)):
        dispatched.append(self._decode(own[k] if k < len(own) else [], w))
    # With overlap, the previous chunk is read while this one runs.
    reading = self._inflight if self.cfg.overlap else dispatched
    self._inflight = dispatched if self.cfg.overlap else []
    done: list[Sample] = []
    for call in reading:
      done += self._read(*call)
    if decode:
      all_slots = self.local_shards * self.num_agents * self.cfg.slots
      self._stats.chunks += 1
      self._stats.occupancy_sum += decoding / all_slots
      self._stats.parked_sum += parked / all_slots
    self._stats.device_seconds += time.perf_counter() - t0
    go_on = any(m["more"] for m in everyone) or self.busy
    return done, go_on

  def _window(self, row: Row) -> int:
    """The columns `row` attends while it decodes: a bucket of its longest context."""
    return bucket(len(row.ctx) + row.max_new + 1, self.cfg.windows, "decode window")

  # ------------------------------------------------------------ device calls
  def _admit(self, plans: list[Admission], x: int) -> None:
    """One admit call of `plans` (at most `cfg.admit_rows` per (shard, agent)), padded."""
    arrays = admit_arrays(
        plans,
        self.local_shards,
        self.num_agents,
        self.cfg.admit_rows,
        self._run.fanout,
        x,
        self.cfg.slots,
        self._run.pad,
    )
    self._pool, self._slot_rows = self.programs.admit(
        self._params,
        self._pool,
        self._slot_rows,
        *self.layout.put_rows(arrays),
        stacked=self._run.stacked,
    )
    self._stats.admit_calls += 1

  def _decode(self, rows: list, window: int) -> tuple:
    """Dispatches one decode call over `rows` (at most `cfg.rows` per (shard, agent)),
    padded; returns (placed rows, outputs) for `_read`, their copies to the host begun."""
    s = self._run
    arrays, placed = decode_arrays(
        rows, self.local_shards, self.num_agents, self.cfg.rows, self.cfg.slots
    )
    out = self.programs.decode(
        self._params,
        self._pool,
        self._slot_rows,
        *self.layout.put_rows(arrays),
        *s.scalars,
        stacked=s.stacked,
        window=window,
        steps=self.cfg.chunk,
        **s.static,
    )
    self._pool, self._slot_rows = out[:2]
    for x in out[2:]:  # the fetches start together: one wait for the device, not six
      x.copy_to_host_async()
    return placed, out[2:]

  def _read(self, placed: list, out: tuple) -> list[Sample]:
    """Books a dispatched decode call's tokens; returns the samples that finished in it."""
    tokens, logps, counts, stopped, finished = (distributed.local_rows(x) for x in out[:5])
    ran = int(out[5])
    st = self._stats
    st.decode_calls += 1
    st.slot_steps += self.local_shards * self.num_agents * self.cfg.rows * ran
    st.decode_steps += ran
    samples = []
    for idx, row in placed:
      if self._rows.get((row.shard, row.agent, row.slot)) is not row:
        continue  # it finished in the call before (read since): this one took no step there
      n = int(counts[idx])
      if n:
        row.ids.extend(tokens[idx][:n].tolist())
        row.logps.extend(logps[idx][:n].tolist())
        st.decode_tokens += n
      if finished[idx]:
        samples.append(self._finish(row, bool(stopped[idx])))
    return samples

  def _finish(self, row: Row, stopped: bool) -> Sample:
    del self._rows[(row.shard, row.agent, row.slot)]
    ids = np.asarray(row.ids, np.int32)
    cached = np.concatenate([row.ctx, row.req.prompt[-1:], ids[:-1]]).astype(np.int32)
    h = Handle(row.shard, row.agent, row.slot, cached)
    self._slots.park(h)
    return Sample(
        row.req.tag,
        row.g,
        ids,
        np.asarray(row.logps, np.float32),
        "stop" if stopped else "length",
        h,
    )

  # ------------------------------------------------------------ compilation
  def programs_for(self, samplings: Sequence[SamplingConfig]) -> list[tuple]:
    """Every (kind, sizes..., static choices) an engine of this config compiles for
    runs with these sampling settings: admit (rows, new tokens bucket) and
    decode (rows, window bucket, greedy, top_k, top_p < 1)."""
    out = [("admit", self.cfg.admit_rows, x) for x in self.cfg.extends]
    statics = sorted({(sp.greedy, sp.top_k, sp.top_p < 1.0) for sp in samplings})
    out += [("decode", self.cfg.rows, w) + st for w in self.cfg.windows for st in statics]
    return out

  def precompile(
      self,
      params,
      samplings: Sequence[SamplingConfig],
      num_stop_ids: int,
      fanout: int,
      threads: int = 2,
      progress=lambda done, total: None,
  ) -> int:
    """Compiles `programs_for(samplings)` without running them (`threads` at once: XLA
    compiles off the Python lock); `progress(done, total)` sees 0, then each. Returns how many."""
    stacked = self.num_agents > 1
    # Concrete params are placed as a run places them (moving them onto the
    # sampling layout compiles reshard programs of its own), then made abstract.
    params = self.layout.put_params(params, stacked)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=x.sharding), params
    )
    pool = self.layout.abstract_pool(self.cfg.slots, self.cfg.capacity)
    slot_rows = self.layout.abstract_slot_rows(self.cfg.slots)
    d, a = self.num_shards, self.num_agents

    def spec(shape, dtype=np.int32):
      return jax.ShapeDtypeStruct(shape, dtype, sharding=self.layout.rows_sharding(len(shape)))

    rep = self.layout.replicated
    scalars = (
        rep(np.zeros((next_pow2(num_stop_ids, 4),), np.int32)),
        rep(np.float32(1)),
        rep(np.float32(1)),
        rep(np.int32(0)),
    )

    def compile_one(program):
      if program[0] == "admit":
        _, e, x = program
        rows = spec((d, a, e))
        self.programs.admit.lower(
            params,
            pool,
            slot_rows,
            rows,
            spec((d, a, e, fanout)),
            spec((d, a, e, x)),
            rows,
            rows,
            rows,
            stacked=stacked,
        ).compile()
        return
      _, r, w, greedy, top_k, use_top_p = program
      rows = spec((d, a, r))
      self.programs.decode.lower(
          params,
          pool,
          slot_rows,
          rows,
          spec((d, a, r, 2), np.uint32),
          spec((d, a, r), np.uint32),
          rows,
          spec((d, a, r), bool),
          *scalars,
          stacked=stacked,
          window=w,
          steps=self.cfg.chunk,
          greedy=greedy,
          top_k=top_k,
          use_top_p=use_top_p,
      ).compile()

    programs = self.programs_for(samplings)
    progress(0, len(programs))
    with concurrent.futures.ThreadPoolExecutor(threads) as ex:
      for done, _ in enumerate(ex.map(compile_one, programs), 1):  # in order, as they finish
        progress(done, len(programs))
    self._allocate()
    return len(programs)
