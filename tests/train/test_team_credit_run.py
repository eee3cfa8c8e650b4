"""Per-agent credit in the real loop: the coop smoke config with team_weight=0.5 and
the marginal joint mode trains, logs per-agent rewards and influence, and dumps them."""

import json
import os

import pytest

from configs import coop as coop_config
from tests.train.test_separate_policies import run_on_one_device  # one CPU device


def _config():
  c = coop_config.get_config("smoke=True,share_policy=True")
  c.agents.team_weight = 0.5
  c.tree.joint_mode = "marginal"
  c.rl.steps, c.sft.steps = 1, 0  # credit is read from the rollout: no warm-up needed
  c.rl.dump_every = 1
  return c


@pytest.mark.slow
def test_coop_smoke_run_with_local_rewards_and_marginal_credit(tmp_path):
  c = _config()
  workdir = str(tmp_path / "run")
  run_on_one_device(
      [{"config": ["tests.train.test_team_credit_run", "_config", []], "workdir": workdir}]
  )
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  step = rows[-1]
  assert step["step"] == 1
  g, roots = c.tree.num_generations, c.rl.roots_per_step
  assert step["tree/nodes"] <= roots * (1 + g)  # the align tree's nodes at most
  # Influence averages the nodes whose joint rewards varied; a smoke policy that never
  # scores leaves none, and then no influence is reported (tests/rollout/test_team_credit.py).
  varied = step["credit/varied_nodes"]
  assert 0.0 <= varied <= 1.0
  for a in (0, 1):
    for key in ("reward/team", "reward/local", "reward/total"):
      assert f"agent_{a}/{key}" in step, (a, key)
    if varied > 0:
      assert 0.0 <= step[f"agent_{a}/influence"] <= 1.0
    else:
      assert f"agent_{a}/influence" not in step
    assert step[f"agent_{a}/reward/local_graded"] == 1.0  # coop grades every agent alone
  with open(os.path.join(workdir, "rollouts", "step_000001.jsonl")) as f:
    root = json.loads(f.readline())
  assert len(root["rewards"]) == g**2  # every combination graded
  assert sum(child >= 0 for child in root["children"]) <= g  # the aligned ones branched
  assert len(root["agent_rewards"]) == g**2
