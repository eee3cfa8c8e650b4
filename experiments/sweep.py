"""Expands a config's `get_sweep(arg)`, or ad-hoc `--axis` values, into runs, one workdir each.

  python -m experiments.sweep --config=configs/calculator.py --workdir=runs/sweep_T --sweep=turns
  python -m experiments.sweep --config=configs/calculator.py --workdir=runs/sweep_T --sweep=turns --print_only
  python -m experiments.sweep --config=configs/coop.py --workdir=runs/coop --sweep=all --parallel=6
  python -m experiments.sweep --config=configs/coop.py --workdir=runs/coop --sweep=all --only=show_partner
  python -m experiments.sweep --config=configs/calculator.py:smoke=True --workdir=runs/G \
      --axis=tree.num_generations=2,4,8 --axis=seed=0,1     # 3 x 2 runs, no config file edit

`get_sweep(arg)` (beside `get_config` in the config file) returns a list of
dicts of dotted overrides, e.g. [{"tree.num_turns": 1, "seed": 0}, ...]; seeds
are one more axis. `--axis=<dotted.key>=v1,v2,...` names an axis on the
command line (values parsed as Python literals, else strings; commas inside
brackets or quotes do not split). Several axes make a grid (every
combination is a run), crossed with `get_sweep(--sweep)` when --sweep is
given, else on their own. An axis of one value sets that field in every run
and stays out of the run names (e.g. --axis=env.factory=weather). Each run's
workdir is named after its overrides, so a sweep re-run skips finished runs
(those with summary.json; --rerun runs them again), resumes unfinished ones at
their last checkpoint, and `experiments/ablate.py` can read them back. Every
arm that will run is validated (as experiments/train.py validates at start)
before the first one runs: an arm that cannot run is refused in one line
naming it and the field (exit status 2), nothing trained. With
--parallel=K the runs are K `experiments/train.py` processes at a time (each
logs to <workdir>.log), e.g. several small runs sharing one GPU.
"""

import ast
import importlib.util
import itertools
import os
import shlex
import subprocess
import sys
import time

from absl import app, flags, logging
from ml_collections import config_dict

from experiments import cli, report

_CONFIG = flags.DEFINE_string("config", None, "config file (path[:arg])")
_SWEEP = flags.DEFINE_string("sweep", "", "argument of get_sweep(arg)")
_AXIS = flags.DEFINE_multi_string(
    "axis",
    [],
    "an ad-hoc axis '<dotted.key>=v1,v2,...' (repeat "
    "for a grid; one value: set in every run, not in run names)",
)
_WORKDIR = flags.DEFINE_string("workdir", None, "parent directory of the runs")
_PRINT = flags.DEFINE_bool("print_only", False, "print one command per run instead of running")
_RERUN = flags.DEFINE_bool(
    "rerun",
    False,
    "also run the runs that finished already "
    "(their workdir has summary.json); by default they are skipped, so "
    "repeating a sweep command completes the missing runs",
)
_ONLY = flags.DEFINE_list(
    "only",
    [],
    "keep only the runs whose workdir name contains one of "
    "these strings, e.g. --only=show_partner,num_generations=2",
)
_PARALLEL = flags.DEFINE_integer(
    "parallel", 0, "run K train.py processes at a time (0: in-process, one by one)"
)
flags.mark_flags_as_required(["config", "workdir"])


def split_values(text: str) -> list[str]:
  """'2,4,8' -> ['2', '4', '8']; commas inside brackets or quotes do not split."""
  out, depth, quote, start = [], 0, None, 0
  for i, ch in enumerate(text):
    if quote:
      quote = None if ch == quote else quote
    elif ch in "'\"":
      quote = ch
    elif ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    elif ch == "," and depth == 0:
      out.append(text[start:i])
      start = i + 1
  return out + [text[start:]]


def parse_value(text: str):
  """A command-line value as config_flags reads it: a Python literal, else the string."""
  text = text.strip()
  if text in ("true", "false"):
    return text == "true"
  try:
    return ast.literal_eval(text)
  except (SyntaxError, ValueError):
    return text


def parse_axis(text: str) -> tuple[str, list]:
  """'tree.num_generations=2,4,8' -> ('tree.num_generations', [2, 4, 8])."""
  key, sep, values = text.partition("=")
  if not sep or not key.strip() or not values.strip():
    raise app.UsageError(
        f"--axis={text!r}; allowed: '<dotted.key>=v1,v2,...', e.g. "
        "--axis=tree.num_generations=2,4,8"
    )
  return key.strip(), [parse_value(v) for v in split_values(values)]


def set_field(config, key: str, value, axis: str) -> None:
  """config.<key> = value; an unknown key or a value of another type is refused in one line."""
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts):
    if not isinstance(node, config_dict.ConfigDict) or part not in node:
      where = ".".join(parts[:i]) or "the config"
      allowed = (
          sorted(node.keys()) if isinstance(node, config_dict.ConfigDict) else "none (not a group)"
      )
      raise app.UsageError(f"--axis={axis}: {where} has no field {part!r}; allowed: {allowed}")
    if i < len(parts) - 1:
      node = node[part]
  try:
    node[parts[-1]] = value
  except (TypeError, ValueError) as e:
    raise app.UsageError(
        f"--axis={axis}: {key}={value!r} ({cli.one_line(e)}); allowed: a "
        f"{type(node[parts[-1]]).__name__}"
    ) from None


def expand(config_spec: str, sweep_arg: str, axes: list[str], parent: str) -> list:
  """(workdir, overrides, ConfigDict) per run: get_sweep's runs (all of them, or one
  without overrides when only axes are given) crossed with the grid of `axes`."""
  if not axes:
    return report.expand_sweep(config_spec, sweep_arg, parent)
  parsed = [(text, *parse_axis(text)) for text in axes]
  keys = [key for _, key, _ in parsed]
  if len(set(keys)) < len(keys):
    raise app.UsageError(f"--axis repeats a key: {keys}; allowed: each key once")
  path, _, arg = config_spec.partition(":")
  if sweep_arg:
    base = report.expand_sweep(config_spec, sweep_arg, parent)
  else:
    spec = importlib.util.spec_from_file_location("sweep_config", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    base = [(parent, {}, module.get_config(arg or None))]
  runs = []
  for _, overrides, config in base:
    for values in itertools.product(*[v for _, _, v in parsed]):
      c = config.copy_and_resolve_references()
      named = dict(overrides)
      fixed = {}
      for (text, key, choices), value in zip(parsed, values):
        set_field(c, key, value, text)
        (named if len(choices) > 1 else fixed)[key] = value
      name = report.run_name(named) or "base"
      runs.append((os.path.join(parent, name), {**fixed, **named}, c))
  return runs


def run_parallel(commands, k: int) -> None:
  """Runs (workdir, command) pairs, k at a time; reports each exit status."""
  pending, active, failed = list(commands), {}, []
  while pending or active:
    while pending and len(active) < k:
      workdir, cmd = pending.pop(0)
      os.makedirs(os.path.dirname(workdir) or ".", exist_ok=True)
      log = open(workdir + ".log", "w")
      argv = shlex.split(cmd)
      argv[0] = sys.executable  # the command says "python"; run this interpreter
      active[workdir] = (
          subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT),
          log,
          time.time(),
      )
      print(f"started {workdir}", flush=True)
    for workdir, (proc, log, t0) in list(active.items()):
      if proc.poll() is not None:
        log.close()
        del active[workdir]
        print(f"finished {workdir} (exit {proc.returncode}, {time.time() - t0:.0f} s)", flush=True)
        if proc.returncode:
          failed.append(workdir)
    time.sleep(1.0)
  if failed:
    raise SystemExit(f"{len(failed)} runs failed; see their .log files: {failed}")


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  try:
    runs = expand(_CONFIG.value, _SWEEP.value, _AXIS.value, _WORKDIR.value)
  except (ValueError, OSError) as e:  # no get_sweep, an unknown sweep, a missing config file
    raise app.UsageError(
        f"--config={_CONFIG.value} --sweep={_SWEEP.value}: {cli.one_line(e)}"
    ) from None
  if _ONLY.value:
    names = [os.path.basename(w) for w, _, _ in runs]
    runs = [r for r in runs if any(o in os.path.basename(r[0]) for o in _ONLY.value)]
    if not runs:
      raise app.UsageError(
          f"--only={','.join(_ONLY.value)} matches no run; allowed: parts of "
          f"the run names {names}"
      )
  if not _PRINT.value:
    from mtrl_jax.run import recipes

    recipes.check_workdir(_WORKDIR.value, "--workdir")
  if not (_RERUN.value or _PRINT.value):
    done = [w for w, _, _ in runs if os.path.exists(os.path.join(w, "summary.json"))]
    for w in done:
      print(f"skipped (finished; --rerun runs it again): {w}", flush=True)
    runs = [r for r in runs if r[0] not in done]
  if not _PRINT.value:
    refusal = report.arm_refusal(runs, memory=_PARALLEL.value <= 0)  # before any arm runs
    if refusal:
      raise app.UsageError(refusal)
  if _PARALLEL.value > 0 and not _PRINT.value:
    commands = [
        (w, report.train_command(_CONFIG.value, w, o) + " --progress=false") for w, o, _ in runs
    ]
    run_parallel(commands, _PARALLEL.value)
    return
  for workdir, overrides, config in runs:
    if _PRINT.value:
      print(report.train_command(_CONFIG.value, workdir, overrides))
      continue
    from mtrl_jax.run import rl

    print(f"== {workdir}", flush=True)
    rl.run(config, workdir)


if __name__ == "__main__":
  cli.run(main)
