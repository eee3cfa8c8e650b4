"""Reads finished run directories and writes a markdown ablation table and a plot.

  python -m experiments.ablate --runs='runs/sweep_T/*' --out=docs/ablations_T.md
  python -m experiments.ablate --runs='runs/sweep_T/*' --level=0.5  # a fixed level
  python -m experiments.ablate --runs='runs/shape/*' --budget --out=/tmp/shape.md  # + tokens, seconds
  python -m experiments.ablate --runs='runs/shape/*' --budget --tokens=448e3  # success at 448k
  python -m experiments.ablate --runs='runs/refine/seed=*' --runs='runs/refine/tree.num_turns=*'
      # one axis of a grid: the base runs and that axis's arms (--runs repeats)

Runs are grouped by their overrides minus the seed (the directory name written
by `experiments/sweep.py`); each row reports mean +- std over seeds of the
held-out success after SFT, final and best, and the RL steps to first reach
--level (a success rate in [0, 1]; default: half of the best held-out success
any of the runs reached, `report.default_level`). The table's command line
states the level used. --out must be a file in an existing folder (checked at
start; the folder is not created).
"""

import glob
import os

from absl import app, flags

from experiments import cli, outputs, report

_RUNS = flags.DEFINE_multi_string("runs", None, "glob of run directories (repeat for several)")
_LEVEL = flags.DEFINE_float(
    "level",
    None,
    "success level for the steps-to-reach column "
    "(default: half of the best held-out success any run reached)",
)
_OUT = flags.DEFINE_string("out", "", "markdown output (also printed); a PNG is written beside it")
_BUDGET = flags.DEFINE_bool(
    "budget",
    False,
    "also a table and a plot (<out>_budget.png) of "
    "success against sampled tokens and RL seconds",
)
_TOKENS = flags.DEFINE_float(
    "tokens",
    None,
    "the --budget table's last column: held-out success "
    "at this many sampled tokens (default: the smallest run's total)",
)
flags.mark_flags_as_required(["runs"])


def main(argv):
  del argv
  if _TOKENS.value is not None and not _TOKENS.value > 0:
    raise app.UsageError(f"--tokens={_TOKENS.value}; allowed: a number of sampled tokens > 0")
  if _LEVEL.value is not None and not 0.0 <= _LEVEL.value <= 1.0:  # never reached otherwise
    raise app.UsageError(f"--level={_LEVEL.value}; allowed: a success level in [0, 1]")
  if _OUT.value:  # written after the tables: a path that cannot be is refused now
    outputs.check_output_file("--out", _OUT.value)
  started = sorted(
      {
          d
          for pattern in _RUNS.value
          for d in glob.glob(pattern)
          if os.path.exists(os.path.join(d, "metrics.jsonl"))
      }
  )
  # A run writes summary.json when it ends; one still running (or killed) is left out.
  workdirs = [d for d in started if os.path.exists(os.path.join(d, "summary.json"))]
  for d in sorted(set(started) - set(workdirs)):
    print(f"skipped (unfinished, no summary.json): {d}")
  runs = " ".join(f"--runs='{pattern}'" for pattern in _RUNS.value)
  if not workdirs:
    raise app.UsageError(
        f"{runs} matches no finished run directory; allowed: "
        "a glob of run directories with metrics.jsonl and summary.json"
    )
  level = _LEVEL.value
  note = ""
  if level is None:
    level, best = report.default_level(workdirs)
    note = (
        f"steps to {level:g}: half of {best:.3f}, the best held-out success any of these "
        "runs reached (--level sets another)"
        if best == best
        else f"steps to {level:g}: no run has a held-out success above 0 (--level sets another)"
    )
  table = report.ablation_table(workdirs, level=level)
  if _BUDGET.value:
    table += "\n\n" + report.budget_table(workdirs, tokens=_TOKENS.value)
  budget = " --budget" if _BUDGET.value else ""
  if _BUDGET.value and _TOKENS.value is not None:
    budget += f" --tokens={_TOKENS.value:.0f}"
  command = f"`python -m experiments.ablate {runs} --level={level:g}{budget}`"
  print(command + (f"\n{note}" if note else ""))
  print(table)
  if _OUT.value:
    with open(_OUT.value, "w") as f:
      f.write(command + "\n\n" + (f"{note}\n\n" if note else ""))
      f.write(table + "\n")
    png = report.plot_groups(workdirs, os.path.splitext(_OUT.value)[0] + ".png")
    if _BUDGET.value:
      png += " and " + report.plot_budget(workdirs, os.path.splitext(_OUT.value)[0] + "_budget.png")
    print(f"written {_OUT.value} and {png}")


if __name__ == "__main__":
  cli.run(main)
