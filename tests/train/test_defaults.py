"""Defaults written once: the base config's values are its dataclasses' defaults, except
the run's choices (`defaults.RUN_CHOICES`), and the `Experiment` mirrors it group for group."""

import dataclasses

import pytest

from mtrl_jax.train import defaults, experiment


def _dataclass_default(field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return dataclasses.MISSING


@pytest.mark.parametrize("group", list(defaults.GROUPS))
def test_every_base_config_field_takes_its_dataclass_default(group):
  cls, internal = defaults.GROUPS[group]
  fields = {f.name: f for f in dataclasses.fields(cls)}
  choices = defaults.RUN_CHOICES.get(group, {})
  base = defaults.base_config()[group]
  assert set(base) == {n for n, f in fields.items() if f.init and n not in internal}
  for name, value in base.items():
    default = _dataclass_default(fields[name])
    if name in choices:
      # A choice restating the dataclass's default would be a second copy of it.
      assert value == choices[name] and value != default, (group, name)
    else:
      if isinstance(default, dict):  # a ConfigDict holds a dict as a ConfigDict
        value = value.to_dict()
      assert value == default and type(value) is type(default), (group, name, value, default)


def test_run_choices_name_real_fields_and_groups_cover_the_config():
  for group, choices in defaults.RUN_CHOICES.items():
    cls, internal = defaults.GROUPS[group]
    names = {f.name for f in dataclasses.fields(cls)}
    assert set(choices) <= names - set(internal), group
  assert set(defaults.base_config()) == {"seed", *defaults.GROUPS}


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
