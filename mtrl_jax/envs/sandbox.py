"""Run untrusted (model-written) Python in a separate, resource-limited process.

`run_python` runs one program; `run_tests` loads code once and runs a list of
asserts in the same process, each under its own alarm (the per-assert protocol
of the HumanEval-style rewards). Each call starts a fresh interpreter
(`sys.executable -s -P -B -c <harness>`) in a new session, with a fresh
temporary working directory (deleted afterwards) and an environment built from
scratch (PATH, LANG, HOME/TMPDIR = the working directory, PYTHONHASHSEED, ...;
nothing of `os.environ` is inherited). `-I` is not used because it would also
ignore our PYTHONHASHSEED; since the environment is ours, `-s -P` isolates as
much as `-I` does.

Threat model, honestly: this guards a training run against *accidental* harm
from generated code (infinite loops, fork bombs, huge allocations, stray file
writes, early exits, reading the trainer's secrets), not against a determined
attacker. The layers:

* Resource limits, set by the harness before any untrusted line runs (not in a
  `preexec_fn`, which is unsafe in the forked child of a multi-threaded
  trainer): RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_CORE=0, RLIMIT_NPROC;
  and a wall-clock timer that kills the whole process group.
* Privileges. RLIMIT_NPROC counts a *user's* processes and never applies to
  root. So when the caller is root, the harness switches to a fresh uid for
  each run and sets `no_new_privs` (see `isolation_mode`). That really caps
  fork bombs, makes files the sandbox does not own unwritable and hides the
  caller's /proc/<pid>/environ; afterwards every process of that uid is
  killed, which also catches children that left the process group with
  setsid(). If the interpreter lives in a directory other users cannot read
  (e.g. under /root), the run keeps CAP_DAC_READ_SEARCH so that imports work:
  it can then *read* any file on the machine (not write). Without root, the
  program runs as the caller's user: the cap is RLIMIT_NPROC on top of the
  caller's task count, the cleanup a process-group kill only (a child that
  calls setsid() escapes it) and only the audit hook guards the files.
* An audit hook (`sys.addaudithook`) installed before the program: writes,
  deletes, renames, permission changes outside the working directory, starting
  other programs and signalling other processes raise PermissionError. It is
  not a security boundary: ctypes or interpreter corruption bypass it.
* Completion. A program passes only if the harness reaches its end and writes
  a record carrying a random nonce to a side channel: `os._exit(0)` or
  `sys.exit(0)` inside the program is an early exit, not a pass. Code that
  inspects the harness on purpose could forge the record; accidents cannot.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

from mtrl_jax.envs.faults import InfrastructureError

STATUSES = ("passed", "failed", "error", "timeout", "killed")
ISOLATION_MODES = ("drop_uid", "drop_uid_read", "process_group")
ASSERT_STATUSES = STATUSES + ("skipped",)
TIMEOUT_TYPE = "TimeoutException"
TIMEOUT_MESSAGE = "Code execution timed out"
# Interpreter start-up (about 20-50 ms) is not charged to the program's budget.
STARTUP_GRACE_S = 0.5

_MESSAGE_CAP = 2000
_UID_BASE = 1_000_000  # per-run uids live in [1e6, 1e6 + 65536 * 256)


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


@dataclasses.dataclass(frozen=True)
class _Limits:
  memory_mb: int
  max_processes: int
  cpu_time_s: int
  max_file_mb: int
  max_output_bytes: int
  block_outside_writes: bool


@dataclasses.dataclass(frozen=True)
class _Raw:
  records: list
  returncode: int | None
  timed_out: bool
  stdout: str
  stderr: str
  duration_s: float


# The child side. Runs as root (if the caller is) until it drops to `uid`.
_HARNESS = r'''
import json, os, resource, signal, sys, time, builtins
spec = json.loads(sys.stdin.buffer.read())
_fd = os.open(os.devnull, os.O_RDONLY); os.dup2(_fd, 0); os.close(_fd)
_OUT, _NONCE, _CAP, _LIM = spec["result_fd"], spec["nonce"], spec["cap"], spec["limits"]
# Our own references: the program shares these modules and may rebind names.
_write, _dumps, _exit, _clock = os.write, json.dumps, os._exit, time.perf_counter
_compile, _exec, _signal, _setitimer = compile, exec, signal.signal, signal.setitimer

def _emit(**rec):
  rec["nonce"] = _NONCE
  data = (_dumps(rec) + "\n").encode()
  while data:
    data = data[_write(_OUT, data):]

def _limit(res, soft, hard=None):
  hard = soft if hard is None else hard
  top = resource.getrlimit(res)[1]
  if top != resource.RLIM_INFINITY:
    soft, hard = min(soft, top), min(hard, top)
  resource.setrlimit(res, (soft, hard))

try:
  _limit(resource.RLIMIT_CORE, 0)
  _limit(resource.RLIMIT_CPU, _LIM["cpu_s"], _LIM["cpu_s"] + 1)
  _limit(resource.RLIMIT_FSIZE, _LIM["file_bytes"])
  _limit(resource.RLIMIT_NPROC, _LIM["nproc"])
  if spec["uid"] is not None:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    def _ok(ret, what):
      if ret != 0:
        raise OSError(ctypes.get_errno(), what)
    # Without KEEPCAPS, leaving root clears every capability.
    _ok(libc.prctl(8, int(spec["read_cap"]), 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    uid = spec["uid"]
    os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
    if spec["read_cap"]:
      class _Hdr(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]
      class _Caps(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]
      caps = (_Caps * 2)()
      caps[0].effective = caps[0].permitted = 1 << 2  # CAP_DAC_READ_SEARCH only
      _ok(libc.capset(ctypes.byref(_Hdr(0x20080522, 0)), caps), "capset")
    _ok(libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
  _limit(resource.RLIMIT_AS, _LIM["as_bytes"])
except BaseException as e:
  _emit(kind="infra", message=f"{type(e).__name__}: {e}")
  os._exit(3)

if spec["block_writes"]:
  _ROOT = os.path.realpath(os.getcwd())
  _WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  _PATHS = {"os.remove": (0,), "os.rmdir": (0,), "os.mkdir": (0,), "os.chmod": (0,),
            "os.chown": (0,), "os.truncate": (0,), "os.utime": (0,), "os.chflags": (0,),
            "os.setxattr": (0,), "os.removexattr": (0,), "os.rename": (0, 1),
            "os.link": (0, 1), "os.symlink": (1,), "shutil.rmtree": (0,),
            "shutil.move": (0, 1), "shutil.chown": (0,)}
  _SPAWN = {"os.exec", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen",
            "pty.spawn", "os.startfile", "os.forkpty"}
  def _check(path):
    if path is None or isinstance(path, int):
      return
    full = os.path.realpath(os.fsdecode(path))
    if full != _ROOT and not full.startswith(_ROOT + os.sep) and full != os.devnull:
      raise PermissionError(f"sandbox: writing outside the working directory is blocked: {path!r}")
  def _hook(event, args):
    if event == "open":
      mode, flags = args[1], args[2]
      if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          isinstance(flags, int) and flags & _WRITE):
        _check(args[0])
    elif event in _PATHS:
      for i in _PATHS[event]:
        _check(args[i])
    elif event in _SPAWN:
      raise PermissionError("sandbox: starting other programs is blocked")
    elif event in ("os.kill", "os.killpg"):
      # Only the sandbox's own process group may be signalled.
      pid, group = args[0], os.getpgid(0)
      if event == "os.killpg":
        ok = pid in (0, group)
      else:
        ok = pid in (0, os.getpid(), -group) or (pid > 0 and os.getpgid(pid) == group)
      if not ok:
        raise PermissionError("sandbox: signalling other processes is blocked")
  sys.addaudithook(_hook)

class _Timeout(BaseException):
  pass

def _on_alarm(signum, frame):
  raise _Timeout()

def _describe(e):
  if isinstance(e, _Timeout):
    return "timeout", "TimeoutException", "Code execution timed out"
  try:
    msg = str(e)[:_CAP]
  except BaseException:
    msg = "<unprintable exception>"
  return ("failed" if isinstance(e, AssertionError) else "error"), type(e).__name__, msg

_G = {"__name__": "__main__", "__builtins__": builtins}

def _timed(src, name, seconds):
  _signal(signal.SIGALRM, _on_alarm)
  _setitimer(signal.ITIMER_REAL, seconds)
  try:
    _exec(_compile(src, name, "exec", dont_inherit=True), _G)
  finally:
    _setitimer(signal.ITIMER_REAL, 0)

_emit(kind="ready")
if spec["mode"] == "program":
  try:
    _exec(_compile(spec["program"], "<program>", "exec", dont_inherit=True), _G)
    res = ("passed", None, None)
  except BaseException as e:
    res = _describe(e)
    try:
      import traceback
      traceback.print_exception(type(e), e, e.__traceback__.tb_next)
    except BaseException:
      pass
  _emit(kind="program", status=res[0], error_type=res[1], error_message=res[2])
else:
  T, fail = spec["timeout_s"], None
  try:
    if spec["prelude"]:
      _timed(spec["prelude"], "<prelude>", T)
    _timed(spec["setup"], "<setup>", T)
  except BaseException as e:
    fail = _describe(e)
  _emit(kind="setup", ok=fail is None)
  timeouts = 0
  for i, a in enumerate(spec["asserts"]):
    t0 = _clock()
    if fail is not None:
      res = ("error",) + fail[1:]
    elif timeouts >= spec["max_timeouts"]:
      res = ("skipped", "TimeoutException", f"skipped after {timeouts} timeouts")
    else:
      try:
        _timed(a, "<assert>", T)
        res = ("passed", None, None)
      except BaseException as e:
        res = _describe(e)
        timeouts += res[0] == "timeout"
    _emit(kind="assert", i=i, status=res[0], error_type=res[1], error_message=res[2],
          duration_s=_clock() - t0)
for _s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
  try:
    _s.flush()
  except BaseException:
    pass
_emit(kind="end")
_exit(0)
'''

_lock = threading.Lock()
_uid_counter = itertools.count()
_isolation: str | None = None


def _allocate_uid() -> int:
  # Unique among this process's concurrent runs; the pid slot separates
  # processes (two live processes with pids equal mod 65536 could collide).
  with _lock:
    n = next(_uid_counter) % 256
  return _UID_BASE + (os.getpid() % 65536) * 256 + n


def _live(uid: int | None = None, pgid: int | None = None) -> list[tuple[int, int]]:
  """(pid, threads) of the live processes of user `uid` or process group `pgid`."""
  found = []
  for name in os.listdir("/proc"):
    if not name.isdigit():
      continue
    try:
      with open(f"/proc/{name}/status", "rb") as f:
        status = f.read()
      field = lambda key: status.split(b"\n" + key + b":\t", 1)[1].split(b"\n", 1)[0]
      if field(b"State")[:1] in b"ZX":
        continue
      if uid is not None and int(field(b"Uid").split()[0]) != uid:
        continue
      if pgid is not None and int(field(b"NSpgid").split()[0]) != pgid:
        continue
      found.append((int(name), int(field(b"Threads"))))
    except (OSError, ValueError, IndexError):
      continue
  return found


def _kill_all(proc: subprocess.Popen, uid: int | None) -> None:
  """SIGKILLs the process group (and every process of `uid`) until none is left; reaps."""
  deadline = time.monotonic() + 5.0
  while True:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    left = [pid for pid, _ in (_live(pgid=proc.pid) if uid is None else _live(uid=uid))]
    if not left:
      break
    for pid in left:
      try:
        os.kill(pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    if time.monotonic() > deadline:
      logging.warning("sandbox: processes survive SIGKILL: %s", left)
      break
    time.sleep(0.002)
  proc.wait()


def _rmtree(path: str) -> None:
  def fix(func, p, _):
    try:  # the program may have made its own directories unreadable
      os.chmod(os.path.dirname(p), 0o700)
      if os.path.isdir(p) and not os.path.islink(p):
        os.chmod(p, 0o700)
      func(p)
    except OSError:
      logging.warning("sandbox: could not remove %s", p)
  shutil.rmtree(path, **({"onexc": fix} if sys.version_info >= (3, 12) else {"onerror": fix}))


def _read(f, cap: int | None) -> bytes:
  f.seek(0)
  return f.read() if cap is None else f.read(cap)


def _decode(f, cap: int) -> str:
  size = os.fstat(f.fileno()).st_size
  text = _read(f, cap).decode("utf-8", errors="replace")
  return text + (f"\n...[truncated {size - cap} bytes]" if size > cap else "")


def _execute(spec: dict, wall_s: float, limits: _Limits, mode: str) -> _Raw:
  """Runs the harness once; `mode` is one of ISOLATION_MODES."""
  uid = None if mode == "process_group" else _allocate_uid()
  nproc = limits.max_processes
  if uid is None and os.geteuid() != 0:
    nproc += sum(threads for _, threads in _live(uid=os.getuid()))
  workdir = tempfile.mkdtemp(prefix="mtrl_sandbox_")
  # Anonymous files (O_TMPFILE): the child writes through inherited fds and
  # nothing is left to delete.
  out, err, res = (tempfile.TemporaryFile() for _ in range(3))
  try:
    if uid is not None:
      os.chown(workdir, uid, uid)
    spec = dict(spec, result_fd=res.fileno(), nonce=secrets.token_hex(16), uid=uid,
                read_cap=mode == "drop_uid_read",
                cap=_MESSAGE_CAP, block_writes=limits.block_outside_writes, limits={
                    "cpu_s": limits.cpu_time_s, "nproc": nproc,
                    "as_bytes": limits.memory_mb << 20, "file_bytes": limits.max_file_mb << 20})
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8",
           "HOME": workdir, "TMPDIR": workdir, "PYTHONHASHSEED": "0",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8",
           "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    flags = ["-s", "-B"] + (["-P"] if sys.version_info >= (3, 11) else [])
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, *flags, "-c", _HARNESS], stdin=subprocess.PIPE,
                            stdout=out, stderr=err, cwd=workdir, env=env,
                            pass_fds=(res.fileno(),), start_new_session=True)
    # A timer thread and a blocking wait: Popen.wait(timeout) polls with
    # sleeps of up to 50 ms, which would dominate short runs.
    expired = threading.Event()

    def on_expiry():
      expired.set()
      try:
        os.killpg(proc.pid, signal.SIGKILL)
      except OSError:
        pass

    timer = threading.Timer(wall_s, on_expiry)
    timer.start()
    try:
      try:
        proc.stdin.write(json.dumps(spec).encode())
        proc.stdin.close()
      except BrokenPipeError:
        pass
      # Wait for the exit without reaping: until `_kill_all` reaps it, the
      # leader's pid (= the group id) cannot be reused, so killpg is safe.
      os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    finally:
      timer.cancel()
      timer.join()
      _kill_all(proc, uid)
    duration = time.monotonic() - t0
    records = []
    for line in _read(res, None).splitlines():
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if isinstance(rec, dict) and rec.get("nonce") == spec["nonce"]:
        records.append(rec)
    cap = limits.max_output_bytes
    return _Raw(records, proc.returncode, expired.is_set(), _decode(out, cap),
                _decode(err, cap), duration)
  finally:
    for f in (out, err, res):
      f.close()
    _rmtree(workdir)


def isolation_mode() -> str:
  """How untrusted code is isolated here, decided once per process.

  'drop_uid': root, a fresh uid per run, no capabilities; 'drop_uid_read':
  the same but keeping CAP_DAC_READ_SEARCH because the interpreter's files are
  not readable by other users (the sandbox can then read, not write, any
  file); 'process_group': not root (or the drop failed; logged), the caller's
  user with RLIMIT_NPROC on top of its task count and a process-group kill.
  """
  global _isolation
  with _lock:
    if _isolation is not None:
      return _isolation
  mode = "process_group"
  if os.geteuid() == 0:
    probe = _Limits(512, 8, 5, 1, 4096, True)
    for candidate in ("drop_uid", "drop_uid_read"):
      try:
        raw = _execute({"mode": "program", "program": "import decimal, fractions"}, 10.0,
                       probe, candidate)
      except OSError as e:
        raw = e
      if not isinstance(raw, Exception) and any(
          r.get("kind") == "program" and r["status"] == "passed" for r in raw.records):
        mode = candidate
        break
    else:
      logging.warning("sandbox: cannot drop root privileges (%s); untrusted code runs as "
                      "root and RLIMIT_NPROC does not apply", raw)
  with _lock:
    _isolation = mode
  return mode


def _make_limits(timeout_s, memory_mb, max_processes, cpu_time_s, max_file_mb,
                 max_output_bytes, block_outside_writes) -> _Limits:
  for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb),
                      ("max_processes", max_processes), ("max_file_mb", max_file_mb),
                      ("max_output_bytes", max_output_bytes)):
    if not isinstance(value, (int, float)) or value <= 0:
      raise ValueError(f"{name} must be a positive number, got {value!r}")
  cpu = math.ceil(timeout_s) + 1 if cpu_time_s is None else int(math.ceil(cpu_time_s))
  if cpu <= 0:
    raise ValueError(f"cpu_time_s must be positive, got {cpu_time_s!r}")
  return _Limits(int(memory_mb), int(max_processes), cpu, int(max_file_mb),
                 int(max_output_bytes), bool(block_outside_writes))


def _signal_name(returncode: int | None) -> str:
  try:
    return signal.Signals(-returncode).name
  except (TypeError, ValueError):
    return f"signal {returncode}"


def _abnormal_end(raw: _Raw, limits: _Limits, wall_s: float) -> tuple[str, str, str]:
  """(status, error_type, message) when the harness did not reach its end."""
  if raw.timed_out:
    return "timeout", TIMEOUT_TYPE, f"wall-clock limit of {wall_s:.1f} s exceeded"
  rc = raw.returncode
  if rc is not None and rc < 0:
    if -rc == signal.SIGXCPU:
      return "timeout", "CPUTimeLimitExceeded", f"CPU limit of {limits.cpu_time_s} s exceeded"
    return "killed", _signal_name(rc), f"the process was killed by {_signal_name(rc)}"
  return "error", "EarlyExit", f"the program exited (code {rc}) before it finished"


def _check_started(raw: _Raw) -> None:
  kinds = {r.get("kind") for r in raw.records}
  if "ready" not in kinds:
    infra = [r.get("message") for r in raw.records if r.get("kind") == "infra"]
    raise SandboxError(f"the sandbox did not start (returncode {raw.returncode}, "
                       f"timed_out {raw.timed_out}): {infra or raw.stderr[-1000:]}")


def run_python(program: str, timeout_s: float, *, memory_mb: int = 1024,
               max_processes: int = 32, cpu_time_s: float | None = None,
               max_file_mb: int = 16, max_output_bytes: int = 65536,
               block_outside_writes: bool = True) -> SandboxResult:
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
    block_outside_writes: install the audit hook (see module docstring).

  Returns:
    A SandboxResult; `.passed` only if the program ran to its end.

  Raises:
    SandboxError: the sandbox itself failed to start (infrastructure fault).
  """
  limits = _make_limits(timeout_s, memory_mb, max_processes, cpu_time_s, max_file_mb,
                        max_output_bytes, block_outside_writes)
  wall = timeout_s + STARTUP_GRACE_S
  raw = _execute({"mode": "program", "program": program}, wall, limits, isolation_mode())
  _check_started(raw)
  done = {r.get("kind"): r for r in raw.records}
  if "end" in done and "program" in done:
    rec = done["program"]
    status, etype, msg = rec["status"], rec["error_type"], rec["error_message"]
  else:
    status, etype, msg = _abnormal_end(raw, limits, wall)
  return SandboxResult(status, etype, msg, raw.stdout, raw.stderr, raw.duration_s,
                       raw.returncode)


def run_tests(setup_code: str, asserts: Sequence[str], timeout_per_assert_s: float,
              max_timeouts: int = 3, *, prelude: str = "", total_timeout_s: float | None = None,
              memory_mb: int = 1024, max_processes: int = 32, max_file_mb: int = 16,
              block_outside_writes: bool = True) -> list[AssertResult]:
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
  wall = (timeout_per_assert_s * (len(asserts) + 1) + STARTUP_GRACE_S
          if total_timeout_s is None else total_timeout_s)
  limits = _make_limits(timeout_per_assert_s, memory_mb, max_processes, wall, max_file_mb,
                        4096, block_outside_writes)
  spec = {"mode": "tests", "prelude": prelude, "setup": setup_code, "asserts": asserts,
          "timeout_s": float(timeout_per_assert_s), "max_timeouts": max_timeouts}
  raw = _execute(spec, wall, limits, isolation_mode())
  _check_started(raw)
  by_index = {r["i"]: r for r in raw.records if r.get("kind") == "assert"}
  setup_done = any(r.get("kind") == "setup" for r in raw.records)
  fate = None if "end" in {r.get("kind") for r in raw.records} else _abnormal_end(
      raw, limits, wall)
  results = []
  for i, a in enumerate(asserts):
    rec = by_index.get(i)
    if rec is not None:
      results.append(AssertResult(a, rec["status"], rec["error_type"], rec["error_message"],
                                  rec["duration_s"]))
    elif fate is None:
      raise SandboxError(f"sandbox ended without a result for assert {i}")
    elif not setup_done:  # died while loading: every assert shares the error
      results.append(AssertResult(a, "error", fate[1], fate[2], 0.0))
    elif i == len(by_index):
      results.append(AssertResult(a, *fate, raw.duration_s))
    else:
      results.append(AssertResult(a, "skipped", fate[1], "not run: " + fate[2], 0.0))
  return results
