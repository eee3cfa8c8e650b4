"""`BatchingGenerator`: merges concurrent text-generation calls into one model call.

Judges and user simulators are called from many environment threads at once
(one per trajectory); wrapping their `TextGenerator` in a `BatchingGenerator`
batches them across trajectories without the environment API changing.
Seeds travel with their prompts.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

from mtrl_jax.resources import SharedResource
from mtrl_jax.seeds import SEED_MASK


def _check_seeds(seeds, n: int):
  if seeds is None:
    return None
  seeds = list(seeds)
  if len(seeds) != n or any(
      isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in seeds
  ):
    raise ValueError(f"seeds: expected None or {n} ints (one per prompt), got {seeds!r}")
  return [int(s) & SEED_MASK for s in seeds]


class _Request:
  __slots__ = ("kind", "key", "prompts", "seeds", "result", "error", "done")

  def __init__(self, kind, key, prompts, seeds=None):
    self.kind, self.key, self.prompts, self.seeds = kind, key, list(prompts), seeds
    self.result, self.error, self.done = None, None, threading.Event()


class BatchingGenerator(SharedResource):
  """Merges concurrent `generate` / `score_choices` calls into one model call.

  The first caller waits `max_wait_s` for others to join, then runs one inner
  call per (kind, sampling or choices, seeded or not) group, at most
  `max_batch` prompts each, and hands every caller its rows. Seeds travel with
  their prompts, so a seeded reply does not depend on the batch it joined
  (up to float rounding of the batch size).

  Args:
    inner: the generator doing the work (e.g. a `LocalLLM`).
    max_wait_s: how long the first caller waits for company.
    max_batch: most prompts per inner call.
  """

  fault_source = "judge"  # see LocalLLM

  def __reduce__(self):
    # It samples on a model in this process: a pickled copy (a worker process of
    # env.workers='processes') would have none to call.
    raise TypeError(
        f"{type(self).__name__} samples on a model in the engine's process and cannot be "
        "pickled (an LLM judge or user simulator cannot run in a worker process)"
    )

  def __init__(self, inner, max_wait_s: float = 0.005, max_batch: int = 256):
    if max_batch < 1 or max_wait_s < 0:
      raise ValueError(
          f"BatchingGenerator: max_batch={max_batch} must be >= 1 and "
          f"max_wait_s={max_wait_s} >= 0"
      )
    self.inner = inner
    self.max_wait_s = max_wait_s
    self.max_batch = max_batch
    self._lock = threading.Lock()
    self._pending: list[_Request] = []
    self._leading = False
    self.inner_calls = 0

  def generate(self, prompts, sampling=None, seeds=None) -> list[str]:
    return self._submit("generate", sampling, prompts, _check_seeds(seeds, len(prompts)))

  def score_choices(self, prompts, choices) -> np.ndarray:
    return np.asarray(self._submit("score", tuple(choices), prompts)).reshape(
        len(prompts), len(choices)
    )

  def _submit(self, kind: str, key: Any, prompts, seeds=None):
    req = _Request(kind, key, prompts, seeds)
    with self._lock:
      self._pending.append(req)
      lead = not self._leading
      self._leading = True
    if lead:
      time.sleep(self.max_wait_s)  # let concurrent callers join this batch
      with self._lock:
        batch, self._pending, self._leading = self._pending, [], False
      self._run(batch)
    req.done.wait()
    if req.error is not None:
      raise req.error
    return req.result

  def _run(self, batch: list[_Request]) -> None:
    groups: dict = {}
    for r in batch:
      groups.setdefault((r.kind, r.key, r.seeds is not None), []).append(r)
    for (kind, key, _), reqs in groups.items():
      # Chunks of whole requests, at most max_batch prompts (a larger request goes alone).
      chunk, size = [], 0
      for r in reqs + [None]:
        if r is None or (chunk and size + len(r.prompts) > self.max_batch):
          self._call(kind, key, chunk)
          chunk, size = [], 0
        if r is not None:
          chunk.append(r)
          size += len(r.prompts)

  def _call(self, kind, key, reqs: list[_Request]) -> None:
    prompts = [p for r in reqs for p in r.prompts]
    try:
      with self._lock:
        self.inner_calls += 1
      if kind == "generate" and reqs[0].seeds is not None:
        out = list(self.inner.generate(prompts, key, seeds=[s for r in reqs for s in r.seeds]))
      elif kind == "generate":
        out = list(self.inner.generate(prompts, key))
      else:
        out = list(np.asarray(self.inner.score_choices(prompts, list(key))))
      start = 0
      for r in reqs:
        r.result = out[start : start + len(r.prompts)]
        start += len(r.prompts)
    except Exception as e:  # every waiting caller sees the failure
      for r in reqs:
        r.error = e
    finally:
      for r in reqs:
        r.done.set()
