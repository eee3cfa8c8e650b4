"""The parent's side of `mtrl_jax.envs.sandbox`: one harness process, start to end.

`execute` starts `sandbox_harness.py` in a fresh interpreter and a new session (setsid),
with a fresh working directory and an environment built from scratch, hands
it its spec on stdin, kills its whole process tree when the wall clock runs
out (and, with a per-run uid, every process of that uid afterwards), and
returns the records the harness wrote with the run's nonce and the truncated
stdout and stderr. What the records mean is `mtrl_jax.envs.sandbox`'s business.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

_MESSAGE_CAP = 2000  # characters of an error message the harness reports
_UID_BASE = 1_000_000  # per-run uids live in [1e6, 1e6 + 65536 * 256)


@dataclasses.dataclass(frozen=True)
class Limits:
  """Resource limits of one run (validated by the caller)."""

  memory_mb: int
  max_processes: int
  cpu_time_s: int
  max_file_mb: int
  max_output_bytes: int
  block_outside_writes: bool


@dataclasses.dataclass(frozen=True)
class Raw:
  """What one run left: the harness's records (with the run's nonce), how it ended, its
  output."""

  records: list
  returncode: int | None
  timed_out: bool
  stdout: str
  stderr: str
  duration_s: float


_HARNESS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_harness.py")
_harness_text: str | None = None
_lock = threading.Lock()
_uid_counter = itertools.count()


def _harness() -> str:
  """The child's program: `sandbox_harness.py`, read once (never imported here)."""
  global _harness_text
  if _harness_text is None:
    with open(_HARNESS_PATH, encoding="utf-8") as f:
      _harness_text = f.read()
  return _harness_text


def _allocate_uid() -> int:
  # Unique among this process's concurrent runs; the pid slot separates
  # processes (two live processes with pids equal mod 65536 could collide).
  with _lock:
    n = next(_uid_counter) % 256
  return _UID_BASE + (os.getpid() % 65536) * 256 + n


def execute(spec: dict, wall_s: float, limits: Limits, mode: str) -> Raw:
  """Runs the harness once on `spec`; `mode` is one of `sandbox.ISOLATION_MODES`."""
  uid = None if mode == "process_group" else _allocate_uid()
  nproc = limits.max_processes
  if uid is None and os.geteuid() != 0:
    nproc += sum(threads for _, threads in live(uid=os.getuid()))
  workdir = tempfile.mkdtemp(prefix="mtrl_sandbox_")
  new_root = tempfile.mkdtemp(prefix="mtrl_sandbox_root_")  # the child mounts its tmpfs here
  # Anonymous files (O_TMPFILE): the child writes through inherited fds and
  # nothing is left to delete.
  out, err, res = (tempfile.TemporaryFile() for _ in range(3))
  try:
    if uid is not None:
      os.chown(workdir, uid, uid)
    spec = dict(
        spec,
        result_fd=res.fileno(),
        nonce=secrets.token_hex(16),
        uid=uid,
        read_cap=mode == "drop_uid_read",
        namespaces=True,
        new_root=new_root,
        cap=_MESSAGE_CAP,
        block_writes=limits.block_outside_writes,
        limits={
            "cpu_s": limits.cpu_time_s,
            "nproc": nproc,
            "as_bytes": limits.memory_mb << 20,
            "file_bytes": limits.max_file_mb << 20,
        },
    )
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "HOME": workdir,
        "TMPDIR": workdir,
        "PYTHONHASHSEED": "0",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    flags = ["-s", "-B"] + (["-P"] if sys.version_info >= (3, 11) else [])
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, *flags, "-c", _harness()],
        stdin=subprocess.PIPE,
        stdout=out,
        stderr=err,
        cwd=workdir,
        env=env,
        pass_fds=(res.fileno(),),
        start_new_session=True,
    )
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
      # Wait for the exit without reaping: until `kill_all` reaps it, the
      # leader's pid (= the group id) cannot be reused, so killpg is safe.
      os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOWAIT)
    finally:
      timer.cancel()
      timer.join()
      kill_all(proc, uid)
    duration = time.monotonic() - t0
    records = []
    for line in read(res, None).splitlines():
      try:
        rec = json.loads(line)
      except ValueError:
        continue
      if isinstance(rec, dict) and rec.get("nonce") == spec["nonce"]:
        records.append(rec)
    cap = limits.max_output_bytes
    return Raw(
        records, proc.returncode, expired.is_set(), decode(out, cap), decode(err, cap), duration
    )
  finally:
    for f in (out, err, res):
      f.close()
    rmtree(workdir)
    os.rmdir(new_root)


def live(uid: int | None = None, pgid: int | None = None) -> list[tuple[int, int]]:
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


def kill_all(proc: subprocess.Popen, uid: int | None) -> None:
  """SIGKILLs the process group (and every process of `uid`) until none is left; reaps."""
  deadline = time.monotonic() + 5.0
  while True:
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
      pass
    left = [pid for pid, _ in (live(pgid=proc.pid) if uid is None else live(uid=uid))]
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


def rmtree(path: str) -> None:
  def fix(func, p, _):
    try:  # the program may have made its own directories unreadable
      os.chmod(os.path.dirname(p), 0o700)
      if os.path.isdir(p) and not os.path.islink(p):
        os.chmod(p, 0o700)
      func(p)
    except OSError:
      logging.warning("sandbox: could not remove %s", p)

  shutil.rmtree(path, **({"onexc": fix} if sys.version_info >= (3, 12) else {"onerror": fix}))


def read(f, cap: int | None) -> bytes:
  f.seek(0)
  return f.read() if cap is None else f.read(cap)


def decode(f, cap: int) -> str:
  size = os.fstat(f.fileno()).st_size
  text = read(f, cap).decode("utf-8", errors="replace")
  return text + (f"\n...[truncated {size - cap} bytes]" if size > cap else "")
