"""Process-tree and output helpers of `mtrl_jax.envs.sandbox` (the parent's side)."""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import time


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
