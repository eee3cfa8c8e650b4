"""What runs but is probably not meant is named at start, one `warning:` line each, once."""

import pytest

from configs import calculator
from mtrl_jax.run import checks, experiment


def _config(**fields):
  c = calculator.get_config("smoke=True")
  c.model.preset = "tiny"  # d_model 32
  for key, value in fields.items():
    *path, leaf = key.split(".")
    node = c
    for part in path:
      node = node[part]
    node[leaf] = value
  return c


@pytest.mark.parametrize(
    "fields, needle",
    [
        (
            {"rl.max_staleness": 1, "loss.is_correction": "none"},
            "config rl.max_staleness=1 with loss.is_correction='none': rollouts sample with "
            "parameters one update old",
        ),
        (
            {"model.lora.rank": 32, "model.lora.alpha": 32.0},
            "config model.lora.rank=32 is at or above the model width d_model=32",
        ),
        (
            {"tree.joint_mode": "cross", "tree.num_generations": 8, "rl.roots_per_step": 1},
            "config tree.joint_mode='cross' with tree.num_generations=8 and tree.num_agents=1: 8 "
            "joint actions (G^N) per node against rl.roots_per_step=1",
        ),
    ],
)
def test_an_unwise_setting_is_one_warning_line_at_start(capsys, fields, needle):
  exp = experiment.start(_config(**fields))
  err = [l for l in capsys.readouterr().err.splitlines() if l.startswith("warning: ")]
  assert len(err) == 1 and err[0].startswith(f"warning: {needle}"), err
  experiment.validate(_config(**fields))  # validation alone (a sweep's arms) prints nothing
  assert "warning: " not in capsys.readouterr().err
  assert checks.advisories(exp) == [err[0][len("warning: ") :]]


def test_a_sensible_config_has_no_advisory():
  assert (
      checks.advisories(
          experiment.validate(_config(**{"rl.max_staleness": 1, "loss.is_correction": "tis"}))
      )
      == []
  )
