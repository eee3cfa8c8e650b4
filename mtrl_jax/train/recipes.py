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
experiment through the loop the command line uses (`train.rl.train`), so the
two give the same metrics. The recipe's config is frozen once validated.
`ENVGSPO` is the same recipe with algorithm 'gspo' and GSPO's clip range.
"""

from __future__ import annotations

import copy
from typing import Any, Optional

import ml_collections

from mtrl_jax.train import experiment, rl
from mtrl_jax.train.defaults import base_config

# Keyword shortcuts -> config fields; any config group name also works as a dict.
_SHORTCUTS = {"factory": "env.factory", "tasks": "tasks.source", "seed": "seed"}


class ENVGRPO:
  """GRPO over environment tree rollouts (see the module docstring).

  Args:
    config: a run's ConfigDict (e.g. `configs.calculator.get_config()`);
      default: the base config.
    factory: environment factory (registry name or 'pkg.module:Factory').
    tasks: task source (registry name or 'pkg.module:fn').
    model: a preset name, or a dict of `model` fields (`path=` a local checkpoint).
    **groups: config groups as dicts of fields (tree=, loss=, sampling=, rl=,
      sft=, eval=, optim=, reward=, ...), or scalar top-level fields (seed=).
  """

  algorithm = "grpo"
  loss_defaults: dict = {}

  def __init__(self, config: Optional[ml_collections.ConfigDict] = None, *,
               model: Any = None, **fields):
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
          f"recipe field {dotted!r}: unknown; allowed: {sorted(node.keys())}")
    node[leaf] = value

  def run(self, workdir: str, *, progress: bool = False) -> dict:
    """Trains (or resumes) in `workdir`; returns the run's summary dict."""
    return rl.train(self.exp, self.config, workdir, progress=progress)


class ENVGSPO(ENVGRPO):
  """GSPO (sequence-level ratio) over environment tree rollouts; GSPO's small clip range."""

  algorithm = "gspo"
  loss_defaults = {"clip_eps_low": 3e-4, "clip_eps_high": 4e-4,
                   "aggregation": "seq-mean-token-mean"}
