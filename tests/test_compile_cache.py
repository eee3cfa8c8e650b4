"""The persistent compilation cache (mtrl_jax/compile_cache.py): a second process loads
what the first compiled, with the same bits; where the cache lives; bad settings and
unusable directories."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from mtrl_jax import compile_cache
from mtrl_jax.run import defaults, experiment

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# One process: the cache set up as a run sets it, one jitted function run, then what
# the process saw (JAX's cache events, the compile census, the result's bits).
_SCRIPT = """
import json, sys
from mtrl_jax import compile_cache, metrics
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda e, **kw: events.append(e))
census = metrics.CompileCensus()
print(json.dumps({"dir": compile_cache.setup(sys.argv[1])}))
y = jax.jit(lambda x: jnp.tanh(x @ x.T).sum(axis=0))(jnp.arange(64.0).reshape(8, 8) / 64)
print(json.dumps({"hits": events.count("/jax/compilation_cache/cache_hits"),
                  "misses": events.count("/jax/compilation_cache/cache_misses"),
                  "compiles": census.counts()["compiles/backend_total"],
                  "bits": y.tobytes().hex()}))
"""


def _process(cache: str) -> dict:
  out = subprocess.run(
      [sys.executable, "-c", _SCRIPT, cache], cwd=REPO, capture_output=True, text=True, timeout=120
  )
  assert out.returncode == 0, out.stderr[-2000:]
  lines = [json.loads(line) for line in out.stdout.splitlines()]
  return {**lines[0], **lines[1], "stderr": out.stderr}


@pytest.fixture(scope="module")
def cold_and_warm(tmp_path_factory):
  cache = str(tmp_path_factory.mktemp("xla"))
  return cache, _process(cache), _process(cache)


def test_a_second_process_loads_what_the_first_compiled_with_the_same_bits(cold_and_warm):
  cache, cold, warm = cold_and_warm
  assert cold["dir"] == warm["dir"] == cache
  assert cold["misses"] > 0 and cold["hits"] == 0
  assert len(os.listdir(cache)) == cold["misses"]  # every program written, however small
  assert warm["hits"] == cold["misses"] and warm["misses"] == 0
  assert warm["bits"] == cold["bits"]
  # A load is one executable to the compile census, as a compile is.
  assert warm["compiles"] == cold["compiles"] == cold["misses"]


def test_a_truncated_entry_is_compiled_again_with_the_same_bits(cold_and_warm):
  """A process killed while writing an entry leaves it short: the next one warns,
  compiles that program and gets the same result; the other entries still load."""
  cache, cold, _ = cold_and_warm  # the last test to use it
  names = sorted(os.listdir(cache))
  with open(os.path.join(cache, names[0]), "r+b") as f:
    f.truncate(10)
  again = _process(cache)
  assert again["bits"] == cold["bits"]
  assert (again["misses"], again["hits"]) == (1, len(names) - 1)
  assert "Error reading persistent compilation cache entry" in again["stderr"]


def test_auto_is_the_environment_variable_then_the_users_cache_directory(monkeypatch, tmp_path):
  monkeypatch.setenv(compile_cache.ENV, str(tmp_path / "env"))
  assert compile_cache.directory("auto") == str(tmp_path / "env")
  monkeypatch.setenv(compile_cache.ENV, "")
  assert compile_cache.directory("auto") == ""  # off
  monkeypatch.delenv(compile_cache.ENV)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert compile_cache.directory("auto") == str(tmp_path / "xdg" / "mtrl_jax" / "xla")
  monkeypatch.delenv("XDG_CACHE_HOME")
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  assert compile_cache.directory("auto") == str(tmp_path / "home/.cache/mtrl_jax/xla")
  assert compile_cache.directory("") == ""
  assert compile_cache.directory("~/x") == str(tmp_path / "home" / "x")
  assert not (tmp_path / "home").exists()  # naming a directory creates nothing


def test_the_test_suite_never_uses_the_users_cache_directory():
  assert os.environ[compile_cache.ENV] == os.environ["JAX_COMPILATION_CACHE_DIR"]
  assert compile_cache.directory("auto") == os.path.abspath(os.environ[compile_cache.ENV])


def test_a_setting_that_is_not_a_string_is_refused_in_one_line(tmp_path):
  c = defaults.base_config()
  c.compile_cache = 3
  before = jax.config.jax_compilation_cache_dir
  with pytest.raises(experiment.ConfigError) as e:
    experiment.start(c)
  msg = str(e.value)
  assert "\n" not in msg and msg.startswith("config compile_cache=3; allowed: 'auto'")
  assert jax.config.jax_compilation_cache_dir == before  # nothing changed


@pytest.fixture
def restores_the_suites_cache():
  yield
  assert compile_cache.setup() == os.path.abspath(os.environ[compile_cache.ENV])


def test_an_unusable_directory_is_reported_in_one_line_and_compiling_goes_on(
    tmp_path, capsys, restores_the_suites_cache
):
  blocker = tmp_path / "a_file"
  blocker.write_text("kept")
  assert compile_cache.setup(str(blocker / "xla")) == ""
  err = capsys.readouterr().err.strip()
  assert "\n" not in err and err.startswith(f"compile_cache '{blocker / 'xla'}' cannot be used")
  assert jax.config.jax_compilation_cache_dir is None
  assert float(jax.jit(lambda x: x * 3)(jnp.float32(2))) == 6.0
  assert blocker.read_text() == "kept"  # nothing on disk lost
