"""The training tests' shared run: one finished calculator smoke run, trained once.

`smoke_run` trains `configs/calculator.py:smoke=True` (3 RL steps) through
the command line, as `python -m experiments.train` runs it, for the tests
that only read what a finished run leaves: config.json, metrics.jsonl,
summary.json, checkpoints, rollout dumps. They must not write into it. Tests
of a config variation train their own runs.

Under pytest-xdist every worker that asks for it gets the same run: the first
trains it into the directory the workers share while the others wait on a
file lock (`mtrl_jax.testing.built_once`), so a test that reads it can run on
any worker.

`no_curves` (module scope) turns off the curves.png a finished `rl.run` draws:
matplotlib takes seconds of CPU per run, and only `smoke_run`'s is looked at.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from configs import calculator as calc_config
from mtrl_jax import metrics as metrics_lib
from mtrl_jax import testing

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# Every checkpoint kept (steps 0-3), so a test can load the step the best one was kept at.
SMOKE_FLAGS = ("--config=configs/calculator.py:smoke=True", "--config.checkpoint.keep=4")


@dataclasses.dataclass(frozen=True)
class SmokeRun:
  """A finished run of `SMOKE_FLAGS` in `workdir` (read only)."""

  workdir: str
  flags = SMOKE_FLAGS  # the command line's --config flags, relative to the repository root

  @staticmethod
  def config():
    """The run's config, as `SMOKE_FLAGS` build it (a fresh, unlocked copy)."""
    c = calc_config.get_config("smoke=True")
    c.checkpoint.keep = 4
    return c

  def rows(self) -> list[dict]:
    with open(os.path.join(self.workdir, "metrics.jsonl")) as f:
      return [json.loads(line) for line in f]

  def summary(self) -> dict:
    with open(os.path.join(self.workdir, "summary.json")) as f:
      return json.load(f)

  def console(self) -> str:
    """What the run printed on stderr (its console lines; kept beside the workdir)."""
    with open(self.workdir + ".stderr") as f:
      return f.read()


def _train(workdir: str) -> None:
  """Trains the run into `workdir`, its stderr kept in `workdir`.stderr; raises
  RuntimeError saying why it failed."""
  cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      *SMOKE_FLAGS,
      f"--workdir={workdir}",
      "--progress=false",
  ]
  try:
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
  except subprocess.TimeoutExpired as e:
    raise RuntimeError(f"{' '.join(cmd)} timed out after {e.timeout} s") from e
  with open(workdir + ".stderr", "w") as f:
    f.write(out.stderr)
  if out.returncode:
    raise RuntimeError(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-4000:]}")


@pytest.fixture(scope="session")
def smoke_run(tmp_path_factory) -> SmokeRun:
  """The finished calculator smoke run (see the module docstring)."""
  return SmokeRun(testing.built_once(tmp_path_factory, "smoke_run", _train))


@pytest.fixture(scope="module")
def no_curves():
  """In-process `rl.run`s of the module draw no curves.png (everything else is written)."""
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(metrics_lib, "plot_metrics", lambda *args, **kwargs: None)
    yield
