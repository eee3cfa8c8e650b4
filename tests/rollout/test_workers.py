"""Environment steps in worker processes (`env.workers='processes'`): the same trees as on
threads, unpicklable environments refused, a dead worker masked and replaced."""

import os
import pickle
import random
import re
import time

import jax
import numpy as np
import pytest

from mtrl_jax.envs import RewardConfig, StepLimits, resolve_factory
from mtrl_jax.envs.fault_report import FAULT_CONSOLE
from mtrl_jax.envs.faults import FaultKind
from mtrl_jax.rollout import TreeConfig, expand_tree, node_records
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.stats import fault_counts
from mtrl_jax.rollout.workers import StepWorkers, check_workers
from mtrl_jax.run.inputs import EnvConfig
from mtrl_jax.sampling.batching import BatchingGenerator
from mtrl_jax.sampling.generation import LocalLLM
from mtrl_jax.tasks import calculator, coop
from mtrl_jax.testing import FakePolicy, byte_renderer

RENDERER = byte_renderer()
TOK = RENDERER.tokenizer
PER_TURN = RewardConfig(outcome_weight=1.0, shaping_weight=1.0)
CFG = TreeConfig(num_turns=2, num_generations=4, num_agents=2)


class CoinPolicy(FakePolicy):
  """Coop answers: by a coin drawn from the sample's key, the cooperative answer (own half
  at turn 1, the joint code at turn 2) or a wrong one; samples finish in jittered order."""

  def completion(self, req, g):
    ids, _, _ = super().completion(req, g)
    users = re.findall(r"<\|user\|>(.*?)<\|end\|>", TOK.decode(list(req.prompt)))
    own = users[0].split(":")[1]
    if int(ids[0]) % 2:
      answer = "0"
    elif len(users) == 1:
      answer = own
    else:
      partner = users[1].split(":")[1].split()[0]
      answer = own + partner if req.agent == 0 else partner + own
    out = TOK.encode(f"<answer>{answer}</answer>") + [RENDERER.fmt.stop_ids[0]]
    return np.asarray(out, np.int32), -0.1 * np.ones(len(out), np.float32), "stop"


class JitteryTransition(EnvTransition):
  """Every step first sleeps a random 0-10 ms (another order every run)."""

  def __init__(self, *a, seed=0, **k):
    super().__init__(*a, **k)
    self.rng = random.Random(seed)

  def step(self, state, actions, seed=None):
    time.sleep(self.rng.random() * 0.01)
    return super().step(state, actions, seed=seed)


class DyingCoopEnv(coop.CoopEnv):
  """Kills its worker process at its second joint action, once per `marker` file."""

  def __init__(self, metadata, marker):
    super().__init__(metadata)
    self.marker = marker

  def react_to_joint(self, threads):
    if threads[0].count("assistant") == 2:
      try:
        os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
      except FileExistsError:
        pass
      else:
        os._exit(3)
    return super().react_to_joint(threads)


class DyingFactory:
  outcome_range = (0.0, 1.0)

  def __init__(self, marker):
    self.marker = marker

  def create_environment(self, metadata):
    return DyingCoopEnv(metadata, self.marker)


def _tasks(n=4):
  return [coop.make_task("eval", i, digits=1) for i in range(n)]


def _expand(transition, workers, factory=None, jitter=0):
  roots = transition.root_states(factory or resolve_factory("coop"), _tasks())
  policy = CoinPolicy(vocab=64, max_latency=4, latency_seed=jitter)
  return expand_tree(CFG, policy, transition, roots, jax.random.key(7), executor=workers)


def _transition(jitter=0):
  return JitteryTransition(RENDERER, num_agents=2, reward_cfg=PER_TURN, seed=jitter)


def test_processes_expand_the_threads_tree_token_for_token():
  want = _expand(_transition(), None)
  records = node_records(want, TOK.decode)
  assert len(records) == 4 * (1 + 4)
  assert len({r for rec in records for r in rec["rewards"]}) > 1  # rewards vary
  transition = _transition(jitter=1)
  workers = StepWorkers("processes", 2, transition)
  try:
    before = transition.renderers[0].metrics()["text/completions_checked"]
    for jitter in (1, 2):  # one pool for several rollouts, steps in another order each
      policy = CoinPolicy(vocab=64, max_latency=4, latency_seed=jitter)
      roots = transition.root_states(resolve_factory("coop"), _tasks())
      got = expand_tree(CFG, policy, transition, roots, jax.random.key(7), executor=workers)
      assert node_records(got, TOK.decode) == records
      for a, b in zip(want.nodes, got.nodes):
        for ca, cb in zip(a.completions, b.completions):
          for x, y in zip(ca, cb):
            assert np.array_equal(x.ids, y.ids) and np.array_equal(x.logprobs, y.logprobs)
        assert np.array_equal(a.rewards_B, b.rewards_B)
        assert np.array_equal(a.advantages_NxG, b.advantages_NxG)
    # The workers' renderers checked the completions; the engine's renderer counts them.
    checked = transition.renderers[0].metrics()["text/completions_checked"] - before
    assert checked == 2 * 2 * sum(len(n.actions) for n in got.nodes)
  finally:
    workers.close()


CALC_RENDERER = byte_renderer(calculator.EXTRA_SPECIALS)
CALC_TOK = CALC_RENDERER.tokenizer


class CalcCoinPolicy(FakePolicy):
  """Calculator messages: by a coin drawn from the sample's key, the golden next message
  (a `calculate` tool call, or the answer) or a wrong answer."""

  def __init__(self, tasks, **latency):
    super().__init__(vocab=64, **latency)
    self.tasks = tasks

  def completion(self, req, g):
    ids, _, _ = super().completion(req, g)
    text = CALC_TOK.decode(list(req.prompt))
    (task,) = [t for t in self.tasks if f"<|user|>{t['question']}<|end|>" in text]
    golden = [c for r, c in calculator.golden_conversation(task) if r == "assistant"]
    stage = min(text.count("<|assistant|>") - 1, len(golden) - 1)
    msg = "<answer>0</answer>" if int(ids[0]) % 3 == 0 else golden[stage]
    out = CALC_TOK.encode(msg) + [CALC_RENDERER.fmt.stop_ids[0]]
    return np.asarray(out, np.int32), -0.1 * np.ones(len(out), np.float32), "stop"


def test_calculator_tools_run_in_worker_processes_as_on_threads():
  # A `@tool` function and the ToolSet's cache cross to the workers; tool calls are
  # sub-steps of one action (branch_on='user_turn').
  tasks = [calculator.make_task("eval", i) for i in range(3)]
  cfg = TreeConfig(num_turns=2, num_generations=2, branch_on="user_turn")
  reward = RewardConfig(outcome_weight=1.0, step_penalty=-0.05, tool_penalty=-0.2)
  trees = []
  for mode in ("threads", "processes"):
    transition = EnvTransition(CALC_RENDERER, reward_cfg=reward, limits=StepLimits(max_turns=8))
    workers = StepWorkers(mode, 2, transition)
    try:
      roots = transition.root_states(resolve_factory("calculator"), tasks)
      policy = CalcCoinPolicy(tasks, max_latency=3, latency_seed=len(trees))
      tree = expand_tree(cfg, policy, transition, roots, jax.random.key(3), executor=workers)
    finally:
      workers.close()
    trees.append(node_records(tree, CALC_TOK.decode))
  assert trees[0] == trees[1]
  calls = [s for rec in trees[0] for a in rec["actions"] for s in a.get("steps", [a])]
  assert any(sum(step.get("tool_calls", ())) for step in calls)  # the tool ran
  assert len({a["reward"] for rec in trees[0] for a in rec["actions"]}) > 1
  # A `@tool` Tool pickles by its module's name; a ToolSet's cache gets its own lock.
  assert pickle.loads(pickle.dumps(calculator.calculate)) is calculator.calculate
  env = resolve_factory("calculator").create_environment(tasks[0])
  assert pickle.loads(pickle.dumps(env)).tools.names == ["calculate"]


@pytest.mark.parametrize("cap", [1, 3])
def test_max_concurrency_caps_steps_in_flight_and_keeps_the_tree(cap):
  want = node_records(_expand(_transition(), None), TOK.decode)
  transition = _transition(jitter=3)
  live, peak = [0], [0]
  step = transition.step

  def counted(state, actions, seed=None):
    live[0] += 1
    peak[0] = max(peak[0], live[0])
    try:
      return step(state, actions, seed=seed)
    finally:
      live[0] -= 1

  transition.step = counted
  workers = StepWorkers("threads", cap)
  try:
    assert node_records(_expand(transition, workers, jitter=3), TOK.decode) == want
  finally:
    workers.close()
  assert 1 <= peak[0] <= cap


def test_a_dead_worker_masks_its_step_replaces_the_pool_and_the_rollout_goes_on(tmp_path):
  want = _expand(_transition(), None)
  transition = _transition()
  workers = StepWorkers("processes", 1, transition)  # one step in flight: the one that dies
  try:
    got = _expand(transition, workers, DyingFactory(str(tmp_path / "died")))
    assert workers.replaced == 1
    assert fault_counts(got) == {"faults/infrastructure": 1.0}
    masked = []
    for a, b in zip(want.nodes, got.nodes):
      assert a.full_id == b.full_id
      for ca, cb in zip(a.completions, b.completions):
        assert all(np.array_equal(x.ids, y.ids) for x, y in zip(ca, cb))
      for j, (ra, rb) in enumerate(zip(a.actions, b.actions)):
        if not rb.valid:
          masked.append((b.turn, j))
          (fault,) = rb.faults
          assert fault.kind == FaultKind.INFRASTRUCTURE and fault.source == "framework"
          assert "worker process died" in fault.message and "env.workers" in fault.message
        else:
          assert ra.reward == rb.reward
    assert len(masked) == 1 and masked[0][0] == 1  # the second joint action's step alone
    # The replacement pool serves the next rollout (the marker says: die no more).
    again = _expand(transition, workers, DyingFactory(str(tmp_path / "died")))
    assert node_records(again, TOK.decode) == node_records(want, TOK.decode)
  finally:
    workers.close()


class LockedCoopEnv(coop.CoopEnv):
  """Holds a lock after its first step: its next state cannot be pickled."""

  def react_to_joint(self, threads):
    import threading

    self.lock = threading.Lock()
    return super().react_to_joint(threads)


class LockedFactory(DyingFactory):

  def __init__(self):
    super().__init__("")

  def create_environment(self, metadata):
    return LockedCoopEnv(metadata)


def test_an_outcome_that_cannot_be_pickled_is_a_masked_contract_fault():
  transition = _transition()
  workers = StepWorkers("processes", 1, transition)
  try:
    got = _expand(transition, workers, LockedFactory())
  finally:
    workers.close()
  for node in got.nodes:  # every first step masked: the roots have no children
    assert node.turn == 0
    for record in node.actions:
      (fault,) = record.faults
      assert not record.valid and fault.kind == FaultKind.CONTRACT
      assert fault.source == "environment" and "_thread.lock" in fault.message
      assert "env.workers='processes'" in fault.message


class RaisingCoopEnv(coop.CoopEnv):
  """Raises at every joint action, after a moment (so that every worker takes steps)."""

  def react_to_joint(self, threads):
    time.sleep(0.02)
    raise RuntimeError("the environment's own bug")


class RaisingFactory(DyingFactory):

  def __init__(self):
    super().__init__("")

  def create_environment(self, metadata):
    return RaisingCoopEnv(metadata)


def test_a_fault_seen_by_several_workers_is_shown_once_by_the_engine(capfd):
  FAULT_CONSOLE.reset()
  transition = _transition()
  workers = StepWorkers("processes", 2, transition)
  try:
    capfd.readouterr()
    got = _expand(transition, workers, RaisingFactory())
    out, err = capfd.readouterr()
  finally:
    workers.close()
  kinds = {f.kind for node in got.nodes for record in node.actions for f in record.faults}
  assert sum(fault_counts(got).values()) == 4 * 4 and len(kinds) == 1  # every first step
  lines = [line for line in (out + err).splitlines() if line.startswith("fault ")]
  assert len(lines) == 1, lines
  assert "from environment" in lines[0] and "the environment's own bug" in lines[0]


def test_engine_bound_generators_refuse_to_be_pickled():
  for cls in (LocalLLM, BatchingGenerator):
    with pytest.raises(TypeError, match="cannot be pickled"):
      pickle.dumps(object.__new__(cls))


def test_the_renderer_pickles_with_its_counters():
  copy = pickle.loads(pickle.dumps(RENDERER))
  assert copy.metrics() == RENDERER.metrics() and copy._lock is not RENDERER._lock


@pytest.mark.parametrize(
    "kw,field,allowed",
    [
        ({"workers": "fork"}, "env.workers='fork'", "['threads', 'processes']"),
        ({"max_concurrency": -1}, "env.max_concurrency=-1", "an int >= 1, or 0"),
        ({"max_concurrency": 1.5}, "env.max_concurrency=1.5", "an int >= 1, or 0"),
    ],
)
def test_bad_worker_fields_are_refused_in_one_line(kw, field, allowed):
  with pytest.raises(ValueError) as e:
    EnvConfig(**kw)
  msg = str(e.value)
  assert "\n" not in msg and field in msg and allowed in msg
  with pytest.raises(ValueError, match="allowed"):
    check_workers(kw.get("workers", "threads"), kw.get("max_concurrency", 0))
