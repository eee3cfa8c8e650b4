"""JSON schemas from typed Python signatures, and argument validation against them.

`function_schema(fn)` reads a function's annotations and Google-style
docstring and returns `(description, parameters_schema)`; supported
annotations: int, float, str, bool, list / list[T], dict / dict[str, T],
Optional[T] (and `T | None`), Literal[...]. `validate_arguments(schema, args)`
checks a call's arguments against that schema and fills defaults, so a tool
function only ever sees arguments of the types it declared.
"""

from __future__ import annotations

import inspect
import re
import types
import typing
from typing import Any, Literal, Union

_SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean"}
_SECTION = re.compile(
    r"^\s*(Args|Arguments|Returns|Raises|Yields|Example|Examples|Note|Notes):\s*$"
)


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
  """Summary (text before the first section) and per-argument descriptions.

  Args:
    doc: a Google-style docstring.

  Returns:
    (summary, {arg name: description}); continuation lines of an argument
    are joined with spaces.
  """
  if not doc:
    return "", {}
  lines = inspect.cleandoc(doc).splitlines()
  summary, args, section, current, arg_indent = [], {}, None, None, None
  for line in lines:
    m = _SECTION.match(line)
    if m:
      section, current = m.group(1), None
      continue
    if section is None:
      summary.append(line.strip())
    elif section in ("Args", "Arguments") and line.strip():
      indent = len(line) - len(line.lstrip())
      am = re.match(r"^\s*\*{0,2}(\w+)\s*(\([^)]*\))?\s*:\s*(.*)$", line)
      if am and (arg_indent is None or indent <= arg_indent):
        arg_indent = indent
        current = am.group(1)
        args[current] = am.group(3).strip()
      elif current is not None:
        args[current] = (args[current] + " " + line.strip()).strip()
  return " ".join(s for s in summary if s).strip(), args


def _is_optional(tp) -> tuple[bool, Any]:
  origin = typing.get_origin(tp)
  if origin is Union or origin is types.UnionType:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if len(args) != len(typing.get_args(tp)):
      inner = args[0] if len(args) == 1 else Union[tuple(args)]
      return True, inner
  return False, tp


def type_schema(tp, where: str = "annotation") -> dict:
  """JSON schema of one annotation; TypeError naming `where` if unsupported."""
  if tp in _SCALARS:
    return {"type": _SCALARS[tp]}
  optional, inner = _is_optional(tp)
  if optional:
    schema = type_schema(inner, where)
    if isinstance(schema.get("type"), str):
      schema["type"] = [schema["type"], "null"]
    return schema
  origin, args = typing.get_origin(tp), typing.get_args(tp)
  if origin is Literal:
    kinds = {type(a) for a in args}
    if len(kinds) != 1 or next(iter(kinds)) not in _SCALARS:
      raise TypeError(f"{where}: Literal values must share one of int/float/str/bool, got {args}")
    return {"type": _SCALARS[next(iter(kinds))], "enum": list(args)}
  if tp is list or origin is list:
    out = {"type": "array"}
    if args:
      out["items"] = type_schema(args[0], where)
    return out
  if tp is dict or origin is dict:
    out = {"type": "object"}
    if args:
      if args[0] is not str:
        raise TypeError(f"{where}: dict keys must be str (JSON objects), got {args[0]}")
      out["additionalProperties"] = type_schema(args[1], where)
    return out
  if tp is Any:
    return {}
  raise TypeError(
      f"{where}: unsupported type {tp!r}; allowed: int, float, str, bool, list[T], "
      "dict[str, T], Optional[T], Literal[...]"
  )


def function_schema(fn) -> tuple[str, dict]:
  """(description, JSON schema of the parameters) of a typed function.

  Every parameter needs an annotation; parameters without a default (and not
  Optional with a None default) are required. `*args` / `**kwargs` are refused.
  """
  summary, arg_docs = parse_docstring(fn.__doc__)
  try:
    hints = typing.get_type_hints(fn)
  except Exception as e:  # unresolved forward references
    raise TypeError(f"tool {fn.__name__}: cannot resolve annotations: {e}") from e
  props, required = {}, []
  for name, p in inspect.signature(fn).parameters.items():
    where = f"tool {fn.__name__}, argument {name!r}"
    if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
      raise TypeError(f"{where}: *args/**kwargs cannot be described by a JSON schema")
    if name not in hints:
      raise TypeError(f"{where}: missing type annotation")
    schema = type_schema(hints[name], where)
    if name in arg_docs and arg_docs[name]:
      schema["description"] = arg_docs[name]
    if p.default is not inspect.Parameter.empty:
      schema["default"] = p.default
    else:
      required.append(name)
    props[name] = schema
  params = {
      "type": "object",
      "properties": props,
      "required": required,
      "additionalProperties": False,
  }
  return summary, params


def _check(value, schema: dict, path: str, errors: list[str]):
  """Validates `value` against `schema`; returns the value (ints widened to float)."""
  if not schema:
    return value
  t = schema.get("type")
  if isinstance(t, list):  # [T, "null"] from Optional[T]
    if value is None:
      return None
    t = t[0]
  ok = {
      "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
      "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
      "string": lambda v: isinstance(v, str),
      "boolean": lambda v: isinstance(v, bool),
      "array": lambda v: isinstance(v, list),
      "object": lambda v: isinstance(v, dict),
  }[t]
  if not ok(value):
    errors.append(f"{path}: expected {t}, got {type(value).__name__} {value!r}")
    return value
  if "enum" in schema and value not in schema["enum"]:
    errors.append(f"{path}: {value!r} is not one of {schema['enum']}")
  if t == "number":
    return float(value)
  if t == "array" and "items" in schema:
    return [_check(v, schema["items"], f"{path}[{i}]", errors) for i, v in enumerate(value)]
  if (
      t == "object"
      and "additionalProperties" in schema
      and isinstance(schema["additionalProperties"], dict)
  ):
    sub = schema["additionalProperties"]
    return {k: _check(v, sub, f"{path}.{k}", errors) for k, v in value.items()}
  return value


def validate_arguments(params: dict, arguments: Any) -> tuple[dict, list[str]]:
  """Checks a call's arguments against a parameters schema from `function_schema`.

  Args:
    params: the parameters schema.
    arguments: the decoded "arguments" of the call.

  Returns:
    (arguments with defaults filled and numbers widened, list of problems);
    the call is valid iff the list is empty.
  """
  if not isinstance(arguments, dict):
    return {}, [f"arguments must be a JSON object, got {type(arguments).__name__}"]
  props, errors, out = params["properties"], [], {}
  for name in arguments:
    if name not in props:
      errors.append(f"unknown argument {name!r}; allowed: {sorted(props)}")
  for name in params["required"]:
    if name not in arguments:
      errors.append(f"missing required argument {name!r}")
  for name, schema in props.items():
    if name in arguments:
      out[name] = _check(arguments[name], schema, name, errors)
    elif "default" in schema:
      out[name] = schema["default"]
  return out, errors
