"""Contract faults: environment, tool and grader code that breaks the API is masked, never
retried, counted apart from infrastructure and shown once on the console in one line."""

import io
import math
import time

import pytest

from mtrl_jax.envs import (
    ContractError,
    Environment,
    Fault,
    FaultCounter,
    FaultKind,
    FaultPolicy,
    StepLimits,
    Thread,
    ToolSet,
    Turn,
    rollout_scripted,
    step_environment,
    tool,
)
from mtrl_jax.envs.fault_report import FAULT_CONSOLE, FaultConsole
from mtrl_jax.graders import Grader
from mtrl_jax.testing import byte_renderer

RETRY_TWICE = StepLimits(faults=FaultPolicy(max_retries=2))


class _Breaks(Environment):
  """Continues once, then answers its second step with `answer()` (or raises it)."""

  def __init__(self, answer):
    super().__init__({"prompt": "go"})
    self.answer, self.calls = answer, 0

  def react_to(self, thread):
    self.calls += 1
    if thread.count("assistant") == 1:
      return thread.append(Turn("user", "more")), None
    return self.answer(thread)


class _KeyErrorGrader(Grader):

  def grade(self, thread):
    return {}["expected"]  # a bug in the grader


def _raise(exc):
  def answer(thread):
    raise exc

  return answer


@pytest.mark.parametrize(
    "answer,needle,where",
    [
        (
            lambda t: (t, None, None),
            "must return a 2-tuple (next_thread | None, grades), got a 3-tuple",
            "_Breaks.react_to",
        ),
        (lambda t: None, "got NoneType", "_Breaks.react_to"),
        (lambda t: ("next", None), "react_to returned str as next thread", "_Breaks.react_to"),
        (
            lambda t: (None, {"g": math.nan}),
            "invalid grades: Grade.score must be finite, got nan",
            "_Breaks.react_to",
        ),
        (lambda t: (None, math.inf), "Grade.score must be finite, got inf", "_Breaks.react_to"),
        (
            _raise(TypeError("unsupported operand")),
            "TypeError: unsupported operand",
            "_Breaks.react_to (test_contract_faults.py:",
        ),
        (
            lambda t: (None, {"g": _KeyErrorGrader("g").grade(t)}),
            "KeyError: 'expected'",
            "_KeyErrorGrader.grade",
        ),
    ],
)
def test_api_breaks_are_masked_contract_faults_never_retried(answer, needle, where):
  env = _Breaks(answer)
  outs, _ = rollout_scripted(env, ["a", "b"], RETRY_TWICE)
  out = outs[1]
  assert out.done and out.masked and out.reward.total == 0.0 and out.invalid_calls == 0
  assert env.calls == 2  # not retried: the same code fails the same way
  (fault,) = out.faults
  assert fault.kind == FaultKind.CONTRACT and needle in fault.message, fault.message
  assert "\n" not in fault.message and fault.retries == 0
  assert fault.where.startswith(where), fault.where
  if "invalid grades" in needle or "returned" in needle or "got" in needle:
    assert fault.where == "_Breaks.react_to"  # the answer was wrong, no line raised
  counter = FaultCounter()
  counter.add_all(out.faults)
  assert counter.metrics()["faults/contract"] == 1
  assert counter.metrics()["faults/infrastructure"] == 0


def test_grader_bug_is_attributed_to_the_grader():
  env = _Breaks(lambda t: (None, {"g": _KeyErrorGrader("g").grade(t)}))
  fault = rollout_scripted(env, ["a", "b"], RETRY_TWICE)[0][1].faults[0]
  assert fault.source == "grader" and fault.where.startswith("_KeyErrorGrader.grade (")


@pytest.mark.parametrize(
    "exc,kind,calls",
    [
        (ConnectionError("refused"), FaultKind.INFRASTRUCTURE, 1 + 1 + 2),  # retried twice
        (OSError("disk"), FaultKind.INFRASTRUCTURE, 1 + 1 + 2),
        (RuntimeError("unknown"), FaultKind.INFRASTRUCTURE, 1 + 1 + 2),
        (TimeoutError("slow"), FaultKind.TIMEOUT, 1 + 1),
        (ContractError("declared"), FaultKind.CONTRACT, 1 + 1),
    ],
)
def test_outside_failures_stay_infrastructure_or_timeout(exc, kind, calls):
  env = _Breaks(_raise(exc))
  out = rollout_scripted(env, ["a", "b"], RETRY_TWICE)[0][1]
  assert out.masked and out.faults[0].kind == kind and env.calls == calls


def test_a_buggy_tool_is_a_contract_fault_not_retried():
  calls = []

  @tool
  def lookup(city: str) -> str:
    """Looks a city up."""
    calls.append(city)
    return {"paris": "12C"}[city]  # KeyError for any other city: a bug in the tool

  class Tools(Environment):

    def react_to(self, thread):
      nxt = self.run_tools(thread)
      return (nxt, None) if nxt is not None else (None, 1.0)

  env = Tools({"prompt": "go"}, tools=ToolSet([lookup], max_retries=2))
  text = '<tool_call>{"name": "lookup", "arguments": {"city": "rome"}}</tool_call>'
  out = rollout_scripted(env, [text, "done"])[0][0]
  assert calls == ["rome"] and out.masked and not out.done
  (fault,) = out.faults
  assert (fault.kind, fault.source) == (FaultKind.CONTRACT, "tool:lookup")
  assert "KeyError: 'rome'" in fault.message
  assert fault.where.startswith(
      "test_a_buggy_tool_is_a_contract_fault_not_retried.<locals>"
      ".lookup (test_contract_faults.py:"
  )


def test_first_fault_of_each_kind_and_source_is_shown_once_in_one_line():
  console = FaultConsole(io.StringIO())
  boom = Fault.from_exception(
      TypeError("boom\nsecond line"), "environment", where="MyEnv.react_to (my_env.py:3)"
  )
  assert console.show(boom) and not console.show(boom)  # once per (kind, source)
  assert not console.show(Fault(FaultKind.CONTRACT, "environment", "another message"))
  assert console.show(Fault(FaultKind.CONTRACT, "grader", "g"))  # another source
  assert console.show(Fault(FaultKind.INFRASTRUCTURE, "environment", "db down"))
  assert not console.show(Fault(FaultKind.TRUNCATION, "framework", "turn cap"))  # routine
  lines = console.stream.getvalue().splitlines()
  assert lines[0] == (
      "fault contract from environment in MyEnv.react_to (my_env.py:3): "
      "TypeError: boom second line  (shown once; counted in faults/contract)"
  )
  assert len(lines) == 3 and lines[2].startswith("fault infrastructure from environment: db")
  console.reset()
  assert console.show(boom)


def test_step_environment_shows_the_fault_where_it_is_recorded(capsys):
  FAULT_CONSOLE.reset()
  for _ in range(3):
    rollout_scripted(_Breaks(_raise(AttributeError("no 'answer'"))), ["a", "b"])
  err = capsys.readouterr().err.splitlines()
  shown = [line for line in err if line.startswith("fault contract from environment")]
  assert len(shown) == 1, err
  assert " in _Breaks.react_to (test_contract_faults.py:" in shown[0]  # the line that raised
  assert "AttributeError: no 'answer'" in shown[0]
  FAULT_CONSOLE.reset()


# ------------------------------------------------------------------ tool output cap
class _Floods(Environment):
  """Answers every message with one tool turn of `size` characters."""

  def __init__(self, size):
    super().__init__({"prompt": "go"})
    self.size = size

  def react_to(self, thread):
    return thread.append(Turn("tool", "y" * self.size, name="dump")), None


def test_tool_output_is_capped_in_characters_before_tokenising():
  renderer = byte_renderer()
  env = _Floods(20_000_000)
  limits = StepLimits(max_tool_output_chars=8000, max_turns=2)
  start = time.perf_counter()
  outs, _ = rollout_scripted(env, ["a"], limits, renderer=renderer)
  elapsed = time.perf_counter() - start
  turn = outs[0].next_thread.turns[-1]
  assert turn.content == "y" * 8000 + "\n[output truncated: 20,000,000 chars -> 8,000]"
  assert turn.metadata["truncated_chars"] == 20_000_000 and turn.name == "dump"
  assert len(outs[0].next_thread.ledger) < 8200  # only the cut text was tokenised
  assert elapsed < 2.0, elapsed  # tokenising 20 MB byte by byte takes far longer


def test_tool_output_cap_defaults_from_the_token_budget_and_is_validated():
  assert StepLimits(max_tokens=256).tool_output_chars == 16 * 256
  assert StepLimits().tool_output_chars == 65_536
  assert StepLimits(max_tokens=256, max_tool_output_chars=100).tool_output_chars == 100
  out = step_environment(
      _Floods(5000),
      Thread((Turn("user", "go"), Turn("assistant", "a"))),
      StepLimits(max_tokens=100),
  )
  assert len(out.next_thread.turns[-1].content) < 1700 and not out.masked
  short = step_environment(_Floods(50), Thread((Turn("assistant", "a"),)), StepLimits())
  assert short.next_thread.turns[-1].content == "y" * 50  # under the cap: unchanged
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError) as info:
      StepLimits(max_tool_output_chars=bad)
    msg = str(info.value)
    assert msg.startswith(
        f"StepLimits.max_tool_output_chars={bad!r} (config "
        "env.max_tool_output_chars); must be a positive int or None"
    )
    assert "\n" not in msg


def test_tool_output_cap_config_field():
  from mtrl_jax.run.inputs import EnvConfig

  assert EnvConfig(max_tool_output_chars=8000).limits.tool_output_chars == 8000
  assert EnvConfig(max_tokens=64).limits.tool_output_chars == 16 * 64
