"""Where a fault came from, and the console line that shows it once.

`fault_source` names the part that raised an exception ('environment',
'grader', 'judge', 'user_sim', 'tool'), `fault_origin` the code ('MyEnv.react_to
(my_env.py:12)'). `show_fault_once` prints the first fault of each (kind,
source) on the console as one line (wrapped here):

    fault contract from environment in MyEnv.react_to (my_env.py:12): TypeError: ...
      (shown once; counted in faults/contract)

so a bug in environment code is seen at the step it first happens, not only
in the rollout dumps; every fault is still counted (`faults/<kind>`).
`show_notice_once` prints other first occurrences the same way (an episode
the tree cut, per-turn grades whose weight is 0).
"""

from __future__ import annotations

import os
import sys
import threading

from mtrl_jax.envs.faults import Fault, FaultKind


def fault_source(exc: BaseException) -> str:
  """Which part raised `exc`.

  An explicit `exc.source` wins. Otherwise the innermost frame of the
  traceback that runs a method of an object whose class declares a
  `fault_source` (graders: 'grader', judges and text generators: 'judge',
  user simulators: 'user_sim', tools: 'tool') names it; else 'environment'.
  """
  if getattr(exc, "source", None):
    return exc.source
  source, tb = "environment", exc.__traceback__
  while tb is not None:
    owner = tb.tb_frame.f_locals.get("self")
    declared = getattr(type(owner), "fault_source", None) if owner is not None else None
    if isinstance(declared, str):
      source = declared
    tb = tb.tb_next
  return source


# Frames of the environment API itself (the step runner, threads, tool calls) are
# skipped when locating an exception: the line worth showing is the caller's.
_API_DIR = os.path.dirname(os.path.abspath(__file__))


def exception_location(exc: BaseException) -> str:
  """'file.py:line' of the innermost frame of `exc`'s traceback outside the
  environment API's own modules ('' when there is none, e.g. a `ContractError`
  the step runner raised about react_to's answer)."""
  location, tb = "", exc.__traceback__
  while tb is not None:
    path = tb.tb_frame.f_code.co_filename
    if os.path.dirname(os.path.abspath(path)) != _API_DIR:
      location = f"{os.path.basename(path)}:{tb.tb_lineno}"
    tb = tb.tb_next
  return location


def fault_origin(exc: BaseException, obj, method: str) -> str:
  """Where `exc` came from: the innermost traceback frame running a method of `obj`
  (the environment, a factory) or of an object whose class declares a
  `fault_source` ('MyEnv.react_to', 'ExactGrader.grade'), with the file and line
  that raised it; '<type of obj>.<method>' when the traceback names neither."""
  where, tb = f"{type(obj).__name__}.{method}", exc.__traceback__
  while tb is not None:
    owner = tb.tb_frame.f_locals.get("self")
    if owner is not None and (
        owner is obj or isinstance(getattr(type(owner), "fault_source", None), str)
    ):
      where = f"{type(owner).__name__}.{tb.tb_frame.f_code.co_name}"
    tb = tb.tb_next
  location = exception_location(exc)
  return f"{where} ({location})" if location else where


class FaultConsole:
  """Prints the first fault of each (kind, source) once, on the process that writes files.

  Faults are shown where they are recorded (`step_environment`, the rollout's
  root and fork faults); truncations are routine and not shown. Other
  processes print nothing: the RL loop shows their faults once the step's
  trees are gathered (`rollout.stats.add_fault_totals`).
  """

  def __init__(self, stream=None):
    self._lock = threading.Lock()
    self._seen: set = set()
    self.stream = stream  # None: sys.stderr at the time of printing
    self._kept: list | None = None  # (key, line) kept instead of printed (`keep_lines`)

  def show(self, fault: Fault) -> bool:
    """Prints `fault.console_line()` if its (kind, source) was not shown yet."""
    if fault.kind == FaultKind.TRUNCATION:
      return False
    return self.notice((fault.kind, fault.source), fault.console_line())

  def notice(self, key, line: str) -> bool:
    """Prints `line`, a one-line notice that is not a fault (a cut episode, grades
    that earn nothing), the first time `key` is noticed; False when already shown."""
    with self._lock:
      if key in self._seen:
        return False
      self._seen.add(key)
      if self._kept is not None:
        self._kept.append((key, line))
        return True
    if not _writes_files():
      return False
    print(line, file=self.stream or sys.stderr, flush=True)
    return True

  def keep_lines(self) -> None:
    """From now on keeps each first line instead of printing it, until `take_lines`: the
    console of an environment worker process, whose lines the engine's process shows
    through its own console (`rollout.workers`), so each is shown once per run, not once
    per worker."""
    with self._lock:
      self._kept = []

  def take_lines(self) -> list:
    """The (key, line) pairs kept since the last call (none unless `keep_lines`)."""
    with self._lock:
      if self._kept is None:
        return []
      kept, self._kept = self._kept, []
      return kept

  def reset(self) -> None:
    """Forgets what was shown (tests, or a new run in the same process)."""
    with self._lock:
      self._seen.clear()


def _writes_files() -> bool:
  """True on the process that writes the run's files (process 0, or without jax)."""
  if "jax" not in sys.modules:
    return True  # no multi-process runtime in this process
  from mtrl_jax import distributed

  return distributed.is_writer()


FAULT_CONSOLE = FaultConsole()


def show_fault_once(fault: Fault) -> bool:
  """Prints the first fault of its (kind, source) once (`FaultConsole.show`)."""
  return FAULT_CONSOLE.show(fault)


def show_notice_once(key: str, line: str) -> bool:
  """Prints a one-line notice the first time `key` is noticed (`FaultConsole.notice`)."""
  return FAULT_CONSOLE.notice(key, line)
