"""The multi-agent task configs run the real training entry point for two steps on CPU."""

import json
import os

import pytest

from configs import calculator as calculator_config
from configs import common
from configs import coop as coop_config
from configs import humaneval as humaneval_config
from mtrl_jax.train import rl


@pytest.mark.parametrize("module,arg", [
    (humaneval_config, "smoke=True,agents=2"),
    (coop_config, "smoke=True"),
])
def test_smoke_config_trains_two_steps(tmp_path, module, arg):
  config = module.get_config(arg)
  config.rl.steps = 2
  workdir = str(tmp_path / "run")
  summary = rl.run(config, workdir, progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert rows[1]["tree/nodes"] >= 1 and "turn_0/mean_reward" in rows[1]
  assert summary["best"] is not None


@pytest.mark.parametrize("module", [calculator_config, coop_config, humaneval_config])
def test_every_smoke_config_applies_the_common_overlay(module):
  """`smoke=True` is `configs.common.apply_smoke` plus what the task changes after it."""
  config = module.get_config("smoke=True")
  overlay = common.apply_smoke(module.get_config(None), rl_steps=config.rl.steps,
                               sft_steps=config.sft.steps,
                               roots_per_step=config.rl.roots_per_step,
                               eval_tasks=config.eval.num_tasks)
  for key in ("rl.precompile", "model.preset", "tree.num_generations", "rl.dump_every",
              "eval.every", "checkpoint.every", "sft.batch_size", "sft.num_examples"):
    group, field = key.split(".")
    assert config[group][field] == overlay[group][field], key
  assert (config.model.preset, config.tree.num_generations, config.rl.precompile) == (
      "tiny", 2, False)
