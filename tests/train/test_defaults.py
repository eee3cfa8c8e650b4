"""Defaults written once: the base config holds the values the documentation states, the
run's choices (`defaults.RUN_CHOICES`) depart from their dataclasses' library defaults,
and the `Experiment` mirrors the config group for group."""

import dataclasses

import pytest

from mtrl_jax.rollout import TreeConfig
from mtrl_jax.run import defaults, experiment

# (group, field) -> the default the documentation states, and where it states it.
DOCUMENTED = {
    # docs/running.md, "LoRA policies"; docs/internals.md, LoRA
    ("model", "lora.rank"): 0,
    ("model", "lora.targets"): ("q", "k", "v", "o", "gate", "up", "down"),
    # docs/running.md, "Separate policies per agent" (empty: the top-level value for every agent)
    ("agents", "learning_rates"): (),
    ("agents", "paths"): (),
    ("agents", "presets"): (),
    ("agents", "trainable"): (),
    # docs/running.md, "Per-agent credit"
    ("agents", "team_weight"): 1.0,
    ("tree", "joint_mode"): "align",
    # docs/running.md, "Value critics"
    ("critic", "kind"): "none",
    ("critic", "target"): "v",
    ("critic", "estimator"): "td0",
    ("critic", "gae_lambda"): 0.95,
    ("critic", "normalize"): True,
    ("critic", "value_coef"): 0.5,
    ("critic", "value_clip"): 0.2,
    # docs/running.md, "A run that learns nothing says so"
    ("rl", "halt_if_idle_steps"): 10,
    ("rl", "max_masked_fraction"): 0.5,
    ("rl", "masked_window"): 5,
    # docs/internals.md: tree shape, packing, success threshold
    ("tree", "shape"): "tree",
    ("rl", "packing"): "tree",
    ("eval", "success_threshold"): None,
    # docs/performance.md: precompilation, the guarded environment step
    ("rl", "precompile"): True,
    ("env", "react_timeout_s"): 30.0,
    # docs/multihost.md, the `distributed` group
    ("distributed", "mode"): "off",
    ("distributed", "heartbeat_timeout_s"): 100,
    ("distributed", "initialization_timeout_s"): 300,
    ("distributed", "gather_timeout_s"): 600,
}

# The run's choices, as `defaults.RUN_CHOICES` states them with their reasons, and the
# library defaults they replace (docs/internals.md: `branch_on='every_turn'` is
# TreeConfig's; the others are their dataclasses' documented fields).
CHOSEN = {
    ("tree", "num_turns"): 2,
    ("tree", "num_generations"): 4,
    ("tree", "branch_on"): "user_turn",
    ("sampling", "max_new_tokens"): 48,
    ("reward", "step_penalty"): -0.05,
    ("reward", "tool_penalty"): -0.2,
    ("loss", "clip_eps_high"): 0.28,
    ("loss", "max_len"): 0,
    ("optim", "learning_rate"): 1e-4,
}


def _library(group):
  """The group's dataclass with its own defaults (TreeConfig has none for T and G)."""
  cls = defaults.GROUPS[group][0]
  return cls(num_turns=2, num_generations=4) if cls is TreeConfig else cls()


def _get(obj, dotted):
  for name in dotted.split("."):
    obj = obj[name] if isinstance(obj, dict) or hasattr(obj, "to_dict") else getattr(obj, name)
  return obj


def test_the_base_config_holds_the_documented_defaults_as_the_library_does():
  base = defaults.base_config()
  wrong = []
  for (group, name), want in DOCUMENTED.items():
    got, lib = _get(base[group], name), _get(_library(group), name)
    # The library's own default is that value too: the config does not restate it.
    if not (got == want == lib and type(got) is type(want) is type(lib)):
      wrong.append((group, name, got, lib, want))
  assert not wrong


def test_the_runs_choices_are_the_documented_values_and_not_the_librarys():
  chosen = {(g, n): v for g, values in defaults.RUN_CHOICES.items() for n, v in values.items()}
  assert chosen == CHOSEN
  base = defaults.base_config()
  for (group, name), want in CHOSEN.items():
    got = base[group][name]
    assert got == want and type(got) is type(want), (group, name, got)
    if (group, name) not in (("tree", "num_turns"), ("tree", "num_generations")):  # no default
      assert getattr(_library(group), name) != want, (group, name)
  assert _library("tree").branch_on == "every_turn"  # docs/internals.md, branch_on


def test_run_choices_name_real_fields_and_groups_cover_the_config():
  base = defaults.base_config()
  for group, (cls, internal) in defaults.GROUPS.items():
    fields = {f.name for f in dataclasses.fields(cls) if f.init} - set(internal)
    assert set(base[group]) == fields, group  # every field of the dataclass, no other
    assert set(defaults.RUN_CHOICES.get(group, {})) <= fields, group
  assert set(base) == {"seed", *defaults.GROUPS}


def test_experiment_mirrors_the_config_group_for_group():
  c = defaults.base_config()
  exp = experiment.validate(c)
  assert {f.name for f in dataclasses.fields(exp)} == set(c)
  for group, (cls, _) in defaults.GROUPS.items():
    assert isinstance(getattr(exp, group), cls), group
  # Validation resolves, never renames: every config field reads back under its own name
  # (the loss's max_len 0, the optimizer's total_steps and an unset success threshold are
  # resolved values).
  resolved = {("loss", "max_len"), ("eval", "success_threshold")}
  for group, values in c.items():
    if group == "seed":
      continue
    for name, value in values.items():
      got = getattr(getattr(exp, group), name)
      if (group, name) in resolved:
        continue
      if name in ("kwargs", "conversation_kwargs"):
        got, value = dict(got), value.to_dict()
      if dataclasses.is_dataclass(got):  # a sub-group (model.lora) resolved to its dataclass
        got, value = dataclasses.asdict(got), value.to_dict()
      assert got == value, (group, name, got, value)
  assert exp.loss.max_len == exp.rl.max_length
  assert c.eval.success_threshold is None and exp.eval.success_threshold == pytest.approx(0.998)


def test_a_none_default_is_a_typed_placeholder():
  c = defaults.base_config()
  assert c.tree.termination_threshold is None
  c.tree.termination_threshold = 0.5  # settable from the command line: typed float
  with pytest.raises(TypeError):
    c.tree.termination_threshold = "high"
