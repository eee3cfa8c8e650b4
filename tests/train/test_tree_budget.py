"""A tree that cannot fit the machine's memory is refused at start, naming the fields and
what would fit; the estimate of every run is printed at start."""

import os
import subprocess
import sys

import pytest

from configs import calculator
from mtrl_jax.run import budget, experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _config(**tree):
  c = calculator.get_config("smoke=True")
  c.model.preset = "tiny"
  c.rl.max_generations = 10**12  # past plan_tree's count budget: the memory check decides
  for k, v in tree.items():
    c.tree[k] = v
  return c


def test_the_estimate_counts_the_tree_and_its_kv_cache():
  exp = experiment.validate(_config())  # T=2, G=2, N=1 align, 2 roots
  e = budget.estimate(exp)
  assert (e.roots, e.nodes, e.joint_actions) == (2, 6, 12)
  arch = exp.model.arch
  assert (
      e.kv_bytes
      == e.slots * e.capacity * arch.num_layers * 2 * arch.num_kv_heads * arch.head_dim * 4
  )
  line = budget.describe(e)
  assert "\n" not in line and line.startswith(
      "tree per step (2 roots): 6 nodes (3 per root), 12 joint actions, "
  )


def test_a_wide_cross_tree_is_refused_naming_what_would_fit():
  exp = experiment.validate(_config(joint_mode="cross", num_generations=8, num_turns=3))
  e = budget.estimate(exp)
  assert e.nodes == 2 * (1 + 8 + 64)
  with pytest.raises(ValueError) as info:
    budget.check_memory(exp, available=e.total_bytes // 3, where="a test budget")
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith(
      "config tree (T=3, G=8, N=1, joint_mode='cross') with rl.roots_per_step=2 and "
      "sampling.max_new_tokens="
  )
  assert "of a test budget; allowed: a narrower tree (tree.num_generations" in msg
  budget.check_memory(exp, available=e.total_bytes, where="enough")  # fits: no refusal


def test_a_tree_no_machine_holds_is_refused_at_start_in_one_line(tmp_path):
  # Cross mode, G=8 over 7 turns: 8^6 children under each root's deepest level.
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.train",
          "--config=configs/calculator.py:smoke=True",
          f"--workdir={tmp_path / 'run'}",
          "--config.model.preset=tiny",
          "--config.tree.joint_mode=cross",
          "--config.tree.num_generations=8",
          "--config.tree.num_turns=7",
          "--config.rl.max_generations=1000000000000",
      ],
      cwd=ROOT,
      env=dict(os.environ, PYTHONPATH=ROOT),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 2, out.stderr[-3000:]
  lines = out.stderr.splitlines()
  assert len(lines) == 1 and lines[0].startswith(
      "error: config tree (T=7, G=8, N=1, joint_mode='cross') with rl.roots_per_step=2"
  ), lines
  assert "GiB (KV cache" in lines[0] and "allowed: " in lines[0]
  assert not os.path.exists(tmp_path / "run")  # refused before anything is written
