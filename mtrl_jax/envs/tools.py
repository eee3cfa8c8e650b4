"""Tools: `@tool` functions with JSON schemas, and a per-environment `ToolSet`.

    @tool(timeout_s=2.0, cacheable=True)
    def get_weather(city: str, unit: Literal["c", "f"] = "c") -> str:
      '''Current temperature in a city.

      Args:
        city: city name, e.g. "Paris".
        unit: "c" for Celsius or "f" for Fahrenheit.
      '''

    tools = ToolSet([get_weather])
    system = tools.system_prompt()          # schemas rendered for the policy
    results = tools.execute(policy_text)    # parse <tool_call>s, run them
    thread = thread.append(*results.turns)  # one `tool` turn per call

Invalid calls (malformed JSON, unknown tool, wrong or missing arguments, a
`ToolError` raised by the tool) become an error tool turn the policy can
recover from and a penalisable fault. A tool whose code raises a programming
error (TypeError, KeyError, ...: `faults.CONTRACT_ERRORS`) is a contract fault
(masked, not retried); anything else is an infrastructure fault (retried
`max_retries` times, then the sample is masked);
a tool that runs past its timeout is a timeout fault: infrastructure, so the
step is masked by default (`FaultPolicy.tool_timeout`, config
`env.tool_timeout='tell'` shows the policy the error turn instead). Each call
runs in a pooled daemon worker thread so a hung tool cannot block the rollout.
Long results are cut in characters before anything tokenises them
(`cap_output`: `ToolSet(max_result_chars=)`, and every tool turn of a step at
`StepLimits.max_tool_output_chars`), with a note in the turn's text.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import sys
import threading
import time
from typing import Any, Callable, Iterable, Optional

from mtrl_jax.envs.core import Thread, Turn
from mtrl_jax.envs.fault_report import exception_location
from mtrl_jax.envs.faults import (
    MODEL_CAUSED,
    Fault,
    FaultKind,
    FaultTimeoutError,
    ToolError,
    call_with_timeout,
    classify,
)
from mtrl_jax.envs.tool_schema import function_schema, validate_arguments
from mtrl_jax.resources import SharedResource


@dataclasses.dataclass(frozen=True, eq=False)
class Tool:
  """A callable with a name, a description and a JSON schema for its arguments.

  Attributes:
    fn: the Python function.
    name: the name the policy calls it by.
    description: from the docstring summary.
    parameters: JSON schema of the arguments (object with properties/required).
    timeout_s: wall-clock limit of one call (None: no limit).
    cacheable: results may be cached by (name, canonical arguments); only for
      deterministic tools.
    model_errors: exception types the tool raises for bad arguments (e.g.
      ValueError); they count as tool_error (model-caused) instead of
      infrastructure. `ToolError` always does.
  """

  fault_source = "tool"  # faults raised inside are the tool's (`fault_source`)

  fn: Callable
  name: str
  description: str
  parameters: dict
  timeout_s: Optional[float] = 10.0
  cacheable: bool = False
  model_errors: tuple = ()

  def __call__(self, *args, **kwargs):
    return self.fn(*args, **kwargs)

  def spec(self) -> dict:
    """The schema shown to the policy: name, description, parameters."""
    return {"name": self.name, "description": self.description, "parameters": self.parameters}

  def __reduce__(self):
    # A `@tool`-decorated function's module name holds this Tool, not `fn`, so `fn`
    # does not pickle by reference: the Tool does, by that name (worker processes,
    # `rollout.workers`). Otherwise field by field.
    module, name = getattr(self.fn, "__module__", None), getattr(self.fn, "__qualname__", "")
    if getattr(sys.modules.get(module), name, None) is self:
      return _module_attribute, (module, name)
    return type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self))


def _module_attribute(module: str, name: str):
  """`module.name`, importing the module (how a `@tool` Tool is unpickled)."""
  return getattr(importlib.import_module(module), name)


def tool(
    fn: Optional[Callable] = None,
    *,
    name: Optional[str] = None,
    description: Optional[str] = None,
    timeout_s: Optional[float] = 10.0,
    cacheable: bool = False,
    model_errors: tuple = (),
):
  """Decorator turning a typed Python function into a `Tool`.

  Usable bare (`@tool`) or with options (`@tool(timeout_s=1.0, cacheable=True)`).

  Args:
    fn: the function; every argument needs a type annotation, and its
      docstring's Args section gives the argument descriptions.
    name: tool name (default: the function name).
    description: overrides the docstring summary.
    timeout_s: per-call time limit in seconds (None: unlimited).
    cacheable: opt in to the result cache (deterministic tools only).
    model_errors: exception types that mean "the caller's arguments are
      wrong" (shown to the policy, penalisable); any other exception except
      `ToolError` is an infrastructure fault.
  """
  if timeout_s is not None and timeout_s <= 0:
    raise ValueError(f"tool timeout_s={timeout_s}; must be > 0 or None")
  model_errors = tuple(model_errors)
  if not all(isinstance(e, type) and issubclass(e, Exception) for e in model_errors):
    raise TypeError(f"tool model_errors={model_errors!r}; must be Exception subclasses")

  def wrap(f):
    summary, params = function_schema(f)
    return Tool(
        fn=f,
        name=name or f.__name__,
        description=description or summary,
        parameters=params,
        timeout_s=timeout_s,
        cacheable=cacheable,
        model_errors=model_errors,
    )

  return wrap(fn) if fn is not None else wrap


def canonical_arguments(arguments: dict) -> str:
  """The cache key form of arguments: JSON with sorted keys, no spaces."""
  return json.dumps(arguments, sort_keys=True, separators=(",", ":"), default=str)


class ToolCache(SharedResource):
  """Thread-safe result cache of cacheable tools, keyed by (name, canonical args).

  Shared (not copied) when an environment is forked: deterministic results
  stay valid across branches. Pass one cache to every ToolSet of a factory to
  share it across trajectories.
  """

  fault_source = "tool"

  def __init__(self):
    self._lock = threading.Lock()
    self._data: dict[tuple[str, str], str] = {}
    self.hits = 0
    self.misses = 0

  def __getstate__(self):
    state = dict(self.__dict__)
    del state["_lock"]  # a pickled copy (a worker process) gets its own lock
    return state

  def __setstate__(self, state):
    self.__dict__.update(state)
    self._lock = threading.Lock()

  def get(self, key):
    with self._lock:
      if key in self._data:
        self.hits += 1
        return True, self._data[key]
      self.misses += 1
      return False, None

  def put(self, key, value: str) -> None:
    with self._lock:
      self._data[key] = value

  def __len__(self):
    return len(self._data)

  def metrics(self, prefix: str = "tool_cache/") -> dict[str, int]:
    return {f"{prefix}hits": self.hits, f"{prefix}misses": self.misses, f"{prefix}size": len(self)}


@dataclasses.dataclass(frozen=True)
class ToolCallRecord:
  """What happened to one call: for logs and per-turn graders."""

  name: str
  arguments: Any
  ok: bool
  result: str
  fault: Optional[Fault] = None
  cached: bool = False
  elapsed_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class ToolResults:
  """The outcome of `ToolSet.execute` on one policy message."""

  turns: tuple[Turn, ...]
  calls: tuple[ToolCallRecord, ...]
  faults: tuple[Fault, ...]

  @property
  def num_invalid(self) -> int:
    """Model-caused faults (malformed, unknown tool, bad arguments, ToolError)."""
    return sum(f.kind in MODEL_CAUSED for f in self.faults)

  @property
  def any_calls(self) -> bool:
    return bool(self.turns)


def cap_output(text: str, max_chars: Optional[int]) -> str:
  """`text` cut to its first `max_chars` characters plus a note saying so
  ("[output truncated: 52,428,800 chars -> 8,000]"); unchanged when it fits
  or `max_chars` is None."""
  if max_chars is None or len(text) <= max_chars:
    return text
  return f"{text[:max_chars]}\n[output truncated: {len(text):,} chars -> {max_chars:,}]"


def cap_tool_turns(thread: Thread, start: int, max_chars: int) -> Thread:
  """The thread with every tool turn from index `start` on cut to `max_chars`
  characters (`cap_output`; the turn's metadata keeps `truncated_chars`)."""
  turns = list(thread.turns)
  for i in range(start, len(turns)):
    t = turns[i]
    if t.role == "tool" and len(t.content) > max_chars:
      turns[i] = Turn(
          "tool",
          cap_output(t.content, max_chars),
          t.name,
          {**t.metadata, "truncated_chars": len(t.content)},
      )
  return thread if turns == list(thread.turns) else thread.replace(turns=tuple(turns))


def _to_text(result) -> str:
  if isinstance(result, str):
    return result
  try:
    return json.dumps(result, default=str)
  except (TypeError, ValueError):
    return str(result)


class ToolSet:
  """The tools of one environment: schemas for the prompt, parsing and execution.

  Args:
    tools: `Tool`s (plain typed functions are wrapped with `tool`).
    cache: result cache for cacheable tools (default: a fresh one).
    max_retries: retries of a call that raised an infrastructure error.
    max_calls: most calls executed per message (extra calls get an error turn
      and a tool_error fault); None: unlimited.
    max_result_chars: longer results are cut, with a note (`cap_output`);
      None: only the step's cap applies (`StepLimits.max_tool_output_chars`).
  """

  fault_source = "tool"

  def __init__(
      self,
      tools: Iterable = (),
      *,
      cache: Optional[ToolCache] = None,
      max_retries: int = 1,
      max_calls: Optional[int] = None,
      max_result_chars: Optional[int] = None,
  ):
    if max_retries < 0:
      raise ValueError(f"ToolSet max_retries={max_retries}; must be >= 0")
    self._tools: dict[str, Tool] = {}
    self.cache = cache if cache is not None else ToolCache()
    self.max_retries = max_retries
    self.max_calls = max_calls
    self.max_result_chars = max_result_chars
    for t in tools:
      self.add(t)

  def add(self, t) -> Tool:
    t = t if isinstance(t, Tool) else tool(t)
    if t.name in self._tools:
      raise ValueError(f"ToolSet: duplicate tool name {t.name!r}")
    self._tools[t.name] = t
    return t

  @property
  def names(self) -> list[str]:
    return list(self._tools)

  def __contains__(self, name: str) -> bool:
    return name in self._tools

  def __getitem__(self, name: str) -> Tool:
    return self._tools[name]

  def __len__(self):
    return len(self._tools)

  def specs(self) -> list[dict]:
    return [t.spec() for t in self._tools.values()]

  def system_prompt(self, preamble: str = "") -> str:
    """The tool schemas and call syntax, for the system prompt."""
    lines = [preamble] if preamble else []
    lines.append("Tools (one JSON schema per line):")
    lines += [json.dumps(s, separators=(",", ":")) for s in self.specs()]
    lines.append('Call a tool with <tool_call>{"name": ..., "arguments": {...}}</tool_call>')
    return "\n".join(lines)

  # ------------------------------------------------------------------ execution
  def _error(
      self,
      name: str,
      kind: FaultKind,
      message: str,
      arguments=None,
      retries: int = 0,
      elapsed: float = 0.0,
      where: str = "",
  ):
    fault = Fault(kind, f"tool:{name}", message, retries, where)
    turn = Turn("tool", f"error: {message}", name=name, metadata={"ok": False, "fault": kind.value})
    return turn, ToolCallRecord(name, arguments, False, turn.content, fault, False, elapsed)

  def call(self, name: str, arguments: Any) -> tuple[Turn, ToolCallRecord]:
    """Validates and runs one call; never raises: failures become error turns."""
    if name not in self._tools:
      return self._error(
          name, FaultKind.TOOL_ERROR, f"unknown tool {name!r}; available: {self.names}", arguments
      )
    t = self._tools[name]
    args, problems = validate_arguments(t.parameters, arguments)
    if problems:
      return self._error(
          name,
          FaultKind.TOOL_ERROR,
          f"invalid arguments for {name!r}: " + "; ".join(problems),
          arguments,
      )
    key = (name, canonical_arguments(args))
    if t.cacheable:
      hit, value = self.cache.get(key)
      if hit:
        return (
            Turn("tool", value, name=name, metadata={"ok": True, "cached": True}),
            ToolCallRecord(name, args, True, value, None, True, 0.0),
        )
    start, retries = time.perf_counter(), 0
    while True:
      try:
        text = _to_text(call_with_timeout(t.fn, t.timeout_s, f"tool {name!r}", **args))
        break
      except Exception as e:  # classified below; never escapes the tool set
        declared = bool(t.model_errors) and isinstance(e, t.model_errors)
        kind = FaultKind.TOOL_ERROR if declared else classify(e)
        if kind == FaultKind.INFRASTRUCTURE and retries < self.max_retries:
          retries += 1
          continue
        msg = (
            str(e)
            if declared or isinstance(e, (ToolError, FaultTimeoutError))
            else (f"tool {name!r} failed ({type(e).__name__}: {e})")
        )
        if kind == FaultKind.MODEL_FORMAT:  # a tool raising ModelFormatError
          kind = FaultKind.TOOL_ERROR
        where, location = getattr(t.fn, "__qualname__", name), exception_location(e)
        if location:
          where = f"{where} ({location})"
        return self._error(name, kind, msg, args, retries, time.perf_counter() - start, where)
    text = cap_output(text, self.max_result_chars)
    if t.cacheable:
      self.cache.put(key, text)
    return (
        Turn("tool", text, name=name, metadata={"ok": True}),
        ToolCallRecord(name, args, True, text, None, False, time.perf_counter() - start),
    )

  def execute(self, text: str) -> ToolResults:
    """Parses the `<tool_call>`s in a policy message and runs them in order.

    Args:
      text: the policy's completion.

    Returns:
      `ToolResults` with one tool turn per call (an error turn for a
      malformed message) and the faults; no calls -> empty results.
    """
    from mtrl_jax.text.tool_calls import ToolCallError, parse_tool_calls

    try:
      calls = parse_tool_calls(text)
    except ToolCallError as e:
      turn, rec = self._error("<parse>", FaultKind.MODEL_FORMAT, f"malformed tool call: {e}")
      return ToolResults((turn,), (rec,), (rec.fault,))
    turns, records = [], []
    for i, c in enumerate(calls):
      if self.max_calls is not None and i >= self.max_calls:
        turn, rec = self._error(
            c.name,
            FaultKind.TOOL_ERROR,
            f"too many tool calls in one message (max {self.max_calls})",
            c.arguments,
        )
      else:
        turn, rec = self.call(c.name, c.arguments)
      turns.append(turn)
      records.append(rec)
    return ToolResults(
        tuple(turns), tuple(records), tuple(r.fault for r in records if r.fault is not None)
    )
