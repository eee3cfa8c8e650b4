"""benchmarks.suite_profile: its hook records a real process; its tables add up by hand."""

import json
import subprocess
import sys

from benchmarks import suite_profile
from mtrl_jax import testing

_PROGRAM = """
import sys
assert "jax" not in sys.modules  # the hook waits for the process's own import
import jax, jax.numpy as jnp
double = lambda x: x * 2
jax.jit(double)(jnp.ones(3)).block_until_ready()
jax.jit(double)(jnp.ones(4)).block_until_ready()
"""


def test_the_hook_records_each_program_a_process_traces_and_compiles(tmp_path):
  out = tmp_path / "records.jsonl"
  env = testing.cpu_env(
      1,
      PYTHONPATH=suite_profile.HOOK,
      MTRL_JAX_SUITE_PROFILE=str(out),
      PYTEST_CURRENT_TEST="tests/x.py::test_y (call)",
  )
  for program in (_PROGRAM, "print('no jax')"):
    done = subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
  with_jax, without = [json.loads(line) for line in out.read_text().splitlines()]
  assert with_jax["test"] == "tests/x.py::test_y" and with_jax["cpu"] > 0
  # One jit'd function, two shapes: two traces, two lowerings, two compiles (or loads).
  for key in ("trace:<lambda>", "lower:jit(<lambda>)", "backend:jit(<lambda>)"):
    count, seconds = with_jax["jax"][key]
    assert count == 2 and seconds > 0, key
  assert without["jax"] == {} and without["pid"] != with_jax["pid"]


def _record(pid, ppid, cpu, children_cpu=0.0, test="", jax=None):
  return dict(pid=pid, ppid=ppid, test=test, cpu=cpu, children_cpu=children_cpu, jax=jax or {})


def test_the_tables_split_workers_from_subprocesses_and_rank_programs_by_compile_seconds():
  records = [
      _record(11, 10, 100.0, 40.0, jax={"trace:_step": [2, 3.0], "backend:jit(_step)": [2, 5.0]}),
      _record(12, 10, 50.0, jax={"backend:jit(_decode)": [4, 2.0], "cache_load:": [1, 0.5]}),
      _record(21, 11, 30.0, test="tests/a.py::t1", jax={"lower:jit(_decode)": [1, 7.0]}),
      _record(22, 11, 10.0, test="tests/a.py::t1"),
      _record(23, 12, 5.0, test="tests/b.py::t2"),
  ]
  text = suite_profile.summarize(records, pytest_pid=10, top=5)
  assert "| pytest workers | 2 | 150 | 40 |" in text
  assert "| subprocesses | 3 | 45 | 0 |" in text
  assert "| workers | 6 | 3.0 | 0.0 | 7.0 | 1, 0.5 |" in text
  assert "| subprocesses | 0 | 0.0 | 7.0 | 0.0 | 0, 0.0 |" in text
  # One row per function (trace events name it bare, the others as jit(...)): _decode's
  # 7.0 s lowering + 2.0 s backend = 9.0 > _step's 3.0 + 5.0 = 8.0; the nameless
  # cache-load entry costs nothing and is left out.
  programs = [line for line in text.splitlines() if line.startswith("| `_")]
  assert programs == ["| `_decode` | 4 | 0.0 | 7.0 | 2.0 |", "| `_step` | 2 | 3.0 | 0.0 | 5.0 |"]
  assert "| `tests/a.py::t1` | 2 | 40.0 |" in text and "| `tests/b.py::t2` | 1 | 5.0 |" in text
