"""Two RL steps of the calculator config train the same parameters with either packing.

The real loop (rollout, tree -> batch, train step, eval, checkpoint) from one
seed: `rl.packing='tree'` (every token once) and 'rows' (one row per action)
see identical rollouts and must apply the same two updates. The KL term is on
so the reference forward runs in both layouts.
"""

import json
import os

import jax
import numpy as np
import pytest

from configs import calculator as calc_config
from mtrl_jax.run import rl, saved

pytestmark = pytest.mark.usefixtures("no_curves")


def _run(tmp_path, packing):
  c = calc_config.get_config("smoke=True")
  c.rl.steps = 2
  c.rl.packing = packing
  c.loss.kl_coef = 0.05
  c.eval.every = 2
  c.rl.dump_every = 0
  c.checkpoint.every = 2
  c.optim.learning_rate = 1e-3
  c.sft.steps = 0  # both layouts would warm up alike: RL from the initial weights
  # Raw returns (the config's step penalty makes them non-zero): every step's update moves
  # the parameters, from a random policy too.
  c.tree.advantage_mode, c.tree.advantage_std_norm = "raw", False
  workdir = str(tmp_path / packing)
  rl.run(c, workdir, progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return rows, saved.load_policy(workdir, "latest").params


@pytest.mark.slow
def test_tree_and_row_packing_train_the_same_parameters(tmp_path):
  rows_m, rows_p = _run(tmp_path, "rows")
  tree_m, tree_p = _run(tmp_path, "tree")
  for a, b in zip(rows_m[1:], tree_m[1:]):  # steps 1 and 2
    assert a["train/grad_norm"] > 0  # both updates move the parameters
    assert b["batch/tokens_rows_equivalent"] == a["batch/tokens_rows_equivalent"]
    assert b["batch/tokens_trained"] < a["batch/tokens_trained"]
    for k in (
        "train/loss",
        "train/pg_loss",
        "train/kl",
        "train/grad_norm",
        "train/tokens",
        "train/rows",
        "train/ratio_mean",
        "train/adv_mean",
        "rollout/return",
    ):
      assert b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-5), k
  for x, y in zip(jax.tree.leaves(tree_p), jax.tree.leaves(rows_p)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)
