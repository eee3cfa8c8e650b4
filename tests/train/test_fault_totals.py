"""The run's faults: summary.json counts every kind over the run, and a factory that raises
for some tasks masks their roots, is shown once in one line, and never ends the run."""

import json
import os
import subprocess
import sys

import pytest

from mtrl_jax import testing
from mtrl_jax.envs import FaultKind

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_summary_counts_every_fault_kind_over_the_run(smoke_run):
  totals = smoke_run.summary()["faults"]
  assert set(totals) == {k.value for k in FaultKind} | {"total"}
  rows = [r for r in smoke_run.rows() if r.get("step", 0) > 0 and "rollout/success" in r]
  for kind in FaultKind:  # the per-step counts of metrics.jsonl, summed
    assert totals[kind.value] == sum(r.get(f"faults/{kind.value}", 0) for r in rows), kind
  assert totals["total"] == sum(totals[k.value] for k in FaultKind)


BROKEN_ENV = '''
from mtrl_jax.tasks.calculator import CalculatorFactory


class BrokenFactory(CalculatorFactory):
  """A bug for every third task: a metadata key that does not exist."""

  def create_environment(self, metadata):
    if metadata["task_index"] % 3 == 1:
      return metadata["no_such_key"]
    return super().create_environment(metadata)
'''


@pytest.mark.slow  # a tiny model's rollout and evaluation programs compile (~30 s on 2 cores)
def test_a_factory_that_raises_for_some_tasks_masks_their_roots_and_the_run_finishes(tmp_path):
  (tmp_path / "broken_env.py").write_text(BROKEN_ENV)
  workdir = tmp_path / "run"
  cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      "--config=configs/calculator.py:smoke=True",
      f"--workdir={workdir}",
      "--progress=false",
      "--config.sft.steps=0",
      "--config.env.factory=broken_env:BrokenFactory",
      "--config.eval.every=10",
      "--config.rl.steps=2",
  ]  # seed 0's step 1 draws a broken task; step 2 goes on
  env = testing.cpu_env(1, PYTHONPATH=os.pathsep.join([str(tmp_path), ROOT]))
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  shown = [line for line in out.stderr.splitlines() if line.startswith("fault contract")]
  assert shown == [
      "fault contract from environment in BrokenFactory.create_environment "
      "(broken_env.py:10): KeyError: 'no_such_key'  (shown once; counted in "
      "faults/contract)"
  ], out.stderr[-3000:]
  with open(workdir / "summary.json") as f:
    totals = json.load(f)["faults"]
  assert totals["contract"] > 0 and totals["infrastructure"] == 0
  with open(workdir / "metrics.jsonl") as f:  # every step trained and was logged
    steps = [json.loads(line)["step"] for line in f]
  assert steps == [0, 1, 2] and sorted(os.listdir(workdir / "ckpt"))


def test_held_out_tasks_that_are_not_mappings_are_passed_on_to_be_masked():
  from mtrl_jax.data import ListSource
  from mtrl_jax.run.evaluate import indexed

  source = ListSource([{"q": 1}, "not a task", {"q": 3}])
  assert indexed(source, 3) == [{"q": 1, "task_index": 0}, "not a task", {"q": 3, "task_index": 2}]
  assert indexed(source, 5, start=2) == [{"q": 3, "task_index": 2}]
