"""Every refusal on the command line and in the recipe API is one line, before anything is written.

In-process: `experiments/cli.py` parses flags into a private `FlagValues` (a
mistyped config key, a key inside a dict-valued field, a value of the wrong
type, a config file that does not load, a missing flag) and runs a main that
raises; `recipes.check_workdir`; the recipe API with classes, instances and
callables. Four subprocess tests check the entry points end to end: exit
status 2, exactly one line on stderr, nothing written.
"""

import os
import subprocess
import sys

import pytest
from absl import app, flags
from ml_collections import config_flags

import mtrl_jax
from experiments import cli
from mtrl_jax.data import TASK_SOURCES
from mtrl_jax.envs.registry import ENV_FACTORIES
from mtrl_jax.run import experiment, recipes
from mtrl_jax.tasks.weather import WeatherFactory, make_task, weather_tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CALC = os.path.join(ROOT, "configs", "calculator.py")
# The weather example's first prompt needs room (mtrl_jax/tasks/weather.py).
WEATHER = dict(env=dict(max_tokens=768), rl=dict(length_buckets=(256, 512, 1024)))


def _refusal(capsys, info) -> str:
  """The one stderr line of a refusal (exit status 2)."""
  assert info.value.code == cli.EXIT_REFUSED
  err = capsys.readouterr().err
  assert err.count("\n") == 1 and err.startswith("error: "), err
  return err


def _parse(monkeypatch, *args):
  """Parses `--config=<calculator smoke> args --workdir=w` into a private FlagValues."""
  argv = ["train", f"--config={CALC}:smoke=True", *args]
  if not any(a.startswith("--workdir") or a == "--noworkdir" for a in args):
    argv.append("--workdir=w")
  monkeypatch.setattr(sys, "argv", argv)  # config_flags reads overrides from sys.argv
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv)
  flags.DEFINE_string("workdir", None, "run directory", flag_values=fv)
  flags.mark_flag_as_required("workdir", flag_values=fv)
  return cli.parse_flags([a for a in argv if a != "--noworkdir"], fv), fv


@pytest.mark.parametrize(
    "args, needles",
    [
        (["--config.rl.stepz=3"], ["--config.rl.stepz:", "no field 'stepz'", "'steps'", "allowed"]),
        (
            ["--config.env.kwargs.k=v"],
            [
                "--config.env.kwargs.k:",
                "config.env.kwargs has no field 'k'",
                "--config.env.kwargs='{\"k\": ...}'",
            ],
        ),
        (["--config.rl.steps.x=1"], ["config.rl.steps is a int value, not a group"]),
        (["--config.rl.steps=abc"], ["--config.rl.steps=abc", "allowed: a value of type int"]),
        (["--noworkdir"], ["--workdir is required; allowed: run directory"]),
        (["--wrokdir=x"], ["'wrokdir'", "workdir"]),
    ],
)
def test_bad_flags_are_one_line(monkeypatch, capsys, args, needles):
  with pytest.raises(SystemExit) as info:
    _parse(monkeypatch, *args)
  err = _refusal(capsys, info)
  for needle in needles:
    assert needle in err, err


@pytest.mark.parametrize(
    "spec, needles",
    [
        ("configs/no_such.py", ["--config=configs/no_such.py", "No such file", "allowed"]),
        (f"{CALC}:bogus=1", [f"--config={CALC}:bogus=1", "'bogus'", "['short', 'smoke']"]),
    ],
)
def test_a_config_file_that_does_not_load_is_one_line(monkeypatch, capsys, spec, needles):
  argv = ["train", f"--config={spec}", "--config.rl.steps=2"]
  monkeypatch.setattr(sys, "argv", argv)
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "config file", flag_values=fv)
  with pytest.raises(SystemExit) as info:
    cli.parse_flags(argv, fv)
  err = _refusal(capsys, info)
  for needle in needles:
    assert needle in err, err


def test_good_flags_parse(monkeypatch):
  rest, fv = _parse(monkeypatch, "--config.rl.steps=5", '--config.env.kwargs={"k": 1}')
  assert rest == ["train"] and fv.config.rl.steps == 5 and fv.config.env.kwargs.k == 1


def test_main_refusals_are_one_line_and_faults_keep_their_traceback(capsys):
  def refuses(error):
    def main(argv):
      raise error

    return main

  for error in (
      app.UsageError("--x=1; allowed: 2"),
      experiment.ConfigError("config rl.steps=-1; allowed: >= 0"),
  ):
    with pytest.raises(SystemExit) as info:
      cli.call_main(refuses(error), ["prog"])
    assert str(error) in _refusal(capsys, info)
  with pytest.raises(RuntimeError):  # not a refusal: the run's own fault
    cli.call_main(refuses(RuntimeError("boom")), ["prog"])


def test_ctrl_c_ends_in_one_line_that_says_how_to_resume(capsys):
  def main(argv):
    raise KeyboardInterrupt

  with pytest.raises(SystemExit) as info:
    cli.call_main(main, ["prog"])
  assert info.value.code == 130
  err = capsys.readouterr().err
  assert "Traceback" not in err and err.strip().count("\n") == 0
  assert "resumes from the last checkpoint" in err


def test_check_workdir(tmp_path, monkeypatch):
  recipes.check_workdir(str(tmp_path / "new" / "run"))  # missing: created later
  recipes.check_workdir(str(tmp_path))
  afile = tmp_path / "afile"
  afile.write_text("keep")
  for path, needle in ((afile, "is a file"), (afile / "run", "is a file")):
    with pytest.raises(experiment.ConfigError, match=needle) as info:
      recipes.check_workdir(str(path), "--workdir")
    assert "\n" not in str(info.value) and str(info.value).startswith("--workdir=")
  monkeypatch.setattr(os, "access", lambda path, mode: False)  # read-only, even for root
  with pytest.raises(experiment.ConfigError, match="is read-only; allowed: a writable"):
    recipes.check_workdir(str(tmp_path / "run"))
  assert afile.read_text() == "keep" and sorted(os.listdir(tmp_path)) == ["afile"]


def _local_tasks(split, **kwargs):
  return [make_task(split, i) for i in range(4)]


def test_recipe_takes_classes_instances_and_callables():
  r = mtrl_jax.ENVGRPO(factory=WeatherFactory, tasks=weather_tasks, **WEATHER)
  assert (r.config.env.factory, r.config.tasks.source) == (
      "mtrl_jax.tasks.weather:WeatherFactory",
      "mtrl_jax.tasks.weather:weather_tasks",
  )

  class LocalFactory(WeatherFactory):
    pass

  instance = LocalFactory()
  r = mtrl_jax.ENVGRPO(factory=instance, tasks=lambda split, **kw: _local_tasks(split), **WEATHER)
  assert ENV_FACTORIES.resolve(r.config.env.factory) is instance
  assert TASK_SOURCES.resolve(r.config.tasks.source)("eval")[0] == make_task("eval", 0)
  r = mtrl_jax.ENVGRPO(
      env=dict(factory=LocalFactory, max_tokens=768), tasks=_local_tasks, rl=WEATHER["rl"]
  )
  assert ENV_FACTORIES.resolve(r.config.env.factory) is LocalFactory
  assert r.config.tasks.source == f"{__name__}:_local_tasks"


@pytest.mark.parametrize(
    "fields, needles",
    [
        (dict(factory=3), ["recipe field 'env.factory'=3", "EnvironmentFactory class"]),
        (dict(tasks=[{"city": "oslo"}]), ["recipe field 'tasks.source'", "a callable (split"]),
        (
            dict(factory=WeatherFactory, tasks=lambda split, **kw: ["oslo", "lima"]),
            ["config tasks.source=", "str"],
        ),
        (
            dict(tree=dict(num_generations="four")),
            ["recipe field 'tree.num_generations'='four'", "allowed: a int"],
        ),
    ],
)
def test_recipe_refusals_are_one_line(fields, needles):
  with pytest.raises(experiment.ConfigError) as info:
    mtrl_jax.ENVGRPO(**fields, **WEATHER)
  msg = str(info.value)
  assert "\n" not in msg
  for needle in needles:
    assert needle in msg, msg


def test_recipe_run_refuses_a_file_workdir_before_writing(tmp_path):
  afile = tmp_path / "run"
  afile.write_text("keep")
  recipe = mtrl_jax.ENVGRPO(factory="weather", tasks="weather", **WEATHER)
  with pytest.raises(experiment.ConfigError, match=r"^workdir='.*run' is a file"):
    recipe.run(str(afile))
  assert afile.read_text() == "keep" and os.listdir(tmp_path) == ["run"]


def _entry(module, *args):
  env = dict(os.environ, PYTHONPATH=ROOT)
  return subprocess.run(
      [sys.executable, "-m", f"experiments.{module}", *args],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )


def _one_line(out, *needles) -> str:
  assert out.returncode == cli.EXIT_REFUSED, (out.stdout, out.stderr)
  lines = out.stderr.splitlines()
  assert len(lines) == 1, out.stderr  # no --help text, no traceback, no log line
  for needle in needles:
    assert needle in lines[0], lines[0]
  return lines[0]


def test_train_refuses_a_mistyped_config_key(tmp_path):
  out = _entry(
      "train", f"--config={CALC}:smoke=True", f"--workdir={tmp_path / 'run'}", "--config.rl.stepz=3"
  )
  _one_line(out, "--config.rl.stepz", "'steps'")
  assert os.listdir(tmp_path) == []


def test_train_refuses_a_workdir_that_is_a_file(tmp_path):
  afile = tmp_path / "run"
  afile.write_text("keep")
  out = _entry("train", f"--config={CALC}:smoke=True", f"--workdir={afile}")
  _one_line(out, f"--workdir={str(afile)!r} is a file")
  assert afile.read_text() == "keep" and os.listdir(tmp_path) == ["run"]


def test_sweep_axis_grid(tmp_path):
  out = _entry(
      "sweep",
      f"--config={CALC}:smoke=True",
      f"--workdir={tmp_path}",
      "--axis=tree.num_generations=2,4,8",
      "--axis=seed=0,1",
      "--axis=rl.length_buckets=(256,512)",
      "--print_only",
  )
  assert out.returncode == 0, out.stderr
  lines = out.stdout.splitlines()
  assert len(lines) == 6 and all("'--config.rl.length_buckets=(256, 512)'" in l for l in lines)
  assert f"--workdir={tmp_path}/tree.num_generations=8,seed=1 " in lines[-1]
  assert os.listdir(tmp_path) == []


def test_sweep_refuses_an_unknown_axis(tmp_path):
  out = _entry(
      "sweep", f"--config={CALC}:smoke=True", f"--workdir={tmp_path}", "--axis=tree.num_gens=2,4"
  )
  _one_line(out, "--axis=tree.num_gens=2,4", "tree has no field 'num_gens'", "num_generations")
  assert os.listdir(tmp_path) == []
