"""A run directory's storage beyond the checkpoints themselves: Orbax's faults kept quiet
and short, and one process at a time in a workdir.

  * `quiet_orbax` keeps Orbax's log records and the exceptions its dropped
    coroutines leave behind off the console; `collect_quietly` finalizes a
    failed call's leftovers now, under that hook.
  * `release_stalled_saves`: a failed background save leaves Orbax threads
    (not daemons) waiting up to its coordination timeout (five minutes) for a
    signal the failed step never sends, and Python's exit waits for them; the
    Checkpointer calls it when it records the failure, so the process exits
    at once.
  * `replace_whole` (`replace_text` for text): a run file written beside itself,
    then renamed, so a failed write (a full disk) leaves the old file and no
    partial one.
  * `WorkdirLock`: an exclusive `fcntl.flock` on `workdir/.lock`, held for a
    run's lifetime by the process that writes its files; a second run of the
    same workdir is refused in one line naming the holder's pid. The OS
    drops the lock when the holder dies, so a killed run's resume is never
    blocked.
"""

from __future__ import annotations

import fcntl
import gc
import inspect
import logging
import os
import sys
import threading
import traceback
import types
import warnings
from typing import Callable, Optional

LOCK_FILE = ".lock"


def _not_orbax(record: logging.LogRecord) -> bool:  # a logging filter
  """False for Orbax's own records, and for asyncio's "exception was never retrieved"
  about an Orbax task (a write a full disk failed: the Checkpointer reports it)."""
  orbax = f"{os.sep}orbax{os.sep}"
  if orbax in record.pathname:
    return False
  if record.name == "asyncio" and "never retrieved" in str(record.msg):
    exc, tb = record.exc_info[1:] if record.exc_info else (None, None)
    files = [frame.filename for frame in traceback.extract_tb(tb)]
    # Orbax writes under `<step>.orbax-checkpoint-tmp`: a tensorstore error names it.
    text = f"{record.msg} {exc}"
    return not (orbax in text or "orbax-checkpoint-tmp" in text or any(orbax in f for f in files))
  return True


def _from_orbax(unraisable) -> bool:
  """An exception a failed Orbax read or write left unraisable (a dropped coroutine)."""
  exc, obj = unraisable.exc_value, unraisable.object
  code = getattr(obj, "cr_code", None)
  if code is not None and f"{os.sep}orbax{os.sep}" in code.co_filename:
    return True
  return isinstance(exc, RuntimeError) and str(exc) == "Event loop is closed"


def _quiet_hook(previous):
  def hook(unraisable):
    if not _from_orbax(unraisable):
      previous(unraisable)

  hook.quiet_orbax = True
  return hook


# The coroutines of Orbax's array writes (`serialization.async_serialize_from_host` and
# the `write_fragment` it creates) that a failed save leaves unawaited; Python warns
# about each when it is dropped, at the latest at exit.
ORBAX_WRITE_COROUTINES = r"coroutine 'async_serialize\w*(\.<locals>\.\w+)*' was never awaited"


def quiet_orbax() -> None:
  """Keeps Orbax's log records (it logs through absl), the exceptions its dropped
  coroutines leave behind and the warnings about its unawaited writes off the
  console; idempotent."""
  for name in ("absl", "orbax", "asyncio"):
    if _not_orbax not in logging.getLogger(name).filters:
      logging.getLogger(name).addFilter(_not_orbax)
  if not getattr(sys.unraisablehook, "quiet_orbax", False):
    sys.unraisablehook = _quiet_hook(sys.unraisablehook)
  warnings.filterwarnings("ignore", message=ORBAX_WRITE_COROUTINES, category=RuntimeWarning)


def collect_quietly() -> None:
  """Finalizes what a failed Orbax call left behind now, under `_quiet_hook`."""
  previous = sys.unraisablehook
  sys.unraisablehook = _quiet_hook(previous)
  try:
    gc.collect()
  finally:
    sys.unraisablehook = previous


def _close_coroutines(obj, depth: int = 0) -> None:
  """Closes the never-started coroutines `obj` holds (a function's closure, a coroutine's
  arguments, nested), so dropping them later warns nothing ('was never awaited')."""
  if depth > 6:
    return
  if isinstance(obj, types.CoroutineType):
    if inspect.getcoroutinestate(obj) == inspect.CORO_CREATED:  # its arguments: unawaited
      for value in list(obj.cr_frame.f_locals.values()):
        _close_coroutines(value, depth + 1)
    obj.close()
  elif isinstance(obj, types.FunctionType):
    for cell in obj.__closure__ or ():
      try:
        _close_coroutines(cell.cell_contents, depth + 1)
      except ValueError:  # an empty cell
        pass
  elif isinstance(obj, (list, tuple)):
    for value in obj:
      _close_coroutines(value, depth + 1)


def release_stalled_saves(timeout: float = 10.0) -> int:
  """Ends this process's Orbax save threads that still wait for a signal (what a failed
  background save leaves behind); returns how many there were.

  Each one is cancelled, then given the signal it waits for, so it returns at once
  instead of after Orbax's coordination timeout; the work it never started is
  dropped without 'coroutine ... was never awaited' warnings. Call it only when no
  save of this process should still complete.
  """
  try:
    from orbax.checkpoint._src.futures import future as ocp_future

    thread_type, set_signals = ocp_future._SignalingThread, ocp_future.set_signals
  except (ImportError, AttributeError):  # another Orbax: its threads end on their timeout
    return 0
  stalled = [t for t in threading.enumerate() if isinstance(t, thread_type) and t.is_alive()]
  for t in stalled:
    t.cancel()
    try:
      set_signals(t._receive_signals, operation_id=t._operation_id)
    except Exception:  # pylint: disable=broad-except  # it ends on its timeout instead
      pass
  for t in stalled:
    threading.Thread.join(t, timeout)  # not Orbax's join, which raises the cancellation
    _close_coroutines(getattr(t, "_target", None))
  return len(stalled)


def replace_whole(path: str, write: Callable[[str], None]) -> None:
  """`write(tmp)` writes the file at `tmp` beside `path`, then it replaces `path`
  whole; an OSError removes `tmp` and is raised, `path` left as it was."""
  tmp = f"{path}.tmp{os.getpid()}"
  try:
    write(tmp)
    os.replace(tmp, path)
  except OSError:
    if os.path.exists(tmp):
      os.remove(tmp)
    raise


def replace_text(path: str, text: str) -> None:
  """`replace_whole` for a text file whose contents are `text`."""

  def write(tmp: str) -> None:
    with open(tmp, "w") as f:
      f.write(text)

  replace_whole(path, write)


class WorkdirBusy(RuntimeError):
  """Another process (or another run of this one) holds the workdir's lock; the message
  is one line naming the workdir and the holder's pid."""


class WorkdirLock:
  """An exclusive lock on `workdir` (created if missing), held until `release`.

  Args:
    workdir: the run directory; the lock is `workdir/.lock`, which keeps the pid of
      its last holder (the file stays: removing it would let two processes lock
      two different files).
  Raises:
    WorkdirBusy: another open lock holds it (another process, or another run in
      this one).
  """

  def __init__(self, workdir: str):
    self.path = os.path.join(os.path.abspath(workdir), LOCK_FILE)
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = _read_pid(fd)
      os.close(fd)
      who = f"process {holder}" if holder else "another process"
      raise WorkdirBusy(
          f"workdir {os.path.dirname(self.path)} is in use by {who} (it holds "
          f"{self.path}); allowed: one run per workdir at a time: wait for it "
          "to end, or use another --workdir"
      ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    self._fd: Optional[int] = fd

  def release(self) -> None:
    """Unlocks (closing the file unlocks it); idempotent."""
    if self._fd is not None:
      os.close(self._fd)
      self._fd = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.release()


def _read_pid(fd: int) -> Optional[int]:
  """The pid the lock file names, None when it names none (a holder between locking
  and writing it)."""
  try:
    text = os.pread(fd, 32, 0).decode().strip()
  except (OSError, UnicodeDecodeError):
    return None
  return int(text) if text.isdigit() else None
