"""docs/recipes.md: every command it gives trains, and its tree-cost table is what
`run/budget.py` counts.

The commands run one after another in one subprocess on one CPU device
(`run_all`), each parsed by absl as `python -m experiments.train` parses it (a
fresh flag set, the config file with its `:arg` and `--config.*` overrides)
and trained as that entry point trains it (`experiment.start`, then
`rl.train`): one process pays the imports once for every recipe, and one
device (not the eight the suite's conftest makes) keeps each smoke run's programs small.
"""

import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap

import pytest
from absl import flags
from ml_collections import config_flags

from configs import coop, guess
from mtrl_jax import metrics as metrics_lib
from mtrl_jax import testing
from mtrl_jax.run import budget, experiment, recipes, rl
from mtrl_jax.tasks import guess as guess_task

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "recipes.md")


def doc_text() -> str:
  with open(DOC) as f:
    return f.read()


def doc_commands(text: str) -> list[str]:
  """Every `python -m experiments.` command of the doc's ```sh blocks, continuation
  lines joined."""
  out = []
  for block in re.findall(r"```sh\n(.*?)```", text, re.S):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split(" #")[0].strip()
      if line.startswith("python -m experiments."):
        out.append(line)
  return out


def run_command(command: str, workdir: str) -> dict:
  """Trains `command` (a `python -m experiments.train` line) in `workdir`."""
  argv = shlex.split(command)
  assert argv[:3] == ["python", "-m", "experiments.train"], command
  args = [a for a in argv[3:] if not a.startswith("--workdir=")]
  fv = flags.FlagValues()
  config = config_flags.DEFINE_config_file(
      "config", None, "config file", flag_values=fv, lock_config=True, sys_argv=["train"] + args
  )
  flags.DEFINE_bool("progress", True, "progress bar", flag_values=fv)
  cwd = os.getcwd()
  os.chdir(ROOT)  # the doc's paths are relative to the repository root
  try:
    fv(["train"] + args)
    recipes.check_workdir(workdir, "--workdir")
    exp = experiment.start(config.value)
    return rl.train(exp, config.value, workdir, progress=False)
  finally:
    os.chdir(cwd)


def test_the_doc_commands_parse_and_cite_existing_files():
  text = doc_text()
  commands = doc_commands(text)
  assert len(commands) >= 4, commands
  for path in set(re.findall(r"`((?:mtrl_jax|configs|docs|experiments|tests)/[\w/.]+)`", text)):
    assert os.path.exists(os.path.join(ROOT, path)), path


def run_all(root: str, commands: list[str]):
  """Trains each command in `root`/run<i>; prints one JSON line per finished run.

  The runs draw no curves.png (as `no_curves` in tests/train/conftest.py):
  matplotlib takes seconds of CPU per run, and a plot is not what a recipe teaches."""
  metrics_lib.plot_metrics = lambda *args, **kwargs: None
  for i, command in enumerate(commands):
    summary = run_command(command, os.path.join(root, f"run{i}"))
    print(json.dumps({"command": command, "halted": bool(summary.get("halted"))}), flush=True)


@pytest.mark.slow  # one training run per command the docs show
def test_every_doc_command_trains(tmp_path):
  commands = doc_commands(doc_text())
  env = testing.cpu_env(1, PYTHONPATH=ROOT)
  out = subprocess.run(
      [
          sys.executable,
          "-c",
          "import sys; from tests.test_docs_recipes import run_all; "
          "run_all(sys.argv[1], sys.argv[2:])",
          str(tmp_path),
      ]
      + commands,
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert out.returncode == 0, out.stderr[-4000:]
  done = [json.loads(line) for line in out.stdout.splitlines() if line.startswith('{"command"')]
  assert [d["command"] for d in done] == commands, out.stdout[-2000:]
  assert not any(d["halted"] for d in done), done
  for i, command in enumerate(commands):
    with open(tmp_path / f"run{i}" / "metrics.jsonl") as f:
      last = json.loads(f.read().splitlines()[-1])
    if "configs/guess.py" in command:  # its smoke trains on the step's samples
      assert last["batch/actions"] > 0, command


def python_blocks(text: str) -> list[str]:
  return re.findall(r"```python\n(.*?)```", text, re.S)


def uncommented(code: str) -> str:
  return "\n".join(line.split("  #")[0].rstrip() for line in code.strip().splitlines())


def test_the_code_excerpt_is_the_module_s_and_the_python_recipe_validates():
  excerpt, recipe = python_blocks(doc_text())
  source = textwrap.dedent(inspect.getsource(guess_task.GuessEnv.react_to))
  assert uncommented(excerpt) in uncommented(source), excerpt
  call, run = recipe.rsplit(".run(", 1)
  assert run.startswith('"runs/'), recipe
  scope = {}
  exec(call, scope)  # builds the recipe (validated, its tree estimated) without training


def cost_rows(text: str) -> list[dict]:
  """The rows of the doc's tree-cost table (the one under "Cost per root")."""
  section = text.split("Cost per root", 1)[1]
  rows = []
  for line in section.splitlines():
    cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
    if len(cells) == 8 and cells[0].isdigit():
      rows.append(
          dict(zip(("T", "G", "N", "mode", "branch_on", "nodes", "actions", "completions"), cells))
      )
    elif rows and not line.startswith("|"):
      break
  return rows


@pytest.mark.parametrize("row", cost_rows(doc_text()), ids=lambda r: "-".join(r.values()))
def test_the_cost_table_is_what_budget_counts(row):
  turns, agents = int(row["T"]), int(row["N"])
  c = (guess if agents == 1 else coop).get_config("smoke=True")
  c.rl.roots_per_step = 1
  c.rl.max_generations = 10**12  # the table's widest trees pass plan_tree's budget
  c.tree.num_turns, c.tree.num_generations = turns, int(row["G"])
  c.tree.num_agents, c.tree.joint_mode = agents, row["mode"]
  c.tree.branch_on = row["branch_on"]
  if agents == 1:
    c.env.max_turns = 2 * turns  # coop's follows tree.num_turns (one FieldReference)
  e = budget.estimate(experiment.validate(c))
  assert (e.nodes, e.joint_actions, e.completions) == (
      int(row["nodes"]),
      int(row["actions"]),
      int(row["completions"]),
  ), row
