"""Helpers shared by config files: structure arguments after ':' in --config."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k1=v1,k2=v2' into a ConfigDict, typed like `defaults`.

  `configs/calculator.py:model=tiny,smoke=True` picks structure; scalars are set
  with `--config.x=y` flags afterwards.

  Args:
    arg: the text after ':' in the --config flag (may be None or empty).
    **defaults: every allowed key with its default value (its type is the type
      the value is parsed to).
  Returns:
    A ConfigDict holding the defaults updated by `arg`.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    if "=" not in item:
      raise ValueError(
          f"config argument {item!r}: expected key=value; allowed keys: {sorted(defaults)}"
      )
    key, value = item.split("=", 1)
    if key not in defaults:
      raise ValueError(f"config argument key {key!r}; allowed keys: {sorted(defaults)}")
    default = defaults[key]
    if isinstance(default, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {key}={value!r}: expected true or false")
      out[key] = value.lower() in ("true", "1")
    elif isinstance(default, int):
      out[key] = int(value)
    elif isinstance(default, float):
      out[key] = float(value)
    else:
      out[key] = value
  return out


def apply_smoke(
    c: ml_collections.ConfigDict,
    *,
    rl_steps: int = 2,
    sft_steps: int = 3,
    roots_per_step: int = 2,
    eval_tasks: int = 4,
) -> ml_collections.ConfigDict:
  """The `smoke=True` overlay: the whole pipeline in seconds on a tiny model (tests, CI).

  Compiles lazily, uses the `tiny` preset (its own depth), G = 2, evaluates every 2 steps,
  checkpoints and dumps every step. The keyword arguments are what differs by
  task; the task config sets anything else it needs afterwards.

  Args:
    c: the task's full config (changed in place).
    rl_steps: RL steps.
    sft_steps: SFT warm-up steps, on batches of 8 rows from 16 examples (0:
      leave the SFT fields alone).
    roots_per_step: tasks per RL step.
    eval_tasks: held-out tasks per evaluation.
  Returns:
    `c`.
  """
  c.rl.precompile = False  # compiles lazily: a few steps need a few shapes
  c.model.preset = "tiny"
  c.model.num_layers = 0  # the tiny preset's own depth
  c.tree.num_generations = 2
  c.rl.steps = rl_steps
  c.rl.roots_per_step = roots_per_step
  c.rl.dump_every = 1
  c.eval.every = 2
  c.eval.num_tasks = eval_tasks
  c.checkpoint.every = 1
  if sft_steps:
    c.sft.steps = sft_steps
    c.sft.batch_size = 8
    c.sft.num_examples = 16
  return c


def critic_trainer_arms(generations, **overrides) -> list[dict]:
  """CoMLRL's critic trainers as sweep arms (`get_sweep`'s 'trainer' axes), beside MAGRPO.

  IAC: a value head per agent on its own history; MAAC: one centralized critic
  model over the joint history. Each trains with a REINFORCE loss and
  batch-normalised TD(0) advantages, once per G in `generations`; `overrides`
  (flag -> value) are added to every arm.
  """
  return [
      {
          "critic.kind": kind,
          "critic.model": model,
          "critic.estimator": "td0",
          "loss.algorithm": "reinforce",
          "tree.num_generations": g,
          **overrides,
      }
      for kind, model in (("independent", "head"), ("centralized", "separate"))
      for g in generations
  ]
