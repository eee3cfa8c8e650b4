"""The recipe API for notebooks and scripts: `ENVGRPO(...).run(workdir)`.

    from mtrl_jax import ENVGRPO
    from configs import calculator
    ENVGRPO(calculator.get_config()).run("runs/calc")            # a config file's config
    ENVGRPO(factory="my_pkg.env:MyFactory", tasks="my_pkg.env:tasks",
            model="small", tree=dict(num_turns=3, num_generations=8),
            loss=dict(kl_coef=0.01), rl=dict(steps=50)).run("runs/mine")

A recipe is a config (`defaults.base_config()` unless one is given) plus
keyword fields, validated in one line before anything is built
(`experiment.start`, as `experiments/train.py` does), and `run` trains that
experiment through the loop the command line uses (`run.rl.train`), so the
two give the same metrics. The recipe's config is frozen once validated.
`ENVGSPO` is the same recipe with algorithm 'gspo' and GSPO's clip range.

`factory` and `tasks` take a registry name or an import path, as the command
line does, or the Python object itself (an `EnvironmentFactory` class or
instance, an `Environment` class or a callable `metadata -> Environment`; a
task-source callable `(split, **kwargs) -> tasks`). An object that an import
path reaches is stored as that path, so config.json names it for
`experiments/eval.py` and `experiments/export.py`; any other object (defined
in `__main__`, a notebook, a function's body, an instance) is registered in
this process under a generated name, which other processes cannot resolve.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Optional

import ml_collections

from mtrl_jax.data import TASK_SOURCES
from mtrl_jax.envs.registry import ENV_FACTORIES
from mtrl_jax.run import experiment, rl
from mtrl_jax.run.defaults import base_config

# Keyword shortcuts -> config fields; any config group name also works as a dict.
_SHORTCUTS = {"factory": "env.factory", "tasks": "tasks.source", "seed": "seed"}
# Fields that take user code: the registry that stores an object given for them.
_CODE_FIELDS = {
    "env.factory": (
        ENV_FACTORIES,
        lambda obj: callable(obj) or hasattr(obj, "create_environment"),
        "an EnvironmentFactory class or instance, an Environment class, a callable "
        "metadata -> Environment",
    ),
    "tasks.source": (TASK_SOURCES, callable, "a callable (split, **tasks.kwargs) -> tasks"),
}


def check_workdir(workdir: str, field: str = "workdir") -> None:
  """Refuses, before anything is written, a run directory that is a file or read-only.

  `workdir` may be missing (the run creates it); then its nearest existing
  parent must be a writable directory.

  Raises:
    experiment.ConfigError naming `field` (e.g. '--workdir').
  """
  if not isinstance(workdir, (str, os.PathLike)) or not str(workdir):
    raise experiment.ConfigError(
        f"{field}={workdir!r}; allowed: a directory path (created if missing)"
    )
  target = os.path.abspath(workdir)
  if os.path.exists(target) and not os.path.isdir(target):
    raise experiment.ConfigError(
        f"{field}={str(workdir)!r} is a file; allowed: a directory (created if missing)"
    )
  existing = target
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    raise experiment.ConfigError(
        f"{field}={str(workdir)!r}: {existing!r} is a file; allowed: a path under a directory"
    )
  if not os.access(existing, os.W_OK | os.X_OK):
    raise experiment.ConfigError(
        f"{field}={str(workdir)!r}: {existing!r} is read-only; allowed: a writable directory"
    )


class ENVGRPO:
  """GRPO over environment tree rollouts (see the module docstring).

  Args:
    config: a run's ConfigDict (e.g. `configs.calculator.get_config()`);
      default: the base config.
    factory: environment factory: a registry name, 'pkg.module:Factory', or the
      factory itself (see the module docstring).
    tasks: task source: a registry name, 'pkg.module:fn', or the callable itself.
    model: a preset name, or a dict of `model` fields (`path=` a local checkpoint).
    **groups: config groups as dicts of fields (tree=, loss=, sampling=, rl=,
      sft=, eval=, optim=, reward=, ...), or scalar top-level fields (seed=).
  """

  algorithm = "grpo"
  loss_defaults: dict = {}

  def __init__(
      self, config: Optional[ml_collections.ConfigDict] = None, *, model: Any = None, **fields
  ):
    c = copy.deepcopy(config) if config is not None else base_config()
    c.loss.algorithm = self.algorithm
    for k, v in self.loss_defaults.items():
      c.loss[k] = v
    if model is not None:
      fields["model"] = {"preset": model} if isinstance(model, str) else dict(model)
    for key, value in fields.items():
      if key in _SHORTCUTS:
        self._set(c, _SHORTCUTS[key], value)
      elif isinstance(value, dict):
        for sub, v in value.items():
          self._set(c, f"{key}.{sub}", v)
      else:
        self._set(c, key, value)
    self.exp = experiment.start(c)
    self.config = ml_collections.FrozenConfigDict(c)  # what `exp` was validated from

  @staticmethod
  def _set(c, dotted: str, value):
    node = c
    *parents, leaf = dotted.split(".")
    for p in parents:
      if p not in node:
        raise experiment.ConfigError(f"recipe field {dotted!r}: no config group {p!r}")
      node = node[p]
    if leaf not in node:
      raise experiment.ConfigError(
          f"recipe field {dotted!r}: unknown; allowed: {sorted(node.keys())}"
      )
    if dotted in _CODE_FIELDS and not isinstance(value, str):
      registry, accepts, allowed = _CODE_FIELDS[dotted]
      if not accepts(value):
        raise experiment.ConfigError(
            f"recipe field {dotted!r}={value!r}; allowed: a registered "
            f"name, 'pkg.module:name', or {allowed}"
        )
      value = registry.spec(value)
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:  # ml_collections refuses a value of another type
      raise experiment.ConfigError(
          f"recipe field {dotted!r}={value!r}: {' '.join(str(e).split())}; allowed: a "
          f"{type(node[leaf]).__name__}"
      ) from None

  def run(self, workdir: str, *, progress: bool = False) -> dict:
    """Trains (or resumes) in `workdir`; returns the run's summary dict.

    Raises:
      experiment.ConfigError (one line) for a workdir that is a file or read-only.
    """
    check_workdir(workdir)
    return rl.train(self.exp, self.config, workdir, progress=progress)


class ENVGSPO(ENVGRPO):
  """GSPO (sequence-level ratio) over environment tree rollouts; GSPO's small clip range."""

  algorithm = "gspo"
  loss_defaults = {
      "clip_eps_low": 3e-4,
      "clip_eps_high": 4e-4,
      "aggregation": "seq-mean-token-mean",
  }
