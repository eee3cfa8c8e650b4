"""The entry-point modules the tests import in-process can share one process: absl refuses
a flag defined twice (`DuplicateFlagError` at collection), and pytest-xdist puts any two
test files in one worker."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_PACKAGES = ("experiments", "benchmarks")


def imported_entry_modules() -> set[str]:
  """`experiments.*` and `benchmarks.*` modules any test file imports at module level or in
  a function (not those a subprocess's script text names)."""
  found = set()
  for dirpath, _, files in os.walk(os.path.join(ROOT, "tests")):
    for f in files:
      if not f.endswith(".py"):
        continue
      with open(os.path.join(dirpath, f)) as fh:
        tree = ast.parse(fh.read())
      for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
          if node.module in ENTRY_PACKAGES:
            found.update(f"{node.module}.{a.name}" for a in node.names)
          elif node.module.split(".")[0] in ENTRY_PACKAGES:
            found.add(node.module)
        elif isinstance(node, ast.Import):
          found.update(a.name for a in node.names if a.name.split(".")[0] in ENTRY_PACKAGES)
  return found


def test_the_entry_modules_tests_import_define_no_flag_twice():
  modules = sorted(imported_entry_modules())
  assert "experiments.show" in modules  # the scan sees the tests' imports
  code = "import importlib\nfor m in %r:\n  importlib.import_module(m)\n" % modules
  out = subprocess.run(
      [sys.executable, "-c", code],
      cwd=ROOT,
      capture_output=True,
      text=True,
      env=dict(os.environ, PYTHONPATH=ROOT),
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
