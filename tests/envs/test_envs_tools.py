"""Tools: JSON schemas from annotations and docstrings, validation, execution, faults, cache."""

import json
import threading
import time
from typing import Literal, Optional

import pytest

from mtrl_jax.envs import (
    FaultKind,
    InfrastructureError,
    ToolCache,
    ToolError,
    ToolSet,
    Turn,
    canonical_arguments,
    tool,
)
from mtrl_jax.envs.tool_schema import parse_docstring, validate_arguments


def search(
    query: str,
    limit: int = 3,
    scale: float = 1.0,
    exact: bool = False,
    tags: list[str] = [],
    filters: dict[str, int] = {},  # noqa: B006
    lang: Optional[str] = None,
    mode: Literal["fast", "slow"] = "fast",
) -> str:
  """Search the index.

  Longer explanation that is part of the summary.

  Args:
    query: what to look for;
      may span two lines.
    limit: how many hits.
    scale (float): score scale.
    exact: exact match only.
    tags: tags to require.
    filters: numeric filters.
    lang: optional language.
    mode: search mode.

  Returns:
    The hits.
  """
  return json.dumps([query, limit, scale, exact, tags, filters, lang, mode])


def test_schema_from_annotations_and_docstring():
  t = tool(search)
  assert t.name == "search"
  assert t.description == "Search the index. Longer explanation that is part of the summary."
  p = t.parameters
  assert p["required"] == ["query"]
  assert p["additionalProperties"] is False
  props = p["properties"]
  assert props["query"] == {
      "type": "string",
      "description": "what to look for; may span two lines.",
  }
  assert props["limit"] == {"type": "integer", "description": "how many hits.", "default": 3}
  assert props["scale"]["type"] == "number" and props["scale"]["description"] == "score scale."
  assert props["exact"]["type"] == "boolean"
  assert props["tags"]["type"] == "array" and props["tags"]["items"] == {"type": "string"}
  assert props["filters"]["type"] == "object"
  assert props["filters"]["additionalProperties"] == {"type": "integer"}
  assert props["lang"]["type"] == ["string", "null"] and props["lang"]["default"] is None
  assert props["mode"]["type"] == "string" and props["mode"]["enum"] == ["fast", "slow"]
  json.dumps(t.spec())  # the spec is JSON


def test_schema_rejects_untyped_and_unsupported():
  def untyped(x):
    """Doc."""

  with pytest.raises(TypeError, match="argument 'x': missing type annotation"):
    tool(untyped)

  def weird(x: set) -> str:
    return ""

  with pytest.raises(TypeError, match="unsupported type"):
    tool(weird)

  def star(*xs: int) -> str:
    return ""

  with pytest.raises(TypeError, match=r"\*args"):
    tool(star)


def test_parse_docstring_sections():
  summary, args = parse_docstring("""Top.

  Args:
    a: first
      continued.
    b (int): second.

  Raises:
    c: not an argument.
  """)
  assert summary == "Top."
  assert args == {"a": "first continued.", "b": "second."}


def test_validate_arguments_reports_every_problem():
  params = tool(search).parameters
  args, problems = validate_arguments(params, {"query": "x", "limit": 2, "scale": 3})
  assert problems == []
  assert args["scale"] == 3.0 and isinstance(args["scale"], float)  # int widened
  assert args["mode"] == "fast" and args["tags"] == []  # defaults filled

  _, problems = validate_arguments(
      params,
      {"limit": "2", "colour": 1, "exact": 1, "mode": "medium", "tags": ["a", 3], "lang": None},
  )
  text = " | ".join(problems)
  assert "missing required argument 'query'" in text
  assert "unknown argument 'colour'" in text
  assert "limit: expected integer, got str" in text
  assert "exact: expected boolean, got int" in text
  assert "'medium' is not one of ['fast', 'slow']" in text
  assert "tags[1]: expected string, got int" in text
  assert len(problems) == 6  # lang=None is fine: Optional accepts null
  _, problems = validate_arguments(params, ["x"])
  assert problems == ["arguments must be a JSON object, got list"]
  # bool is not an integer even though isinstance(True, int).
  _, problems = validate_arguments(params, {"query": "x", "limit": True})
  assert problems == ["limit: expected integer, got bool True"]


def _calls(*calls):
  return "thinking " + "".join(
      "<tool_call>" + json.dumps({"name": n, "arguments": a}) + "</tool_call>" for n, a in calls
  )


@tool
def add(a: int, b: int) -> int:
  """Adds two integers.

  Args:
    a: first.
    b: second.
  """
  return a + b


def test_execute_valid_calls_in_order():
  tools = ToolSet([add])
  res = tools.execute(_calls(("add", {"a": 1, "b": 2}), ("add", {"a": 5, "b": -7})))
  assert [t.content for t in res.turns] == ["3", "-2"]  # ints rendered as JSON
  assert all(t.role == "tool" and t.name == "add" and t.metadata["ok"] for t in res.turns)
  assert res.faults == () and res.num_invalid == 0
  assert tools.execute("no calls here").turns == ()


@pytest.mark.parametrize(
    "text,kind,needle",
    [
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1,}}</tool_call>',
            FaultKind.MODEL_FORMAT,
            "malformed tool call",
        ),
        (
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}',
            FaultKind.MODEL_FORMAT,
            "unclosed",
        ),
        (_calls(("mul", {"a": 1})), FaultKind.TOOL_ERROR, "unknown tool 'mul'; available: ['add']"),
        (_calls(("add", {"a": 1})), FaultKind.TOOL_ERROR, "missing required argument 'b'"),
        (_calls(("add", {"a": 1, "b": "2"})), FaultKind.TOOL_ERROR, "b: expected integer"),
    ],
)
def test_invalid_calls_become_error_turns(text, kind, needle):
  res = ToolSet([add]).execute(text)
  assert len(res.turns) == 1 and len(res.faults) == 1
  assert res.faults[0].kind == kind
  assert res.num_invalid == 1  # counted for the tool-validity penalty
  assert res.turns[0].role == "tool" and res.turns[0].content.startswith("error: ")
  assert needle in res.turns[0].content
  assert res.turns[0].metadata["ok"] is False


def test_recovery_after_error_in_same_message():
  res = ToolSet([add]).execute(_calls(("add", {"a": 1}), ("add", {"a": 1, "b": 1})))
  assert [t.metadata["ok"] for t in res.turns] == [False, True]
  assert res.turns[1].content == "2" and res.num_invalid == 1


def test_tool_error_vs_infrastructure_error():
  attempts = []

  @tool
  def picky(x: int) -> str:
    """Picky."""
    attempts.append(x)
    if x < 0:
      raise ToolError("x must be >= 0")
    if x == 0:
      raise RuntimeError("database down")
    return "ok"

  tools = ToolSet([picky], max_retries=2)
  res = tools.execute(_calls(("picky", {"x": -1})))
  assert res.faults[0].kind == FaultKind.TOOL_ERROR and res.num_invalid == 1
  assert res.turns[0].content == "error: x must be >= 0"
  assert attempts == [-1]  # model-caused: not retried

  attempts.clear()
  res = tools.execute(_calls(("picky", {"x": 0})))
  assert res.faults[0].kind == FaultKind.INFRASTRUCTURE and res.num_invalid == 0
  assert res.faults[0].retries == 2 and attempts == [0, 0, 0]  # 1 try + 2 retries
  assert "RuntimeError: database down" in res.turns[0].content


def test_declared_model_errors_are_tool_errors():
  @tool(model_errors=(ValueError,))
  def parse(x: str) -> str:
    """Parses an int."""
    return str(int(x))

  res = ToolSet([parse]).execute(_calls(("parse", {"x": "abc"})))
  assert res.faults[0].kind == FaultKind.TOOL_ERROR and res.num_invalid == 1
  assert res.turns[0].content == "error: invalid literal for int() with base 10: 'abc'"
  with pytest.raises(TypeError, match="model_errors"):
    tool(model_errors=("ValueError",))


def test_infrastructure_error_recovered_by_retry():
  state = {"n": 0}

  @tool
  def flaky() -> str:
    """Fails once."""
    state["n"] += 1
    if state["n"] == 1:
      raise InfrastructureError("transient")
    return "fine"

  res = ToolSet([flaky], max_retries=1).execute(_calls(("flaky", {})))
  assert res.faults == () and res.turns[0].content == "fine"


def test_timeout_becomes_timeout_fault_without_blocking():
  release = threading.Event()

  @tool(timeout_s=0.05)
  def hang() -> str:
    """Hangs."""
    release.wait(5)
    return "late"

  start = time.perf_counter()
  res = ToolSet([hang]).execute(_calls(("hang", {})))
  elapsed = time.perf_counter() - start
  release.set()
  assert elapsed < 1.0
  assert res.faults[0].kind == FaultKind.TIMEOUT and res.num_invalid == 0
  assert "timed out after 0.05s" in res.turns[0].content


def test_cache_hits_and_misses_on_canonical_arguments():
  calls = []

  @tool(cacheable=True)
  def lookup(key: str, scale: float = 1.0) -> str:
    """Deterministic lookup."""
    calls.append(key)
    return f"{key}:{scale}"

  @tool
  def fresh(key: str) -> str:
    """Not cacheable."""
    calls.append("fresh")
    return key

  cache = ToolCache()
  tools = ToolSet([lookup, fresh], cache=cache)
  r1 = tools.execute(_calls(("lookup", {"key": "a"})))
  # Same call spelled differently: default made explicit, int for float.
  r2 = tools.execute(_calls(("lookup", {"scale": 1, "key": "a"})))
  r3 = tools.execute(_calls(("lookup", {"key": "b"})))  # another key: a miss
  tools.execute(_calls(("fresh", {"key": "a"}), ("fresh", {"key": "a"})))
  assert r1.turns[0].content == r2.turns[0].content == "a:1.0"
  assert r2.calls[0].cached and not r1.calls[0].cached and not r3.calls[0].cached
  assert r3.turns[0].content == "b:1.0"
  assert calls == ["a", "b", "fresh", "fresh"]
  assert (cache.hits, cache.misses, len(cache)) == (1, 2, 2)
  assert cache.metrics() == {"tool_cache/hits": 1, "tool_cache/misses": 2, "tool_cache/size": 2}
  assert canonical_arguments({"b": 1, "a": [1, 2]}) == '{"a":[1,2],"b":1}'


def test_failed_calls_are_not_cached():
  @tool(cacheable=True)
  def boom(x: int) -> str:
    """Always fails."""
    raise ToolError("no")

  tools = ToolSet([boom])
  tools.execute(_calls(("boom", {"x": 1})))
  tools.execute(_calls(("boom", {"x": 1})))
  assert len(tools.cache) == 0 and tools.cache.hits == 0


def test_system_prompt_lists_schemas_and_syntax():
  tools = ToolSet([add])
  text = tools.system_prompt("Be brief.")
  lines = text.splitlines()
  assert lines[0] == "Be brief."
  spec = json.loads(lines[2])
  assert spec["name"] == "add" and spec["parameters"]["required"] == ["a", "b"]
  assert "<tool_call>" in lines[-1]


def test_toolset_options():
  with pytest.raises(ValueError, match="duplicate tool name 'add'"):
    ToolSet([add, add])
  res = ToolSet([add], max_calls=1).execute(
      _calls(("add", {"a": 1, "b": 1}), ("add", {"a": 2, "b": 2}))
  )
  assert [t.metadata["ok"] for t in res.turns] == [True, False]
  assert "too many tool calls" in res.turns[1].content

  @tool
  def long() -> str:
    """Long output."""
    return "x" * 100

  res = ToolSet([long], max_result_chars=10).execute(_calls(("long", {})))
  assert res.turns[0].content == "x" * 10 + "\n[output truncated: 100 chars -> 10]"
  with pytest.raises(ValueError, match="timeout_s"):
    tool(timeout_s=0)


def test_plain_function_is_wrapped_and_turns_are_turns():
  def mul(a: int, b: int) -> int:
    """Multiplies."""
    return a * b

  tools = ToolSet([mul])
  assert "mul" in tools and tools["mul"].description == "Multiplies."
  res = tools.execute(_calls(("mul", {"a": 3, "b": 4})))
  assert isinstance(res.turns[0], Turn) and res.turns[0].content == "12"
