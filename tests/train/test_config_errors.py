"""Every bad config is refused before compute in one line naming the field (invariant 8).

The refusals are checked in-process on the validation functions; one subprocess
test checks that the entry point prints the line and exits before writing.
"""

import os
import subprocess
import sys

import pytest

from configs import calculator as calc_config
from configs import coop as coop_config
from configs import humaneval as humaneval_config
from configs import refine as refine_config
from mtrl_jax.envs import Environment, EnvironmentFactory
from mtrl_jax.run import builders, components, experiment

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CALC = calc_config.get_config().sft.conversations.partition(":")[0]  # the task's module

# (config file, overrides, text the one-line error must contain)
BAD = {
    "factory_import_path": (
        "calculator",
        {"env.factory": "no_such_pkg.env:Factory"},
        ["env.factory='no_such_pkg.env:Factory'", "no_such_pkg"],
    ),
    "factory_name": (
        "calculator",
        {"env.factory": "calculater"},
        ["env.factory='calculater'", "'calculator'"],
    ),
    "factory_attr": (
        "calculator",
        {"env.factory": f"{CALC}:NoFactory"},
        ["env.factory=", "NoFactory"],
    ),
    "factory_kwargs": (
        "calculator",
        {"env.kwargs": {"colour": "red"}},
        ["env.factory='calculator'", "colour"],
    ),
    "task_source": (
        "calculator",
        {"tasks.source": "no_such_pkg.tasks:make"},
        ["tasks.source='no_such_pkg.tasks:make'"],
    ),
    "task_split": (
        "calculator",
        {"tasks.eval_split": "held_out"},
        ["tasks.eval_split='held_out'", "'eval'"],
    ),
    "sft_conversations": (
        "calculator",
        {"sft.conversations": f"{CALC}:no_golden"},
        ["sft.conversations=", "no_golden"],
    ),
    "sft_conversation_kwargs": (
        "refine",
        {"sft.conversation_kwargs": {"turns": 2}},
        ["sft.conversation_kwargs={'turns': 2}", "turns", "refine:warmup_conversation"],
    ),
    "sft_conversation_kwargs_alone": (
        "calculator",
        {"sft.steps": 0, "sft.conversations": "", "sft.conversation_kwargs": {"turns": 2}},
        ["sft.conversation_kwargs={'turns': 2}", "needs sft.conversations"],
    ),
    "single_agent_separate": (
        "refine",
        {"tree.num_agents": 1, "agents.share_policy": False},
        ["agents.share_policy=False with tree.num_agents=1", "allowed: True"],
    ),
    "extra_specials": (
        "calculator",
        {"tokenizer.extra_specials": f"{CALC}:golden_conversation"},
        ["tokenizer.extra_specials=", "tuple of strings"],
    ),
    "agents": (
        "coop",
        {"tree.num_agents": 1, "agents.share_policy": True},
        ["tree.num_agents=1", "env.factory='coop'", "allowed: 2"],
    ),
    "team_weight_range": (
        "coop",
        {"agents.team_weight": 1.5},
        ["agents.team_weight=1.5", "allowed: a number in [0, 1]"],
    ),
    "team_weight_one_agent": (
        "calculator",
        {"agents.team_weight": 0.5},
        ["agents.team_weight=0.5 with tree.num_agents=1", "allowed: 1.0"],
    ),
    "marginal_one_agent": (
        "calculator",
        {"tree.joint_mode": "marginal"},
        ["tree.joint_mode='marginal' with tree.num_agents=1", "allowed: tree.num_agents >= 2"],
    ),
    "one_generation_mean": (
        "calculator",
        {"tree.num_generations": 1},
        ["tree.num_generations=1", "advantage_mode='mean'", "'raw'"],
    ),
    "one_generation_max": (
        "calculator",
        {"tree.num_generations": 1, "tree.advantage_mode": "max"},
        ["tree.num_generations=1", "advantage_mode='max'"],
    ),
    "dtype": ("calculator", {"model.dtype": "float16"}, ["model.dtype='float16'", "'bfloat16'"]),
    "model_path": (
        "calculator",
        {"model.path": "/no/such/checkpoint"},
        ["model.path='/no/such/checkpoint'", "config.json"],
    ),
    "is_correction": (
        "calculator",
        {"loss.is_correction": "clip"},
        ["is_correction='clip'", "'tis'", "'mis_action'"],
    ),
    "is_cap": ("calculator", {"loss.is_cap": 0.5}, ["is_cap=0.5", "> 1"]),
    "num_layers": ("calculator", {"model.num_layers": -2}, ["model.num_layers=-2", "positive int"]),
}


def _config(name, overrides):
  module = {"calculator": calc_config, "coop": coop_config, "refine": refine_config}[name]
  c = module.get_config("smoke=True")
  for key, value in overrides.items():
    group, field = key.split(".")
    setattr(c[group], field, value)
  return c


@pytest.mark.parametrize("case", sorted(BAD))
def test_validate_refuses_in_one_line(case):
  name, overrides, needles = BAD[case]
  with pytest.raises(experiment.ConfigError) as info:
    experiment.validate(_config(name, overrides))
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("config ")
  for needle in needles:
    assert needle in msg, msg


def test_good_configs_and_raw_single_sample_pass():
  for c in (
      calc_config.get_config(),
      calc_config.get_config("smoke=True"),
      coop_config.get_config(),
      humaneval_config.get_config("smoke=True"),
      refine_config.get_config(),
  ):
    experiment.validate(c)
  # 'raw' advantages of one sample are the returns themselves: allowed.
  experiment.validate(
      _config(
          "calculator",
          {
              "tree.num_generations": 1,
              "tree.advantage_mode": "raw",
              "tree.advantage_std_norm": False,
          },
      )
  )
  # `build` keeps raising plain ValueErrors (ConfigError is one) for library callers.
  with pytest.raises(ValueError, match="model.dtype"):
    experiment.build(_config("calculator", {"model.dtype": "int8"}))


class _MiscountingFactory(EnvironmentFactory):
  """Declares two agents but creates one-agent environments."""

  num_agents = 2

  def create_environment(self, metadata):
    return Environment(metadata)


def test_factory_agent_count_must_match_its_environments():
  assert EnvironmentFactory.num_agents is None  # undeclared by default
  c = _config("calculator", {"env.factory": f"{__name__}:_MiscountingFactory"})
  with pytest.raises(
      experiment.ConfigError, match="declares num_agents=2 but its environments have 1"
  ):
    experiment.validate(c)


def test_start_validates_once_and_refuses_in_one_line():
  """`experiment.start` (the entry points' call): the same experiment as `validate`, and
  a bad distributed group refused as a `ConfigError` like any other field."""
  c = _config("calculator", {})
  assert experiment.start(c) == experiment.validate(c)
  c.distributed.mode = "cluster"
  with pytest.raises(experiment.ConfigError) as info:
    experiment.start(c)
  msg = str(info.value)
  assert "\n" not in msg and msg.startswith("config distributed.mode='cluster'"), msg
  c = _config("calculator", {"env.factory": "no_such_pkg.env:Factory"})
  with pytest.raises(experiment.ConfigError, match=r"^config env.factory='no_such_pkg"):
    experiment.start(c)


def test_vocabulary_is_fitted_and_checked_during_validation():
  c = _config("calculator", {})
  exp = experiment.validate(c)
  tokenizer = builders.make_tokenizer(exp.tokenizer, exp.model.path)
  assert exp.model.arch.vocab_size == tokenizer.vocab_size  # from scratch: the tokenizer's
  c.tokenizer.extra_specials = ""
  assert experiment.validate(c).model.arch.vocab_size < exp.model.arch.vocab_size


def test_train_entry_point_refuses_before_writing(tmp_path):
  """The one subprocess test: `experiments/train.py` prints the refusal as its last line,
  exits non-zero, and writes nothing (every refusal itself is checked in-process above)."""
  name, overrides, needles = BAD["factory_import_path"]
  workdir = tmp_path / "run"
  cmd = [
      sys.executable,
      os.path.join(ROOT, "experiments", "train.py"),
      f"--config={os.path.join(ROOT, 'configs', name + '.py')}:smoke=True",
      f"--workdir={workdir}",
  ]
  cmd += [f"--config.{key}={value}" for key, value in overrides.items()]
  env = dict(os.environ, PYTHONPATH=ROOT)
  out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  assert out.returncode != 0, out.stdout
  assert "Traceback" not in out.stderr, out.stderr
  last = [line for line in out.stderr.splitlines() if line.strip()][-1]
  for needle in needles:
    assert needle in last, out.stderr
  assert not workdir.exists()  # no config.json, nothing written
  assert "params)" not in out.stdout  # the run's summary (printed after build) never came


def test_curriculum_config_builds_the_stream_and_bad_values_fail_in_one_line():
  from mtrl_jax import data

  c = calc_config.get_config("smoke=True")
  exp = experiment.validate(c)
  assert not exp.curriculum.enabled  # off by default: the plain stream
  assert isinstance(
      components.make_train_stream(exp, builders.make_task_source(exp.tasks, "train")),
      data.TaskStream,
  )
  c.curriculum.enabled = True
  exp = experiment.validate(c)
  stream = components.make_train_stream(exp, None)
  assert isinstance(stream, data.CurriculumStream) and stream.level == 0
  assert {t["level"] for t in stream.next(4)} == {0}
  c.curriculum.window = 0
  with pytest.raises(experiment.ConfigError, match=r"^config curriculum.window=0; allowed"):
    experiment.validate(c)
  c.curriculum.window = 10
  c.tasks.kwargs = {"level": 1}
  with pytest.raises(experiment.ConfigError, match="curriculum.level_key='level' is also set"):
    experiment.validate(c)
  c = coop_config.get_config("smoke=True")  # the coop task has no levels
  c.curriculum.enabled = True
  with pytest.raises(experiment.ConfigError) as err:
    experiment.validate(c)
  assert "curriculum.num_levels=5" in str(err.value) and "\n" not in str(err.value)
