"""One run per workdir: a second process is refused in one line naming the holder's pid,
before it writes anything; a killed holder's lock goes with it, so a resume is never blocked."""

import os
import signal
import subprocess
import sys
import time

import pytest

from mtrl_jax import storage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _files(path) -> dict:
  out = {}
  for d, _, names in os.walk(path):
    for n in names:
      p = os.path.join(d, n)
      with open(p, "rb") as f:
        out[os.path.relpath(p, path)] = f.read()
  return out


def test_a_second_lock_on_a_workdir_is_refused_naming_the_holder(tmp_path):
  workdir = tmp_path / "run"
  with storage.WorkdirLock(str(workdir)):
    with pytest.raises(storage.WorkdirBusy) as e:
      storage.WorkdirLock(str(workdir))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        f"workdir {workdir} is in use by process {os.getpid()} (it holds {workdir}/.lock); "
        "allowed: one run per workdir at a time"
    )
  storage.WorkdirLock(str(workdir)).release()  # released: it locks again


def test_a_killed_holder_leaves_the_workdir_free(tmp_path):
  script = (
      "import sys, time; from mtrl_jax import storage; "
      "lock = storage.WorkdirLock(sys.argv[1]); print('locked', flush=True); time.sleep(60)"
  )
  proc = subprocess.Popen(
      [sys.executable, "-c", script, str(tmp_path)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      stdout=subprocess.PIPE,
      text=True,
  )
  try:
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(storage.WorkdirBusy, match=f"in use by process {proc.pid} "):
      storage.WorkdirLock(str(tmp_path))
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  with storage.WorkdirLock(str(tmp_path)):  # the OS dropped the dead holder's lock
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"


def test_the_same_command_twice_refuses_the_second_before_it_writes(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "config.json").write_text("{}")  # a run's files: left as they are
  with storage.WorkdirLock(str(workdir)):  # this process stands in for the first run
    before = _files(workdir)
    t0 = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/calculator.py:smoke=True",
            f"--workdir={workdir}",
            "--config.model.preset=tiny",
            "--config.rl.steps=1",
            "--config.rl.precompile=false",
            "--progress=false",
        ],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stderr[-3000:]
    assert out.stderr.splitlines() == [
        f"error: workdir {workdir} is in use by process {os.getpid()} (it holds "
        f"{workdir}/.lock); allowed: one run per workdir at a time: wait for it to end, or "
        "use another --workdir"
    ], out.stderr
    assert [l for l in out.stdout.splitlines() if not l.startswith("tree per step")] == []
    assert time.time() - t0 < 120  # refused at start, before any model is built
    assert _files(workdir) == before
