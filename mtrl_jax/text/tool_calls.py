"""Tool-call syntax: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, and answer tags.

Parsing is strict on purpose: a malformed call is a model format error
(docs/design.md invariant 7), so `ToolCallError` says exactly what is wrong and the
environment can report it back to the policy or penalise it.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Optional

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


class ToolCallError(ValueError):
  """A malformed tool call; the message names the call and the problem."""


@dataclasses.dataclass(frozen=True)
class ToolCall:
  """One parsed call: tool `name`, its `arguments`, and the `raw` tagged text."""

  name: str
  arguments: dict
  raw: str


def render_tool_call(
    name: str,
    arguments: dict[str, Any],
    open_tag: str = TOOL_CALL_OPEN,
    close_tag: str = TOOL_CALL_CLOSE,
) -> str:
  """The tagged call in compact JSON (no spaces: demo episodes stay short)."""
  if not isinstance(name, str) or not name:
    raise ValueError(f"render_tool_call: name must be a non-empty string, got {name!r}")
  if not isinstance(arguments, dict):
    raise ValueError(f"render_tool_call: arguments must be a dict, got {type(arguments).__name__}")
  body = json.dumps(
      {"name": name, "arguments": arguments}, separators=(",", ":"), ensure_ascii=False
  )
  return f"{open_tag}{body}{close_tag}"


def _parse_body(body: str, k: int) -> tuple:
  where = f"tool call #{k}"
  if not body.strip():
    raise ToolCallError(f"{where}: empty body between the tags")
  try:
    obj = json.loads(body)
  except json.JSONDecodeError as e:
    near = body[max(0, e.pos - 12) : e.pos + 12]
    raise ToolCallError(
        f"{where}: invalid JSON at position {e.pos} (line {e.lineno}, "
        f"column {e.colno}): {e.msg}; near {near!r}"
    ) from None
  if not isinstance(obj, dict):
    raise ToolCallError(
        f'{where}: JSON must be an object {{"name": ..., "arguments": {{...}}}}, '
        f"got {type(obj).__name__}"
    )
  if "name" not in obj:
    raise ToolCallError(f'{where}: missing "name"')
  if not isinstance(obj["name"], str) or not obj["name"]:
    raise ToolCallError(f'{where}: "name" must be a non-empty string, got {obj["name"]!r}')
  if "arguments" not in obj:
    raise ToolCallError(f'{where}: missing "arguments" (use {{}} for a tool without arguments)')
  if not isinstance(obj["arguments"], dict):
    raise ToolCallError(
        f'{where}: "arguments" must be a JSON object, got '
        f'{type(obj["arguments"]).__name__} {obj["arguments"]!r}'
    )
  extra = sorted(set(obj) - {"name", "arguments"})
  if extra:
    raise ToolCallError(f'{where}: unexpected keys {extra}; allowed: ["name", "arguments"]')
  return obj["name"], obj["arguments"]


def parse_tool_calls(
    text: str, open_tag: str = TOOL_CALL_OPEN, close_tag: str = TOOL_CALL_CLOSE
) -> list[ToolCall]:
  """All tool calls in `text`, in order (empty list when there are none).

  Raises:
    ToolCallError: an unclosed or nested opening tag, a closing tag without
      an opening one, an empty body, invalid JSON (with its position), a
      non-object, a missing or non-string "name", a missing or non-object
      "arguments", or unexpected keys.
  """
  tags = re.compile(f"{re.escape(open_tag)}|{re.escape(close_tag)}")
  calls, start, k = [], None, 0
  for m in tags.finditer(text):
    if m.group() == open_tag:
      if start is not None:
        raise ToolCallError(
            f"tool call #{k}: {open_tag} at char {start} is not closed before "
            f"the next {open_tag} at char {m.start()}"
        )
      k += 1
      start = m.start()
    else:
      if start is None:
        raise ToolCallError(f"{close_tag} at char {m.start()} has no matching {open_tag}")
      name, arguments = _parse_body(text[start + len(open_tag) : m.start()], k)
      calls.append(ToolCall(name, arguments, text[start : m.end()]))
      start = None
  if start is not None:
    raise ToolCallError(
        f"tool call #{k}: unclosed tag: {open_tag} at char {start} has no {close_tag}"
    )
  return calls


def extract_answer(text: str, tag: str = "answer") -> Optional[str]:
  """Content of the last complete `<tag>...</tag>`, whitespace-stripped; None if absent."""
  open_tag, close_tag = f"<{tag}>", f"</{tag}>"
  # Content may not contain another opening tag, so "<a>x<a>y</a>" yields "y".
  pattern = re.compile(
      f"{re.escape(open_tag)}((?:(?!{re.escape(open_tag)}).)*?){re.escape(close_tag)}",
      re.DOTALL,
  )
  matches = pattern.findall(text)
  return matches[-1].strip() if matches else None
