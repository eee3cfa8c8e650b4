"""The curriculum inside the real RL loop: levels move by rollout success, are logged and saved."""

import json
import os

import pytest

from configs import calculator as calc_config
from mtrl_jax.run import rl

pytestmark = pytest.mark.usefixtures("no_curves")


@pytest.mark.slow
def test_loop_moves_the_level_logs_it_and_checkpoints_the_stream(tmp_path):
  c = calc_config.get_config("smoke=True")
  c.rl.steps = 2
  c.eval.every = 10  # evaluations at 0 and the end only
  c.sft.steps = 0  # an untrained policy fails every task, which is all this test needs
  c.rl.dump_every, c.checkpoint.every = 0, 2
  c.curriculum.enabled = True
  # The smoke policy fails every task: with a window of one step and lower_below 0.5
  # the level drops one per step from 1 and then stays at 0.
  c.curriculum.start_level = 1
  c.curriculum.window = 1
  c.curriculum.lower_below = 0.5
  workdir = str(tmp_path / "run")
  rl.run(c, workdir, progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["rollout/success"] for r in rows[1:]] == [0.0, 0.0]
  assert [r["curriculum/level"] for r in rows[1:]] == [1.0, 0.0]
  # Resuming restores the stream's state: step 3 draws level-0 tasks (a fresh
  # stream would start again at level 1).
  c.rl.steps = 3
  rl.run(c, workdir, progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert rows[3]["curriculum/level"] == 0.0
