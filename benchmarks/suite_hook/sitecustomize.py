"""Records one Python process's compile work for `benchmarks.suite_profile`.

Python imports `sitecustomize` at start-up from the first directory of `sys.path`
that has one; `benchmarks.suite_profile` puts this directory on PYTHONPATH, so
the pytest workers and every process the tests start (they inherit the
environment) load it. Nothing happens unless `$MTRL_JAX_SUITE_PROFILE` names a
file. Then, once the process imports jax, a `jax.monitoring` listener sums the
seconds jax spends tracing, lowering and compiling (a compile-cache load
included) per function name, and at exit the process appends one JSON line to
that file: its pid and parent pid, the test that was running when it started
(`$PYTEST_CURRENT_TEST`), its own and its children's CPU seconds, and those sums.
"""

import atexit
import importlib.abc
import importlib.util
import json
import os
import resource
import sys

_OUT = os.environ.get("MTRL_JAX_SUITE_PROFILE")
# jax.monitoring's duration events of one compilation, each carrying `fun_name`.
EVENTS = {
    "/jax/core/compile/jaxpr_trace_duration": "trace",
    "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
    "/jax/core/compile/backend_compile_duration": "backend",
    "/jax/compilation_cache/cache_retrieval_time_sec": "cache_load",
}


def _listen(sums: dict) -> None:
  from jax import monitoring  # noqa: PLC0415  (jax is being imported: see _AfterJax)

  def on_duration(event, seconds, **kwargs):
    kind = EVENTS.get(event)
    if kind is not None:
      key = f"{kind}:{kwargs.get('fun_name', '')}"
      count, total = sums.get(key, (0, 0.0))
      sums[key] = (count + 1, total + seconds)

  monitoring.register_event_duration_secs_listener(on_duration)


class _AfterJax(importlib.abc.MetaPathFinder):
  """Registers the listener right after jax's own module runs: importing jax here,
  earlier, would read its configuration before tests/conftest.py sets it."""

  def __init__(self, sums: dict):
    self.sums = sums

  def find_spec(self, name, path=None, target=None):
    if name != "jax":
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec("jax")
    run_module = spec.loader.exec_module

    def exec_module(module):
      run_module(module)
      _listen(self.sums)

    spec.loader.exec_module = exec_module
    return spec


def _install(out: str) -> None:
  sums = {}
  test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" ", 1)[0]
  sys.meta_path.insert(0, _AfterJax(sums))

  def dump():
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "test": test,
        "cpu": own.ru_utime + own.ru_stime,
        "children_cpu": children.ru_utime + children.ru_stime,
        "jax": sums,
    }
    with open(out, "a") as f:
      f.write(json.dumps(record) + "\n")

  atexit.register(dump)


if _OUT:
  _install(_OUT)
