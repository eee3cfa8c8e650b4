"""Run untrusted (model-written) Python in a separate, confined process.

`run_python` runs one program; `run_tests` loads code once and runs a list of
asserts in the same process, each under its own alarm (the per-assert protocol
of the HumanEval-style rewards). Each call starts a fresh interpreter
(`sys.executable -s -P -B -c <sandbox_harness.py>`) in a new session, with a
fresh temporary working directory (deleted afterwards) and an environment
built from scratch (HOME = TMPDIR = the working directory; nothing of
`os.environ` is inherited; `-I` is not used because it would also ignore our
PYTHONHASHSEED). The harness confines itself before the first untrusted line:

* resource limits (CPU, address space, file size, core, processes) and a
  wall-clock timer here that kills the whole process group;
* its own network namespace (no interface up: no sockets reach anything)
  and its own root: a tmpfs holding read-only binds of the Python
  installation and the shared libraries, and the writable working directory
  (nothing of $HOME, /tmp or the project is visible); as root, or in a new
  user namespace where the kernel allows one;
* a fresh uid per run when the caller is root (`isolation_mode`), no
  capabilities, no_new_privs; afterwards every process of that uid is killed;
* an audit hook: writes, reads and listings outside the working directory
  and the Python installation, sockets, ctypes, starting programs and
  signalling other processes raise PermissionError (ImportError for ctypes
  and subinterpreters);
* completion: a program passes only if the harness reaches its end and
  writes a record carrying a random nonce: `os._exit(0)` is not a pass.

The threat model and the residual risks are in docs/internals.md ("The code
sandbox"); `confinement()` says which namespaces this machine allows.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import signal
import threading
from typing import Sequence

from mtrl_jax.envs.faults import InfrastructureError
from mtrl_jax.envs.sandbox_procs import Limits, Raw, execute

STATUSES = ("passed", "failed", "error", "timeout", "killed")
ISOLATION_MODES = ("drop_uid", "drop_uid_read", "process_group")
ASSERT_STATUSES = STATUSES + ("skipped",)
TIMEOUT_TYPE = "TimeoutException"
TIMEOUT_MESSAGE = "Code execution timed out"
# Interpreter start-up (about 20-50 ms) is not charged to the program's budget.
STARTUP_GRACE_S = 0.5


class SandboxError(InfrastructureError):
  """The sandbox itself failed (an infrastructure fault, not the program's)."""


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome of one `run_python` call.

  status: 'passed' (ran to its end), 'failed' (AssertionError), 'error'
  (another exception, a syntax error or an early exit), 'timeout' (wall clock
  or CPU limit) or 'killed' (another signal, e.g. SIGSEGV).
  """

  status: str
  error_type: str | None
  error_message: str | None
  stdout: str
  stderr: str
  duration_s: float
  returncode: int | None

  @property
  def passed(self) -> bool:
    return self.status == "passed"


@dataclasses.dataclass(frozen=True)
class AssertResult:
  """Outcome of one assert of `run_tests` (status adds 'skipped')."""

  assertion: str
  status: str
  error_type: str | None
  error_message: str | None
  duration_s: float

  @property
  def passed(self) -> bool:
    return self.status == "passed"


_lock = threading.Lock()
_isolation: str | None = None
_confined: dict = {}


def _probe(mode: str):
  """One trivial run in `mode`: its 'ready' record when it passed, else the failure."""
  try:
    raw = execute(
        {"mode": "program", "program": "import decimal, fractions"},
        10.0,
        Limits(512, 8, 5, 1, 4096, True),
        mode,
    )
  except OSError as e:
    return e
  kinds = {r.get("kind"): r for r in raw.records}
  if kinds.get("program", {}).get("status") != "passed":
    return SandboxError(f"probe in mode {mode!r} failed: {raw.records} {raw.stderr[-500:]}")
  return kinds["ready"]


def isolation_mode() -> str:
  """How untrusted code is isolated here, decided once per process.

  'drop_uid': root, a fresh uid per run, no capabilities; 'drop_uid_read':
  the same but keeping CAP_DAC_READ_SEARCH because the interpreter's files are
  not readable by the run's uid even inside its own root (it can then read,
  not write, any file it can name); 'process_group': not root (or the drop
  failed; logged), the caller's user with RLIMIT_NPROC on top of its task
  count and a process-group kill. `confinement()` says which namespaces work.
  """
  global _isolation, _confined
  with _lock:
    if _isolation is not None:
      return _isolation
  mode, ready = "process_group", None
  candidates = (
      ("drop_uid", "drop_uid_read", "process_group") if os.geteuid() == 0 else ("process_group",)
  )
  for candidate in candidates:
    ready = _probe(candidate)
    if not isinstance(ready, Exception):
      mode = candidate
      break
    if candidate != "process_group":
      logging.warning("sandbox: cannot drop root privileges in mode %s (%s)", candidate, ready)
  if isinstance(ready, Exception):
    raise SandboxError(f"the sandbox cannot run a trivial program: {ready}")
  if not (ready["net"] and ready["files"]):
    logging.warning(
        "sandbox: no network/mount namespace here (%s): network, reads and ctypes "
        "are guarded by the audit hook only",
        "; ".join(ready["why"]),
    )
  with _lock:
    _isolation, _confined = mode, {"net": ready["net"], "files": ready["files"]}
  return mode


def confinement() -> dict:
  """{'net': own network namespace, 'files': own root (chroot)}, as the probe found."""
  isolation_mode()
  return dict(_confined)


def _make_limits(
    timeout_s,
    memory_mb,
    max_processes,
    cpu_time_s,
    max_file_mb,
    max_output_bytes,
    block_outside_writes,
) -> Limits:
  for name, value in (
      ("timeout_s", timeout_s),
      ("memory_mb", memory_mb),
      ("max_processes", max_processes),
      ("max_file_mb", max_file_mb),
      ("max_output_bytes", max_output_bytes),
  ):
    if not isinstance(value, (int, float)) or value <= 0:
      raise ValueError(f"{name} must be a positive number, got {value!r}")
  cpu = math.ceil(timeout_s) + 1 if cpu_time_s is None else int(math.ceil(cpu_time_s))
  if cpu <= 0:
    raise ValueError(f"cpu_time_s must be positive, got {cpu_time_s!r}")
  return Limits(
      int(memory_mb),
      int(max_processes),
      cpu,
      int(max_file_mb),
      int(max_output_bytes),
      bool(block_outside_writes),
  )


def _signal_name(returncode: int | None) -> str:
  try:
    return signal.Signals(-returncode).name
  except (TypeError, ValueError):
    return f"signal {returncode}"


def _abnormal_end(raw: Raw, limits: Limits, wall_s: float) -> tuple[str, str, str]:
  """(status, error_type, message) when the harness did not reach its end."""
  if raw.timed_out:
    return "timeout", TIMEOUT_TYPE, f"wall-clock limit of {wall_s:.1f} s exceeded"
  rc = raw.returncode
  if rc is not None and rc < 0:
    if -rc == signal.SIGXCPU:
      return "timeout", "CPUTimeLimitExceeded", f"CPU limit of {limits.cpu_time_s} s exceeded"
    return "killed", _signal_name(rc), f"the process was killed by {_signal_name(rc)}"
  return "error", "EarlyExit", f"the program exited (code {rc}) before it finished"


def _check_started(raw: Raw) -> None:
  ready = [r for r in raw.records if r.get("kind") == "ready"]
  if not ready:
    infra = [r.get("message") for r in raw.records if r.get("kind") == "infra"]
    raise SandboxError(
        f"the sandbox did not start (returncode {raw.returncode}, "
        f"timed_out {raw.timed_out}): {infra or raw.stderr[-1000:]}"
    )
  lost = [k for k, v in _confined.items() if v and not ready[0].get(k)]
  if lost:  # worked at the probe, failed now (e.g. out of namespaces): not the program's fault
    raise SandboxError(f"the sandbox lost its {'/'.join(lost)} isolation: {ready[0]['why']}")


def run_python(
    program: str,
    timeout_s: float,
    *,
    memory_mb: int = 1024,
    max_processes: int = 32,
    cpu_time_s: float | None = None,
    max_file_mb: int = 16,
    max_output_bytes: int = 65536,
    block_outside_writes: bool = True,
) -> SandboxResult:
  """Runs `program` as `__main__` in a fresh sandboxed interpreter.

  Args:
    program: Python source text.
    timeout_s: wall-clock budget of the program (plus `STARTUP_GRACE_S` for
      the interpreter start); on expiry the whole process tree is killed.
    memory_mb: address-space limit (RLIMIT_AS).
    max_processes: processes/threads the sandbox may hold (RLIMIT_NPROC).
    cpu_time_s: CPU-seconds limit; default ceil(timeout_s) + 1.
    max_file_mb: largest file it may write (RLIMIT_FSIZE), stdout included.
    max_output_bytes: stdout/stderr are truncated to this many bytes.
    block_outside_writes: install the audit hook (see module docstring); off, only
      the kernel layers (namespaces, uid, limits) guard the machine.

  Returns:
    A SandboxResult; `.passed` only if the program ran to its end.

  Raises:
    SandboxError: the sandbox itself failed to start (infrastructure fault).
  """
  limits = _make_limits(
      timeout_s,
      memory_mb,
      max_processes,
      cpu_time_s,
      max_file_mb,
      max_output_bytes,
      block_outside_writes,
  )
  wall = timeout_s + STARTUP_GRACE_S
  raw = execute({"mode": "program", "program": program}, wall, limits, isolation_mode())
  _check_started(raw)
  done = {r.get("kind"): r for r in raw.records}
  if "end" in done and "program" in done:
    rec = done["program"]
    status, etype, msg = rec["status"], rec["error_type"], rec["error_message"]
  else:
    status, etype, msg = _abnormal_end(raw, limits, wall)
  return SandboxResult(status, etype, msg, raw.stdout, raw.stderr, raw.duration_s, raw.returncode)


def run_tests(
    setup_code: str,
    asserts: Sequence[str],
    timeout_per_assert_s: float,
    max_timeouts: int = 3,
    *,
    prelude: str = "",
    total_timeout_s: float | None = None,
    memory_mb: int = 1024,
    max_processes: int = 32,
    max_file_mb: int = 16,
    block_outside_writes: bool = True,
) -> list[AssertResult]:
  """Loads `setup_code` once, then runs each assert under its own alarm.

  All in one sandbox process and one globals dict. If loading fails, every
  assert fails with that error (status 'error'). After `max_timeouts` asserts
  timed out, the rest are 'skipped' (not passed). If the process dies or hits
  the total wall clock, the assert in flight gets that fate and the rest are
  skipped.

  Args:
    setup_code: code defining what the asserts test.
    asserts: statements, each run on its own (typically `assert f(x) == y`).
    timeout_per_assert_s: alarm per assert (and for loading the code).
    max_timeouts: timeouts after which the remaining asserts are skipped.
    prelude: trusted code run first in the same globals (e.g. 'import math').
    total_timeout_s: wall clock for the whole process; default
      timeout_per_assert_s * (len(asserts) + 1) + STARTUP_GRACE_S.
    memory_mb, max_processes, max_file_mb, block_outside_writes: as `run_python`.

  Returns:
    One AssertResult per assert, in order.
  """
  asserts = list(asserts)
  if not isinstance(max_timeouts, int) or max_timeouts < 1:
    raise ValueError(f"max_timeouts must be a positive int, got {max_timeouts!r}")
  wall = (
      timeout_per_assert_s * (len(asserts) + 1) + STARTUP_GRACE_S
      if total_timeout_s is None
      else total_timeout_s
  )
  limits = _make_limits(
      timeout_per_assert_s, memory_mb, max_processes, wall, max_file_mb, 4096, block_outside_writes
  )
  spec = {
      "mode": "tests",
      "prelude": prelude,
      "setup": setup_code,
      "asserts": asserts,
      "timeout_s": float(timeout_per_assert_s),
      "max_timeouts": max_timeouts,
  }
  raw = execute(spec, wall, limits, isolation_mode())
  _check_started(raw)
  by_index = {r["i"]: r for r in raw.records if r.get("kind") == "assert"}
  setup_done = any(r.get("kind") == "setup" for r in raw.records)
  fate = None if "end" in {r.get("kind") for r in raw.records} else _abnormal_end(raw, limits, wall)
  results = []
  for i, a in enumerate(asserts):
    rec = by_index.get(i)
    if rec is not None:
      results.append(
          AssertResult(a, rec["status"], rec["error_type"], rec["error_message"], rec["duration_s"])
      )
    elif fate is None:
      raise SandboxError(f"sandbox ended without a result for assert {i}")
    elif not setup_done:  # died while loading: every assert shares the error
      results.append(AssertResult(a, "error", fate[1], fate[2], 0.0))
    elif i == len(by_index):
      results.append(AssertResult(a, *fate, raw.duration_s))
    else:
      results.append(AssertResult(a, "skipped", fate[1], "not run: " + fate[2], 0.0))
  return results
