"""Orbax checkpoints of a run: the latest N under `workdir/ckpt`, the best under `workdir/best`.

A checkpoint holds two items:
  * `state`: any pytree of arrays (here the `TrainState`: step, params,
    optimizer state, RNG key), saved with `StandardSave` and restored onto
    abstract arrays that carry the target shardings, so a restored state is
    born sharded on the current mesh;
  * `meta`: a JSON-able dict of host state (data-iterator position,
    curriculum, best score, anything the loop needs to resume exactly).

Resuming (docs/design.md invariant 6) is `restore_latest(...)`: the newest
checkpoint that reads back.

Storage faults (docs/internals.md, "Resuming and storage faults"): a failed
save (a full disk, any write error, in the background with async saves) raises
`CheckpointError`, one line naming the step, the reason and the last complete
checkpoint (intact), at the next call that waits for it (`save`,
`maybe_save_best`, `wait`, `close`). `restore_latest` skips an unreadable
checkpoint (a truncated file, garbage metadata) with one warning line naming it
and moves it to `workdir/ckpt.unreadable/<step>` (one process, not read-only);
none readable: `CheckpointError` naming the directory. Orbax's log records are
kept off the console.

A failed background save leaves Orbax threads waiting for a signal its failed
step never sends: the Checkpointer ends them when it records the failure
(`storage.release_stalled_saves`), after its other manager's save has
finished, so a run that cannot save exits in seconds.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import sys
from typing import Any, Callable, Optional

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint._src.metadata import array_metadata_store

from mtrl_jax.storage import collect_quietly, quiet_orbax, release_stalled_saves

CKPT_DIR = "ckpt"
BEST_DIR = "best"
UNREADABLE_SUFFIX = ".unreadable"  # ckpt.unreadable/<step>: a skipped checkpoint, kept
# JSON files of an Orbax checkpoint step, named when one of them does not parse.
_JSON_FILES = ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA", "state/_sharding")


class CheckpointError(RuntimeError):
  """A checkpoint that could not be written, or no checkpoint that could be read. The
  message is one line naming the directory; a failed write's Orbax error is its
  `__cause__` (a failed read's is dropped, with the coroutines it holds)."""


def print_warning(line: str) -> None:
  sys.stderr.write(f"warning: {line}\n")
  sys.stderr.flush()


def reason(exc: BaseException) -> str:
  """One short line: why a checkpoint was not written or read: the OS error (`No space
  left on device (errno 28)`), else the innermost TensorStore status, else the first line."""
  chain, seen = [], exc
  while seen is not None and len(chain) < 20:
    chain.append(seen)
    seen = seen.__cause__ or seen.__context__
  for e in chain:
    code = e.errno if isinstance(e, OSError) and e.errno else None
    found = re.search(r"os_error_code='?(\d+)", str(e))
    code = code or (int(found.group(1)) if found else None)
    if code:
      return f"{os.strerror(code)} (errno {code})"
  status = [e for e in chain if re.match(r"^[A-Z_]{4,}: ", str(e))]
  e = status[-1] if status else exc
  text = re.sub(r' in OCDBT database at local file "[^"]*"', "", str(e).strip())
  first = text.splitlines()[0] if text else ""
  first = first if len(first) <= 240 else first[:237] + "..."
  return first if status else f"{type(e).__name__}: {first}"


def step_dirs(directory: str) -> list[int]:
  """Steps of the complete checkpoints in `directory` (Orbax names a step's directory
  `<step>` once every file of it is written)."""
  if not os.path.isdir(directory):
    return []
  return sorted(int(n) for n in os.listdir(directory) if n.isdigit())


def abstract_like(state) -> Any:
  """ShapeDtypeStructs (with shardings) of a concrete or abstract pytree."""

  def one(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(one, state)


@functools.cache
def _one_writer_per_array() -> None:
  """Turns off Orbax's replica-parallel saving in a one-process run.

  Replica-parallel saving splits each replicated array into one slice per
  replica, so that each host writes a share; in one process the same host
  writes every slice anyway, and each slice is an eager device program (48
  arrays replicated over 8 CPU devices: 384 slices, and a save took 0.87 s
  with them and 0.16 s without, on 2 cores). Orbax's default is already off
  on GPUs; runs of several processes keep it. The handler is otherwise
  Orbax's default one (its array metadata store records the RNG key's
  implementation). Once per process: the registry is Orbax's global one.
  """
  if jax.process_count() == 1:
    handler = ocp.type_handlers.ArrayHandler(
        array_metadata_store=array_metadata_store.Store(), use_replica_parallel=False
    )
    ocp.type_handlers.register_type_handler(jax.Array, handler, override=True)


def _manager(directory: str, keep: Optional[int], async_save: bool) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=async_save
  )
  return ocp.CheckpointManager(directory, options=options, item_names=("state", "meta"))


class Checkpointer:
  """Saves and restores run state under `workdir`.

  Args:
    workdir: run directory; checkpoints go to `workdir/ckpt/<step>` and the
      best one to `workdir/best/<step>`.
    keep: number of latest checkpoints kept (older ones are deleted).
    async_save: write in a background thread (device arrays are copied to
      host before `save` returns, so donating them afterwards is safe).
    read_only: never move an unreadable checkpoint aside (eval, export).
    warn: where the one-line warnings go (default: stderr).
  """

  def __init__(
      self,
      workdir: str,
      keep: int = 3,
      async_save: bool = True,
      *,
      read_only: bool = False,
      warn: Callable[[str], None] = print_warning,
  ):
    if keep < 1:
      raise ValueError(f"Checkpointer keep={keep}; allowed: an integer >= 1")
    quiet_orbax()
    _one_writer_per_array()
    self.workdir = os.path.abspath(workdir)
    self._warn = warn
    self._move_aside = not read_only and jax.process_count() == 1
    self._async = async_save
    self._latest = _manager(os.path.join(self.workdir, CKPT_DIR), keep, async_save)
    self._best = _manager(os.path.join(self.workdir, BEST_DIR), 1, async_save)
    self._writing = {}  # id(manager) -> the step it writes in the background
    self._failed: Optional[CheckpointError] = None  # a failed save ends the Checkpointer
    self._unreadable_best = None  # the best step already reported unreadable
    self._closed = False

  # ------------------------------------------------------------ faults
  def _wait(self, manager: ocp.CheckpointManager) -> None:
    """Waits for `manager`'s background save; a failed one raises `CheckpointError`
    (and so does every later call: the run cannot save any more)."""
    if self._failed is not None:
      raise self._failed
    step = self._writing.pop(id(manager), None)
    try:
      manager.wait_until_finished()
    except Exception as e:
      raise self._write_error(manager, step, e) from e

  def _write_error(self, manager, step, exc) -> CheckpointError:
    directory = str(manager.directory)
    done = step_dirs(directory)
    last = f"{directory}/{done[-1]} is intact" if done else "none is complete"
    which = f"{directory}/{step}" if step is not None else f"a checkpoint under {directory}"
    self._failed = CheckpointError(
        f"checkpoint {which} was not written: {reason(exc)}; the "
        f"last complete checkpoint there: {last}"
    )
    self._end_failed_save(manager)
    return self._failed

  def _end_failed_save(self, failed: ocp.CheckpointManager) -> None:
    """Lets the other manager's save finish, then ends the threads the failed one left
    waiting (`release_stalled_saves`): the process can exit at once."""
    for manager in (self._latest, self._best):
      if manager is not failed:
        self._writing.pop(id(manager), None)
        try:
          manager.wait_until_finished()
        except Exception:  # pylint: disable=broad-except  # the first failure is reported
          pass
    release_stalled_saves()

  def check(self) -> None:
    """Raises `CheckpointError` if a background save has failed; never blocks."""
    for manager in (self._latest, self._best):
      if id(manager) in self._writing and not manager.is_saving_in_progress():
        self._wait(manager)

  def _save(self, manager, step: int, args) -> bool:
    self._wait(manager)  # the previous save of this manager (Orbax waits for it anyway)
    try:
      saved = manager.save(int(step), args=args, force=True)
    except Exception as e:
      raise self._write_error(manager, step, e) from e
    if saved and self._async:
      self._writing[id(manager)] = int(step)
    return saved

  # ------------------------------------------------------------ latest N
  def save(self, step: int, state, meta: Optional[dict] = None) -> bool:
    """Saves `state` and JSON-able `meta` as checkpoint `step`.

    Returns:
      True if a checkpoint was written (False when this step already exists).
    Raises:
      CheckpointError: this save, or an earlier background one, failed.
    """
    self.check()
    if step in self.all_steps():
      return False
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(dict(meta or {}))
    )
    return self._save(self._latest, step, args)

  def all_steps(self) -> list[int]:
    self._wait(self._latest)
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
    Raises:
      CheckpointError naming the checkpoint when there is none or it does not read.
    """
    steps = self.all_steps()
    if step is None and not steps:
      raise CheckpointError(f"no checkpoint under {self._latest.directory}")
    step = steps[-1] if step is None else step
    return _restore(self._latest, step, target)

  def restore_latest(self, target) -> Optional[tuple[int, Any, dict]]:
    """The newest checkpoint that reads back: (step, state, meta); None when there is none.

    An unreadable one is skipped with one warning line naming it (and moved to
    `workdir/ckpt.unreadable/<step>` unless read-only or with several processes).
    Raises:
      CheckpointError naming the directory when no checkpoint reads back.
    """
    steps = self.all_steps()
    failed = []  # (step, why)
    found = None
    for step in reversed(steps):
      try:
        found = (step, *_restore(self._latest, step, target))
        break
      except CheckpointError as e:
        failed.append((step, str(e)))
    for step, why in failed:  # moved only when an older one read back
      where = self._set_aside(self._latest, step) if found else ""
      older = [s for s in steps if s < step]
      then = f"trying step {older[-1]}" if older else "no older checkpoint"
      self._warn(f"{why}; skipped it{where}; {then}")
    if failed and found is None:
      raise CheckpointError(
          f"no readable checkpoint under {self._latest.directory}: steps "
          f"{sorted(s for s, _ in failed)} do not read back (see the "
          "warnings above)"
      )
    return found

  def _set_aside(self, manager, step: int) -> str:
    """Moves unreadable `step` to `<dir>.unreadable/<step>`: ', moved to ...' or ''."""
    if not self._move_aside:
      return ""
    src = os.path.join(str(manager.directory), str(step))
    dst = os.path.join(str(manager.directory) + UNREADABLE_SUFFIX, str(step))
    n = 1
    while os.path.exists(dst):
      dst, n = os.path.join(str(manager.directory) + UNREADABLE_SUFFIX, f"{step}.{n}"), n + 1
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    os.replace(src, dst)
    manager.reload()
    return f", moved to {dst}"

  # ------------------------------------------------------------ best
  def best(self) -> Optional[dict]:
    """`{"step": int, "score": float}` of the kept best checkpoint, or None (also when
    its metadata does not read back: one warning line names it)."""
    self._wait(self._best)
    step = self._best.latest_step()
    if step is None:
      return None
    try:
      meta = self._best.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
      return {"step": int(step), "score": float(meta["meta"]["best_score"])}
    except Exception as e:
      if self._unreadable_best != step:
        self._unreadable_best = step
        self._warn(
            f"best checkpoint {self._best.directory}/{step} does not read back "
            f"({_diagnose(self._best, step, e)}); ignored it"
            f"{self._set_aside(self._best, step)}"
        )
      return None

  def maybe_save_best(self, step: int, score: float, state, meta: Optional[dict] = None) -> bool:
    """Saves `state` as the best checkpoint if `score` beats the kept one.

    Args:
      step: training step of `state`.
      score: held-out score, higher is better (e.g. held-out success).
      state: the state pytree.
      meta: host state stored beside it (`best_score` and `best_step` are added).
    Returns:
      True if this became the new best (the previous best is deleted).
    Raises:
      CheckpointError: this save, or an earlier background one, failed.
    """
    if not math.isfinite(score):
      raise ValueError(f"maybe_save_best score={score!r}; allowed: a finite number")
    self.check()
    current = self.best()
    if current is not None and not score > current["score"]:
      return False
    meta = dict(meta or {}, best_score=float(score), best_step=int(step))
    args = ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    if step in self._best.all_steps():
      self._best.delete(step)
    self._save(self._best, step, args)
    return True

  def restore_best(self, target) -> tuple[Any, dict]:
    """Restores the best checkpoint onto `target`'s shardings: (state, meta).

    Raises:
      CheckpointError naming the directory when there is none or it does not read.
    """
    info = self.best()
    if info is None:
      raise CheckpointError(f"no readable best checkpoint under {self._best.directory}")
    return _restore(self._best, info["step"], target)

  # ------------------------------------------------------------ lifecycle
  def wait(self):
    """Waits for the background saves; raises `CheckpointError` if one failed."""
    self._wait(self._latest)
    self._wait(self._best)

  def close(self):
    """Waits for the saves and closes both managers (both, even if one failed); raises
    `CheckpointError` for a failed save not raised before. A second call does nothing."""
    if self._closed:
      return
    self._closed = True
    raised, error = self._failed, None
    for manager in (self._latest, self._best):
      try:
        self._wait(manager)
      except CheckpointError as e:
        error = error or e
      try:
        manager.close()
      except Exception:  # the failure itself is `error`
        pass
    if error is not None and error is not raised:
      raise error

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def _diagnose(manager: ocp.CheckpointManager, step: int, exc: BaseException) -> str:
  """The reason a checkpoint step does not read, naming the JSON file that does not parse."""
  root = os.path.join(str(manager.directory), str(step))
  for name in _JSON_FILES:
    path = os.path.join(root, name)
    try:
      with open(path) as f:
        json.load(f)
    except FileNotFoundError:
      continue
    except (ValueError, UnicodeDecodeError) as e:
      return f"{path} is not valid JSON: {' '.join(str(e).split())}"
  return reason(exc)


def _restore(manager: ocp.CheckpointManager, step: int, target) -> tuple[Any, dict]:
  abstract = abstract_like(target)
  try:
    out = manager.restore(
        int(step),
        args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()
        ),
    )
  except Exception as e:
    error = CheckpointError(
        f"checkpoint {manager.directory}/{step} does not read back "
        f"({_diagnose(manager, step, e)})"
    )
  else:
    return out["state"], dict(out["meta"] or {})
  collect_quietly()
  raise error
