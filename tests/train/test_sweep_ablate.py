"""Sweep expansion and ablation tables (no training: hand-written run directories)."""

import json
import os

import numpy as np
import pytest

from experiments import report

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALC = os.path.join(ROOT, "configs", "calculator.py")


def test_expand_sweep_applies_overrides_with_seeds(tmp_path):
  runs = report.expand_sweep(CALC, "generations", str(tmp_path))
  assert len(runs) == 9  # 3 values x 3 seeds
  workdir, overrides, config = runs[4]
  assert overrides == {"tree.num_generations": 4, "seed": 1}
  assert config.tree.num_generations == 4 and config.seed == 1
  assert os.path.basename(workdir) == "tree.num_generations=4,seed=1"
  assert report.train_command(CALC, workdir, overrides).endswith(
      "--config.tree.num_generations=4 --config.seed=1"
  )
  with pytest.raises(ValueError, match="allowed"):
    report.expand_sweep(CALC, "nonsense", str(tmp_path))


def _fake_run(parent, name, curve, best):
  d = os.path.join(parent, name)
  os.makedirs(d)
  with open(os.path.join(d, "metrics.jsonl"), "w") as f:
    for step, v in curve:
      f.write(json.dumps({"step": step, report.SUCCESS_KEY: v}) + "\n")
  with open(os.path.join(d, "summary.json"), "w") as f:
    json.dump({"best": best}, f)
  return d


def test_ablation_table_groups_seeds(tmp_path):
  p = str(tmp_path)
  runs = [
      _fake_run(
          p,
          "tree.num_generations=2,seed=0",
          [(0, 0.2), (10, 0.4), (20, 0.6)],
          {"step": 20, "score": 0.6},
      ),
      _fake_run(
          p,
          "tree.num_generations=2,seed=1",
          [(0, 0.2), (10, 0.3), (20, 0.4)],
          {"step": 20, "score": 0.4},
      ),
      _fake_run(
          p,
          "tree.num_generations=4,seed=0",
          [(0, 0.3), (10, 0.5), (20, 0.5)],
          {"step": 10, "score": 0.5},
      ),
  ]
  table = report.ablation_table(runs, level=0.5).splitlines()
  assert table[0] == "| setting | seeds | after SFT | final | best | steps to 0.5 |"
  # G=2: after SFT 0.2, 0.2; final 0.6, 0.4 -> 0.5 +- 0.1; reaches 0.5 at step 20 in seed 0 only
  assert table[2] == (
      "| tree.num_generations=2 | 2 | 0.200 +- 0.000 | 0.500 +- 0.100 | "
      "0.500 +- 0.100 | 20 (1/2 reached) |"
  )
  assert table[3].startswith("| tree.num_generations=4 | 1 | 0.300 +- 0.000 | 0.500 +- 0.000")
  png = report.plot_groups(runs, str(tmp_path / "g.png"))
  assert os.path.getsize(png) > 1000


def test_the_default_level_is_half_the_best_success_any_run_reached(tmp_path):
  import subprocess
  import sys

  p = str(tmp_path)
  runs = [
      _fake_run(p, "seed=0", [(0, 0.1), (10, 0.3), (20, 0.2)], {"step": 10, "score": 0.3}),
      _fake_run(
          p, "tree.num_turns=1,seed=0", [(0, 0.1), (10, 0.6), (20, 0.5)], {"step": 10, "score": 0.6}
      ),
  ]
  assert report.default_level(runs) == (0.3, 0.6)
  table = report.ablation_table(runs, level=0.3).splitlines()
  assert table[0].endswith("| steps to 0.3 |")
  assert table[2] == (
      "| (base) | 1 | 0.100 +- 0.000 | 0.200 +- 0.000 | 0.300 +- 0.000 | 10 (1/1 reached) |"
  )
  none = _fake_run(p, "never", [(0, 0.0)], {})
  assert report.default_level([none]) == (0.5, pytest.approx(float("nan"), nan_ok=True))
  # An explicit level is used as given, and stated.
  res = subprocess.run(
      [sys.executable, "-m", "experiments.ablate", f"--runs={p}/*seed=0", "--level=0.55"],
      cwd=ROOT,
      capture_output=True,
      text=True,
  )
  assert res.returncode == 0, res.stderr
  assert "--level=0.55`" in res.stdout and "| steps to 0.55 |" in res.stdout
  assert "half of" not in res.stdout


def test_ablate_takes_several_globs_and_names_them_in_its_table(tmp_path):
  """One axis of a grid: the base runs and that axis's arms, leaving the other axes out."""
  import subprocess
  import sys

  p = str(tmp_path)
  for name, v in (
      ("seed=0", 0.8),
      ("tree.num_turns=1,seed=0", 0.25),
      ("tree.num_generations=2,seed=0", 0.6),
  ):
    _fake_run(p, name, [(0, 0.4), (10, v)], {"step": 10, "score": v})
  out = str(tmp_path / "turns.md")
  res = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.ablate",
          f"--runs={p}/seed=*",
          f"--runs={p}/tree.num_turns=*",
          f"--out={out}",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
  )
  assert res.returncode == 0, res.stderr
  text = open(out).read()
  # No --level: half of the best held-out success any run reached (0.8 -> 0.4), stated.
  assert text.startswith(
      f"`python -m experiments.ablate --runs='{p}/seed=*' "
      f"--runs='{p}/tree.num_turns=*' --level=0.4`\n\nsteps to 0.4: half "
      "of 0.800, the best held-out success any of these runs reached"
  )
  assert "| steps to 0.4 |" in text and "--level=0.4" in res.stdout
  assert "| (base) | 1 |" in text and "| tree.num_turns=1 | 1 |" in text
  assert "num_generations" not in text
  res = subprocess.run(
      [sys.executable, "-m", "experiments.ablate", f"--runs={p}/seed=*", "--budget", "--tokens=0"],
      cwd=ROOT,
      capture_output=True,
      text=True,
  )
  assert res.returncode != 0 and "--tokens=0.0; allowed: a number of sampled tokens > 0" in (
      res.stdout + res.stderr
  )


def test_ablate_reads_finished_runs_without_importing_jax():
  """A table of finished runs starts in a fraction of a second: no jax, no tasks."""
  import subprocess
  import sys

  code = "import sys, experiments.ablate; print(sorted(m for m in ('jax', 'flax') if m in sys.modules))"
  res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
  assert res.returncode == 0, res.stderr
  assert res.stdout.strip() == "[]"


def test_sweep_skips_finished_runs(tmp_path):
  import subprocess
  import sys

  runs = report.expand_sweep(CALC, "generations", str(tmp_path))
  for workdir, _, _ in runs:  # every run finished: nothing is started
    os.makedirs(workdir)
    open(os.path.join(workdir, "summary.json"), "w").close()
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.sweep",
          f"--config={CALC}",
          "--sweep=generations",
          f"--workdir={tmp_path}",
          "--parallel=2",
      ],
      capture_output=True,
      text=True,
      check=True,
      cwd=ROOT,
  ).stdout
  assert out.count("skipped (finished") == 9 and "started" not in out
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.sweep",
          f"--config={CALC}",
          "--sweep=generations",
          f"--workdir={tmp_path}",
          "--only=generations=8,generations=2",
          "--print_only",
      ],
      capture_output=True,
      text=True,
      check=True,
      cwd=ROOT,
  ).stdout
  assert len(out.splitlines()) == 6 and "num_generations=4" not in out


def test_budget_curve_table_and_plot(tmp_path):
  def run(name, rows):
    d = tmp_path / name
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(d)

  s = report.SUCCESS_KEY
  tree = run(
      "tree.shape=tree,seed=0",
      [
          {"step": 0, s: 0.2, "time/step": 5.0, "time/eval": 5.0},  # eval only: no RL cost
          {"step": 1, "tree/sampled_tokens": 100.0, "time/step": 2.0},
          {"step": 2, "tree/sampled_tokens": 150.0, "time/step": 9.0, "time/eval": 6.0, s: 0.5},
      ],
  )
  chain = run(
      "tree.shape=chain,seed=0",
      [{"step": 0, s: 0.2}, {"step": 2, "tree/sampled_tokens": 4000.0, "time/step": 1.5, s: 0.7}],
  )
  c = report.budget_curve(tree)
  np.testing.assert_array_equal(c["step"], [0, 2])
  np.testing.assert_array_equal(c["tokens"], [0, 250])
  np.testing.assert_array_equal(c["seconds"], [0, 5])  # 2 + (9 - 6)
  np.testing.assert_array_equal(c["success"], [0.2, 0.5])
  chain_1 = run(
      "tree.shape=chain,seed=1",
      [
          {"step": 0, s: 0.1},
          {"step": 1, "tree/sampled_tokens": 200.0, s: 0.4},
          {"step": 2, "tree/sampled_tokens": 3800.0, "time/step": 2.5, s: 0.9},
      ],
  )
  table = report.budget_table([tree, chain, chain_1]).splitlines()
  # The default budget: 250, the tree's total. The chains at 250 tokens, between their
  # evaluations: 0.2 + 0.5 * 250 / 4000 = 0.23125 and 0.4 + 0.5 * 50 / 3800 = 0.40658,
  # mean 0.31891, std 0.08766.
  assert table[0].endswith("| at 0k tokens |")
  assert table[2] == "| tree.shape=tree | 1 | 0.500 | 0k | 5 | 0.500 +- 0.000 |"
  assert table[3] == "| tree.shape=chain | 2 | 0.800 | 4k | 2 | 0.319 +- 0.088 |"
  # A budget of 4000 (both chains' totals): the tree sampled less (its final 0.5 counts).
  table = report.budget_table([tree, chain, chain_1], tokens=4000).splitlines()
  assert table[2].endswith("| 0.500 +- 0.000 |") and table[3].endswith("| 0.800 +- 0.100 |")
  png = report.plot_budget([tree, chain], str(tmp_path / "b.png"))
  assert os.path.getsize(png) > 1000


def test_refine_axes_share_one_base_arm_and_follow_their_field_references(tmp_path):
  """Every axis of configs/refine.py starts with the same base runs (so a grid runs them
  once), and T, the agent count and the feedback mode reach the env and the warm-up data."""
  path = os.path.join(ROOT, "configs", "refine.py")
  names = {}
  for axis in (
      "turns",
      "generations",
      "joint",
      "feedback",
      "policy",
      "shape",
      "discount",
      "agents",
      "trainer",
  ):
    runs = report.expand_sweep(path, axis, str(tmp_path))
    names[axis] = [os.path.basename(w) for w, _, _ in runs]
    assert names[axis][:3] == ["seed=0", "seed=1", "seed=2"] and len(runs) % 3 == 0
  every = report.expand_sweep(path, "all", str(tmp_path))
  assert sorted(os.path.basename(w) for w, _, _ in every) == sorted(
      {n for axis in names.values() for n in axis}
  )
  by_name = {os.path.basename(w): c for w, _, c in every}
  c = by_name["tree.num_turns=3,seed=0"]
  assert (c.env.kwargs.num_turns, c.sft.conversation_kwargs.num_turns, c.env.max_turns) == (3, 3, 3)
  c = by_name["env.kwargs.feedback=plain,seed=1"]
  assert c.sft.conversation_kwargs.feedback == "plain"
  c = by_name["tree.num_agents=1,agents.share_policy=True,seed=2"]
  assert (c.env.kwargs.agents, c.sft.conversation_kwargs.agents) == (1, 1)
