"""Fault kinds, classification of arbitrary exceptions, counting, timeouts."""

import threading
import time

import pytest

from mtrl_jax.envs import (
    ContractError,
    Fault,
    FaultCounter,
    FaultKind,
    FaultPolicy,
    FaultTimeoutError,
    InfrastructureError,
    ModelFormatError,
    ToolError,
    call_with_timeout,
    classify,
)
from mtrl_jax.text import ToolCallError, parse_tool_calls


def test_classification():
  assert classify(ModelFormatError("x")) == FaultKind.MODEL_FORMAT
  assert classify(ToolError("x")) == FaultKind.TOOL_ERROR
  assert classify(InfrastructureError("x")) == FaultKind.INFRASTRUCTURE
  assert classify(FaultTimeoutError("x")) == FaultKind.TIMEOUT
  assert classify(TimeoutError("x")) == FaultKind.TIMEOUT
  with pytest.raises(ToolCallError) as info:
    parse_tool_calls("<tool_call>{</tool_call>")
  assert classify(info.value) == FaultKind.MODEL_FORMAT
  # Programming errors are contract faults; outside failures and unknown
  # exceptions are infrastructure. Neither is ever reward.
  for exc in (
      ValueError("x"),
      KeyError("k"),
      ZeroDivisionError(),
      TypeError(),
      AttributeError(),
      IndexError(),
      NotImplementedError(),
      ContractError("x"),
  ):
    assert classify(exc) == FaultKind.CONTRACT, exc
  for exc in (
      RuntimeError(),
      ConnectionError(),
      OSError(),
      BrokenPipeError(),
      MemoryError(),
      Exception(),
  ):
    assert classify(exc) == FaultKind.INFRASTRUCTURE, exc


def test_fault_record_and_counter():
  f = Fault.from_exception(ConnectionError("db"), "environment", retries=2)
  assert f.kind == FaultKind.INFRASTRUCTURE and f.message == "ConnectionError: db"
  assert f.to_dict() == {
      "kind": "infrastructure",
      "source": "environment",
      "message": "ConnectionError: db",
      "retries": 2,
  }
  assert Fault.from_exception(ToolError("bad city"), "tool:w").message == "bad city"
  a, b = FaultCounter(), FaultCounter()
  a.add_all([f, Fault("timeout", "tool:w", "slow")])
  b.add(Fault(FaultKind.TIMEOUT, "tool:w", "slow"))
  a.merge(b)
  assert a.count() == 3 and a.count("timeout") == 2 and a.by_source["tool:w"] == 2
  m = a.metrics()
  assert m == {
      "faults/model_format": 0,
      "faults/tool_error": 0,
      "faults/contract": 0,
      "faults/infrastructure": 1,
      "faults/timeout": 2,
      "faults/truncation": 0,
      "faults/total": 3,
  }
  a.reset()
  assert a.count() == 0
  with pytest.raises(ValueError, match="fault kind 'bug'; allowed: \\['model_format'"):
    Fault("bug", "x", "y")


def test_fault_policy_timeouts_are_infrastructure_unless_told():
  default = FaultPolicy()
  assert default.tool_timeout == "mask"
  assert default.mask == {FaultKind.CONTRACT, FaultKind.INFRASTRUCTURE, FaultKind.TIMEOUT}
  assert FaultKind.TIMEOUT not in default.penalise  # masked, never penalised
  tell = FaultPolicy(tool_timeout="tell")
  assert tell.mask == {FaultKind.CONTRACT, FaultKind.INFRASTRUCTURE}
  assert tell.penalise == default.penalise
  assert FaultPolicy(mask={"infrastructure", "timeout"}) == default
  with pytest.raises(ValueError, match=r"tool_timeout='wait'.*allowed: \['mask', 'tell'\]"):
    FaultPolicy(tool_timeout="wait")
  with pytest.raises(ValueError, match="mask contains 'timeout' but tool_timeout='tell'"):
    FaultPolicy(mask={"infrastructure", "timeout"}, tool_timeout="tell")


def test_call_with_timeout():
  assert call_with_timeout(lambda x, fn=None: x + 1, 1.0, "add", 1) == 2
  with pytest.raises(KeyError):  # exceptions cross the worker thread unchanged
    call_with_timeout(lambda: {}["k"], 1.0, "lookup")
  release = threading.Event()
  start = time.perf_counter()
  with pytest.raises(FaultTimeoutError, match="sleepy timed out after 0.05s"):
    call_with_timeout(release.wait, 0.05, "sleepy", 5)
  release.set()
  assert time.perf_counter() - start < 1.0
  assert call_with_timeout(lambda: "inline", None, "x") == "inline"


def test_timed_calls_reuse_workers_and_skip_a_stuck_one():
  from mtrl_jax.envs.faults import _WORKERS

  call_with_timeout(lambda: None, 1.0, "warm")
  started = _WORKERS.started
  assert [call_with_timeout(lambda i=i: i * i, 1.0, "sq") for i in range(200)] == [
      i * i for i in range(200)
  ]
  assert _WORKERS.started == started  # one idle worker served them all
  # A stuck worker is not handed the next call: that one gets a fresh worker
  # and finishes at once. Nested timed calls (a tool inside react_to) work too.
  release = threading.Event()
  with pytest.raises(FaultTimeoutError):
    call_with_timeout(release.wait, 0.05, "stuck", 10)
  start = time.perf_counter()
  inner = lambda: call_with_timeout(lambda: "tool", 1.0, "tool")
  assert call_with_timeout(inner, 1.0, "react_to") == "tool"
  assert time.perf_counter() - start < 0.5
  release.set()  # the stuck worker returns and rejoins the idle ones
  deadline = time.perf_counter() + 10  # (every timed call in the suite is released)
  while len(_WORKERS._idle) < _WORKERS.started and time.perf_counter() < deadline:
    time.sleep(0.01)
  assert len(_WORKERS._idle) == _WORKERS.started
