"""The multi-agent task configs run the real training entry point for two steps on CPU."""

import json
import os

import pytest

from configs import calculator as calculator_config
from configs import common
from configs import coop as coop_config
from configs import humaneval as humaneval_config
from configs import refine as refine_config
from mtrl_jax.train import rl


@pytest.mark.slow
@pytest.mark.parametrize("module,arg", [
    (humaneval_config, "smoke=True,agents=2"),
    # One shared policy here; coop's separate-policy default runs in test_separate_policies.
    (coop_config, "smoke=True,share_policy=True"),
    (refine_config, "smoke=True"),
])
def test_smoke_config_trains_two_steps(tmp_path, module, arg):
  config = module.get_config(arg)
  config.rl.steps = 2
  # One row per engine call and device: the 8 test devices would otherwise pad every
  # fixed-shape call to 8 rows each (HumanEval's prompts fill 1024-token admit calls).
  config.engine.admit_rows = config.engine.decode_rows = 1
  workdir = str(tmp_path / "run")
  summary = rl.run(config, workdir, progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert rows[1]["tree/nodes"] >= 1 and "turn_0/mean_reward" in rows[1]
  assert summary["best"] is not None
  # HumanEval defaults to one policy per agent (aux and main), as CoMLRL trains them.
  assert config.agents.share_policy == ("share_policy=True" in arg)
  assert all((f"agent_{a}/batch/actions" in rows[1]) != config.agents.share_policy
             for a in (0, 1))


@pytest.mark.parametrize("module", [calculator_config, coop_config, humaneval_config,
                                    refine_config])
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


def test_multi_agent_configs_default_to_one_policy_per_agent():
  """CoMLRL trains one LLM per agent: coop and HumanEval (aux + main) default to it."""
  for config in (coop_config.get_config(None), coop_config.get_config("smoke=True"),
                 refine_config.get_config(None),
                 humaneval_config.get_config(None), humaneval_config.get_config("smoke=True")):
    assert config.tree.num_agents == 2 and not config.agents.share_policy
  assert coop_config.get_config("share_policy=True").agents.share_policy
  assert humaneval_config.get_config("agents=1").agents.share_policy  # GRPO: one agent
