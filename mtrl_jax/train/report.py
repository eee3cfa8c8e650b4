"""Multi-seed runs, summary tables and learning-curve plots of finished workdirs."""

from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from mtrl_jax import metrics as metrics_lib

SUCCESS_KEY = "eval/greedy/success"


def run_seeds(config, parent: str, seeds: Sequence[int]) -> list[str]:
  """Runs `config` once per seed under `parent/seed_<k>` (resuming finished ones)."""
  from mtrl_jax.train import rl
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
  return (np.array([r["step"] for r in rows], np.int64),
          np.array([r[key] for r in rows], np.float64))


def run_summary(workdir: str, key: str = SUCCESS_KEY) -> dict:
  steps, values = eval_curve(workdir, key)
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  best = summary.get("best") or {}
  return {"workdir": workdir, "after_sft": float(values[0]) if len(values) else float("nan"),
          "after_rl": float(values[-1]) if len(values) else float("nan"),
          "best_step": best.get("step"), "best": best.get("score"),
          "steps": int(steps[-1]) if len(steps) else 0}


def summary_table(workdirs: Sequence[str], key: str = SUCCESS_KEY) -> str:
  """Markdown table: held-out success after SFT, after RL and at the best step, per seed."""
  rows = [run_summary(w, key) for w in workdirs]
  lines = ["| run | held-out success after SFT | after RL | best (step) |",
           "|---|---|---|---|"]
  for r in rows:
    lines.append(f"| {os.path.basename(r['workdir'])} | {r['after_sft']:.3f} | "
                 f"{r['after_rl']:.3f} | {r['best'] or float('nan'):.3f} ({r['best_step']}) |")
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
    ax.plot(s, v, lw=2 if alone else 0.8, alpha=1 if alone else 0.5, marker="o" if alone else None,
            label=os.path.basename(w))
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
