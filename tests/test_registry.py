"""mtrl_jax.registry: the one Registry class and its re-registration rule."""

import subprocess
import sys

import pytest

from mtrl_jax import data, registry
from mtrl_jax.envs.registry import ENV_FACTORIES
from mtrl_jax.graders.base import GRADERS


def test_registry_names_import_paths_and_errors():
  reg = registry.Registry("widget", hint="widgets register on import")

  @reg.register("one")
  def one():
    return 1

  assert reg.get("one") is one and reg.resolve("one") is one and "one" in reg
  assert reg.resolve("mtrl_jax.registry:Registry") is registry.Registry
  assert reg.names() == ["one"]
  with pytest.raises(
      ValueError,
      match=r"unknown widget 'two'; registered: \['one'\]; or use "
      r"an import path 'package.module:Name'; widgets "
      r"register on import",
  ):
    reg.get("two")
  with pytest.raises(ValueError, match="widget 'nope:x': cannot import 'nope'"):
    reg.resolve("nope:x")
  with pytest.raises(ValueError, match="without ':'"):
    reg.register("a:b")


def test_one_reregistration_rule():
  """Same object or a re-import of the same definition: replaced; anything else: error."""
  reg = registry.Registry("widget")

  def make():
    def f():
      return "first"

    return f

  first, reimported = make(), make()  # same module and qualified name, new objects
  reg.register("f")(first)
  reg.register("f")(first)
  reg.register("f")(reimported)
  assert reg.get("f") is reimported
  with pytest.raises(ValueError, match="widget 'f' is already registered"):
    reg.register("f")(len)


def test_the_three_registries_resolve_names_and_import_paths_to_what_runs():
  import mtrl_jax.tasks  # noqa: F401  (the built-in tasks register when imported)
  from mtrl_jax.envs import resolve_factory
  from mtrl_jax.graders.base import FunctionGrader, resolve_grader
  from mtrl_jax.tasks.calculator import CalculatorEnv, CalculatorFactory, calculator_tasks

  assert all(isinstance(r, registry.Registry) for r in (data.TASK_SOURCES, ENV_FACTORIES, GRADERS))
  # Task sources: the name and the import path reach the registered function.
  assert data.TASK_SOURCES.get("calculator") is calculator_tasks
  assert data.TASK_SOURCES.resolve("mtrl_jax.tasks.calculator:calculator_tasks") is calculator_tasks
  tasks = data.resolve_task_source("calculator", "eval", size=3)
  assert len(tasks) == 3 and tasks[2] == calculator_tasks("eval", size=3)[2]
  # Environment factories: the registered class, built with the config's keyword arguments.
  assert ENV_FACTORIES.get("calculator") is CalculatorFactory
  factory = resolve_factory("calculator", max_tool_calls=1)
  assert type(factory) is CalculatorFactory and factory.max_tool_calls == 1
  assert type(factory.create_environment(tasks[0])) is CalculatorEnv
  # Graders: 'function' builds a FunctionGrader that grades with the given function.
  assert GRADERS.get("function") is FunctionGrader
  grader = resolve_grader("function", fn=lambda thread: 0.25, name="quarter")
  assert type(grader) is FunctionGrader and grader.name == "quarter"
  assert grader.grade(None).score == 0.25
  # Each registry names what it holds in its unknown-name error.
  for reg, what in (
      (data.TASK_SOURCES, "task source"),
      (ENV_FACTORIES, "environment factory"),
      (GRADERS, "grader"),
  ):
    with pytest.raises(ValueError, match=rf"^unknown {what} 'nope'; registered: \[.*'"):
      reg.get("nope")


def test_importing_the_env_api_imports_no_task():
  code = (
      "import sys, mtrl_jax.envs, mtrl_jax.graders, mtrl_jax.data\n"
      "assert not [m for m in sys.modules if m.startswith('mtrl_jax.tasks')], "
      "sorted(m for m in sys.modules if m.startswith('mtrl_jax.tasks'))\n"
      "import mtrl_jax.tasks\n"
      "from mtrl_jax.envs import registered_env_factories\n"
      "from mtrl_jax.data import registered_task_sources\n"
      "print(registered_env_factories(), registered_task_sources())\n"
  )
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
  names = (
      "['calculator', 'charclass', 'coop', 'guess', 'humaneval', 'refine', 'user_chat', "
      "'weather']"
  )
  assert out.stdout.strip() == f"{names} {names}"
