"""The child side of `mtrl_jax.envs.sandbox`: confines itself, then runs the untrusted code.

Never imported: the parent reads this file once and runs its text with
`python -s -B -P -c`. It reads a JSON spec on stdin and writes JSON records,
each carrying the spec's nonce, to the inherited fd `spec["result_fd"]`.

Order, all before any untrusted line runs (docs/internals.md, "The code
sandbox"): resource limits; new network and mount namespaces (as root; else in
a new user namespace, when the kernel lets unprivileged users make one); a
chroot into a tmpfs holding read-only binds of the Python installation and the
shared libraries plus the writable working directory; dropping root for the
run's own uid (or every capability, in a user namespace) and setting
no_new_privs; the audit hook. Each step that fails is reported in the 'ready'
record, and the run goes on with the layers that remain.
"""

import builtins
import json
import os
import resource
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWNET = 0x00020000, 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE = 1024, 2048, 4096, 16384, 1 << 18
MS_RELATIME = 1 << 21
# statvfs flag -> mount flag: flags a remount inside a user namespace must keep.
LOCKED_FLAGS = (
    (os.ST_NOSUID, MS_NOSUID),
    (os.ST_NODEV, MS_NODEV),
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
LIB_DIRS = (
    "/lib",
    "/lib64",
    "/lib32",
    "/libx32",
    "/usr/lib",
    "/usr/lib64",
    "/usr/lib32",
    "/usr/libx32",
    "/usr/local/lib",
)
SYSTEM_FILES = ("/etc/ld.so.cache", "/etc/localtime")
DEVICES = ("/dev/null", "/dev/zero", "/dev/urandom", "/dev/random")
# Modules that reach past the audit hook: foreign calls and raw memory
# (ctypes), interpreters without this interpreter's hooks, CPython's test
# helpers. (_posixsubprocess.fork_exec, an exec without audit event of its
# own, is replaced instead: asyncio and multiprocessing import the module.)
BLOCKED_MODULES = frozenset(
    {
        "ctypes",
        "_ctypes",
        "_xxsubinterpreters",
        "_xxinterpchannels",
        "_interpreters",
        "_testcapi",
        "_testinternalcapi",
        "_testmultiphase",
    }
)


def _libc():
  import ctypes

  return ctypes, ctypes.CDLL(None, use_errno=True)


def _ok(ctypes, ret, what):
  if ret != 0:
    raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _limit(res, soft, hard=None):
  hard = soft if hard is None else hard
  top = resource.getrlimit(res)[1]
  if top != resource.RLIM_INFINITY:
    soft, hard = min(soft, top), min(hard, top)
  resource.setrlimit(res, (soft, hard))


def python_roots() -> list:
  """The Python installation as this interpreter sees it: prefixes and sys.path entries."""
  roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, *sys.path}
  return _outermost(os.path.realpath(r) for r in roots if r and os.path.exists(r))


def _outermost(paths) -> list:
  """Sorted paths without those inside another one."""
  out = []
  for p in sorted(set(paths)):
    if not any(p == q or p.startswith(q.rstrip("/") + "/") for q in out):
      out.append(p)
  return out


def _unshare(ctypes, libc, as_root: bool) -> None:
  """New network + mount namespaces (inside a new user namespace unless root)."""
  if as_root:
    _ok(ctypes, libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(NEWNS|NEWNET)")
    return
  uid, gid = os.geteuid(), os.getegid()
  _ok(
      ctypes,
      libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET),
      "unshare(NEWUSER|NEWNS|NEWNET)",
  )
  for name, text in (
      ("setgroups", "deny"),
      ("uid_map", f"{uid} {uid} 1"),
      ("gid_map", f"{gid} {gid} 1"),
  ):
    with open(f"/proc/self/{name}", "w") as f:
      f.write(text)


def _build_root(ctypes, libc, new_root: str, workdir: str) -> None:
  """Mounts a tmpfs at new_root holding only what the program may see; chroots into it."""

  def mount(src, dst, fstype, flags, data=None):
    _ok(
        ctypes,
        libc.mount(
            None if src is None else src.encode(),
            dst.encode(),
            None if fstype is None else fstype.encode(),
            flags,
            None if data is None else data.encode(),
        ),
        f"mount {dst}",
    )

  def bind(src, writable=False, at=None):
    dst = new_root + (at or src)
    if os.path.isdir(src):
      os.makedirs(dst, exist_ok=True)
    else:
      os.makedirs(os.path.dirname(dst), exist_ok=True)
      os.close(os.open(dst, os.O_CREAT | os.O_WRONLY, 0o644))
    mount(src, dst, None, MS_BIND | MS_REC)
    if not writable:
      kept = sum(ms for st, ms in LOCKED_FLAGS if os.statvfs(dst).f_flag & st)
      mount(None, dst, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | kept)

  mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing below propagates to the caller
  mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
  real = [d for d in LIB_DIRS if os.path.isdir(d) and not os.path.islink(d)]
  for path in _outermost(python_roots() + [os.path.realpath(d) for d in real]):
    bind(path)
  for d in LIB_DIRS:  # merged /usr: /lib -> usr/lib stays a link
    if os.path.islink(d) and not os.path.lexists(new_root + d):
      os.symlink(os.readlink(d), new_root + d)
  for f in SYSTEM_FILES:  # a link (/etc/localtime -> zoneinfo) is bound as its target
    if os.path.isfile(f) and not os.path.lexists(new_root + f):
      bind(os.path.realpath(f), at=f)
  for dev in DEVICES:
    if os.path.exists(dev):
      bind(dev, writable=True)
  bind(workdir, writable=True)
  os.chroot(new_root)
  os.chdir(workdir)


def _drop_capabilities(ctypes, libc, keep: int = 0) -> None:
  class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

  class Data(ctypes.Structure):
    _fields_ = [
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    ]

  caps = (Data * 2)()
  caps[0].effective = caps[0].permitted = keep
  _ok(ctypes, libc.capset(ctypes.byref(Header(0x20080522, 0)), caps), "capset")


def confine(spec) -> dict:
  """Limits, namespaces, chroot, privileges. Returns what was achieved (for 'ready')."""
  lim, done = spec["limits"], {"net": False, "files": False, "why": []}
  _limit(resource.RLIMIT_CORE, 0)
  _limit(resource.RLIMIT_CPU, lim["cpu_s"], lim["cpu_s"] + 1)
  _limit(resource.RLIMIT_FSIZE, lim["file_bytes"])
  _limit(resource.RLIMIT_NPROC, lim["nproc"])
  uid, as_root = spec["uid"], os.geteuid() == 0
  try:
    ctypes, libc = _libc()
  except (ImportError, OSError) as e:  # dropping root needs it; the namespaces can go
    if uid is not None:
      raise
    ctypes = libc = None
    done["why"].append(f"no ctypes: {type(e).__name__}: {e}")
  if spec["namespaces"] and libc is not None:
    try:
      _unshare(ctypes, libc, as_root and uid is not None)
      done["net"] = True
      _build_root(ctypes, libc, spec["new_root"], os.getcwd())
      done["files"] = True
    except (OSError, ValueError) as e:
      done["why"].append(f"{type(e).__name__}: {e}")
  if uid is not None:
    # Without KEEPCAPS, leaving root clears every capability.
    _ok(ctypes, libc.prctl(8, int(spec["read_cap"]), 0, 0, 0), "prctl(PR_SET_KEEPCAPS)")
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    if spec["read_cap"]:
      _drop_capabilities(ctypes, libc, keep=1 << 2)  # CAP_DAC_READ_SEARCH only
  elif spec["namespaces"] and libc is not None:
    _drop_capabilities(ctypes, libc)  # a user namespace's full set would undo the chroot
  if libc is not None:
    _ok(ctypes, libc.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
  _limit(resource.RLIMIT_AS, lim["as_bytes"])
  return done


def make_hook(root: str, readable: tuple):
  """The audit hook: every value it needs is held in this closure, not in globals."""
  realpath, fsdecode, sep, devnull = os.path.realpath, os.fsdecode, os.sep, os.devnull
  getpgid, getpid = os.getpgid, os.getpid
  write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
  writable = (root,)
  path_events = {
      "os.remove": (0,),
      "os.rmdir": (0,),
      "os.mkdir": (0,),
      "os.chmod": (0,),
      "os.chown": (0,),
      "os.truncate": (0,),
      "os.utime": (0,),
      "os.chflags": (0,),
      "os.setxattr": (0,),
      "os.removexattr": (0,),
      "os.rename": (0, 1),
      "os.link": (0, 1),
      "os.symlink": (1,),
      "shutil.rmtree": (0,),
      "shutil.move": (0, 1),
      "shutil.chown": (0,),
  }
  spawn = frozenset(
      {
          "os.exec",
          "os.posix_spawn",
          "os.spawn",
          "os.system",
          "subprocess.Popen",
          "pty.spawn",
          "os.startfile",
          "os.forkpty",
      }
  )
  network = frozenset(
      {
          "socket.bind",
          "socket.connect",
          "socket.sendto",
          "socket.sendmsg",
          "socket.getaddrinfo",
          "socket.gethostbyname",
          "socket.gethostbyaddr",
          "socket.getnameinfo",
          "socket.sethostname",
          "urllib.Request",
      }
  )
  unix, blocked = 1, BLOCKED_MODULES  # AF_UNIX: unconnected pairs only (asyncio's self-pipe)

  def inside(path, roots) -> bool:
    full = realpath(fsdecode(path))
    return any(full == r or full.startswith(r.rstrip(sep) + sep) for r in roots)

  def check(path, roots, what):
    if path is None or isinstance(path, int):
      return
    if not inside(path, roots):
      where = "" if roots is writable else " and the Python installation"
      raise PermissionError(
          f"sandbox: {what} outside the working directory{where} is blocked: {path!r}"
      )

  def hook(event, args):
    if event == "open":
      path, mode, flags = args
      if path is None or isinstance(path, int) or fsdecode(path) == devnull:
        return
      if (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
          isinstance(flags, int) and flags & write_flags
      ):
        check(path, writable, "writing")
      else:
        check(path, readable, "reading")
    elif event in path_events:
      for i in path_events[event]:
        check(args[i], writable, "writing")
    elif event in ("os.listdir", "os.scandir"):
      check("." if args[0] is None else args[0], readable, "listing")
    elif event == "sqlite3.connect":
      name = fsdecode(args[0])
      if name.startswith("file:"):  # a URI: the hook cannot resolve its path
        raise PermissionError("sandbox: sqlite URIs are blocked")
      if name not in (":memory:", ""):
        check(name, writable, "opening a database")
    elif event.startswith("sqlite3.") and "load_extension" in event:
      raise PermissionError("sandbox: loading sqlite extensions is blocked")
    elif event == "socket.__new__":
      if args[1] != unix:
        raise PermissionError("sandbox: network access is blocked")
    elif event in network:
      raise PermissionError("sandbox: network access is blocked")
    elif event == "import" and args[0].partition(".")[0] in blocked:
      raise ImportError(f"sandbox: importing {args[0]!r} is blocked")
    elif event.startswith("ctypes."):
      raise PermissionError(f"sandbox: ctypes is blocked ({event})")
    elif event in spawn:
      raise PermissionError("sandbox: starting other programs is blocked")
    elif event in ("os.kill", "os.killpg"):
      # Only the sandbox's own process group may be signalled.
      pid, group = args[0], getpgid(0)
      if event == "os.killpg":
        ok = pid in (0, group)
      else:
        ok = pid in (0, getpid(), -group) or (pid > 0 and getpgid(pid) == group)
      if not ok:
        raise PermissionError("sandbox: signalling other processes is blocked")

  return hook


def _no_exec(*args, **kwargs):
  raise PermissionError("sandbox: starting other programs is blocked")


class _Timeout(BaseException):
  pass


def _on_alarm(signum, frame):
  raise _Timeout()


def main():
  spec = json.loads(sys.stdin.buffer.read())
  fd = os.open(os.devnull, os.O_RDONLY)
  os.dup2(fd, 0)
  os.close(fd)
  out, nonce, cap = spec["result_fd"], spec["nonce"], spec["cap"]
  # Our own references: the program shares these modules and may rebind names.
  write, dumps, exit_, clock = os.write, json.dumps, os._exit, time.perf_counter
  compile_, exec_, signal_, setitimer = compile, exec, signal.signal, signal.setitimer

  def emit(**rec):
    rec["nonce"] = nonce
    data = (dumps(rec) + "\n").encode()
    while data:
      data = data[write(out, data) :]

  try:
    done = confine(spec)
    if spec["block_writes"]:
      root = os.path.realpath(os.getcwd())
      readable = tuple(python_roots()) + (root,) + DEVICES
      for name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED_MODULES]:
        del sys.modules[name]  # a later import is refused by the hook
      import _posixsubprocess

      _posixsubprocess.fork_exec = _no_exec
      sys.addaudithook(make_hook(root, readable))
  except BaseException as e:
    emit(kind="infra", message=f"{type(e).__name__}: {e}")
    exit_(3)

  def describe(e):
    if isinstance(e, _Timeout):
      return "timeout", "TimeoutException", "Code execution timed out"
    try:
      msg = str(e)[:cap]
    except BaseException:
      msg = "<unprintable exception>"
    return ("failed" if isinstance(e, AssertionError) else "error"), type(e).__name__, msg

  env = {"__name__": "__main__", "__builtins__": builtins}

  def timed(src, name, seconds):
    signal_(signal.SIGALRM, _on_alarm)
    setitimer(signal.ITIMER_REAL, seconds)
    try:
      exec_(compile_(src, name, "exec", dont_inherit=True), env)
    finally:
      setitimer(signal.ITIMER_REAL, 0)

  emit(kind="ready", net=done["net"], files=done["files"], why=done["why"])
  if spec["mode"] == "program":
    try:
      exec_(compile_(spec["program"], "<program>", "exec", dont_inherit=True), env)
      res = ("passed", None, None)
    except BaseException as e:
      res = describe(e)
      try:
        import traceback

        traceback.print_exception(type(e), e, e.__traceback__.tb_next)
      except BaseException:
        pass
    emit(kind="program", status=res[0], error_type=res[1], error_message=res[2])
  else:
    limit, fail = spec["timeout_s"], None
    try:
      if spec["prelude"]:
        timed(spec["prelude"], "<prelude>", limit)
      timed(spec["setup"], "<setup>", limit)
    except BaseException as e:
      fail = describe(e)
    emit(kind="setup", ok=fail is None)
    timeouts = 0
    for i, a in enumerate(spec["asserts"]):
      t0 = clock()
      if fail is not None:
        res = ("error",) + fail[1:]
      elif timeouts >= spec["max_timeouts"]:
        res = ("skipped", "TimeoutException", f"skipped after {timeouts} timeouts")
      else:
        try:
          timed(a, "<assert>", limit)
          res = ("passed", None, None)
        except BaseException as e:
          res = describe(e)
          timeouts += res[0] == "timeout"
      emit(
          kind="assert",
          i=i,
          status=res[0],
          error_type=res[1],
          error_message=res[2],
          duration_s=clock() - t0,
      )
  for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
    try:
      s.flush()
    except BaseException:
      pass
  emit(kind="end")
  exit_(0)


if __name__ == "__main__":
  main()
