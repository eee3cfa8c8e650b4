"""Finding environment factories: a registry of names, and import paths.

    @register_env_factory("weather")
    class WeatherFactory(EnvironmentFactory): ...

    resolve_factory("weather")                     # registry name
    resolve_factory("my_pkg.my_env:MyFactory")     # import path: no package edit
    resolve_factory("calculator", show_tools=True) # constructor arguments

A user's own environment runs without editing the package: the config names it
as `--config.env.factory=my_pkg.my_env:MyFactory`. Registry names of the
built-in tasks resolve once `mtrl_jax.tasks` is imported (the training entry
points do it).
"""

from __future__ import annotations

from typing import Callable, Mapping

from mtrl_jax.envs.core import Environment, EnvironmentFactory
from mtrl_jax.registry import Registry


class _FunctionFactory(EnvironmentFactory):
  """Adapts a plain callable `metadata -> Environment` (or an Environment class)."""

  def __init__(self, fn: Callable[[Mapping], Environment]):
    self.fn = fn

  def create_environment(self, metadata):
    return self.fn(metadata)


# name -> an EnvironmentFactory subclass or instance, an Environment class, or a
# callable `metadata -> Environment`. The built-in tasks (`mtrl_jax.tasks`, a
# higher layer) register themselves when imported; the run's composition root
# imports them.
ENV_FACTORIES = Registry(
    "environment factory",
    hint="the built-in tasks (calculator, coop, "
    "humaneval, weather) register when mtrl_jax.tasks is imported",
)


def register_env_factory(name: str):
  """Class/function decorator registering an environment factory under `name`.

  The decorated object is an `EnvironmentFactory` subclass (instantiated with
  the keyword arguments given to `resolve_factory`), a factory instance, or a
  callable `metadata -> Environment`.
  """
  return ENV_FACTORIES.register(name)


def registered_env_factories() -> list[str]:
  return ENV_FACTORIES.names()


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
  obj = ENV_FACTORIES.resolve(spec) if isinstance(spec, str) else spec
  if isinstance(obj, EnvironmentFactory) or (
      not isinstance(obj, type) and hasattr(obj, "create_environment")
  ):
    if kwargs:
      raise ValueError(f"environment factory {spec!r} is an instance; cannot apply {kwargs}")
    return obj
  if isinstance(obj, type) and issubclass(obj, EnvironmentFactory):
    return obj(**kwargs)
  if isinstance(obj, type) and issubclass(obj, Environment):
    return _FunctionFactory(lambda metadata: obj(metadata, **kwargs))
  if callable(obj):
    return _FunctionFactory(lambda metadata: obj(metadata, **kwargs))
  raise TypeError(
      f"environment factory {spec!r} resolved to {obj!r}, which is neither an "
      "EnvironmentFactory, an Environment class nor a callable"
  )
