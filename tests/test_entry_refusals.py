"""Entry points refuse at start, in one line and before any work: a sweep arm that cannot
run, an output path whose folder is missing, a level outside [0, 1], an export into a run."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = ("--config=configs/calculator.py:smoke=True", "--config.model.preset=tiny")


def _entry(module, *args):
  return subprocess.run([sys.executable, "-m", f"experiments.{module}", *args], cwd=ROOT,
                        env=dict(os.environ, PYTHONPATH=ROOT), capture_output=True, text=True,
                        timeout=300)


def _one_line(out, *needles) -> str:
  assert out.returncode == 2, (out.stdout, out.stderr[-3000:])
  lines = out.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr[-3000:]
  for needle in needles:
    assert needle in lines[0], lines[0]
  return lines[0]


def test_a_sweep_refuses_a_bad_arm_before_the_first_arm_trains(tmp_path):
  out = _entry("sweep", "--config=configs/calculator.py:smoke=True", f"--workdir={tmp_path}",
               "--axis=tree.num_generations=2,0", "--axis=model.preset=tiny",
               "--axis=rl.steps=1", "--axis=rl.precompile=false")
  _one_line(out, f"sweep arm tree.num_generations=0 ({tmp_path}/tree.num_generations=0): ",
            "num_generations=0")
  assert "Traceback" not in out.stderr
  assert os.listdir(tmp_path) == []  # the G=2 arm did not train


def test_output_files_in_a_missing_folder_and_a_bad_level_are_refused_at_start(tmp_path):
  missing = tmp_path / "no_such" / "rows.json"
  out = _entry("eval", f"--workdir={tmp_path / 'run'}", f"--json={missing}")
  _one_line(out, f"--json={str(missing)!r}: its folder {tmp_path}/no_such does not exist",
            "allowed: a file in an existing folder")
  table = tmp_path / "no_such" / "table.md"
  out = _entry("ablate", f"--runs={tmp_path}/*", f"--out={table}")
  _one_line(out, f"--out={str(table)!r}: its folder {tmp_path}/no_such does not exist")
  out = _entry("ablate", f"--runs={tmp_path}/*", f"--out={tmp_path}")
  _one_line(out, f"--out={str(tmp_path)!r} is a directory")
  for level in ("1.5", "-0.1"):
    out = _entry("ablate", f"--runs={tmp_path}/*", f"--level={level}")
    _one_line(out, f"--level={float(level)}; allowed: a success level in [0, 1]")
  assert os.listdir(tmp_path) == []
