"""Faults the rollout records itself: a factory that raises, a task that is not a mapping,
an environment that cannot fork. Each masks what it touches (never reward), is shown once
in one line, counted (`faults/contract`, the run's totals), and the rest of the rollout goes on."""

import threading

import jax
import numpy as np

from mtrl_jax.data import ListSource, TaskStream
from mtrl_jax.envs import Environment, EnvironmentFactory, FaultKind, Grade, Turn
from mtrl_jax.envs.fault_report import FAULT_CONSOLE
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.dump import node_records
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.stats import add_fault_totals, rollout_metrics
from mtrl_jax.testing import FakePolicy, byte_renderer, byte_tokenizer
from mtrl_jax.text import compact

FMT = compact(byte_tokenizer())
CFG = TreeConfig(num_turns=2, num_generations=2)


class _Echo(Environment):

  def react_to(self, thread):
    return thread.append(Turn("user", "again")), Grade(1.0)


class _Factory(EnvironmentFactory):
  """Raises for tasks marked 'broken' (a bug in the factory)."""

  def create_environment(self, metadata):
    if metadata.get("broken"):
      return self.build(metadata["missing_key"])
    return _Echo(metadata)

  def build(self, x):
    raise AssertionError("unreachable")


def _policy():
  return FakePolicy(vocab=128, low=32, max_new_tokens=4, stop_id=FMT.stop_ids[0])


def _expand(transition, roots, seed=0):
  return expand_tree(CFG, _policy(), transition, roots, jax.random.key(seed))


def _root_actions(tree, root):
  node = next(n for n in tree.nodes if n.parent_id < 0 and n.root == root)
  return node, node.actions


def test_a_factory_that_raises_masks_its_root_and_the_run_goes_on(capsys):
  FAULT_CONSOLE.reset()
  transition = EnvTransition(byte_renderer())
  tasks = [{"prompt": "a"}, {"prompt": "b", "broken": True}, {"prompt": "c"}]
  roots = transition.root_states(_Factory(), tasks)  # never raises
  tree = _expand(transition, roots)
  node, actions = _root_actions(tree, 1)
  assert not node.valid_B.any() and (node.weight_NxG == 0).all() and (node.children_B < 0).all()
  for action in actions:
    (fault,) = action.faults
    assert fault.kind == FaultKind.CONTRACT and fault.message == "KeyError: 'missing_key'"
    assert fault.where.startswith("_Factory.create_environment (test_root_faults.py:")
  for r in (0, 2):  # the other roots are untouched
    other, _ = _root_actions(tree, r)
    assert other.valid_B.all() and (other.children_B >= 0).all()
  err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("fault ")]
  assert err == [
      f"fault contract from environment in {fault.where}: KeyError: 'missing_key'"
      "  (shown once; counted in faults/contract)"
  ]
  assert rollout_metrics(tree, 0.5)["faults/contract"] == CFG.num_generations
  node_records(tree)  # the dump serialises the failed root like any other
  FAULT_CONSOLE.reset()


def test_a_non_mapping_task_deep_in_the_task_source_masks_its_root():
  source = ListSource([{"prompt": "a"}, ["not", "a", "dict"], {"prompt": "c"}])
  tasks = TaskStream(source, seed=0, shuffle=False).next(3)  # passes it through
  assert tasks[1] == ["not", "a", "dict"] and tasks[0]["task_index"] == 0
  transition = EnvTransition(byte_renderer())
  tree = _expand(transition, transition.root_states(_Factory(), tasks))
  node, actions = _root_actions(tree, 1)
  assert not node.valid_B.any()
  fault = actions[0].faults[0]
  assert (fault.kind, fault.source) == (FaultKind.CONTRACT, "task_source")
  assert (
      fault.message == "task 1 of the step is list, not a mapping of metadata: ['not', 'a', "
      "'dict']"
  )
  assert _root_actions(tree, 0)[0].valid_B.all() and _root_actions(tree, 2)[0].valid_B.all()


class _Locked(Environment):
  """Holds a lock as plain state: the default fork (a deep copy) fails."""

  def __init__(self, metadata):
    super().__init__(metadata)
    self.lock = threading.Lock()

  def react_to(self, thread):
    return None, 1.0


def test_an_environment_that_cannot_fork_is_a_contract_fault_naming_fork_and_shared_resource():
  transition = EnvTransition(byte_renderer())
  roots = [
      transition.root_state(_Locked({"prompt": "a"})),
      transition.root_state(_Echo({"prompt": "b"})),
  ]
  tree = _expand(transition, roots)
  locked, actions = _root_actions(tree, 0)
  assert not locked.valid_B.any()
  fault = actions[0].faults[0]
  assert fault.kind == FaultKind.CONTRACT and fault.where.startswith("_Locked.fork")
  assert fault.message.startswith(
      "_Locked.fork failed (TypeError: cannot pickle '_thread.lock' object)"
  )
  assert (
      "mtrl_jax.envs.SharedResource" in fault.message
      and "override _Locked.fork()" in fault.message
      and "\n" not in fault.message
  )
  assert _root_actions(tree, 1)[0].valid_B.all()


def test_fault_totals_add_up_over_steps_with_every_kind():
  transition = EnvTransition(byte_renderer())
  roots = transition.root_states(_Factory(), [{"prompt": "a", "broken": True}, {"prompt": "b"}])
  tree = _expand(transition, roots)
  once = add_fault_totals(None, tree)
  assert set(once) == {k.value for k in FaultKind} | {"total"}
  assert once["contract"] == CFG.num_generations and once["infrastructure"] == 0
  assert once["total"] == sum(v for k, v in once.items() if k != "total")
  twice = add_fault_totals(once, tree)
  assert twice == {k: 2 * v for k, v in once.items()}
  np.testing.assert_equal(rollout_metrics(tree, 0.5)["faults/contract"], once["contract"])
