"""A value critic in the real loop (IAC on the coop smoke config), and its config refusals."""

import json
import os

import numpy as np
import pytest

from configs import coop as coop_config
from mtrl_jax.run import experiment
from tests.train.test_separate_policies import run_on_one_device  # one CPU device


@pytest.mark.parametrize(
    "key,value,field",
    [
        ("critic.kind", "central", "critic.kind"),
        ("critic.target", "w", "critic.target"),
        ("critic.estimator", "td1", "critic.estimator"),
        ("critic.gae_lambda", 1.5, "critic.gae_lambda"),
        ("critic.value_coef", 0.0, "critic.value_coef"),
        ("critic.value_clip", -0.1, "critic.value_clip"),
        ("model.lora.rank", 4, "model.lora.rank"),
        ("rl.max_staleness", 1, "rl.max_staleness"),
    ],
)
def test_bad_critic_configs_are_refused_in_one_line(key, value, field):
  c = coop_config.get_config("smoke=True")
  c.critic.kind = "independent"
  group, name = key.split(".", 1)
  if "." in name:
    sub, leaf = name.split(".")
    c[group][sub][leaf] = value
  else:
    c[group][name] = value
  with pytest.raises(experiment.ConfigError) as err:
    experiment.validate(c)
  msg = str(err.value)
  assert "\n" not in msg and field in msg, msg


def _iac_config():
  """CoMLRL's IAC: G = 1 (no sibling baseline), REINFORCE, batch-normalised TD advantages;
  here with a Q critic and GAE, one head per agent."""
  c = coop_config.get_config("smoke=True")
  c.critic.kind, c.critic.target, c.critic.estimator = "independent", "q", "gae"
  c.loss.algorithm, c.tree.num_generations = "reinforce", 1
  c.rl.steps, c.sft.steps = 1, 0  # one update from the start weights; no warm-up
  return c


@pytest.mark.slow  # a training run in a subprocess
def test_iac_chain_run_trains_the_value_heads(tmp_path):
  workdir = str(tmp_path / "run")
  run_on_one_device(
      [{"config": ["tests.train.test_critic_run", "_iac_config", []], "workdir": workdir}]
  )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  for a in (0, 1):
    for key in ("value_loss", "value_mean", "value_target_mean", "value_explained_var"):
      assert np.isfinite(rows[-1][f"agent_{a}/train/{key}"]), (a, key)
  assert rows[-1]["batch/actions"] > 0
  with open(os.path.join(workdir, "rollouts", "step_000001.jsonl")) as f:
    root = json.loads(f.readline())
  assert len(root["advantages"]) == 2 and len(root["advantages"][0]) == 1  # N x G
