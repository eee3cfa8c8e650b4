"""Test set-up: 8 fake CPU devices, set before jax is imported anywhere; shared fixtures.

A count already in XLA_FLAGS wins: `make test` runs the tests marked several_devices
(pytest.ini) on the 8 and the rest on one (`--xla_force_host_platform_device_count=1`),
where the tests marked several_devices are skipped, saying why.

Compilation is ~40% of this suite's time (1232 s of test time from an empty cache,
720 s with every program cached; AMD EPYC family 25 model 17, 2026-12-06), so the
suite compiles cheaply: LLVM at optimisation level 0 (the XLA program is the same;
half the compile time) and XLA:CPU's older elemental emitters instead of its MLIR
fusion emitters (`--xla_cpu_use_fusion_emitters=false`: the same fused program through
another code generator; 1.75x less compile time on the calculator smoke run). A
persistent compilation cache shared by the whole `pytest` run (below) turns repeated
compiles of the same program into loads. Subprocesses get the same flags through
`mtrl_jax.testing.cpu_env`.

Fixtures (built by `mtrl_jax.testing`, which also holds the scripted fakes):
`byte_tokenizer`, `renderer` (compact chat format on it, fresh per test) and
`tiny_model` (the seed-0 `tiny` preset, built once per process).
"""

import os

_FLAGS = (
    "--xla_force_host_platform_device_count=8",
    "--xla_backend_optimization_level=0",
    "--xla_cpu_use_fusion_emitters=false",
)
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", "")]
    + [f for f in _FLAGS if f.split("=")[0] not in os.environ.get("XLA_FLAGS", "")]
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache per `pytest` run, shared by the xdist
# workers and the entry-point subprocesses tests start (they inherit the
# environment): many tests compile the same tiny-model programs, and a cache
# hit replaces a compile. The first process creates it and removes it at exit.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  import atexit
  import shutil
  import tempfile

  _cache = tempfile.mkdtemp(prefix="mtrl_jax_test_jit_cache_")
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)
# Runs started through `experiment.start` use the same one (mtrl_jax/compile_cache.py),
# never the user's cache directory.
os.environ["MTRL_JAX_COMPILE_CACHE"] = os.environ["JAX_COMPILATION_CACHE_DIR"]
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

import jax  # noqa: E402  (after the XLA flags above)
import pytest  # noqa: E402

from mtrl_jax import testing  # noqa: E402

SEVERAL_DEVICES = 8  # what tests marked several_devices need (pytest.ini)


def pytest_ignore_collect(collection_path, config):
  """A run of the several_devices tests alone (`-m several_devices`, the first run of `make
  test`) does not import the test modules that never name the mark: each xdist worker
  would import and collect all of them (docs/performance.md, "The test suite")."""
  if (
      config.getoption("markexpr") == "several_devices"
      and collection_path.name.startswith("test_")
      and collection_path.suffix == ".py"
      and "several_devices" not in collection_path.read_text()
  ):
    return True
  return None


def pytest_collection_modifyitems(config, items):
  """Skips the tests marked several_devices in a run of fewer devices, saying why."""
  if jax.device_count() >= SEVERAL_DEVICES:
    return
  skip = pytest.mark.skip(
      reason=f"needs {SEVERAL_DEVICES} devices; this run has {jax.device_count()} (XLA_FLAGS)"
  )
  for item in items:
    if "several_devices" in item.keywords:
      item.add_marker(skip)


@pytest.fixture(scope="session")
def byte_tokenizer():
  """The byte tokenizer with the default specials (shared: it is immutable)."""
  return testing.byte_tokenizer()


@pytest.fixture
def renderer():
  """A fresh compact-format renderer on the byte tokenizer (its counters start at 0)."""
  return testing.byte_renderer()


@pytest.fixture(scope="session")
def tiny_model():
  """The seed-0 `tiny` model, built once per process; tests must not mutate it."""
  return testing.tiny_model()
