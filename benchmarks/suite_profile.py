r"""Where the test suite's time goes: CPU and compile work, per program and per test.

  .venv/bin/python -m benchmarks.suite_profile
  .venv/bin/python -m benchmarks.suite_profile --rows=20 -- -m "not slow" tests/train

Runs pytest as the second run of `make test` does (`-n auto --dist=worksteal`, on one
CPU device, `-m "not several_devices" tests`; the arguments after `--` replace the
last two) with benchmarks/suite_hook on PYTHONPATH. Its sitecustomize.py records each
Python process that exits normally: the pytest workers and the runs the tests start
in subprocesses. Prints, as markdown tables:

  * the CPU seconds of the workers, of the processes they started (the kernel's count,
    recorded or not) and of the recorded ones;
  * jax's compile work (tracing, lowering to MLIR, the backend compile or cache load)
    in the workers and in the recorded subprocesses;
  * the jit'd functions whose programs cost the most, both places together;
  * the tests whose subprocesses used the most CPU.

Processes that set their own PYTHONPATH (tests/test_docs_recipes.py's runs) or die by
a signal (the killed process of tests/test_distributed.py) are not recorded: their
CPU counts in the workers' children only. The compile cache is tests/conftest.py's,
fresh per run, as in `make test`.
"""

from __future__ import annotations

import collections
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from absl import app, flags

_ROWS = flags.DEFINE_integer("rows", 12, "rows of the program and test tables")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HOOK = os.path.join(ROOT, "benchmarks", "suite_hook")
DEFAULT_ARGS = ("-m", "not several_devices", "tests")
KINDS = ("trace", "lower", "backend")


def summarize(records: list[dict], pytest_pid: int, top: int) -> str:
  """The markdown tables of the module docstring, from the hook's records of one run
  whose pytest process had `pytest_pid`."""
  workers = [r for r in records if r["ppid"] == pytest_pid]
  others = [r for r in records if r["ppid"] != pytest_pid and r["pid"] != pytest_pid]
  lines = [
      "| processes | recorded | CPU s | their children's CPU s |",
      "|---|---|---|---|",
      f"| pytest workers | {len(workers)} | {sum(r['cpu'] for r in workers):.0f} "
      f"| {sum(r['children_cpu'] for r in workers):.0f} |",
      f"| subprocesses | {len(others)} | {sum(r['cpu'] for r in others):.0f} "
      f"| {sum(r['children_cpu'] for r in others):.0f} |",
      "",
      "| where | programs compiled or loaded | trace s | lower s | backend s "
      "| of it cache loads (count, s) |",
      "|---|---|---|---|---|---|",
  ]
  per_function = collections.defaultdict(collections.Counter)
  for where, group in (("workers", workers), ("subprocesses", others)):
    totals, counts = collections.Counter(), collections.Counter()
    for r in group:
      for key, (count, seconds) in r["jax"].items():
        kind, name = key.split(":", 1)
        if name.startswith("jit(") and name.endswith(")"):  # trace events name it bare
          name = name[4:-1]
        totals[kind] += seconds
        counts[kind] += count
        per_function[name][kind] += seconds
        if kind == "backend":
          per_function[name]["programs"] += count
    lines.append(
        f"| {where} | {counts['backend']} | {totals['trace']:.1f} | {totals['lower']:.1f} "
        f"| {totals['backend']:.1f} | {counts['cache_load']}, {totals['cache_load']:.1f} |"
    )
  lines += ["", "| jit'd function | programs compiled or loaded | trace s | lower s | backend s |"]
  lines.append("|---|---|---|---|---|")
  cost = lambda item: -sum(item[1][k] for k in KINDS)
  ranked = [item for item in sorted(per_function.items(), key=cost) if cost(item) < 0]
  for name, c in ranked[:top]:
    lines.append(
        f"| `{name}` | {c['programs']} | {c['trace']:.1f} | {c['lower']:.1f} "
        f"| {c['backend']:.1f} |"
    )
  by_test, runs = collections.Counter(), collections.Counter()
  for r in others:
    by_test[r["test"] or "(outside a test)"] += r["cpu"]
    runs[r["test"] or "(outside a test)"] += 1
  lines += ["", "| test | its recorded subprocesses | their CPU s |", "|---|---|---|"]
  for test, seconds in by_test.most_common(top):
    lines.append(f"| `{test}` | {runs[test]} | {seconds:.1f} |")
  return "\n".join(lines)


def main(argv):
  pytest_args = argv[1:] or list(DEFAULT_ARGS)
  with tempfile.TemporaryDirectory(prefix="suite_profile_") as tmp:
    out = os.path.join(tmp, "records.jsonl")
    env = dict(os.environ, MTRL_JAX_SUITE_PROFILE=out)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (HOOK, env.get("PYTHONPATH")) if p)
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "pytest", "-n", "auto", "--dist=worksteal", "-q", *pytest_args]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    result = "(no output)"
    for line in proc.stdout:  # pytest's output goes on to stderr; its last line is kept
      sys.stderr.write(line)
      result = line.strip() or result
    proc.wait()
    wall = time.time() - start
    records = []
    if os.path.exists(out):
      with open(out) as f:
        records = [json.loads(line) for line in f]
  print(
      f"`{shlex.join(['python', *cmd[1:]])}` (XLA_FLAGS={env['XLA_FLAGS']}): "
      f"{result}; {wall:.0f} s wall, {os.cpu_count()} cores\n"
  )
  print(summarize(records, proc.pid, _ROWS.value))
  return proc.returncode


if __name__ == "__main__":
  app.run(main)
