"""Multi-seed runs, summary tables and learning-curve plots of finished workdirs."""

from __future__ import annotations

import json
import os
import shlex
from typing import Optional, Sequence

import numpy as np

from experiments import cli
from mtrl_jax import metrics as metrics_lib
from mtrl_jax.run import budget

SUCCESS_KEY = "eval/greedy/success"


def run_seeds(config, parent: str, seeds: Sequence[int]) -> list[str]:
  """Runs `config` once per seed under `parent/seed_<k>` (resuming finished ones)."""
  from mtrl_jax.run import rl

  workdirs = []
  for seed in seeds:
    c = config.copy_and_resolve_references()
    c.seed = seed
    workdir = os.path.join(parent, f"seed_{seed}")
    rl.run(c, workdir)
    workdirs.append(workdir)
  return workdirs


def eval_curve(workdir: str, key: str = SUCCESS_KEY) -> tuple[np.ndarray, np.ndarray]:
  rows = [r for r in metrics_lib.read_metrics(workdir) if key in r]
  return (
      np.array([r["step"] for r in rows], np.int64),
      np.array([r[key] for r in rows], np.float64),
  )


def run_summary(workdir: str, key: str = SUCCESS_KEY) -> dict:
  steps, values = eval_curve(workdir, key)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  best = summary.get("best") or {}
  return {
      "workdir": workdir,
      "after_sft": float(values[0]) if len(values) else float("nan"),
      "after_rl": float(values[-1]) if len(values) else float("nan"),
      "best_step": best.get("step"),
      "best": best.get("score"),
      "steps": int(steps[-1]) if len(steps) else 0,
  }


def summary_table(workdirs: Sequence[str], key: str = SUCCESS_KEY) -> str:
  """Markdown table: held-out success after SFT, after RL and at the best step, per seed."""
  rows = [run_summary(w, key) for w in workdirs]
  lines = ["| run | held-out success after SFT | after RL | best (step) |", "|---|---|---|---|"]
  for r in rows:
    lines.append(
        f"| {os.path.basename(r['workdir'])} | {r['after_sft']:.3f} | "
        f"{r['after_rl']:.3f} | {r['best'] or float('nan'):.3f} ({r['best_step']}) |"
    )
  if len(rows) > 1:

    def ms(name):
      v = np.array([r[name] or np.nan for r in rows], np.float64)
      return f"{np.nanmean(v):.3f} +- {np.nanstd(v):.3f}"

    lines.append(f"| mean +- std | {ms('after_sft')} | {ms('after_rl')} | {ms('best')} |")
  return "\n".join(lines)


def plot_learning_curves(workdirs: Sequence[str], out_png: str, key: str = SUCCESS_KEY) -> str:
  """Held-out success vs RL step: each seed thin, mean +- std band thick."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6, 4))
  curves = [eval_curve(w, key) for w in workdirs]
  alone = len(curves) == 1
  for w, (s, v) in zip(workdirs, curves):
    ax.plot(
        s,
        v,
        lw=2 if alone else 0.8,
        alpha=1 if alone else 0.5,
        marker="o" if alone else None,
        label=os.path.basename(w),
    )
  common = min((len(s) for s, _ in curves), default=0)
  if len(curves) > 1 and common:
    vals = np.stack([v[:common] for _, v in curves])
    steps = curves[0][0][:common]
    mean, std = vals.mean(0), vals.std(0)
    ax.plot(steps, mean, lw=2, color="k", label="mean")
    ax.fill_between(steps, mean - std, mean + std, color="k", alpha=0.15)
  ax.set_xlabel("RL step (0 = after SFT warm-up)")
  ax.set_ylabel("held-out success (greedy)")
  ax.set_ylim(-0.02, 1.02)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  os.makedirs(os.path.dirname(out_png) or ".", exist_ok=True)
  fig.tight_layout()
  fig.savefig(out_png, dpi=120)
  plt.close(fig)
  return out_png


# ------------------------------------------------------------------ sweeps and ablations
def _load_config_module(config_path: str):
  import importlib.util

  spec = importlib.util.spec_from_file_location("sweep_config", config_path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def run_name(overrides: dict) -> str:
  """A directory name from overrides: 'tree.num_turns=2,seed=0' -> 'tree.num_turns=2,seed=0'."""
  return ",".join(f"{k}={v}" for k, v in overrides.items()).replace("/", "_")


def expand_sweep(config_spec: str, sweep_arg: str, parent: str) -> list:
  """(workdir, overrides, ConfigDict) per run of `get_sweep(sweep_arg)` of the config file."""
  path, _, arg = config_spec.partition(":")
  module = _load_config_module(path)
  if not hasattr(module, "get_sweep"):
    raise ValueError(f"{path} has no get_sweep(arg)")
  out = []
  for overrides in module.get_sweep(sweep_arg or None):
    config = module.get_config(arg or None)
    for key, value in overrides.items():
      *path, leaf = key.split(".")
      target = config
      for part in path:
        target = target[part]
      if leaf not in target:
        raise ValueError(f"sweep override {key!r}: no such config field")
      target[leaf] = value
    out.append((os.path.join(parent, run_name(overrides)), dict(overrides), config))
  return out


def arm_refusal(runs, memory: bool) -> Optional[str]:
  """Validates every arm's config as `experiments/train.py` does at start, so a sweep
  refuses a config that cannot run before its first arm computes; returns one line
  naming the first arm that does not validate (its run directory) and why, else None.

  Args:
    runs: (workdir, overrides, ConfigDict) per arm, as `expand_sweep` returns them.
    memory: also check that each arm's tree fits this machine's memory
      (`budget.check_memory`: it touches the devices, so only when the arms run in
      this process; with --parallel each train.py checks its own at start).
  """
  # Here, not at the top: it imports jax and every task (~1 s), which the tables and
  # plots of finished runs (`experiments/ablate.py`) never need.
  from mtrl_jax.run import experiment

  for workdir, _, config in runs:
    try:
      if experiment.distributed_config(config).mode == "off":
        exp = experiment.validate(config)  # several processes: each arm's own validate
        if memory:
          budget.check_memory(exp)
    except (experiment.ConfigError, ValueError, TypeError) as e:
      return f"sweep arm {os.path.basename(workdir)} ({workdir}): {cli.one_line(e)}"
  return None


def train_command(config_spec: str, workdir: str, overrides: dict) -> str:
  """The `experiments.train` command of one run; shell-quoted where a value needs it."""
  args = [f"--config={config_spec}", f"--workdir={workdir}"]
  args += [f"--config.{k}={v}" for k, v in overrides.items()]
  return "python -m experiments.train " + " ".join(shlex.quote(a) for a in args)


def _group_key(workdir: str) -> str:
  parts = [p for p in os.path.basename(workdir).split(",") if not p.startswith("seed=")]
  return ",".join(parts) or "(base)"


def _groups(workdirs: Sequence[str]) -> dict[str, list[str]]:
  groups: dict[str, list[str]] = {}
  for w in workdirs:
    groups.setdefault(_group_key(w), []).append(w)
  return groups


def steps_to_reach(workdir: str, level: float, key: str = SUCCESS_KEY):
  steps, values = eval_curve(workdir, key)
  hit = np.flatnonzero(values >= level)
  return int(steps[hit[0]]) if hit.size else None


def default_level(workdirs: Sequence[str], key: str = SUCCESS_KEY) -> tuple[float, float]:
  """(level, best): half of the best held-out success any of the runs reached (the highest
  value of any evaluation curve, or of a summary's best score), and that best. A level
  every run can be compared at: a fixed one may lie above every run (never reached) or
  below their first evaluation (reached at step 0). 0.5 when no run has a success value
  above 0 (best: NaN)."""
  best = []
  for w in workdirs:
    r = run_summary(w, key)
    best += [v for v in eval_curve(w, key)[1]] + ([r["best"]] if r["best"] is not None else [])
  top = max((float(v) for v in best if np.isfinite(v)), default=float("nan"))
  if not top > 0:
    return 0.5, float("nan")
  return round(top / 2, 3), top


def ablation_table(workdirs: Sequence[str], level: float, key: str = SUCCESS_KEY) -> str:
  """Markdown: per group (overrides minus seed) mean +- std over seeds."""
  groups = _groups(workdirs)
  lines = [
      f"| setting | seeds | after SFT | final | best | steps to {level:g} |",
      "|---|---|---|---|---|---|",
  ]
  for name, runs in groups.items():
    rows = [run_summary(w, key) for w in runs]

    def ms(field):
      v = np.array([np.nan if r[field] is None else r[field] for r in rows], np.float64)
      return f"{np.nanmean(v):.3f} +- {np.nanstd(v):.3f}"

    reach = [steps_to_reach(w, level, key) for w in runs]
    reached = [s for s in reach if s is not None]
    reach_txt = (
        f"{np.mean(reached):.0f} ({len(reached)}/{len(runs)} reached)"
        if reached
        else f"never (0/{len(runs)})"
    )
    lines.append(
        f"| {name} | {len(runs)} | {ms('after_sft')} | {ms('after_rl')} | "
        f"{ms('best')} | {reach_txt} |"
    )
  return "\n".join(lines)


def plot_groups(workdirs: Sequence[str], out_png: str, key: str = SUCCESS_KEY) -> str:
  """Mean held-out success vs step, one line per group."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  groups = _groups(workdirs)
  fig, ax = plt.subplots(figsize=(6, 4))
  for name, runs in groups.items():
    curves = [eval_curve(w, key) for w in runs]
    n = min(len(s) for s, _ in curves)
    if n == 0:
      continue
    mean = np.stack([v[:n] for _, v in curves]).mean(0)
    ax.plot(curves[0][0][:n], mean, label=f"{name} (n={len(runs)})")
  ax.set_xlabel("RL step")
  ax.set_ylabel("held-out success (greedy)")
  ax.grid(alpha=0.3)
  ax.legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out_png, dpi=120)
  plt.close(fig)
  return out_png


def budget_curve(workdir: str, key: str = SUCCESS_KEY) -> dict:
  """Held-out success against what it cost, at each evaluation: cumulative sampled
  tokens (`tree/sampled_tokens`) and RL wall seconds (`time/step` less `time/eval`)."""
  tokens = seconds = 0.0
  out = {"step": [], "tokens": [], "seconds": [], "success": []}
  for r in metrics_lib.read_metrics(workdir):
    tokens += r.get("tree/sampled_tokens", 0.0)
    seconds += r.get("time/step", 0.0) - r.get("time/eval", 0.0)
    if key in r:
      for name, v in (
          ("step", r["step"]),
          ("tokens", tokens),
          ("seconds", seconds),
          ("success", r[key]),
      ):
        out[name].append(v)
  return {k: np.asarray(v, np.float64) for k, v in out.items()}


def budget_table(
    workdirs: Sequence[str], key: str = SUCCESS_KEY, tokens: Optional[float] = None
) -> str:
  """Markdown: per group, mean over seeds of the final held-out success, the tokens
  sampled and the RL seconds spent to get there, and the success at a token
  budget.

  The budget is `tokens`, by default the smallest final sampled-token count
  among the runs (every run reached it). A run's value at the budget is
  interpolated linearly between the two evaluations around it (evaluations
  come every `eval.every` steps, so an arm that samples more per step would
  otherwise be read further below the budget); a run that sampled fewer
  tokens counts with its final evaluation.
  """
  curves = {name: [budget_curve(w, key) for w in runs] for name, runs in _groups(workdirs).items()}
  if tokens is None:
    tokens = min(c["tokens"][-1] for cs in curves.values() for c in cs)
  lines = [
      "| setting | seeds | final | sampled tokens | RL seconds (eval excluded) | "
      f"at {tokens / 1e3:.0f}k tokens |",
      "|---|---|---|---|---|---|",
  ]
  for name, cs in curves.items():
    mean = lambda f: float(np.mean([c[f][-1] for c in cs]))
    at_budget = [np.interp(tokens, c["tokens"], c["success"]) for c in cs]
    lines.append(
        f"| {name} | {len(cs)} | {mean('success'):.3f} | "
        f"{mean('tokens') / 1e3:.0f}k | {mean('seconds'):.0f} | "
        f"{np.mean(at_budget):.3f} +- {np.std(at_budget):.3f} |"
    )
  return "\n".join(lines)


def plot_budget(workdirs: Sequence[str], out_png: str, key: str = SUCCESS_KEY) -> str:
  """Held-out success against sampled tokens and against RL seconds, one line per
  run, one colour per group (seeds reach different budgets, so they are not averaged)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=True)
  for i, (name, runs) in enumerate(_groups(workdirs).items()):
    for j, w in enumerate(runs):
      c = budget_curve(w, key)
      for ax, x, scale in ((axes[0], "tokens", 1e3), (axes[1], "seconds", 1.0)):
        ax.plot(
            c[x] / scale,
            c["success"],
            color=f"C{i}",
            marker=".",
            alpha=0.8,
            label=f"{name} (n={len(runs)})" if j == 0 else None,
        )
  axes[0].set_xlabel("sampled tokens (thousands)")
  axes[1].set_xlabel("RL wall seconds (eval excluded)")
  axes[0].set_ylabel("held-out success (greedy)")
  for ax in axes:
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=7)
  fig.tight_layout()
  fig.savefig(out_png, dpi=120)
  plt.close(fig)
  return out_png
