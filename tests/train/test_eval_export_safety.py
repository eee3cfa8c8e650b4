"""eval/export on the calculator smoke run: they name the checkpoint they use, warn when the
best is step 0, skip an unreadable latest checkpoint, take any --num_tasks, and export
refuses a non-empty --out without --force."""

import glob
import os
import shutil
import subprocess
import sys

import pytest

from mtrl_jax import testing
from mtrl_jax.run import experiment, saved

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _entry(script, *flags, env=None):
  return subprocess.run(
      [sys.executable, os.path.join(ROOT, "experiments", script), *flags],
      cwd=ROOT,
      env=dict(env or os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=600,
  )


def _copy(smoke_run, tmp_path) -> str:
  workdir = str(tmp_path / "run")
  shutil.copytree(smoke_run.workdir, workdir)
  return workdir


def test_eval_names_its_checkpoint_and_takes_more_tasks_than_slots(smoke_run, tmp_path):
  best = smoke_run.summary()["best"]
  # The run's compile_cache ('auto': $MTRL_JAX_COMPILE_CACHE) holds what eval compiled
  # (one CPU device: every program compiles afresh here, and none is split 8 ways).
  env = testing.cpu_env(1, MTRL_JAX_COMPILE_CACHE=str(tmp_path / "cache"))
  del env["JAX_COMPILATION_CACHE_DIR"]
  cache = env["MTRL_JAX_COMPILE_CACHE"]
  out = _entry("eval.py", f"--workdir={smoke_run.workdir}", "--num_tasks=20", env=env)
  assert out.returncode == 0, out.stderr[-3000:]
  assert os.listdir(cache)
  err = [l for l in out.stderr.splitlines() if l.strip()]
  assert (
      f"using best checkpoint: step {best['step']} (eval/greedy/success "
      f"{best['score']:.3g})" in err
  )
  if best["step"] == 0:  # the random smoke policy never beats its first evaluation
    assert (
        "warning: the best checkpoint is step 0, saved before any RL update: no later "
        "held-out evaluation beat it"
    ) in err
  table = out.stdout.strip().splitlines()
  assert len(table) == 3 and table[2].startswith(f"| best (step {best['step']}) | greedy | 20 |")


def test_load_latest_skips_an_unreadable_checkpoint_read_only(smoke_run, tmp_path, capsys):
  workdir = _copy(smoke_run, tmp_path)
  data = glob.glob(f"{workdir}/ckpt/3/state/**/d/*", recursive=True)
  for path in data:  # every array file of step 3 cut in half
    os.truncate(path, os.path.getsize(path) // 2)
  policy = saved.load_policy(workdir, "latest")
  assert (policy.step, policy.using) == (2, "using latest checkpoint: step 2")
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith(
      f"warning: checkpoint {workdir}/ckpt/3 does not read back ("
  )
  assert err[0].endswith("); skipped it; trying step 2")
  assert all(os.path.isfile(p) for p in data)  # read-only: left as it was
  assert saved.load_policy(workdir, 1).using == "using checkpoint step 1"


def test_an_unreadable_best_is_refused_in_one_line(smoke_run, tmp_path, capsys):
  workdir = _copy(smoke_run, tmp_path)
  step = smoke_run.summary()["best"]["step"]
  with open(f"{workdir}/best/{step}/meta/metadata", "w") as f:
    f.write("")
  with pytest.raises(experiment.ConfigError) as e:
    saved.load_policy(workdir, "best")
  assert "\n" not in str(e.value)
  assert str(e.value).startswith(
      f"--checkpoint=best: {workdir} has no readable best "
      "checkpoint; allowed: 'latest' or a saved step [0, 1, 2, 3]"
  )
  assert capsys.readouterr().err.startswith(
      f"warning: best checkpoint {workdir}/best/{step} does not read back ({workdir}/best/"
      f"{step}/meta/metadata is not valid JSON"
  )
  assert os.path.isfile(f"{workdir}/best/{step}/meta/metadata")  # read-only: left there


def test_export_refuses_a_non_empty_out_and_force_replaces_the_export(smoke_run, tmp_path):
  out_dir = tmp_path / "hf"
  out_dir.mkdir()
  stale = ("model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json")
  for name in stale + ("notes.txt",):
    (out_dir / name).write_text("old")
  out = _entry("export.py", f"--workdir={smoke_run.workdir}", f"--out={out_dir}")
  assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
  assert out.stderr.strip().splitlines()[-1] == (
      f"error: --out='{out_dir}' is not empty (holds config.json, model-00001-of-00002."
      "safetensors, model.safetensors.index.json, notes.txt); allowed: a new or empty "
      "directory, or --force to replace an earlier export there"
  )
  assert sorted(os.listdir(out_dir)) == sorted(stale + ("notes.txt",))
  out = _entry(
      "export.py",
      f"--workdir={smoke_run.workdir}",
      f"--out={out_dir}",
      "--force",
      "--checkpoint=latest",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "using latest checkpoint: step 3" in out.stderr
  assert sorted(os.listdir(out_dir)) == [
      "config.json",
      "model.safetensors",
      saved.BYTE_TOKENIZER_FILE,
      saved.EXPORT_FILE,
      "notes.txt",
  ]
  assert (out_dir / "notes.txt").read_text() == "old"  # not an export's file: kept


def test_export_peft_of_a_run_without_adapters_is_refused_in_one_line(smoke_run, tmp_path):
  out_dir = tmp_path / "adapters"
  out = _entry("export.py", f"--workdir={smoke_run.workdir}", f"--out={out_dir}", "--format=peft")
  assert out.returncode != 0
  err = [l for l in out.stderr.splitlines() if l.strip()]
  assert len(err) == 1 and "--format=peft" in err[0] and "model.lora.rank=0" in err[0], err
  assert not out_dir.exists()
