"""Finding environment factories: a registry of names, and import paths.

    @register_env_factory("weather")
    class WeatherFactory(EnvironmentFactory): ...

    resolve_factory("weather")                     # registry name
    resolve_factory("my_pkg.my_env:MyFactory")     # import path: no package edit
    resolve_factory("calculator", show_tools=True) # constructor arguments

A user's own environment runs without editing the package: the config names it
as `--config.env.factory=my_pkg.my_env:MyFactory`.
"""

from __future__ import annotations

import importlib
import threading
from typing import Any, Callable, Mapping

from mtrl_jax.envs.core import Environment, EnvironmentFactory
from mtrl_jax.registry import import_object


class _FunctionFactory(EnvironmentFactory):
  """Adapts a plain callable `metadata -> Environment` (or an Environment class)."""

  def __init__(self, fn: Callable[[Mapping], Environment]):
    self.fn = fn

  def create_environment(self, metadata):
    return self.fn(metadata)


_REGISTRY: dict[str, Any] = {}
_REGISTRY_LOCK = threading.Lock()
# Imported on a registry miss so their factories register themselves.
_BUILTIN_MODULES = ("mtrl_jax.envs.examples", "mtrl_jax.envs.tasks")


def register_env_factory(name: str):
  """Class/function decorator registering an environment factory under `name`.

  The decorated object is an `EnvironmentFactory` subclass (instantiated with
  the keyword arguments given to `resolve_factory`), a factory instance, or a
  callable `metadata -> Environment`.
  """
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(f"register_env_factory: name must be a non-empty string without ':', "
                     f"got {name!r}")

  def decorate(obj):
    with _REGISTRY_LOCK:
      if name in _REGISTRY and _REGISTRY[name] is not obj:
        old = _REGISTRY[name]
        same = getattr(old, "__qualname__", None) == getattr(obj, "__qualname__", 0) and (
            getattr(old, "__module__", None) == getattr(obj, "__module__", 0))
        if not same:  # re-importing a module re-registers the same name: fine
          raise ValueError(f"environment factory {name!r} is already registered to {old!r}")
      _REGISTRY[name] = obj
    return obj

  return decorate


def registered_env_factories() -> list[str]:
  return sorted(_REGISTRY)


def _import_path(spec: str):
  return import_object(spec, "environment factory")


def resolve_factory(spec, **kwargs) -> EnvironmentFactory:
  """The factory named by `spec`.

  Args:
    spec: a registry name ('weather'), an import path
      ('my_pkg.my_env:MyFactory'), or an object: an `EnvironmentFactory`
      instance or subclass, an `Environment` subclass (called with metadata),
      or a callable `metadata -> Environment`.
    kwargs: constructor arguments when `spec` names a class.

  Returns:
    An object with `create_environment(metadata)`.
  """
  obj = spec
  if isinstance(spec, str):
    if ":" in spec:
      obj = _import_path(spec)
    else:
      if spec not in _REGISTRY:
        for module in _BUILTIN_MODULES:
          try:
            importlib.import_module(module)
          except ModuleNotFoundError as e:
            if e.name != module:  # a real import error inside the module
              raise
      if spec not in _REGISTRY:
        raise ValueError(f"unknown environment factory {spec!r}; registered: "
                         f"{registered_env_factories()}; or use an import path "
                         "'package.module:Name'")
      obj = _REGISTRY[spec]
  if isinstance(obj, EnvironmentFactory) or (
      not isinstance(obj, type) and hasattr(obj, "create_environment")):
    if kwargs:
      raise ValueError(f"environment factory {spec!r} is an instance; cannot apply {kwargs}")
    return obj
  if isinstance(obj, type) and issubclass(obj, EnvironmentFactory):
    return obj(**kwargs)
  if isinstance(obj, type) and issubclass(obj, Environment):
    return _FunctionFactory(lambda metadata: obj(metadata, **kwargs))
  if callable(obj):
    return _FunctionFactory(lambda metadata: obj(metadata, **kwargs))
  raise TypeError(f"environment factory {spec!r} resolved to {obj!r}, which is neither an "
                  "EnvironmentFactory, an Environment class nor a callable")
