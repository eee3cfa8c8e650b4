"""Naming things in configs: one `Registry` class, and import paths ('pkg.module:attr').

Every registry of the package (task sources, environment factories, graders)
is a `Registry`: a decorator registers an object under a name, and a config
names it either by that name or by an import path, so a user's own code runs
without editing the package.

Re-registration rule (the same for every registry): registering a name again
with the same object, or with an object of the same module and qualified name
(the module was imported again, e.g. reloaded), replaces the entry silently;
any other object under a taken name is a `ValueError`.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable


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


def _same_definition(a: Any, b: Any) -> bool:
  """True when b is a re-import of a (same module and qualified name)."""
  return (
      getattr(a, "__qualname__", None) is not None
      and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
      and getattr(a, "__module__", None) == getattr(b, "__module__", None)
  )


class Registry:
  """Name -> object, filled by a decorator, looked up by name or import path.

      SOURCES = Registry("task source", hint="built-in tasks register when "
                         "mtrl_jax.tasks is imported")

      @SOURCES.register("calculator")
      def calculator_tasks(split, **kwargs): ...

      SOURCES.resolve("calculator")            # by name
      SOURCES.resolve("my_pkg.tasks:mine")     # by import path

  Args:
    what: what the entries are, for error messages ('environment factory').
    hint: appended to the unknown-name error (where entries come from).
  """

  def __init__(self, what: str, hint: str = ""):
    self.what = what
    self.hint = hint
    self._entries: dict[str, Any] = {}
    self._lock = threading.Lock()

  def register(self, name: str) -> Callable[[Any], Any]:
    """Decorator registering its argument under `name` (see the module's rule)."""
    if not isinstance(name, str) or not name or ":" in name:
      raise ValueError(f"{self.what} name must be a non-empty string without ':', got {name!r}")

    def decorate(obj):
      with self._lock:
        old = self._entries.get(name)
        if old is not None and old is not obj and not _same_definition(old, obj):
          raise ValueError(f"{self.what} {name!r} is already registered to {old!r}")
        self._entries[name] = obj
      return obj

    return decorate

  def names(self) -> list[str]:
    """The registered names, sorted."""
    return sorted(self._entries)

  def __contains__(self, name: str) -> bool:
    return name in self._entries

  def get(self, name: str) -> Any:
    """The object registered under `name`."""
    if name not in self._entries:
      hint = f"; {self.hint}" if self.hint else ""
      raise ValueError(
          f"unknown {self.what} {name!r}; registered: {self.names()}; or use an "
          f"import path 'package.module:Name'{hint}"
      )
    return self._entries[name]

  def resolve(self, spec: Any) -> Any:
    """The object named by a registry name or an import path ('pkg.module:attr'); an
    object that is not a string is returned as it is."""
    if not isinstance(spec, str):
      return spec
    if ":" in spec:
      return import_object(spec, self.what)
    return self.get(spec)

  def spec(self, obj: Any) -> str:
    """A string that `resolve` turns back into `obj`, for a config to hold.

    A string is returned as it is. An object an import path reaches (defined
    at the top level of an importable module) gets that path, which every
    process resolves. Any other object (defined in `__main__` or a notebook,
    inside a function, a lambda, an instance) is registered under a generated
    name, '<module>.<qualname>' (with '@<id>' unless it is a top-level class or
    function, so that two such objects never share a name); only this process
    resolves that name.
    """
    if isinstance(obj, str):
      return obj
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module and qualname and module != "__main__":
      path = f"{module}:{qualname}"
      try:
        if import_object(path, self.what) is obj:
          return path
      except ValueError:
        pass
    if module is None or qualname is None:  # an instance: named after its class
      kind = type(obj)
      module, qualname = kind.__module__, f"{kind.__qualname__}()"
    name = f"{module}.{qualname}".replace(":", ".")
    if not qualname.replace(".", "").isidentifier():
      name += f"@{id(obj):x}"
    self.register(name)(obj)
    return name
