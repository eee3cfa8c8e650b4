"""LoRA in the real loop: a stopped run resumes exactly (adapters, their moments and the
warmed-up base from the checkpoint), shared and per agent. (A checkpoint over another
base is refused: tests/train/test_lora_init.py.)"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from configs import calculator as calc_config
from configs import coop as coop_config
from mtrl_jax import sharding
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.run import components, experiment, saved

from tests.train.test_separate_policies import run_on_one_device

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _calc(steps):
  c = calc_config.get_config("smoke=True")
  c.model.lora.rank = 4
  c.model.lora.alpha = 8.0
  c.loss.kl_coef = 0.05  # against the base with the adapters off: no reference copy
  c.tree.advantage_std_norm = False
  c.tree.advantage_mode = "raw"  # every step trains, even when sibling groups tie
  c.reward.step_penalty = -0.05
  c.rl.steps = steps
  c.rl.dump_every = 0
  c.eval.every = 1  # evaluated at step 1, as a run stopped there is
  c.checkpoint.every = 1  # the step-1 checkpoint the resumed run continues
  return c


def _separate_config(steps):
  """Coop with one LoRA adapter per agent over the one warmed-up base."""
  c = coop_config.get_config("smoke=True")
  c.agents.share_policy = False
  c.agents.learning_rates = (1e-3, 3e-3)
  c.model.lora.rank = 2
  c.tree.advantage_mode = "raw"
  c.reward.step_penalty = -0.05
  c.loss.kl_coef = 0.01
  c.rl.steps, c.rl.dump_every = steps, 0
  c.eval.every = 1  # evaluated at step 1, as a run stopped there is
  c.checkpoint.every = 1  # the step-1 checkpoint the resumed run continues
  return c


def _full_and_resumed(tmp_path, config):
  """Trains `config(2)` into tmp_path/full, then continues a copy of it as it stood after
  step 1 into tmp_path/resumed, in one process on one CPU device (test_separate_policies);
  returns the two workdirs."""
  full, resumed = str(tmp_path / "full"), str(tmp_path / "resumed")
  job = {"config": ["tests.train.test_lora_run", config, [2]], "workdir": full}
  run_on_one_device([job, dict(job, workdir=resumed, resume_of=[full, 1])])
  return full, resumed


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(RUN_BOUND_PREFIXES)}
        for line in f
    ]


@pytest.mark.slow
def test_a_lora_run_stopped_and_resumed_equals_the_uninterrupted_run(tmp_path):
  full, resumed = _full_and_resumed(tmp_path, "_calc")
  rows = _rows(full)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert rows[1]["train/kl"] >= 0 and rows[2]["train/grad_norm"] > 0
  # eval/export load the adapters over the base the warm-up trained (from the checkpoint)
  assert _calc(2).sft.steps > 0
  policy = saved.load_policy(full, "latest")
  greedy = saved.evaluate_policy(policy, samples=1)[0]
  assert greedy["outcome"] == rows[-1]["eval/greedy/outcome"]
  peft_dir = tmp_path / "peft"
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.export",
          f"--workdir={full}",
          f"--out={peft_dir}",
          "--format=peft",
          "--checkpoint=latest",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert sorted(os.listdir(peft_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
  exp = experiment.validate(_calc(2))
  mesh = sharding.make_mesh(exp.mesh.shape(jax.device_count()))
  built = components.make_policies(exp, components.make_model(exp, mesh), mesh).train_step.base
  loaded = policy.parts.policies.train_step.base
  assert any(
      not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(built), jax.tree.leaves(loaded))
  )
  assert _rows(resumed) == rows


@pytest.mark.slow
def test_separate_lora_agents_over_one_base_resume_exactly(tmp_path):
  full, resumed = _full_and_resumed(tmp_path, "_separate_config")
  rows = _rows(full)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert "agent_1/train/kl" in rows[1] and "agent_0/train/grad_norm" in rows[2]
  assert _rows(resumed) == rows
