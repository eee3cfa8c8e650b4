"""Orbax checkpoints of a run: the latest N under `workdir/ckpt`, the best under `workdir/best`.

A checkpoint holds two items:
  * `state`: any pytree of arrays (here the `TrainState`: step, params,
    optimizer state, RNG key), saved with `StandardSave` and restored onto
    abstract arrays that carry the target shardings, so a restored state is
    born sharded on the current mesh;
  * `meta`: a JSON-able dict of host state (data-iterator position,
    curriculum, best score, anything the loop needs to resume exactly).

Resuming (docs/design.md invariant 6) is `latest_step()` + `restore(...)`.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

CKPT_DIR = "ckpt"
BEST_DIR = "best"


def abstract_like(state) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete or abstract pytree."""

  def one(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, state)


def _manager(directory: str, keep: Optional[int], async_save: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=async_save)
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


class Checkpointer:
  """Saves and restores run state under `workdir`.

  Args:
    workdir: run directory; checkpoints go to `workdir/ckpt/<step>` and the
      best one to `workdir/best/<step>`.
    keep: number of latest checkpoints kept (older ones are deleted).
    async_save: write in a background thread (device arrays are copied to
      host before `save` returns, so donating them afterwards is safe).
  """

  def __init__(self, workdir: str, keep: int = 3, async_save: bool = True):
    if keep < 1:
      raise ValueError(f"Checkpointer keep={keep}; allowed: an integer >= 1")
    self.workdir = os.path.abspath(workdir)
    self._latest = _manager(os.path.join(self.workdir, CKPT_DIR), keep, async_save)
    self._best = _manager(os.path.join(self.workdir, BEST_DIR), 1, async_save)

  # ------------------------------------------------------------ latest N
  def save(self, step: int, state, meta: Optional[dict] = None, force: bool = True) -> bool:
    """Saves `state` and JSON-able `meta` as checkpoint `step`.

    Returns:
      True if a checkpoint was written (False when this step already exists).
    """
    if step in self._latest.all_steps():
      return False
    args = ocp.args.Composite(state=ocp.args.StandardSave(state),
                              meta=ocp.args.JsonSave(dict(meta or {})))
    return self._latest.save(int(step), args=args, force=force)

  def latest_step(self) -> Optional[int]:
    """The newest saved step, or None when the run starts fresh."""
    self._latest.wait_until_finished()
    return self._latest.latest_step()

  def all_steps(self) -> list[int]:
    self._latest.wait_until_finished()
    return sorted(self._latest.all_steps())

  def restore(self, target, step: Optional[int] = None) -> tuple[Any, dict]:
    """Restores checkpoint `step` (default: the latest) onto `target`'s shardings.

    Args:
      target: a pytree like the saved state: concrete arrays or
        `jax.ShapeDtypeStruct`s with `sharding=`; restored arrays get those
        shardings (and dtypes).
      step: which checkpoint; default the latest.
    Returns:
      (state, meta).
    """
    self._latest.wait_until_finished()
    step = self._latest.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint under {self._latest.directory}")
    return _restore(self._latest, step, target)

  # ------------------------------------------------------------ best
  def best(self) -> Optional[dict]:
    """`{"step": int, "score": float}` of the kept best checkpoint, or None."""
    self._best.wait_until_finished()
    step = self._best.latest_step()
    if step is None:
      return None
    meta = self._best.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    return {"step": int(step), "score": float(meta["best_score"])}

  def maybe_save_best(self, step: int, score: float, state, meta: Optional[dict] = None) -> bool:
    """Saves `state` as the best checkpoint if `score` beats the kept one.

    Args:
      step: training step of `state`.
      score: held-out score, higher is better (e.g. held-out success).
      state: the state pytree.
      meta: host state stored beside it (`best_score` and `best_step` are added).
    Returns:
      True if this became the new best (the previous best is deleted).
    """
    if not math.isfinite(score):
      raise ValueError(f"maybe_save_best score={score!r}; allowed: a finite number")
    current = self.best()
    if current is not None and not score > current["score"]:
      return False
    meta = dict(meta or {}, best_score=float(score), best_step=int(step))
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    if current is not None and current["step"] == step:
      self._best.delete(step)
    self._best.save(int(step), args=args, force=True)
    return True

  def restore_best(self, target) -> tuple[Any, dict]:
    """Restores the best checkpoint onto `target`'s shardings: (state, meta)."""
    info = self.best()
    if info is None:
      raise FileNotFoundError(f"no best checkpoint under {self._best.directory}")
    return _restore(self._best, info["step"], target)

  # ------------------------------------------------------------ lifecycle
  def wait(self):
    self._latest.wait_until_finished()
    self._best.wait_until_finished()

  def close(self):
    self._latest.close()
    self._best.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _restore(manager: ocp.CheckpointManager, step: int, target) -> tuple[Any, dict]:
  abstract = abstract_like(target)
  out = manager.restore(int(step), args=ocp.args.Composite(
      state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
  return out["state"], dict(out["meta"] or {})
