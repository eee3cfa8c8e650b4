"""Checkpoint storage faults: a failed write ends in one line with the last checkpoint
intact; an unreadable checkpoint is skipped (named in one warning line) for the previous one."""

import asyncio
import contextlib
import errno
import glob
import json
import logging
import os
import re
import subprocess
import sys
import time
import warnings

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from mtrl_jax import checkpoint, testing
from mtrl_jax.checkpoint import Checkpointer, CheckpointError
from mtrl_jax.metrics import MetricsWriter
from mtrl_jax.run import defaults, saved
from mtrl_jax.run.run_record import RunRecord
from mtrl_jax.storage import quiet_orbax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(shift: float, size: int = 64):
  return {"w": jnp.arange(size, dtype=jnp.float32) + shift, "n": jnp.int32(shift)}


def _target(size: int = 64):
  return checkpoint.abstract_like(_state(0.0, size))


def _files(path):
  return sorted(os.path.relpath(p, path) for p in glob.glob(f"{path}/**", recursive=True))


def _saved(workdir, steps, keep=3, size=64):
  with Checkpointer(workdir, keep=keep) as ckpt:
    for step in steps:
      ckpt.save(step, _state(float(step), size), {"step": step})


def _one_line(text: str) -> str:
  assert "\n" not in text.strip(), text
  return text


def test_a_failed_background_write_raises_one_line_at_the_next_save(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  _saved(workdir, [1, 2])
  before = _files(tmp_path / "ckpt" / "2")

  async def full_disk(self, x, directory):
    raise OSError(errno.ENOSPC, "No space left on device")

  ckpt = Checkpointer(workdir, keep=2)
  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full_disk)
  assert ckpt.save(3, _state(3.0), {"step": 3})  # written in the background
  t0 = time.time()
  with pytest.raises(CheckpointError) as e:
    ckpt.save(4, _state(4.0), {"step": 4})
  assert time.time() - t0 < 10
  msg = _one_line(str(e.value))
  assert f"checkpoint {workdir}/ckpt/3 was not written: No space left on device (errno 28)" in msg
  assert f"{workdir}/ckpt/2 is intact" in msg
  monkeypatch.undo()
  with pytest.raises(CheckpointError, match="ckpt/3 was not written"):  # and stays so
    ckpt.save(5, _state(5.0), {"step": 5})
  ckpt.close()  # the failure was raised already
  # Nothing lost: step 2 (and 1, keep=2 deleted nothing) restores as saved.
  assert checkpoint.step_dirs(f"{workdir}/ckpt") == [1, 2]
  assert _files(tmp_path / "ckpt" / "2") == before
  with Checkpointer(workdir, keep=2) as again:
    step, state, meta = again.restore_latest(_target())
    assert (step, meta) == (2, {"step": 2})
    np.testing.assert_array_equal(state["w"], np.arange(64) + 2.0)
    assert again.save(3, _state(3.0), {"step": 3})  # the step saves again once there is room
  assert checkpoint.step_dirs(f"{workdir}/ckpt") == [2, 3]


def test_a_failed_best_save_raises_and_keeps_the_previous_best(tmp_path, monkeypatch):
  workdir = str(tmp_path)
  with Checkpointer(workdir) as ckpt:
    ckpt.maybe_save_best(1, 0.5, _state(1.0))

  async def full_disk(self, x, directory):
    raise OSError(errno.ENOSPC, "No space left on device")

  ckpt = Checkpointer(workdir, async_save=False)  # several processes save synchronously
  monkeypatch.setattr(ocp.handlers.JsonCheckpointHandler, "_save_fn", full_disk)
  with pytest.raises(
      CheckpointError,
      match=r"best/2 was not written: No space left on device"
      r" \(errno 28\); .*/best/1 is intact",
  ):
    ckpt.maybe_save_best(2, 0.9, _state(2.0))
  monkeypatch.undo()
  ckpt.close()
  with Checkpointer(workdir) as again:
    assert again.best() == {"step": 1, "score": 0.5}
    state, _ = again.restore_best(_target())
  np.testing.assert_array_equal(state["w"], np.arange(64) + 1.0)


_FSIZE_SCRIPT = """
import resource, signal, sys
from mtrl_jax.checkpoint import Checkpointer, CheckpointError
from mtrl_jax.storage import quiet_orbax
from tests.test_checkpoint_faults import _state
ckpt = Checkpointer(sys.argv[1], keep=3)
ckpt.save(1, _state(1.0), {"step": 1})
ckpt.wait()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
ckpt.save(2, _state(2.0, size=100_000), {"step": 2})
try:
  ckpt.save(3, _state(3.0), {"step": 3})
except CheckpointError as e:
  print(e)
  sys.exit(3)
"""


def test_a_write_the_os_refuses_ends_the_process_with_one_line(tmp_path):
  # A real write error from the kernel, in TensorStore's own writes: the file size
  # limit of the process stands in for a full disk.
  t0 = time.time()
  out = subprocess.run(
      [sys.executable, "-c", _FSIZE_SCRIPT, str(tmp_path)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert out.returncode == 3, out.stderr[-3000:]
  assert time.time() - t0 < 60
  lines = out.stdout.strip().splitlines()
  assert (
      len(lines) == 1
      and f"{tmp_path}/ckpt/2 was not written: File too large (errno 27)" in lines[0]
      and f"{tmp_path}/ckpt/1 is intact" in lines[0]
  ), out.stdout
  assert "Traceback" not in out.stderr and "orbax" not in out.stderr, out.stderr[-3000:]
  with Checkpointer(str(tmp_path)) as ckpt:
    step, state, _ = ckpt.restore_latest(_target())
  assert step == 1 and float(state["w"][0]) == 1.0


def _truncate_largest(step_dir):
  path = max(glob.glob(f"{step_dir}/state/**/d/*", recursive=True), key=os.path.getsize)
  os.truncate(path, os.path.getsize(path) // 2)


def test_an_unreadable_latest_checkpoint_is_skipped_and_moved_aside(tmp_path):
  workdir = str(tmp_path)
  _saved(workdir, [1, 2, 3], size=4096)
  _truncate_largest(tmp_path / "ckpt" / "3")
  warnings = []
  with Checkpointer(workdir, warn=warnings.append) as ckpt:
    step, state, meta = ckpt.restore_latest(_target(4096))
    assert (step, meta) == (2, {"step": 2})
    np.testing.assert_array_equal(state["w"], np.arange(4096) + 2.0)
    assert ckpt.save(3, _state(30.0, 4096), {"step": 30})  # the step saves again
  assert len(warnings) == 1
  warning = _one_line(warnings[0])
  assert warning.startswith(f"checkpoint {workdir}/ckpt/3 does not read back (")
  assert f"skipped it, moved to {workdir}/ckpt.unreadable/3; trying step 2" in warning
  assert os.path.isdir(tmp_path / "ckpt.unreadable" / "3" / "state")  # kept, not deleted
  with Checkpointer(workdir) as ckpt:
    assert ckpt.restore_latest(_target(4096))[2] == {"step": 30}


def test_garbage_metadata_is_named_and_skipped_read_only(tmp_path, capsys):
  workdir = str(tmp_path)
  _saved(workdir, [1, 2])
  (tmp_path / "ckpt" / "2" / "meta" / "metadata").write_text("{garbage")
  with Checkpointer(workdir, read_only=True) as ckpt:
    step, _, meta = ckpt.restore_latest(_target())
  assert (step, meta) == (1, {"step": 1})
  err = capsys.readouterr().err.strip().splitlines()
  assert err == [
      f"warning: checkpoint {workdir}/ckpt/2 does not read back ({workdir}/ckpt/2/"
      "meta/metadata is not valid JSON: Expecting property name enclosed in double "
      "quotes: line 1 column 2 (char 1)); skipped it; trying step 1"
  ]
  assert os.path.isdir(tmp_path / "ckpt" / "2")  # read-only: left where it is


def test_no_readable_checkpoint_names_the_directory(tmp_path):
  workdir = str(tmp_path)
  _saved(workdir, [1, 2])
  for step in (1, 2):
    (tmp_path / "ckpt" / str(step) / "state" / "_METADATA").write_text("not json")
  warnings = []
  with Checkpointer(workdir, read_only=True, warn=warnings.append) as ckpt:
    with pytest.raises(CheckpointError) as e:
      ckpt.restore_latest(_target())
  assert _one_line(str(e.value)).startswith(
      f"no readable checkpoint under {workdir}/ckpt: steps [1, 2] do not read back"
  )
  assert [w.split(" does not")[0] for w in warnings] == [
      f"checkpoint {workdir}/ckpt/2",
      f"checkpoint {workdir}/ckpt/1",
  ]
  with Checkpointer(str(tmp_path / "empty")) as ckpt:
    assert ckpt.restore_latest(_target()) is None


def test_an_unreadable_best_is_named_and_replaced(tmp_path):
  workdir = str(tmp_path)
  with Checkpointer(workdir) as ckpt:
    ckpt.maybe_save_best(4, 0.5, _state(4.0))
  (tmp_path / "best" / "4" / "meta" / "metadata").write_text("")
  warnings = []
  with Checkpointer(workdir, warn=warnings.append) as ckpt:
    assert ckpt.best() is None
    assert ckpt.maybe_save_best(6, 0.1, _state(6.0))
    assert ckpt.best() == {"step": 6, "score": 0.1}
  assert len(warnings) == 1 and warnings[0].startswith(
      f"best checkpoint {workdir}/best/4 does not read back ({workdir}/best/4/meta/metadata is "
      "not valid JSON"
  )
  assert warnings[0].endswith(f"ignored it, moved to {workdir}/best.unreadable/4")
  assert os.path.isdir(tmp_path / "best.unreadable" / "4")


def test_orbax_records_stay_off_the_console(tmp_path, caplog):
  from absl import logging as absl_logging

  absl_logging.set_verbosity(absl_logging.INFO)
  try:
    with caplog.at_level(logging.DEBUG):
      _saved(str(tmp_path), [1])
  finally:
    absl_logging.set_verbosity(absl_logging.WARNING)
  assert not [r for r in caplog.records if f"{os.sep}orbax{os.sep}" in r.pathname]


def test_reason_is_one_short_line():
  assert checkpoint.reason(OSError(errno.ENOSPC, "x")) == "No space left on device (errno 28)"
  ts = ValueError(
      'RESOURCE_EXHAUSTED: Error writing "a/0" in OCDBT database at local file '
      '"/r/ckpt/2/state/": Failed writing: "/r/d/x": No space left on device '
      "[os_error_code='28']"
  )
  try:
    raise RuntimeError("Encountered error while reading\nspec {\n}") from ts
  except RuntimeError as e:
    assert checkpoint.reason(e) == "No space left on device (errno 28)"
  status = ValueError(
      'OUT_OF_RANGE: Error reading "w/0" in OCDBT database at local file '
      '"/r/": Requested byte range [5, 9) is not valid'
  )
  try:
    raise Exception("Encountered error while reading array index\n...") from status
  except Exception as e:
    assert checkpoint.reason(e) == (
        'OUT_OF_RANGE: Error reading "w/0": Requested byte range [5, 9) is not valid'
    )
  assert checkpoint.reason(KeyError("x" * 500)).startswith("KeyError: 'xxx")
  assert len(checkpoint.reason(KeyError("x" * 500))) < 260


_BLOCKED_SCRIPT = """
import os, sys, time
from mtrl_jax.checkpoint import Checkpointer, CheckpointError
from mtrl_jax.storage import quiet_orbax
from tests.test_checkpoint_faults import _state
ckpt = Checkpointer(sys.argv[1], keep=3)
try:
  ckpt.save(0, _state(0.0), {"step": 0})  # in the background while the best one fails
  ckpt.maybe_save_best(0, 0.5, _state(0.0))
  # check() reports the failure once Orbax's thread has failed: a few ms here, longer on
  # a loaded machine (a save that came sooner would not see it yet).
  deadline = time.time() + 20
  while time.time() < deadline:
    ckpt.check()
    time.sleep(0.01)
except CheckpointError as e:  # leaves without close(), as a run's exception does
  print(e)
  sys.exit(1)
print("check() never reported the failed save", flush=True)  # os._exit skips the flush
os._exit(2)  # its stalled threads would hold the exit for minutes
"""


def test_a_failed_background_save_lets_the_process_exit_at_once(tmp_path):
  # A file where Orbax must create the best checkpoint's directory: the OS refuses the
  # write even to root (ENOTDIR), and Orbax's other save threads of that step wait for a
  # signal that never comes (five minutes) unless the Checkpointer ends them.
  (tmp_path / "best").write_text("keep")
  t0 = time.time()
  out = subprocess.run(
      [sys.executable, "-c", _BLOCKED_SCRIPT, str(tmp_path)],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=200,
  )
  assert out.returncode == 1, out.stderr[-3000:]
  assert time.time() - t0 < 30
  assert out.stdout.strip() == (
      f"checkpoint {tmp_path}/best/0 was not written: Not a directory "
      "(errno 20); the last complete checkpoint there: none is complete"
  )
  assert "never awaited" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert (tmp_path / "best").read_text() == "keep"
  with Checkpointer(str(tmp_path)) as ckpt:  # the other save, in flight, was finished
    step, state, meta = ckpt.restore_latest(_target())
  assert (step, meta) == (0, {"step": 0}) and float(state["w"][1]) == 1.0


@pytest.mark.slow
def test_a_run_that_cannot_save_exits_in_one_line_at_once(tmp_path):
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "best").write_text("keep")  # where the step-0 best checkpoint must go
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
      timeout=280,
  )
  assert out.returncode == 1, out.stderr[-3000:]
  assert time.time() - t0 < 150  # start-up and the step-0 evaluation; no wait at exit
  errors = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
  assert errors == [
      f"error: checkpoint {workdir}/best/0 was not written: Not a directory "
      "(errno 20); the last complete checkpoint there: none is complete"
  ], out.stderr
  assert "never awaited" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert (workdir / "best").read_text() == "keep" and (workdir / "config.json").is_file()


def test_asyncio_reports_of_failed_orbax_tasks_stay_off_the_console(caplog):
  """A full disk fails Orbax's tensorstore writes inside asyncio tasks nobody awaits
  any more; asyncio logs each ("Task exception was never retrieved") with a traceback.
  The Checkpointer reports the failure in one line, so those records are dropped, and
  only those."""
  quiet_orbax()
  scope = {}
  exec(
      compile(
          "def write():\n  raise ValueError('RESOURCE_EXHAUSTED: No space left')\n",
          os.path.join(os.sep, "x", "orbax", "checkpoint", "serialization.py"),
          "exec",
      ),
      scope,
  )
  try:
    scope["write"]()
  except ValueError as e:
    from_orbax = e
  loop = asyncio.new_event_loop()
  try:
    with caplog.at_level(logging.ERROR):
      loop.call_exception_handler(
          {"message": "Task exception was never retrieved", "exception": from_orbax}
      )
      loop.call_exception_handler(
          {
              "message": "Task exception was never retrieved",
              "exception": ValueError("a task of the run's own"),
          }
      )
  finally:
    loop.close()
  logged = [r.getMessage() for r in caplog.records if r.name == "asyncio"]
  assert len(logged) == 1 and "never retrieved" in logged[0], logged
  assert "own" in str(caplog.records[-1].exc_info[1])


@contextlib.contextmanager
def _tmpfs(path, size: str):
  """A tmpfs of `size` mounted at `path` (made here) for the block; skips the test where
  mounting needs a permission this process lacks."""
  path.mkdir()
  mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
  if subprocess.run(mount, capture_output=True).returncode:
    pytest.skip("cannot mount a tmpfs here")
  try:
    yield path
  finally:
    subprocess.run(["umount", str(path)], capture_output=True)


@pytest.mark.slow
def test_a_full_disk_ends_the_run_in_one_line_with_the_last_checkpoint_intact(tmp_path):
  """The workdir on a 1000 KB tmpfs: checkpoints and the best (about 270 KB each) fill it,
  and a later one fails inside tensorstore (RESOURCE_EXHAUSTED, errno 28). Four steps, a
  checkpoint each: more than the disk holds, whatever the rollout dumps beside them take."""
  with _tmpfs(tmp_path / "disk", "1000k") as disk:
    workdir = disk / "run"
    # One CPU device (the tests' 8 would write each array in 8 shards: other sizes).
    one_device = testing.cpu_env(1, PYTHONPATH=ROOT)
    t0 = time.time()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "experiments.train",
            "--config=configs/calculator.py:smoke=True",
            f"--workdir={workdir}",
            "--config.checkpoint.every=1",
            "--config.rl.steps=4",
            "--config.sft.steps=0",
            "--progress=false",
        ],
        cwd=ROOT,
        env=one_device,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 1, out.stderr[-3000:]
    assert time.time() - t0 < 150
    errors = [l for l in out.stderr.splitlines() if l.startswith("error: ")]
    assert len(errors) == 1, out.stderr[-3000:]
    m = re.fullmatch(
        rf"error: checkpoint {workdir}/(ckpt|best)/(\d+) was not written: No space "
        r"left on device \(errno 28\); the last complete checkpoint there: "
        rf"{workdir}/(ckpt|best)/(\d+) is intact",
        errors[0],
    )
    assert m and m[1] == m[3] and int(m[4]) < int(m[2]), errors[0]
    assert "Traceback" not in out.stderr and "never" not in out.stderr, out.stderr[-3000:]
    assert checkpoint.step_dirs(str(workdir / m[1]))[-1] == int(m[4])
    with Checkpointer(str(workdir), read_only=True) as ckpt:  # the intact one reads back
      assert ckpt.all_steps() and ckpt.all_steps()[-1] < 4


def _fill(disk):
  """Writes `disk/filler` until the disk is full."""
  with pytest.raises(OSError) as full:
    with open(disk / "filler", "wb") as f:
      while True:
        f.write(b"\0" * 4096)
        f.flush()
  assert full.value.errno == errno.ENOSPC


def test_a_full_disk_at_the_end_warns_once_per_file_and_keeps_the_old_summary(tmp_path, capfd):
  """summary.json and curves.png on a full disk: one warning line each, the summary
  already there unchanged and no partial file left."""
  with _tmpfs(tmp_path / "disk", "64k") as disk:
    with open(disk / "metrics.jsonl", "w") as f:
      f.writelines(json.dumps({"step": s, "train/loss": 0.1 * s}) + "\n" for s in range(3))
    (disk / "summary.json").write_text('{"old": 1}')
    _fill(disk)
    record = RunRecord(str(disk))
    record.summary["eval_history"] = [{"step": 2, "success": 0.5}]
    capfd.readouterr()
    record.write(str(disk))
    err = capfd.readouterr().err
    assert err.splitlines() == [
        f"warning: {disk}/summary.json was not written: No space left on device (errno 28)",
        f"warning: {disk}/curves.png was not written: No space left on device (errno 28)",
    ], err
    assert (disk / "summary.json").read_text() == '{"old": 1}'
    assert sorted(os.listdir(disk)) == ["filler", "metrics.jsonl", "summary.json"]


def test_a_config_or_metrics_rewrite_on_a_full_disk_keeps_the_old_file_and_no_temporary(
    tmp_path,
):
  """config.json and a resumed run's metrics.jsonl are replaced whole: on a full disk the
  write raises ENOSPC, the old file stays as it was and no temporary file is left."""
  with _tmpfs(tmp_path / "disk", "64k") as disk:
    rows = "".join(json.dumps({"step": s, "train/loss": 0.1 * s}) + "\n" for s in range(3))
    (disk / "metrics.jsonl").write_text(rows)
    (disk / "config.json").write_text('{"old": 1}')
    _fill(disk)
    with pytest.raises(OSError) as config_error:
      saved.save_config(defaults.base_config(), str(disk))
    with pytest.raises(OSError) as metrics_error:
      MetricsWriter(str(disk), resume_step=1, tensorboard=False)  # keeps steps 0-1
    assert config_error.value.errno == metrics_error.value.errno == errno.ENOSPC
    assert (disk / "config.json").read_text() == '{"old": 1}'
    assert (disk / "metrics.jsonl").read_text() == rows
    assert sorted(os.listdir(disk)) == ["config.json", "filler", "metrics.jsonl"]


def test_warnings_about_orbax_writes_left_unawaited_are_dropped_and_only_those():
  with warnings.catch_warnings(record=True) as caught:  # its filters are restored after
    warnings.simplefilter("default")  # every warning shown ...
    quiet_orbax()  # ... but these
    for name in ("async_serialize_from_host.<locals>.write_fragment", "async_serialize"):
      warnings.warn(f"coroutine '{name}' was never awaited", RuntimeWarning)
    warnings.warn("coroutine 'my_env_step' was never awaited", RuntimeWarning)
  assert [str(w.message) for w in caught] == ["coroutine 'my_env_step' was never awaited"]
