"""The module path -> category mapping of benchmarks/bench_host.py (no model is run)."""

from benchmarks import bench_host as bh


def test_module_path_strips_site_packages_and_checkouts():
  assert bh.module_path("/x/.venv/lib/python3.11/site-packages/jax/_src/api.py") == (
      "jax/_src/api.py"
  )
  assert bh.module_path("/work/repo/mtrl_jax/text/chat.py") == "mtrl_jax/text/chat.py"
  assert bh.module_path("~") == "~"


def test_python_categories_by_path_and_function():
  root = "/work/repo/"
  site = "/v/lib/python3.11/site-packages/"
  cases = {
      (root + "mtrl_jax/sampling/engine.py", "_admit"): "admission",
      (root + "mtrl_jax/sampling/engine.py", "_decode"): "sampling bookkeeping",
      (root + "mtrl_jax/rollout/engine.py", "run"): "engine scheduling",
      (root + "mtrl_jax/rollout/tree_packing.py", "pack_tree"): "packing",
      (root + "mtrl_jax/rollout/tree.py", "finalize"): "tree bookkeeping",
      (root + "mtrl_jax/envs/grades.py", "grade"): "grading",
      (root + "mtrl_jax/graders/judges.py", "__call__"): "grading",
      (root + "mtrl_jax/tasks/calculator.py", "react_to"): "environment react_to",
      (root + "mtrl_jax/text/chat.py", "append"): "rendering and tokenising",
      (root + "mtrl_jax/train/step.py", "__call__"): "train step dispatch",
      (site + "jax/_src/array.py", "_value"): bh.DEVICE,
      (site + "jax/_src/tree_util.py", "tree_map"): "jax python (dispatch, pytrees)",
      ("/usr/lib/python3.11/copy.py", "deepcopy"): bh.OTHER,
  }
  for (filename, func), want in cases.items():
    assert bh.category(filename, func) == want, (filename, func)


def test_c_functions():
  assert bh.c_category("<method 'block_until_ready' of 'ArrayImpl' objects>") == bh.DEVICE
  assert bh.c_category("<method 'acquire' of '_thread.lock' objects>") == bh.WAITS
  assert bh.c_category("<method '__enter__' of '_thread.lock' objects>") == bh.WAITS
  assert bh.c_category("<built-in method numpy.array>") is None  # its callers' category


def test_c_time_follows_callers():
  py = ("/r/mtrl_jax/rollout/tree_packing.py", 1, "pack")
  tok = ("/r/mtrl_jax/text/chat.py", 1, "render")
  c = ("~", 0, "<built-in method numpy.array>")
  stats = {
      py: (1, 1, 0.5, 1.0, {}),
      tok: (1, 1, 0.1, 0.5, {}),
      c: (2, 2, 0.8, 0.8, {py: (1, 1, 0.6, 0.6), tok: (1, 1, 0.2, 0.2)}),
  }
  by_cat, _ = bh.attribute(stats)
  assert abs(by_cat["packing"] - 1.1) < 1e-9
  assert abs(by_cat["rendering and tokenising"] - 0.3) < 1e-9
