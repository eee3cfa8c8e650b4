"""Starts a multi-process run on this machine: P processes x D fake CPU devices.

  python -m experiments.launch_local --num_processes=2 --devices_per_process=4 -- \
      --config=configs/calculator.py:smoke=True --workdir=/tmp/mh --progress=false

Each process runs `experiments.train` with the flags after `--`, plus
`--config.distributed.mode=explicit` and the coordinator address (loopback,
a free port), the process count and its index. It sees D CPU devices
(`--xla_force_host_platform_device_count`) and exchanges collectives through
gloo, so the mesh spans P x D devices exactly as on P hosts. Output lines are
prefixed `[p<i>]`. When a process fails, the others get `--grace_s` seconds to
stop on their own (the coordinator's heartbeat ends them) and are then
killed; the launcher names the process that failed first and exits non-zero.
See docs/multihost.md.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from absl import app, flags

from experiments import cli

_NUM = flags.DEFINE_integer("num_processes", 2, "processes to start")
_DEVICES = flags.DEFINE_integer("devices_per_process", 4, "fake CPU devices per process")
_GRACE = flags.DEFINE_float("grace_s", 60.0, "seconds the others get to stop after a failure")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_s", 10, "a silent process is declared dead after this"
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(prefix: str, stream, out):
  for line in iter(stream.readline, b""):
    out.write(prefix + line.decode(errors="replace"))
    out.flush()


def launch(
    num: int,
    devices: int,
    train_flags: list,
    grace_s: float = 60.0,
    heartbeat_s: int = 10,
    out=sys.stdout,
) -> int:
  """Runs the processes to the end; returns 0, or the first failure's exit code."""
  port = free_port()
  env = dict(
      os.environ,
      JAX_PLATFORMS="cpu",
      PYTHONUNBUFFERED="1",
      PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]),
  )
  flags_xla = [
      f
      for f in env.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(flags_xla + [f"--xla_force_host_platform_device_count={devices}"])
  procs, pumps = [], []
  for i in range(num):
    cmd = [
        sys.executable,
        "-m",
        "experiments.train",
        *train_flags,
        "--config.distributed.mode=explicit",
        f"--config.distributed.coordinator_address=127.0.0.1:{port}",
        f"--config.distributed.num_processes={num}",
        f"--config.distributed.process_id={i}",
        f"--config.distributed.heartbeat_timeout_s={heartbeat_s}",
    ]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out.write(f"[launch] process {i} pid {p.pid}\n")
    out.flush()
    t = threading.Thread(target=_pump, args=(f"[p{i}] ", p.stdout, out), daemon=True)
    t.start()
    procs.append(p)
    pumps.append(t)
  first, deadline = None, None
  while True:
    codes = [p.poll() for p in procs]
    if first is None:
      failed = [i for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        first = failed[0]
        deadline = time.time() + grace_s
        out.write(
            f"[launch] process {first} failed first (exit {codes[first]}); the others "
            f"get {grace_s:.0f} s to stop\n"
        )
        out.flush()
    if all(c is not None for c in codes):
      break
    if deadline is not None and time.time() > deadline:
      for i, p in enumerate(procs):
        if p.poll() is None:
          out.write(f"[launch] killing process {i} (pid {p.pid})\n")
          p.send_signal(signal.SIGKILL)
      deadline = None
    time.sleep(0.1)
  for t in pumps:
    t.join(timeout=5)
  codes = [p.returncode for p in procs]
  out.write(f"[launch] exit codes {codes}\n")
  out.flush()
  if first is None:
    return 0
  return codes[first] if codes[first] > 0 else 128 - codes[first]


def main(argv):
  if _NUM.value < 1 or _DEVICES.value < 1:
    raise app.UsageError(
        f"--num_processes={_NUM.value} --devices_per_process={_DEVICES.value}; "
        "allowed: integers >= 1"
    )
  sys.exit(launch(_NUM.value, _DEVICES.value, argv[1:], _GRACE.value, _HEARTBEAT.value))


if __name__ == "__main__":
  cli.run(main)
