"""The references generated from the code: docs/config.md and docs/metrics.md are what
`experiments.reference` gives, every config field has its docstring entry, and every
key a run logs has a glossary entry (`mtrl_jax.run.glossary`)."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np

from experiments import reference
from mtrl_jax import data, losses
from mtrl_jax.envs.faults import FaultKind
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.batching import BatchConfig, make_agent_batches
from mtrl_jax.rollout.stats import rollout_metrics
from mtrl_jax.run import glossary
from mtrl_jax.run.config import EvalConfig
from mtrl_jax.testing import FakePolicy, ScriptedTransition
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.policies import agent_labels
from tests.train.conftest import smoke_run  # noqa: F401  (the shared calculator smoke run)

REGENERATE = f"run `{reference.COMMAND}` and commit docs/config.md and docs/metrics.md"
# Config fields whose dataclass docstring has no `Attributes:` entry for them: the
# reference says so in their row. The set may only shrink (the test below fails both
# ways).
NO_ENTRY_YET = set()


def test_the_reference_files_are_what_the_code_gives():
  stale = reference.stale()
  assert not stale, f"out of date (not what the code gives): {', '.join(stale)}; {REGENERATE}"


def test_every_config_field_has_an_entry_in_its_dataclass_docstring():
  missing = set(reference.undocumented())
  assert not missing - NO_ENTRY_YET, (
      f"config fields without an entry in their dataclass's `Attributes:` docstring section: "
      f"{sorted(missing - NO_ENTRY_YET)}; add one line of what each does, then {REGENERATE}"
  )
  assert (
      not NO_ENTRY_YET - missing
  ), f"{sorted(NO_ENTRY_YET - missing)} now have their entry: take them out of NO_ENTRY_YET"


def test_attribute_entries_are_read_whole_and_shared_entries_name_each_field():

  @dataclasses.dataclass
  class Group:
    """A group.

    Attributes:
      first: one line
        and its continuation.
      b1, b2: both moments.
      typed (int): a typed entry.

    Returns:
      not_an_attribute: outside the section.
    """

  assert reference.attribute_docs(Group) == {
      "first": "one line and its continuation.",
      "b1": "both moments.",
      "b2": "both moments.",
      "typed": "a typed entry.",
  }


def test_allowed_values_are_the_validation_messages():
  rows = {r["name"]: r for r in reference.config_rows()}
  assert rows["rl.packing"]["allowed"] == "['tree', 'rows']"
  assert rows["rl.steps"]["allowed"] == "an integer >= 0"
  assert (rows["tree.num_turns"]["default"], rows["tree.num_turns"]["library"]) == ("2", "required")
  assert rows["sampling.max_new_tokens"]["library"] == "`64`"
  assert rows["rl.steps"]["library"] == ""  # the run keeps the dataclass's default
  assert rows["model.lora.rank"]["type"] == "int" and rows["model.lora"]["type"] == "group"
  assert rows["eval.success_threshold"]["type"] == "float or None"


def test_key_patterns_match_their_placeholders_only():
  assert glossary.entry_of("agent_1/reward/team") == "agent_<a>/reward/team"
  assert glossary.entry_of("eval/sampled/cut_fraction") == "eval/<mode>/cut_fraction"
  assert glossary.entry_of("turn_3/mean_return") == "turn_<t>/mean_return"
  assert glossary.entry_of("compiles/engine") == "compiles/engine"
  assert glossary.entry_of("compiles/critic_step") == "compiles/<name>"
  for key in ("eval/other/success", "agent_x/reward/team", "train/lossy", "train/loss/x"):
    assert glossary.entry_of(key) is None, key
  assert len(glossary.METRICS) == sum(len(rows) for _, _, rows in glossary.SECTIONS)


def test_every_key_of_the_smoke_run_has_a_glossary_entry(smoke_run):  # noqa: F811
  keys = {k for row in smoke_run.rows() for k in row}
  assert "train/loss" in keys and "eval/greedy/success" in keys
  unknown = glossary.unknown_keys(keys)
  assert not unknown, (
      f"logged keys without a glossary entry: {unknown}; add them to "
      f"mtrl_jax/run/glossary.py SECTIONS, then {REGENERATE}"
  )


def _policy_and_value_keys() -> set:
  """train/* of a loss with KL, entropy and an off-policy correction, and a critic's (traced
  by `jax.eval_shape`: the keys without compiling)."""
  b, n = 2, 3
  cfg = losses.LossConfig(kl_coef=0.1, is_correction="tis")
  obj = PolicyObjective(cfg, value_coef=0.5)

  def metrics(logp):
    _, _, sums = losses.policy_loss_terms(
        logp,
        logp,
        logp - 0.1,
        jnp.ones((b,)),
        jnp.ones((b, n), bool),
        cfg,
        entropy=jnp.ones((b, n)),
        sampler_logp=logp - 0.2,
    )
    batch = types.SimpleNamespace(
        value_mask_BxK=jnp.ones((b, n), bool),
        row_weight_B=jnp.ones(b),
        value_target_BxK=jnp.ones((b, n)),
        old_value_BxK=jnp.zeros((b, n)),
    )
    _, value_sums = obj.value_terms(logp, batch)
    return obj.finalize({**sums, **value_sums})

  return {f"train/{k}" for k in jax.eval_shape(metrics, jnp.zeros((b, n)))}


def test_keys_of_agents_critics_corrections_faults_and_evaluations_have_entries(smoke_run):  # noqa: F811,E501
  """Keys the smoke run does not log, from the functions that make them."""
  cfg = TreeConfig(num_turns=2, num_generations=2, num_agents=2, joint_mode="cross")
  tr = ScriptedTransition()
  tree = expand_tree(
      cfg, FakePolicy(vocab=32, max_new_tokens=3, low=4), tr, tr.roots(2, 2), jax.random.key(0)
  )
  keys = {**tree.metrics(), **rollout_metrics(tree, 0.5)}.keys() | set(
      make_agent_batches(tree, BatchConfig(length_buckets=(64,), zero_variance_filter=False))[1]
  )
  assert {"agent_1/influence", "credit/varied_nodes", "agent_1/batch/actions"} <= keys
  train = _policy_and_value_keys()
  assert {"train/kl", "train/sampler_gap", "train/value_explained_var"} <= train
  keys |= train | {f"{label}/{k}" for label in agent_labels(2) for k in train}
  keys |= {f"faults/{kind.value}" for kind in FaultKind}
  evaluated = {k.split("/")[-1] for row in smoke_run.rows() for k in row if k.startswith("eval/")}
  keys |= {f"eval/{mode}/{k}" for mode, _ in EvalConfig(sampled=True).modes for k in evaluated}
  stream = data.CurriculumStream(lambda level: [{"level": level}], data.CurriculumConfig(), 0)
  keys |= set(stream.observe(0.5))
  unknown = glossary.unknown_keys(keys)
  assert not unknown, (
      f"keys without a glossary entry: {unknown}; add them to "
      f"mtrl_jax/run/glossary.py SECTIONS, then {REGENERATE}"
  )
  np.testing.assert_equal(
      sorted(k.value for k in FaultKind),
      sorted(p.split("/")[1] for p in glossary.METRICS if p.startswith("faults/")),
  )
