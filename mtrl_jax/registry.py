"""Naming things in configs: one `Registry` class, and import paths ('pkg.module:attr').

Every registry of the package (task sources, environment factories, graders)
is a `Registry`: a decorator registers an object under a name, and a config
names it either by that name or by an import path, so a user's own code runs
without editing the package.

Re-registration rule (the same for every registry): registering a name again
with the same object, or with an object of the same module and qualified name
(the module was imported again, e.g. reloaded), replaces the entry silently;
any other object under a taken name is a `ValueError`.

`alias_module` keeps an old import path working after a module moved.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
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
  return (getattr(a, "__qualname__", None) is not None
          and getattr(a, "__qualname__", None) == getattr(b, "__qualname__", None)
          and getattr(a, "__module__", None) == getattr(b, "__module__", None))


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
      raise ValueError(f"{self.what} name must be a non-empty string without ':', "
                       f"got {name!r}")

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
      raise ValueError(f"unknown {self.what} {name!r}; registered: {self.names()}; or use an "
                       f"import path 'package.module:Name'{hint}")
    return self._entries[name]

  def resolve(self, spec: str) -> Any:
    """The object named by a registry name or an import path ('pkg.module:attr')."""
    if ":" in spec:
      return import_object(spec, self.what)
    return self.get(spec)


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  """Imports `old.X` as the already-existing module `new.X` (the same object)."""

  def __init__(self, old: str, new: str):
    self.old, self.new = old, new
    self._specs: dict[str, Any] = {}  # real module name -> its own spec

  def find_spec(self, name, path=None, target=None):
    if not name.startswith(self.old + "."):
      return None
    return importlib.util.spec_from_loader(name, self)

  def create_module(self, spec):
    module = importlib.import_module(self.new + spec.name[len(self.old):])
    self._specs[module.__name__] = module.__spec__
    return module

  def exec_module(self, module):
    # The import system stamps the alias's spec on the module; give it its own back.
    module.__spec__ = self._specs[module.__name__]


def alias_module(old: str, new: str) -> Any:
  """Makes the module (or package) `old` and all its submodules names of `new`'s.

  For old import paths kept after a move: `import old.sub` and
  `import_object('old.sub:attr')` give the very module objects of `new`,
  executed once, so registrations are not repeated. Called from the shim
  module `old` itself, which is only imported when somebody names it.

  Returns:
    The module `new`.
  """
  module = importlib.import_module(new)
  sys.modules[old] = module
  with _ALIAS_LOCK:
    if not any(isinstance(f, _AliasFinder) and f.old == old for f in sys.meta_path):
      sys.meta_path.insert(0, _AliasFinder(old, new))
  return module


_ALIAS_LOCK = threading.Lock()
