"""Import paths: how configs name user code ('pkg.module:attr') without editing the package."""

from __future__ import annotations

import importlib
from typing import Any


def import_object(spec: str, what: str = "object") -> Any:
  """Resolves 'package.module:attr' (attr may be dotted) to the object.

  Args:
    spec: the import path.
    what: what the object is, for error messages ('environment factory', ...).
  Raises:
    ValueError naming the path and what is wrong with it.
  """
  module_name, sep, attr = str(spec).partition(":")
  if not sep or not module_name or not attr:
    raise ValueError(f"{what} {spec!r}: expected an import path 'package.module:name'")
  try:
    obj = importlib.import_module(module_name)
  except ImportError as e:
    raise ValueError(f"{what} {spec!r}: cannot import {module_name!r}: {e}") from e
  for part in attr.split("."):
    if not hasattr(obj, part):
      raise ValueError(f"{what} {spec!r}: module {module_name!r} has no {attr!r}")
    obj = getattr(obj, part)
  return obj
