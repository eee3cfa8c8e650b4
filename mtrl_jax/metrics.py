"""Run metrics: `metrics.jsonl`, TensorBoard events, plots, step timers, compile census.

Host-side only. Every run writes `workdir/metrics.jsonl` (one JSON object per
step: `{"step": int, key: float, ...}`) and TensorBoard event files under
`workdir/tb/`; `plot_metrics` draws chosen keys against the step.
"""

from __future__ import annotations

import collections
import contextlib
import fnmatch
import json
import math
import os
import sys
import threading
import time
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

import numpy as np

from mtrl_jax import event_file, storage

METRICS_FILE = "metrics.jsonl"
TB_DIR = "tb"
# Prefixes of the keys that depend on the process, the wall clock or the
# schedule of environment steps (which requests share a decode chunk), not on
# the seed: two runs of one seed, or a run and its resumed twin, differ in
# these keys only.
RUN_BOUND_PREFIXES = ("compiles/", "time/", "engine/")
# What `plot_metrics` draws by default: keys the RL loop writes (`run.rl`);
# glob patterns match per-evaluation, per-turn and per-kind keys.
DEFAULT_PLOT_KEYS = (
    "eval/*/success",
    "rollout/path_success",
    "rollout/return",
    "turn_*/mean_reward",
    "train/loss",
    "train/kl",
    "train/clip_frac",
    "train/entropy",
    "faults/*",
    "curriculum/level",
    "engine/kv_reuse",
    "engine/slot_occupancy",
)


def _to_float(value) -> float:
  arr = np.asarray(value)
  if arr.size != 1:
    raise ValueError(f"metric value of shape {arr.shape} is not a scalar")
  return float(arr.reshape(()))


def _warn(line: str) -> None:
  sys.stderr.write(f"warning: {line}\n")
  sys.stderr.flush()


def _json_float(x: float):
  # JSON has no NaN/Inf literals; keep the line valid and the fact visible.
  return x if math.isfinite(x) else str(x)


class MetricsWriter:
  """Appends per-step scalars to `workdir/metrics.jsonl` and TensorBoard.

  Args:
    workdir: run directory (created if missing).
    resume_step: when resuming from a checkpoint at this step, lines of
      later steps (written after that checkpoint by the killed run) are
      dropped, so the file reads as if the run had never stopped. A file that
      is missing, or ends before this step, is not refused: the run goes on
      and one warning line on stderr says which steps have no metrics. None: a
      run starting at step 0; lines already in the file (an attempt that saved
      no checkpoint) move to `metrics.jsonl.<n>`, with a warning line.
    tensorboard: also write TensorBoard event files under `workdir/tb/`.
  """

  def __init__(self, workdir: str, resume_step: Optional[int] = None, tensorboard: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.path = os.path.join(workdir, METRICS_FILE)
    if resume_step is not None:
      self._resume(resume_step)
    elif os.path.exists(self.path) and os.path.getsize(self.path):
      n = 1
      while os.path.exists(f"{self.path}.{n}"):
        n += 1
      os.replace(self.path, f"{self.path}.{n}")
      _warn(
          f"{self.path} held lines of an attempt that saved no checkpoint; moved them to "
          f"{self.path}.{n}, the run starts at step 0"
      )
    self._file = open(self.path, "a")
    self._tb = event_file.EventFile(os.path.join(workdir, TB_DIR)) if tensorboard else None
    self._failed_rows = 0  # rows a write error kept off the disk (warned once)

  def _resume(self, step: int):
    """Keeps the lines up to `step` (rewritten whole, never half); warns about a gap."""
    if not os.path.exists(self.path):
      _warn(
          f"{self.path} is missing: steps 0-{step} have no metrics, the run goes on from "
          f"step {step + 1}"
      )
      return
    kept, bad = [], 0
    with open(self.path) as f:
      for line in f:
        try:
          row = json.loads(line) if line.strip() else None
        except ValueError:  # a line cut short by the kill
          bad += 1
          continue
        if row is not None and row["step"] <= step:
          kept.append(line if line.endswith("\n") else line + "\n")
    last = json.loads(kept[-1])["step"] if kept else None
    if last is None or last < step:
      ends = f"ends at step {last}" if kept else "holds no step"
      _warn(
          f"{self.path} {ends} but the checkpoint is step {step}: steps "
          f"{0 if last is None else last + 1}-{step} have no metrics, the run goes on"
      )
    if bad:
      _warn(f"{self.path}: dropped {bad} unreadable line(s)")
    storage.replace_text(self.path, "".join(kept))

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    """Writes one step's scalars (device scalars, numpy or Python numbers).

    Returns:
      The row written, with values as Python floats.
    """
    values = {k: _to_float(v) for k, v in sorted(metrics.items())}
    row = {"step": int(step), **{k: _json_float(v) for k, v in values.items()}}
    try:  # a write error (a full disk) is one warning line; the run goes on
      self._file.write(json.dumps(row) + "\n")
      self._file.flush()
      if self._tb is not None:
        self._tb.add(int(step), values)
    except OSError as e:
      self._failed_rows += 1
      if self._failed_rows == 1:
        _warn(
            f"step {step}'s metrics were not written under {os.path.dirname(self.path)}: "
            f"{e.strerror} (errno {e.errno}); later steps try again"
        )
    return {"step": int(step), **values}

  def flush(self):
    self._file.flush()

  def close(self):
    for f in (self._file, self._tb):
      try:
        if f is not None and not f.closed:
          f.close()
      except OSError:  # what it could not write was warned about
        pass

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class NullWriter:
  """A `MetricsWriter` that writes nothing: every process but the writer of a
  multi-process run (`mtrl_jax.distributed.is_writer`)."""

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict:
    return {"step": int(step), **{k: _to_float(v) for k, v in metrics.items()}}

  def flush(self):
    pass

  def close(self):
    pass


def read_metrics(workdir: str) -> list[dict]:
  """Rows of `workdir/metrics.jsonl` with values as floats (NaN/Inf restored)."""
  path = os.path.join(workdir, METRICS_FILE)
  rows = []
  with open(path) as f:
    for line in f:
      if line.strip():
        row = json.loads(line)
        rows.append({k: (v if k == "step" else float(v)) for k, v in row.items()})
  return rows


def _match_keys(patterns: Sequence[str], available: Iterable[str]) -> list[str]:
  available = sorted(available)
  out = []
  for pat in patterns:
    for key in available:
      if (key == pat or fnmatch.fnmatchcase(key, pat)) and key not in out:
        out.append(key)
  return out


def plot_metrics(
    workdir: str, keys: Optional[Sequence[str]] = None, out_png: Optional[str] = None
) -> str:
  """Plots metrics against the step, one panel per key, into a PNG.

  Args:
    workdir: run directory holding `metrics.jsonl`.
    keys: metric names or glob patterns (`reward/*` for the per-component
      rewards); default `DEFAULT_PLOT_KEYS`. Keys absent from the file are
      skipped; if none matches, a ValueError lists the available ones.
    out_png: output path; default `workdir/metrics.png`.
  Returns:
    The PNG path.
  """
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  rows = read_metrics(workdir)
  available = {k for r in rows for k in r if k != "step"}
  names = _match_keys(keys or DEFAULT_PLOT_KEYS, available)
  if not names:
    raise ValueError(
        f"plot_metrics keys={list(keys or DEFAULT_PLOT_KEYS)} match nothing; "
        f"available: {sorted(available)}"
    )
  out_png = out_png or os.path.join(workdir, "metrics.png")
  cols = min(3, len(names))
  nrows = -(-len(names) // cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.2 * nrows), squeeze=False)
  for ax, name in zip(axes.flat, names):
    pts = [(r["step"], r[name]) for r in rows if name in r]
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="." if len(pts) < 50 else None)
    ax.set_title(name)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  for ax in list(axes.flat)[len(names) :]:
    ax.set_visible(False)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  try:  # a failed write leaves the old PNG, if any
    storage.replace_whole(out_png, lambda tmp: fig.savefig(tmp, dpi=80, format="png"))
  finally:
    plt.close(fig)
  return out_png


class StepTimer:
  """Wall-clock split of one step into named sections.

  Usage: `with timer.section("generation"): ...`; `timer.split()` returns
  `{"time/generation": s, ..., "time/step": total}` and starts a new step.
  Device work is asynchronous: time a jitted section only around a call whose
  result is fetched (or `jax.block_until_ready`-ed) inside the section.
  """

  def __init__(self):
    self._totals: dict[str, float] = collections.defaultdict(float)
    self._start = time.perf_counter()

  @contextlib.contextmanager
  def section(self, name: str):
    t0 = time.perf_counter()
    try:
      yield
    finally:
      self._totals[name] += time.perf_counter() - t0

  def split(self) -> dict[str, float]:
    now = time.perf_counter()
    out = {f"time/{k}": v for k, v in self._totals.items()}
    out["time/step"] = now - self._start
    self._totals = collections.defaultdict(float)
    self._start = now
    return out


class _BackendCompileCounter:
  """Process-wide count of XLA executables made: backend compilations and loads
  from JAX's persistent compilation cache (jax.monitoring events). A cache hit
  is still a program the process had not run before, so it counts: JAX times a
  load as a backend compile too (one event per executable either way).
  """

  def __init__(self):
    self.count = 0
    self._lock = threading.Lock()
    self._installed = False

  def install(self):
    with self._lock:
      if self._installed:
        return
      import jax
      from jax._src import dispatch  # event name only; stable across 0.4-0.10

      def listener(event, duration, **kw):
        del duration, kw
        if event == dispatch.BACKEND_COMPILE_EVENT:
          self.count += 1

      jax.monitoring.register_event_duration_secs_listener(listener)
      self._installed = True


_BACKEND = _BackendCompileCounter()


class CompileCensus:
  """Compile counts of named jitted functions, reported as metrics.

  A registered entry is an object with a `num_compiles` attribute (e.g.
  `TrainStep`, the sampler) or a zero-argument callable returning a count
  (e.g. `lambda: fn.num_traces` for `jax.jit(count_calls(fn))`). A jitted
  function's private cache size is not used: it under-counts when JAX takes
  its slow dispatch path.
  `counts()` also reports `compiles/backend_total`, every XLA compilation in
  the process since the census was created (eager ops included), which must
  stay flat after warm-up.
  """

  def __init__(self):
    _BACKEND.install()
    self._base = _BACKEND.count
    self._entries: dict[str, Any] = {}
    self._warm: Optional[int] = None

  def register(self, name: str, fn_or_obj) -> None:
    if not (hasattr(fn_or_obj, "num_compiles") or callable(fn_or_obj)):
      raise TypeError(
          f"CompileCensus.register({name!r}): expected an object with "
          f"`num_compiles` or a callable; got {type(fn_or_obj)}"
      )
    self._entries[name] = fn_or_obj

  @staticmethod
  def _count(entry) -> int:
    if hasattr(entry, "num_compiles"):
      return int(entry.num_compiles)
    return int(entry())

  def mark_warm(self) -> None:
    """Ends warm-up: `counts()` then also reports `compiles/after_warmup`."""
    self._warm = self._total()

  def _total(self) -> int:
    return sum(self._count(e) for e in self._entries.values()) + _BACKEND.count - self._base

  def counts(self) -> dict[str, int]:
    out = {f"compiles/{name}": self._count(e) for name, e in self._entries.items()}
    out["compiles/backend_total"] = _BACKEND.count - self._base
    if self._warm is not None:
      # Traces of the registered functions plus every backend compilation since
      # warm-up ended; docs/design.md invariant 5 wants this at 0.
      out["compiles/after_warmup"] = self._total() - self._warm
    return out


def count_calls(fn: Callable) -> Callable:
  """Wraps a function to be traced by `jax.jit`, counting its traces.

  `jax.jit(count_calls(f))` compiles exactly when it traces, so the wrapper's
  `num_traces` is the compile count of that jitted function.
  """

  def wrapped(*args, **kwargs):
    wrapped.num_traces += 1
    return fn(*args, **kwargs)

  wrapped.num_traces = 0
  wrapped.__name__ = getattr(fn, "__name__", "fn")
  wrapped.__doc__ = fn.__doc__
  return wrapped
