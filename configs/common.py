"""Helpers shared by config files: structure arguments after ':' in --config."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **defaults) -> ml_collections.ConfigDict:
  """Parses 'k1=v1,k2=v2' into a ConfigDict, typed like `defaults`.

  `configs/calculator.py:model=tiny,smoke=True` picks structure; scalars are set
  with `--config.x=y` flags afterwards.

  Args:
    arg: the text after ':' in the --config flag (may be None or empty).
    **defaults: every allowed key with its default value (its type is the type
      the value is parsed to).
  Returns:
    A ConfigDict holding the defaults updated by `arg`.
  """
  out = ml_collections.ConfigDict(defaults)
  for item in filter(None, (arg or "").split(",")):
    if "=" not in item:
      raise ValueError(f"config argument {item!r}: expected key=value; allowed keys: "
                       f"{sorted(defaults)}")
    key, value = item.split("=", 1)
    if key not in defaults:
      raise ValueError(f"config argument key {key!r}; allowed keys: {sorted(defaults)}")
    default = defaults[key]
    if isinstance(default, bool):
      if value.lower() not in ("true", "false", "1", "0"):
        raise ValueError(f"config argument {key}={value!r}: expected true or false")
      out[key] = value.lower() in ("true", "1")
    elif isinstance(default, int):
      out[key] = int(value)
    elif isinstance(default, float):
      out[key] = float(value)
    else:
      out[key] = value
  return out
