"""Resuming only the same run: another run's workdir is refused before compute with its
files untouched; metrics that lag the checkpoint are warned about; an unreadable latest
checkpoint resumes from the one before; a failed checkpoint write ends the run in one line."""

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import time

import pytest

from mtrl_jax import checkpoint, metrics
from mtrl_jax.run import experiment, rl, saved

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _copy(smoke_run, tmp_path) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(smoke_run.workdir, workdir)
  return workdir


def _digest(workdir) -> dict:
  """Every file of the workdir with the hash of its bytes."""
  out = {}
  for path in sorted(glob.glob(f"{workdir}/**", recursive=True)):
    if os.path.isfile(path):
      with open(path, "rb") as f:
        out[os.path.relpath(path, workdir)] = hashlib.sha1(f.read()).hexdigest()
  return out


def _train(*flags):
  cmd = [sys.executable, "-m", "experiments.train", "--progress=false", *flags]
  return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)


def _last_line(text: str) -> str:
  return [line for line in text.splitlines() if line.strip()][-1]


def test_another_runs_config_is_refused_before_compute(smoke_run, tmp_path):
  workdir = _copy(smoke_run, tmp_path)
  before = _digest(workdir)
  config = smoke_run.config()
  config.env.max_tokens, config.tree.num_generations = 200, 4
  config.rl.steps, config.eval.every = 9, 5  # allowed to change: not listed
  t0 = time.time()
  with pytest.raises(experiment.ConfigError) as e:
    rl.run(config, workdir, progress=False)
  assert time.time() - t0 < 20  # validation only: nothing built
  msg = str(e.value)
  assert "\n" not in msg
  assert msg.startswith(
      f"workdir {workdir} holds another run: differs in env.max_tokens "
      "(160 -> 200), tree.num_generations (2 -> 4); allowed to change on "
      "resume: rl.steps, eval.every, eval.num_tasks, rl.dump_every,"
  )
  assert _digest(workdir) == before  # config.json, metrics.jsonl, checkpoints untouched


def test_the_command_line_refuses_another_run_in_one_line(smoke_run, tmp_path):
  workdir = _copy(smoke_run, tmp_path)
  before = _digest(workdir)
  out = _train(*smoke_run.flags, f"--workdir={workdir}", "--config.env.max_tokens=200")
  assert out.returncode == 2, out.stderr[-3000:]
  assert "Traceback" not in out.stderr
  assert _last_line(out.stderr).startswith(
      f"error: workdir {workdir} holds another run: differs in env.max_tokens (160 -> 200); "
      "allowed to change on resume: rl.steps,"
  )
  assert _digest(workdir) == before


def test_checkpoints_without_a_config_are_refused(smoke_run, tmp_path):
  workdir = _copy(smoke_run, tmp_path)
  os.remove(os.path.join(workdir, "config.json"))
  before = _digest(workdir)
  with pytest.raises(experiment.ConfigError, match=r"holds checkpoints but no config.json"):
    saved.check_resume(smoke_run.config(), workdir)
  assert _digest(workdir) == before
  fresh = str(tmp_path / "fresh")
  saved.check_resume(smoke_run.config(), fresh)  # nothing there: a new run
  assert not os.path.exists(fresh)


def test_every_allowed_field_may_change_and_no_other(smoke_run, tmp_path):
  workdir = _copy(smoke_run, tmp_path)
  config = smoke_run.config()
  config.rl.steps, config.eval.every, config.eval.num_tasks = 50, 7, 9
  config.rl.dump_every, config.checkpoint.every, config.checkpoint.keep = 0, 5, 2
  config.rl.precompile, config.step.num_microbatches, config.model.remat = True, 2, True
  config.mesh.fsdp, config.distributed.coordinator_address = 2, "10.0.0.1:1234"
  saved.check_resume(config, workdir)
  config.eval.success_threshold = 0.5
  with pytest.raises(experiment.ConfigError, match=r"differs in eval.success_threshold "):
    saved.check_resume(config, workdir)


def test_metrics_behind_or_missing_are_one_warning_line(tmp_path, capsys):
  workdir = str(tmp_path)
  with metrics.MetricsWriter(workdir, tensorboard=False) as w:
    for step in range(3):
      w.write(step, {"r": step})
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 3, "r"')  # cut short by a kill
  with metrics.MetricsWriter(workdir, resume_step=5, tensorboard=False) as w:
    w.write(6, {"r": 6})
  err = capsys.readouterr().err.strip().splitlines()
  path = os.path.join(workdir, "metrics.jsonl")
  assert err == [
      f"warning: {path} ends at step 2 but the checkpoint is step 5: steps 3-5 have "
      "no metrics, the run goes on",
      f"warning: {path}: dropped 1 unreadable line(s)",
  ]
  assert [r["step"] for r in metrics.read_metrics(workdir)] == [0, 1, 2, 6]
  os.remove(path)
  metrics.MetricsWriter(workdir, resume_step=4, tensorboard=False).close()
  assert capsys.readouterr().err == (
      f"warning: {path} is missing: steps 0-4 have no metrics, the run goes on from step 5\n"
  )
  with metrics.MetricsWriter(workdir, tensorboard=False) as w:  # a fresh start: old lines kept
    w.write(0, {"r": 1})
  with metrics.MetricsWriter(workdir, tensorboard=False) as w:
    w.write(0, {"r": 2})
  assert "moved them to" in capsys.readouterr().err
  assert [r["r"] for r in metrics.read_metrics(workdir)] == [2.0]
  assert open(path + ".1").read().count("\n") == 1


def test_an_unreadable_latest_checkpoint_resumes_from_the_one_before(smoke_run, tmp_path):
  workdir = _copy(smoke_run, tmp_path)
  meta = os.path.join(workdir, "ckpt", "3", "meta", "metadata")
  with open(meta, "w") as f:
    f.write("{not json")
  # rl.steps=2: nothing left to train once resumed at step 2
  out = _train(*smoke_run.flags, f"--workdir={workdir}", "--config.rl.steps=2")
  assert out.returncode == 0, out.stderr[-3000:]
  warnings = [l for l in out.stderr.splitlines() if l.startswith("warning:")]
  assert warnings == [
      f"warning: checkpoint {workdir}/ckpt/3 does not read back ({meta} is not valid JSON: "
      "Expecting property name enclosed in double quotes: line 1 column 2 (char 1)); skipped "
      f"it, moved to {workdir}/ckpt.unreadable/3; trying step 2"
  ], out.stderr[-3000:]
  assert f"resumed from {workdir}/ckpt at step 2" in out.stderr
  assert os.path.isfile(os.path.join(workdir, "ckpt.unreadable", "3", "meta", "metadata"))
  assert [r["step"] for r in metrics.read_metrics(workdir)] == [0, 1, 2]


_FULL_DISK = """
import errno, sys
import orbax.checkpoint as ocp
from experiments import cli, train

save_fn = ocp.handlers.JsonCheckpointHandler._save_fn


async def full_disk(self, x, directory):  # the disk fills up at step 4's checkpoint
  if "/ckpt/4" in str(directory):
    raise OSError(errno.ENOSPC, "No space left on device")
  return await save_fn(self, x, directory)


ocp.handlers.JsonCheckpointHandler._save_fn = full_disk
cli.run(train.main, argv=sys.argv)
"""


@pytest.mark.slow
def test_a_failed_checkpoint_write_ends_the_run_in_one_line(smoke_run, tmp_path):
  workdir = _copy(smoke_run, tmp_path)
  t0 = time.time()
  cmd = [
      sys.executable,
      "-c",
      _FULL_DISK,
      *smoke_run.flags,
      f"--workdir={workdir}",
      "--config.rl.steps=6",
      "--progress=false",
  ]
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 1, out.stderr[-3000:]
  assert time.time() - t0 < 240
  assert "Traceback" not in out.stderr and "orbax" not in out.stderr.lower(), out.stderr[-3000:]
  assert _last_line(out.stderr) == (
      f"error: checkpoint {workdir}/ckpt/4 was not written: No space left on device (errno "
      f"28); the last complete checkpoint there: {workdir}/ckpt/3 is intact"
  )
  assert checkpoint.step_dirs(os.path.join(workdir, "ckpt")) == [0, 1, 2, 3]
  with checkpoint.Checkpointer(workdir, keep=4, read_only=True) as ckpt:
    assert ckpt.all_steps() == [0, 1, 2, 3]
  # The run resumes from step 3 once there is room again.
  policy = saved.load_policy(workdir, "latest")
  assert policy.step == 3


@pytest.mark.slow
def test_no_readable_checkpoint_is_refused_naming_the_directory(smoke_run, tmp_path, capsys):
  workdir = _copy(smoke_run, tmp_path)
  for path in glob.glob(f"{workdir}/ckpt/*/meta/metadata"):
    with open(path, "w") as f:
      f.write("garbage")
  before = _digest(workdir)
  with pytest.raises(experiment.ConfigError) as e:
    rl.run(smoke_run.config(), workdir, progress=False)
  assert str(e.value) == (
      f"no readable checkpoint under {workdir}/ckpt: steps [0, 1, 2, 3] do not read back (see "
      f"the warnings above); allowed: repair them, or move {workdir}/ckpt away to start afresh"
  )
  warnings = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning:")]
  assert len(warnings) == 4 and all("is not valid JSON" in w for w in warnings)
  assert _digest(workdir) == before  # nothing moved, rewritten or lost
