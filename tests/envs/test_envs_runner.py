"""step_environment: faults injected by kind, limits, rendering, reward, multi-agent.

Every environment here is driven by a scripted policy (assistant texts fed in
turn by turn) through `rollout_scripted`, the same path the rollout engine
takes through `step_environment`.
"""

import json
import threading

import jax
import numpy as np
import pytest

from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.testing import FakePolicy
from mtrl_jax.envs import (
    Environment,
    FaultCounter,
    FaultKind,
    FaultPolicy,
    Grade,
    InfrastructureError,
    ModelFormatError,
    RewardConfig,
    StepLimits,
    Thread,
    ToolError,
    ToolSet,
    Turn,
    fault_source,
    resolve_factory,
    render_thread,
    rollout_scripted,
    step_environment,
    tool,
)
from mtrl_jax.tasks import weather  # noqa: F401  (registers "weather")

REWARD = RewardConfig(
    outcome_weight=1.0, step_penalty=-0.01, tool_penalty=-0.1, shaping_weight=0.05
)


def call(name, **arguments):
  return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_weather_example_end_to_end(renderer):
  env = resolve_factory("weather").create_environment({"city": "oslo"})
  outs, seen = rollout_scripted(
      env,
      [call("get_weather", city="Oslo"), "It is <answer>4</answer>"],
      StepLimits(max_turns=5),
      reward_cfg=REWARD,
      renderer=renderer,
  )
  assert len(outs) == 2 and outs[1].done and not outs[0].done
  first, last = outs
  # Step 1: tool result appended, per-turn grade 1.0 -> shaping 0.05, step -0.01.
  assert first.next_thread.turns[-1].content == "4"
  assert first.grades["tools_ok"].score == 1.0
  assert first.reward.shaping == pytest.approx(0.05) and first.reward.outcome == 0.0
  assert first.reward.total == pytest.approx(0.05 - 0.01)
  # Step 2: correct (0.9 * 1) + concise (0.1 * 1/(2-1)) = 1.0.
  final = last.grades["final"]
  assert final.score == pytest.approx(1.0)
  assert final.components == {"correct": 1.0, "concise": 1.0}
  assert last.reward.total == pytest.approx(1.0 - 0.01)
  assert not any(o.masked or o.truncated or o.faults for o in outs)
  # The thread the policy saw at step 2 has every turn rendered exactly once.
  t = seen[1]
  assert t.num_rendered == len(t.turns) == 5
  roles = t.ledger.roles
  trainable = t.ledger.trainable
  assert all(not tr for r, tr in zip(roles, trainable) if r in ("system", "user", "tool"))
  assert sum(trainable) > 0


def test_invalid_tool_call_is_recoverable_and_penalised():
  env = resolve_factory("weather").create_environment({"city": "paris"})
  outs, _ = rollout_scripted(
      env,
      [
          call("get_weather", town="Paris"),
          '<tool_call>{"name": "get_weather"</tool_call>',
          call("get_weather", city="Atlantis"),
          call("get_weather", city="Paris"),
          "<answer>18</answer>",
      ],
      reward_cfg=REWARD,
  )
  kinds = [[f.kind for f in o.faults] for o in outs]
  assert kinds == [[FaultKind.TOOL_ERROR], [FaultKind.MODEL_FORMAT], [FaultKind.TOOL_ERROR], [], []]
  assert [o.invalid_calls for o in outs] == [1, 1, 1, 0, 0]
  assert "unknown argument 'town'" in outs[0].next_thread.turns[-1].content
  assert "unknown city 'Atlantis'" in outs[2].next_thread.turns[-1].content
  # Error steps: per-turn grade 0 -> no shaping; penalty -0.1 and step -0.01.
  assert outs[0].reward.total == pytest.approx(-0.11)
  assert outs[0].reward.tool == pytest.approx(-0.1)
  # Recovered: success, but concise = 1/(5-1).
  assert outs[-1].grades["final"].score == pytest.approx(0.9 + 0.1 * 0.25)
  assert not any(o.masked for o in outs)


class _Raising(Environment):
  """Continues once, then raises whatever `exc` says on the second step."""

  def __init__(self, exc, fail_times=10**9):
    super().__init__({"prompt": "go"})
    self.exc, self.fail_times, self.calls = exc, fail_times, 0

  def react_to(self, thread):
    self.calls += 1
    if thread.count("assistant") == 1:
      return thread.append(Turn("user", "more")), None
    if self.calls - 1 <= self.fail_times:
      raise self.exc
    return None, {"ok": Grade(1.0)}


@pytest.mark.parametrize(
    "exc,kind,masked,invalid",
    [
        (ModelFormatError("no <answer> tag"), FaultKind.MODEL_FORMAT, False, 1),
        (ToolError("bad"), FaultKind.TOOL_ERROR, False, 1),
        (InfrastructureError("db down"), FaultKind.INFRASTRUCTURE, True, 0),
        (KeyError("metadata key"), FaultKind.CONTRACT, True, 0),  # a bug: masked, not retried
        (ConnectionError("refused"), FaultKind.INFRASTRUCTURE, True, 0),
        (RuntimeError("unknown"), FaultKind.INFRASTRUCTURE, True, 0),
        (TimeoutError("slow"), FaultKind.TIMEOUT, True, 0),
    ],
)
def test_exception_kinds(exc, kind, masked, invalid):
  env = _Raising(exc)
  outs, _ = rollout_scripted(
      env, ["a", "b", "c"], StepLimits(faults=FaultPolicy(max_retries=2)), reward_cfg=REWARD
  )
  assert len(outs) == 2 and outs[1].done  # the run goes on; this trajectory ends
  fault = outs[1].faults[0]
  assert fault.kind == kind and fault.source == "environment"
  assert outs[1].masked == masked and outs[1].invalid_calls == invalid
  if masked:  # never scored as reward
    assert outs[1].reward.total == 0.0
  else:  # penalised: step + tool penalty, no outcome
    assert outs[1].reward.total == pytest.approx(-0.01 - 0.1)
  # Only infrastructure is retried: 1 + max_retries attempts.
  expected_calls = 1 + (3 if kind == FaultKind.INFRASTRUCTURE else 1)
  assert env.calls == expected_calls
  counter = FaultCounter()
  for o in outs:
    counter.add_all(o.faults)
  assert counter.count(kind) == 1 and counter.metrics()[f"faults/{kind.value}"] == 1


def test_infrastructure_retry_succeeds():
  env = _Raising(InfrastructureError("transient"), fail_times=1)
  outs, _ = rollout_scripted(env, ["a", "b"], StepLimits(faults=FaultPolicy(max_retries=1)))
  assert outs[1].grades["ok"].score == 1.0 and outs[1].faults == () and not outs[1].masked
  env = _Raising(InfrastructureError("transient"), fail_times=1)
  outs, _ = rollout_scripted(env, ["a", "b"], StepLimits(faults=FaultPolicy(max_retries=0)))
  assert outs[1].masked and outs[1].faults[0].retries == 0


class _ToolEnv(Environment):

  def __init__(self, tools):
    super().__init__({"prompt": "go"}, tools=tools)

  def react_to(self, thread):
    nxt = self.run_tools(thread)
    return (nxt, None) if nxt is not None else (None, {"done": 1.0})


def test_tool_infrastructure_fault_masks_but_continues():
  @tool
  def broken() -> str:
    """Always crashes."""
    raise ConnectionError("refused")

  outs, _ = rollout_scripted(
      _ToolEnv(ToolSet([broken], max_retries=1)), [call("broken"), "done"], reward_cfg=REWARD
  )
  assert outs[0].masked and not outs[0].done and outs[0].reward.total == 0.0
  assert outs[0].faults[0].kind == FaultKind.INFRASTRUCTURE
  assert outs[0].faults[0].source == "tool:broken" and outs[0].faults[0].retries == 1
  assert not outs[1].masked and outs[1].reward.outcome == 1.0


@pytest.fixture
def slow_tool():
  """A tool that sleeps past its 0.05 s timeout (woken when the test ends)."""
  wake = threading.Event()

  @tool(timeout_s=0.05)
  def slow() -> str:
    """Slow."""
    wake.wait(5)
    return "x"

  yield slow
  wake.set()


def test_tool_timeout_masks_the_step_by_default(slow_tool):
  assert FaultKind.TIMEOUT in FaultPolicy().mask
  outs, _ = rollout_scripted(
      _ToolEnv(ToolSet([slow_tool])), [call("slow"), "done"], reward_cfg=REWARD
  )
  first = outs[0]
  assert [f.kind for f in first.faults] == [FaultKind.TIMEOUT]
  assert first.faults[0].source == "tool:slow"
  # Infrastructure: neither rewarded (no step penalty, no shaping) nor penalised.
  assert first.masked and first.invalid_calls == 0
  assert first.reward.total == 0.0 and first.reward.step == 0.0
  assert not outs[1].masked and outs[1].reward.outcome == 1.0


def test_tool_timeout_tell_mode_shows_the_policy_and_goes_on(slow_tool):
  limits = StepLimits(faults=FaultPolicy(tool_timeout="tell"))
  outs, seen = rollout_scripted(
      _ToolEnv(ToolSet([slow_tool])), [call("slow"), "done"], limits, reward_cfg=REWARD
  )
  first = outs[0]
  assert [f.kind for f in first.faults] == [FaultKind.TIMEOUT]
  assert not first.masked and not first.done and first.invalid_calls == 0
  assert first.reward.total == pytest.approx(-0.01)  # the step penalty only
  assert "timed out" in first.next_thread.turns[-1].content
  assert "timed out" in seen[1].turns[-2].content  # the policy read it
  assert outs[1].done and outs[1].reward.outcome == 1.0


class _ScriptedPolicy(FakePolicy):
  """Sample g of every prompt says texts[g] (then the stop id)."""

  def __init__(self, renderer, texts):
    super().__init__()
    self.renderer, self.texts = renderer, texts

  def completion(self, req, g):
    stop = self.renderer.fmt.stop_ids[0]
    ids = np.asarray(self.renderer.tokenizer.encode(self.texts[g]) + [stop], np.int32)
    return ids, np.full(len(ids), -0.5, np.float32), "stop"


@pytest.mark.parametrize("mode", ["mask", "tell"])
def test_tool_timeout_in_the_tree_engine(renderer, slow_tool, mode):
  # Sample 0 calls the slow tool, sample 1 answers at once.
  limits = StepLimits(max_turns=4, faults=FaultPolicy(tool_timeout=mode))
  transition = EnvTransition(renderer, limits=limits, reward_cfg=REWARD)
  root = transition.root_state(_ToolEnv(ToolSet([slow_tool])))
  policy = _ScriptedPolicy(renderer, [call("slow"), "done"])
  tree = expand_tree(
      TreeConfig(num_turns=2, num_generations=2), policy, transition, [root], jax.random.key(0)
  )
  node = tree.nodes[0]
  assert [f.kind.value for f in node.actions[0].faults] == ["timeout"]
  assert node.actions[0].valid == (mode == "tell")
  if mode == "mask":  # no reward, no child, weight 0, out of the baseline
    assert not node.valid_B[0] and node.children_B[0] < 0 and node.rewards_B[0] == 0.0
    assert node.weight_NxG[0, 0] == 0.0 and node.advantages_NxG[0, 1] == 0.0
  else:  # the branch goes on: the policy saw "timed out" and answered
    assert node.valid_B[0] and node.children_B[0] >= 0
    assert node.rewards_B[0] == pytest.approx(-0.01)
    assert "timed out" in renderer.tokenizer.decode(tree.nodes[node.children_B[0]].prompts[0])


def test_tool_timeout_config_switch():
  from configs import calculator as calc_config
  from mtrl_jax.run import experiment

  c = calc_config.get_config("smoke=True")
  assert experiment.build(c).env.limits.faults.tool_timeout == "mask"
  c.env.tool_timeout = "tell"
  assert FaultKind.TIMEOUT not in experiment.build(c).env.limits.faults.mask
  c.env.tool_timeout = "ignore"
  with pytest.raises(ValueError, match=r"env.tool_timeout.*allowed: \['mask', 'tell'\]"):
    experiment.build(c)


def test_react_timeout_masks_and_ends():
  release = threading.Event()

  class Slow(Environment):

    def react_to(self, thread):
      release.wait(5)
      return None, 1.0

  env = Slow({"prompt": "x"})
  thread = env.initial_thread().append(Turn("assistant", "a"))
  out = step_environment(env, thread, StepLimits(react_timeout_s=0.05))
  release.set()
  assert out.done and out.masked and out.faults[0].kind == FaultKind.TIMEOUT


class _Echo(Environment):
  """Replies forever with a user turn; per-turn grade 0.5; finalize grades 0.25."""

  def react_to(self, thread):
    return thread.append(Turn("user", "again " * 5)), {"turn": 0.5}

  def finalize(self, thread):
    return {"partial": Grade(0.25, "cut short")}


def test_turn_cap_truncates_with_finalize_grades():
  outs, _ = rollout_scripted(
      _Echo({"prompt": "x"}), ["a"] * 10, StepLimits(max_turns=3), reward_cfg=REWARD
  )
  assert len(outs) == 3 and outs[-1].done and outs[-1].truncated
  assert [f.kind for f in outs[-1].faults] == [FaultKind.TRUNCATION]
  assert "turn cap reached (3 policy turns)" in outs[-1].faults[0].message
  r = outs[-1].reward
  assert r.outcome == pytest.approx(0.25) and r.shaping == pytest.approx(0.05 * 0.5)
  assert r.total == pytest.approx(0.25 + 0.025 - 0.01)
  assert set(outs[-1].grades) == {"turn", "partial"} and not outs[-1].masked


def test_token_budget_truncates(renderer):
  outs, seen = rollout_scripted(
      _Echo({"prompt": "x"}), ["abc"] * 50, StepLimits(max_tokens=120), renderer=renderer
  )
  assert outs[-1].truncated and "token budget reached" in outs[-1].faults[0].message
  assert all(len(t.ledger) < 120 for t in seen)
  assert len(outs) < 50


def test_environment_misuse_is_a_contract_fault():
  class ReturnsNothing(Environment):

    def react_to(self, thread):
      return None, None

  class BadGrade(Environment):

    def react_to(self, thread):
      return None, {"g": "great"}

  for cls, needle in [(ReturnsNothing, "(None, None)"), (BadGrade, "grade 'g' returned 'great'")]:
    env = cls({"prompt": "x"})
    out = step_environment(
        env,
        env.initial_thread().append(Turn("assistant", "a")),
        StepLimits(faults=FaultPolicy(max_retries=0)),
    )
    assert out.masked and out.done and needle in out.faults[0].message
    assert out.faults[0].kind == FaultKind.CONTRACT


def test_environment_rewriting_earlier_turns_is_a_history_rewrite_not_misuse(renderer):
  """The next thread drops the system turn: rendered anew into a fresh ledger,
  counted, never masked."""

  class Rewrites(Environment):

    def react_to(self, thread):
      return Thread(thread.turns[1:]).append(Turn("user", "again")), None

  env = Rewrites({"prompt": "x"}, system="sys")
  thread = render_thread(env.initial_thread(), renderer)
  ledger = thread.ledger.copy()
  renderer.begin_assistant(ledger)
  renderer.append_completion(
      ledger, renderer.tokenizer.encode("a") + [renderer.fmt.stop_ids[0]], [0.0, 0.0]
  )
  acted = thread.replace(ledger=ledger).append(Turn("assistant", "a"))
  out = step_environment(env, acted, renderer=renderer)
  assert not out.masked and not out.done and not out.faults
  assert out.history_rewrites == 1 and out.to_dict()["history_rewrites"] == 1
  nxt = out.next_thread
  assert [t.role for t in nxt.turns] == ["user", "assistant", "user"]
  expected = renderer.render_conversation(
      [(t.role, t.content) for t in nxt.turns], train_assistant=False
  )
  assert list(nxt.ledger.ids) == list(expected.ids) and not any(nxt.ledger.trainable)
  assert renderer.metrics()["text/history_rewrites"] == 1


def test_fault_source_is_the_innermost_object_declaring_one():
  """Sources come from a class attribute on the traceback, not from module names."""

  class Service:
    fault_source = "my_service"

    def call(self, inner=None):
      if inner is not None:
        return inner.call()
      raise RuntimeError("down")

  class Inner:
    fault_source = "inner_service"

    def call(self):
      raise RuntimeError("inner down")

  for service, inner, want in [
      (Service(), None, "my_service"),
      (Service(), Inner(), "inner_service"),
  ]:

    class Calls(Environment):

      def react_to(self, thread):
        return None, {"g": service.call(inner)}

    env = Calls({"prompt": "x"})
    out = step_environment(
        env,
        env.initial_thread().append(Turn("assistant", "a")),
        StepLimits(faults=FaultPolicy(max_retries=0)),
    )
    assert out.masked and out.faults[0].source == want
  explicit = InfrastructureError("tagged")
  explicit.source = "explicit"
  assert fault_source(explicit) == "explicit"
  assert fault_source(RuntimeError("no traceback")) == "environment"


def test_grader_fault_source_is_traced():
  from mtrl_jax.graders import BinaryJudgeGrader, ScriptedGenerator

  def broken_scores(prompt, choices):
    raise RuntimeError("CUDA OOM")

  judge = BinaryJudgeGrader(ScriptedGenerator(scores=broken_scores), "is it good?")

  class Judged(Environment):

    def react_to(self, thread):
      return None, {"judge": judge.grade(thread)}

  env = Judged({"prompt": "x"})
  out = step_environment(env, env.initial_thread().append(Turn("assistant", "a")))
  assert out.masked and out.faults[0].source == "judge"
  assert "CUDA OOM" in out.faults[0].message and out.faults[0].retries == 2


def test_masked_env_recorded_fault_and_env_reported_format_fault():
  class Reports(Environment):

    def react_to(self, thread):
      if "<answer>" not in thread.last_assistant:
        self.report_fault("model_format", "no answer tag")
        return thread.append(Turn("user", "Use <answer>.")), None
      return None, 1.0

  outs, _ = rollout_scripted(
      Reports({"prompt": "x"}), ["hm", "<answer>1</answer>"], reward_cfg=REWARD
  )
  assert outs[0].invalid_calls == 1 and outs[0].reward.tool == pytest.approx(-0.1)
  assert outs[1].reward.outcome == 1.0


class _TwoAgents(Environment):
  num_agents = 2

  def initial_threads(self):
    return [Thread.from_messages([("user", f"you are agent {i}")]) for i in range(2)]

  def react_to_joint(self, threads):
    a, b = (t.last_assistant for t in threads)
    if a == b:
      return None, {"agree": 1.0}
    return [t.append(Turn("user", f"other said {o}")) for t, o in zip(threads, (b, a))], None


def test_multi_agent_joint_steps(renderer):
  outs, seen = rollout_scripted(_TwoAgents({}), [["x", "y"], ["z", "z"]], renderer=renderer)
  assert len(outs[0].next_threads) == 2 and outs[0].next_threads[0].last().content == "other said y"
  assert outs[1].done and outs[1].reward.outcome == 1.0
  assert all(t.num_rendered == len(t.turns) for t in seen[1])
  with pytest.raises(ValueError, match="2 agents; use next_threads"):
    outs[0].next_thread


def test_outcome_to_dict_is_json():
  outs, _ = rollout_scripted(_Echo({"prompt": "x"}), ["a", "b"], StepLimits(max_turns=2))
  json.dumps([o.to_dict() for o in outs])
  assert outs[1].to_dict()["faults"][0]["kind"] == "truncation"


def test_limits_validation():
  with pytest.raises(ValueError, match="StepLimits.max_turns=0"):
    StepLimits(max_turns=0)
  with pytest.raises(ValueError, match="only model-caused kinds may be penalised"):
    FaultPolicy(penalise={"infrastructure"})
  with pytest.raises(ValueError, match="must contain 'infrastructure'"):
    FaultPolicy(mask={"timeout"})
