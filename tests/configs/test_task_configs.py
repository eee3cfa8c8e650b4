"""The multi-agent task configs run the real training loop on CPU.

The runs share one process on one CPU device (`rl.run` for each config in turn): the
suite's 8 fake devices would pad every engine call 8-fold (HumanEval's prompts fill
1024-token admit calls), and the runs share the tiny model's programs. Each runs one RL
step: the step-0 evaluation and checkpoint, a rollout, its batch and metrics, the dump,
the last step's evaluation and checkpoint; a second step would repeat them.

The untrained tiny policy scores alike on every sample of a task, so with the configs'
own advantages a step trains nothing. The HumanEval and refine runs take raw advantages
(the returns) with a step penalty instead, so their step updates both agents' policies
through their own batch shapes; no other test trains these two configs. Coop's shared
policy takes the one-policy train step that the calculator smoke run trains
(tests/train/test_fail_loudly.py).
"""

import json
import os
import subprocess
import sys

import pytest

from configs import calculator as calculator_config
from configs import common
from configs import coop as coop_config
from configs import guess as guess_config
from configs import humaneval as humaneval_config
from configs import refine as refine_config
from mtrl_jax import testing

SMOKE_RUNS = [
    ("configs.humaneval", "smoke=True,agents=2"),
    # One shared policy here; coop's separate-policy default runs in test_separate_policies.
    ("configs.coop", "smoke=True,share_policy=True"),
    ("configs.refine", "smoke=True"),
]
# The runs whose one step must train (the module docstring).
TRAINED = ("configs.humaneval", "configs.refine")

# Runs each (config module, argument, workdir, trained) of argv[1] (JSON) for one RL
# step. No curves.png (matplotlib takes over a second of CPU per run; nothing here
# reads it).
_RUN_CONFIGS = """
import importlib, json, sys
from mtrl_jax import metrics
from mtrl_jax.run import rl
metrics.plot_metrics = lambda *args, **kwargs: None
for module, arg, workdir, trained in json.loads(sys.argv[1]):
  config = importlib.import_module(module).get_config(arg)
  config.rl.steps = 1
  # One row per engine call: fixed-shape calls would otherwise pad each to 8 rows.
  config.engine.admit_rows = config.engine.decode_rows = 1
  if trained:  # the returns as advantages, non-zero where every sample fails
    config.tree.advantage_mode = "raw"
    config.reward.step_penalty = -0.05
  rl.run(config, workdir, progress=False)
"""


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory):
  """{(module, arg): workdir} of the smoke runs, run by one process on one CPU device."""

  def train(root):
    jobs = [
        (module, arg, f"{root}/run_{i}", module in TRAINED)
        for i, (module, arg) in enumerate(SMOKE_RUNS)
    ]
    done = subprocess.run(
        [sys.executable, "-c", _RUN_CONFIGS, json.dumps(jobs)],
        env=testing.cpu_env(1),
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-5000:]

  # Built once per `pytest` run: the first xdist worker to ask builds it, the others reuse it.
  root = testing.built_once(tmp_path_factory, "task_config_smoke_runs", train)
  return {
      (module, arg): os.path.join(root, f"run_{i}") for i, (module, arg) in enumerate(SMOKE_RUNS)
  }


@pytest.mark.slow
@pytest.mark.parametrize("module,arg", SMOKE_RUNS)
def test_smoke_config_runs_an_rl_step(smoke_runs, module, arg):
  workdir = smoke_runs[(module, arg)]
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  assert [r["step"] for r in rows] == [0, 1]
  assert rows[1]["tree/nodes"] >= 1 and "turn_0/mean_reward" in rows[1]
  assert summary["best"] is not None
  assert config["model"]["preset"] == "tiny" and config["rl"]["steps"] == 1
  assert {e["step"] for e in summary["eval_history"]} == {0, 1}
  assert os.path.exists(os.path.join(workdir, "rollouts", "step_000001.jsonl"))
  assert {"0", "1"} <= set(os.listdir(os.path.join(workdir, "ckpt")))
  # HumanEval defaults to one policy per agent (aux and main), as CoMLRL trains them.
  share_policy = config["agents"]["share_policy"]
  assert share_policy == ("share_policy=True" in arg)
  assert all((f"agent_{a}/batch/actions" in rows[1]) != share_policy for a in (0, 1))
  if module in TRAINED:  # the step updated each agent's policy on its own actions
    for a in (0, 1):
      assert rows[1][f"agent_{a}/batch/actions"] > 0, rows[1]
      assert rows[1][f"agent_{a}/train/grad_norm"] > 0, rows[1]
      assert rows[1][f"agent_{a}/train/skipped"] == 0, rows[1]
    assert "trained_nothing" not in summary, summary
  if module == "configs.coop":  # its grade scores each agent's own answer too
    assert {"eval/greedy/agent_0/local", "eval/greedy/agent_1/local"} <= set(rows[0])


@pytest.mark.parametrize(
    "module", [calculator_config, coop_config, guess_config, humaneval_config, refine_config]
)
def test_every_smoke_config_applies_the_common_overlay(module):
  """`smoke=True` is `configs.common.apply_smoke` plus what the task changes after it."""
  config = module.get_config("smoke=True")
  overlay = common.apply_smoke(
      module.get_config(None),
      rl_steps=config.rl.steps,
      sft_steps=config.sft.steps,
      roots_per_step=config.rl.roots_per_step,
      eval_tasks=config.eval.num_tasks,
  )
  for key in (
      "rl.precompile",
      "model.preset",
      "tree.num_generations",
      "rl.dump_every",
      "eval.every",
      "checkpoint.every",
      "sft.batch_size",
      "sft.num_examples",
  ):
    group, field = key.split(".")
    assert config[group][field] == overlay[group][field], key
  assert (config.model.preset, config.tree.num_generations, config.rl.precompile) == (
      "tiny",
      2,
      False,
  )


def test_multi_agent_configs_default_to_one_policy_per_agent():
  """CoMLRL trains one LLM per agent: coop and HumanEval (aux + main) default to it."""
  for config in (
      coop_config.get_config(None),
      coop_config.get_config("smoke=True"),
      refine_config.get_config(None),
      humaneval_config.get_config(None),
      humaneval_config.get_config("smoke=True"),
  ):
    assert config.tree.num_agents == 2 and not config.agents.share_policy
  assert coop_config.get_config("share_policy=True").agents.share_policy
  assert humaneval_config.get_config("agents=1").agents.share_policy  # GRPO: one agent
