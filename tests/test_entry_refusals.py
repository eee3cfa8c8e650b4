"""Entry points refuse at start, in one line and before any work: a sweep arm that cannot
run, an output path whose folder is missing, a level outside [0, 1], an export into a run."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ("--config=configs/calculator.py:smoke=True", "--config.model.preset=tiny")


def _entry(module, *args):
  return subprocess.run(
      [sys.executable, "-m", f"experiments.{module}", *args],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=300,
  )


def _one_line(out, *needles) -> str:
  assert out.returncode == 2, (out.stdout, out.stderr[-3000:])
  lines = out.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
  for needle in needles:
    assert needle in lines[0], lines[0]
  return lines[0]


def test_a_sweep_refuses_a_bad_arm_before_the_first_arm_trains(tmp_path):
  out = _entry(
      "sweep",
      "--config=configs/calculator.py:smoke=True",
      f"--workdir={tmp_path}",
      "--axis=tree.num_generations=2,0",
      "--axis=model.preset=tiny",
      "--axis=rl.steps=1",
      "--axis=rl.precompile=false",
  )
  _one_line(
      out,
      f"sweep arm tree.num_generations=0 ({tmp_path}/tree.num_generations=0): ",
      "num_generations=0",
  )
  assert "Traceback" not in out.stderr
  assert os.listdir(tmp_path) == []  # the G=2 arm did not train


@pytest.mark.slow
def test_output_files_in_a_missing_folder_and_a_bad_level_are_refused_at_start(tmp_path):
  missing = tmp_path / "no_such" / "rows.json"
  out = _entry("eval", f"--workdir={tmp_path / 'run'}", f"--json={missing}")
  _one_line(
      out,
      f"--json={str(missing)!r}: its folder {tmp_path}/no_such does not exist",
      "allowed: a file in an existing folder",
  )
  table = tmp_path / "no_such" / "table.md"
  out = _entry("ablate", f"--runs={tmp_path}/*", f"--out={table}")
  _one_line(out, f"--out={str(table)!r}: its folder {tmp_path}/no_such does not exist")
  out = _entry("ablate", f"--runs={tmp_path}/*", f"--out={tmp_path}")
  _one_line(out, f"--out={str(tmp_path)!r} is a directory")
  for level in ("1.5", "-0.1"):
    out = _entry("ablate", f"--runs={tmp_path}/*", f"--level={level}")
    _one_line(out, f"--level={float(level)}; allowed: a success level in [0, 1]")
  assert os.listdir(tmp_path) == []


def _fake_run(path):
  """What marks a run directory, with contents to check after a refusal."""
  os.makedirs(path / "ckpt" / "3")
  (path / "config.json").write_text('{"seed": 0}')
  (path / "metrics.jsonl").write_text('{"step": 0}\n')
  return path


def _tree(path) -> dict:
  out = {}
  for d, _, names in os.walk(path):
    for n in names:
      with open(os.path.join(d, n)) as f:
        out[os.path.relpath(os.path.join(d, n), path)] = f.read()
  return out


@pytest.mark.slow
def test_export_refuses_an_out_that_is_holds_or_is_inside_a_run_even_with_force(tmp_path):
  source = _fake_run(tmp_path / "source")
  other = _fake_run(tmp_path / "runs" / "other")
  before = _tree(tmp_path)
  for out_dir, needle in (
      (other, "is a run directory (it holds config.json, and metrics.jsonl or ckpt/)"),
      (tmp_path / "runs", f"contains the run directory {other}"),
      (other / "ckpt", f"is inside ckpt/ of the run directory {other}"),
  ):
    out = _entry("export", f"--workdir={source}", f"--out={out_dir}", "--force")
    _one_line(out, f"--out={str(out_dir)!r} {needle}", "even with --force")
  assert _tree(tmp_path) == before  # other's config.json is still there
