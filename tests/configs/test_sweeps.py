"""Every arm of every config's `get_sweep` axes is a config that `experiments.train` accepts.

The check `experiments/sweep.py` makes before its first arm runs (`report.arm_refusal`:
`experiment.validate` per arm), made here for every axis of every config file with a
`get_sweep`, so an axis whose field was renamed or whose value became invalid fails in
the suite, not at the start of a sweep. Validation only: no model is built.
"""

import ast
import os
import re

import pytest

from experiments import report
from mtrl_jax.run import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SWEPT = ("configs/calculator.py", "configs/coop.py", "configs/refine.py")


def _axes(path: str) -> list[str]:
  """The axis names of a config's `get_sweep`, from its one-line refusal of an unknown one."""
  with pytest.raises(ValueError, match=r"allowed: \[") as e:
    report.expand_sweep(os.path.join(ROOT, path), "no-such-axis", "/tmp")
  return ast.literal_eval(re.search(r"allowed: (\[.*\])", str(e.value)).group(1))


@pytest.mark.parametrize("path", SWEPT)
def test_every_sweep_arm_validates(path):
  axes = _axes(path)
  assert "trainer" in axes or path.endswith("calculator.py")
  for axis in axes:
    runs = report.expand_sweep(os.path.join(ROOT, path), axis, "/tmp/sweep")
    assert runs and len({w for w, _, _ in runs}) == len(runs), axis  # one directory per arm
    refusal = report.arm_refusal(runs, memory=False)
    assert refusal is None, f"{path} axis {axis}: {refusal}"


def test_the_refine_trainer_axis_runs_iac_and_maac_on_chains():
  runs = report.expand_sweep(os.path.join(ROOT, "configs/refine.py"), "trainer", "/tmp/sweep")
  kinds = sorted({(c.critic.kind, c.critic.model, c.tree.num_generations) for _, _, c in runs})
  assert kinds == [("centralized", "separate", 1), ("independent", "head", 1), ("none", "head", 4)]
  for _, overrides, config in runs:
    exp = experiment.validate(config)
    assert exp.critic.kind == "none" or (
        exp.loss.algorithm == "reinforce" and config.optim.learning_rate == 1e-4
    ), overrides
