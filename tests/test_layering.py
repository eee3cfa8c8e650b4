"""The package's layers (docs/design.md section 2): nothing imports upward, no package cycles.

Walks every module of `mtrl_jax` with `ast`, collects every import it makes
(module level and inside functions, plus `importlib.import_module("...")`
with a literal name), maps each module to its package and layer, and fails on
an import from a lower layer into a higher one or a cycle between packages.

Layers, bottom to top (a package may import its own layer and the ones below):

  infrastructure: sharding, distributed, checkpoint, storage, metrics, event_file,
                  registry, data, buckets, resources, seeds, compile_cache
  text, models, losses
  sampling
  envs
  graders
  tasks
  rollout
  train (the jitted step, its objectives and optimizer)
  run (config, validation, composition, the RL loop, the warm-up, saved runs)
  testing (fakes for tests and benchmarks; may import anything)

A module lives under one name only: no module aliases another (no
`sys.modules` assignment), so an old import path cannot come back as a shim;
and a name is imported from the module that defines it (or a package's
`__init__`, the public surface), never through a module that only imports
it, so a name moved to another module cannot stay behind as a re-export.

Every module stays at most `MAX_LINES` long (docs/design.md, Conventions).

Validation sits below composition: `run.experiment` and `run.checks` never
import the composition root `run.components` (the builders both use live in
`run.builders`).
"""

from __future__ import annotations

import ast
import io
import os
import tokenize

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOT = os.path.join(REPO, "mtrl_jax")
# The repository's Python that imports mtrl_jax (checked for imports through re-exports).
IMPORTERS = ("mtrl_jax", "tests", "benchmarks", "experiments", "configs")
MAX_LINES = 400  # code lines (`code_lines`): a guide to where a module is two ideas

LAYERS = (
    (
        "sharding",
        "distributed",
        "checkpoint",
        "storage",
        "metrics",
        "event_file",
        "registry",
        "data",
        "buckets",
        "resources",
        "seeds",
        "compile_cache",
    ),
    ("text", "models", "losses"),
    ("sampling",),
    ("envs",),
    ("graders",),
    ("tasks",),
    ("rollout",),
    ("train",),
    ("run",),
    ("testing",),
)
LAYER = {pkg: i for i, names in enumerate(LAYERS) for pkg in names}


def module_files(root: str = ROOT) -> dict[str, str]:
  """Module name -> file path, for every .py file under `root` (the package dir)."""
  base = os.path.dirname(root)
  out = {}
  for dirpath, _, files in os.walk(root):
    for f in files:
      if not f.endswith(".py"):
        continue
      path = os.path.join(dirpath, f)
      parts = os.path.relpath(path, base)[:-3].split(os.sep)
      if parts[-1] == "__init__":
        parts = parts[:-1]
      out[".".join(parts)] = path
  return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
  if not node.level:
    return node.module or ""
  parts = module.split(".")
  if not is_package:
    parts = parts[:-1]
  parts = parts[: len(parts) - (node.level - 1)]
  return ".".join(parts + ([node.module] if node.module else []))


def imports_of(module: str, path: str) -> set[str]:
  """Every mtrl_jax module `module` imports, anywhere in its body."""
  with open(path) as f:
    tree = ast.parse(f.read(), path)
  is_package = os.path.basename(path) == "__init__.py"
  out = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      out.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      target = _absolute(module, is_package, node)
      out.add(target)
      # `from pkg import sub` may name a submodule.
      out.update(f"{target}.{a.name}" for a in node.names if a.name != "*")
    elif (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and ast.unparse(node.func) in ("importlib.import_module", "import_module")
    ):
      out.add(node.args[0].value)
    elif isinstance(node, (ast.Tuple, ast.List)):
      # Module names listed as data for a later import_module (e.g. built-in
      # modules a registry loads on a miss) count as imports too.
      out.update(
          e.value
          for e in node.elts
          if isinstance(e, ast.Constant)
          and isinstance(e.value, str)
          and e.value.startswith("mtrl_jax.")
      )
  return {m for m in out if m == "mtrl_jax" or m.startswith("mtrl_jax.")}


def package_of(module: str) -> str:
  parts = module.split(".")
  return parts[1] if len(parts) > 1 else ""


def import_graph(root: str = ROOT) -> dict[str, set[str]]:
  """Module -> the mtrl_jax modules (existing ones, or their nearest parent) it imports."""
  files = module_files(root)
  graph = {}
  for module, path in files.items():
    targets = set()
    for t in imports_of(module, path):
      while t not in files and "." in t:  # `from pkg import name`: name is not a module
        t = t.rsplit(".", 1)[0]
      if t in files and t != module:
        targets.add(t)
    graph[module] = targets
  return graph


def violations(root: str = ROOT) -> list[str]:
  """Every upward import, unknown package, and package cycle."""
  graph = import_graph(root)
  problems = []
  pkg_edges: dict[str, set[str]] = {}
  for module, targets in sorted(graph.items()):
    src = package_of(module)
    if src and src not in LAYER:
      problems.append(f"{module}: package {src!r} has no layer (add it to LAYERS)")
      continue
    for t in sorted(targets):
      dst = package_of(t)
      if not src or not dst or src == dst:
        continue
      if dst not in LAYER:
        continue  # reported once, as the source of its own imports
      if LAYER[dst] > LAYER[src]:
        problems.append(
            f"{module} ({src}, layer {LAYER[src]}) imports {t} "
            f"({dst}, layer {LAYER[dst]}): upward"
        )
      pkg_edges.setdefault(src, set()).add(dst)
  problems += [f"package cycle: {' -> '.join(c)}" for c in _cycles(pkg_edges)]
  return problems


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
  """One cycle per strongly connected component with more than one package."""
  index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

  def visit(v):
    index[v] = low[v] = counter[0]
    counter[0] += 1
    stack.append(v)
    on.add(v)
    for w in sorted(edges.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      comp = []
      while True:
        w = stack.pop()
        on.discard(w)
        comp.append(w)
        if w == v:
          break
      if len(comp) > 1:
        out.append(sorted(comp) + [sorted(comp)[0]])

  for v in sorted(edges):
    if v not in index:
      visit(v)
  return out


def test_no_upward_imports_and_no_package_cycles():
  problems = violations()
  assert not problems, "layering violations:\n" + "\n".join(problems)


# Module -> modules it must not import (directly): validation below composition.
FORBIDDEN_IMPORTS = {
    "mtrl_jax.run.experiment": ("mtrl_jax.run.components",),
    "mtrl_jax.run.checks": ("mtrl_jax.run.components",),
}


def test_validation_does_not_import_the_composition_root():
  graph = import_graph()
  problems = [
      f"{module} imports {t}"
      for module, banned in sorted(FORBIDDEN_IMPORTS.items())
      for t in banned
      if t in graph[module]
  ]
  assert not problems, "validation imports composition:\n" + "\n".join(problems)
  assert "mtrl_jax.run.checks" in graph["mtrl_jax.run.experiment"]  # the graph sees them


def test_graph_sees_function_level_and_importlib_imports(tmp_path):
  """The walker finds imports inside functions and import_module calls, and cycles."""
  pkg = tmp_path / "mtrl_jax"
  for sub in ("envs", "graders", "sampling"):
    (pkg / sub).mkdir(parents=True)
    (pkg / sub / "__init__.py").write_text("")
  (pkg / "__init__.py").write_text("")
  (pkg / "envs" / "runner.py").write_text(
      "def f():\n  from mtrl_jax.graders import base\n  return base\n"
  )
  (pkg / "graders" / "base.py").write_text("from mtrl_jax.envs import runner\n")
  (pkg / "sampling" / "x.py").write_text(
      "import importlib\nimportlib.import_module('mtrl_jax.envs.runner')\n"
  )
  problems = violations(str(pkg))
  assert any(
      "mtrl_jax.envs.runner" in p and "upward" in p and "graders" in p for p in problems
  ), problems
  assert any("mtrl_jax.sampling.x" in p and "upward" in p for p in problems), problems
  assert "package cycle: envs -> graders -> envs" in problems, problems


def aliasing_calls(root: str = ROOT) -> list[str]:
  """Every call of `alias_module` and every assignment into `sys.modules` under `root`."""
  problems = []
  for module, path in sorted(module_files(root).items()):
    with open(path) as f:
      tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
      if isinstance(node, ast.Call):
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name == "alias_module":
          problems.append(f"{module}:{node.lineno} calls alias_module")
        elif (
            name in ("__setitem__", "setdefault", "update")
            and isinstance(func, ast.Attribute)
            and ast.unparse(func.value) in ("sys.modules", "modules")
        ):
          problems.append(f"{module}:{node.lineno} writes sys.modules ({name})")
      targets = []
      if isinstance(node, ast.Assign):
        targets = node.targets
      elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
      for t in targets:
        for sub in ast.walk(t):
          if isinstance(sub, ast.Subscript) and ast.unparse(sub.value) in (
              "sys.modules",
              "modules",
          ):
            problems.append(f"{module}:{node.lineno} assigns into sys.modules")
  return problems


def test_no_module_is_an_alias_of_another(tmp_path):
  """No module of mtrl_jax makes itself (or another) a second name of a module."""
  problems = aliasing_calls()
  assert not problems, "module aliases (import the real module instead):\n" + "\n".join(problems)
  # The walker itself catches both forms.
  pkg = tmp_path / "mtrl_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "old.py").write_text(
      "import sys\nfrom mtrl_jax.registry import alias_module\n"
      "alias_module(__name__, 'mtrl_jax.new')\nsys.modules['mtrl_jax.x'] = sys\n"
  )
  found = aliasing_calls(str(pkg))
  assert any("mtrl_jax.old:3 calls alias_module" in p for p in found), found
  assert any("mtrl_jax.old:4 assigns into sys.modules" in p for p in found), found


def code_lines(source: str) -> int:
  """Lines of `source` that hold code: not blank, not only a comment, not in a docstring
  (a module's, class's or function's first statement when it is a string)."""
  doc = set()
  for node in ast.walk(ast.parse(source)):
    if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
      first = node.body[0] if node.body else None
      if (
          isinstance(first, ast.Expr)
          and isinstance(first.value, ast.Constant)
          and isinstance(first.value.value, str)
      ):
        doc.update(range(first.lineno, first.end_lineno + 1))
  skip = (
      tokenize.COMMENT,
      tokenize.NL,
      tokenize.NEWLINE,
      tokenize.INDENT,
      tokenize.DEDENT,
      tokenize.ENDMARKER,
  )
  lines = set()
  for tok in tokenize.generate_tokens(io.StringIO(source).readline):
    if tok.type not in skip:
      lines.update(range(tok.start[0], tok.end[0] + 1))
  return len(lines - doc)


def long_modules(root: str = ROOT, limit: int = MAX_LINES) -> list[str]:
  """Every module under `root` with more than `limit` code lines (`code_lines`)."""
  problems = []
  for module, path in sorted(module_files(root).items()):
    with open(path) as f:
      n = code_lines(f.read())
    if n > limit:
      problems.append(f"{module}: {n} code lines")
  return problems


def test_every_module_holds_at_most_400_code_lines(tmp_path):
  """A guide to where a module is two ideas: docstrings and comments do not count, so
  documenting a module never pushes it over."""
  problems = long_modules()
  assert not problems, (
      f"modules over {MAX_LINES} code lines (split them along a seam, "
      "never compress):\n" + "\n".join(problems)
  )
  doc = '"""A module docstring\n\nof three lines."""\n\n# a comment\n'
  func = 'def f(x):\n  """f\'s docstring."""\n  return (x +  # a comment after code\n    1)\n'
  assert code_lines(doc + func) == 3  # def, return and its continuation
  pkg = tmp_path / "mtrl_jax"
  pkg.mkdir()
  (pkg / "__init__.py").write_text("")
  (pkg / "big.py").write_text(doc + "x = 1\n" * 401)
  (pkg / "fits.py").write_text(doc + "# note\n" * 50 + "x = 1\n" * 400)
  assert long_modules(str(pkg)) == ["mtrl_jax.big: 401 code lines"]


def _top_level_names(tree: ast.Module) -> tuple[set[str], set[str]]:
  """(names a module defines, names it imports) at module level (inside if / try too)."""
  defined, imported = set(), set()

  def visit(body):
    for node in body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        defined.add(node.name)
      elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
          defined.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
      elif isinstance(node, (ast.Import, ast.ImportFrom)):
        imported.update((a.asname or a.name).split(".")[0] for a in node.names)
      elif isinstance(node, (ast.If, ast.Try)):
        visit(node.body)
        visit(node.orelse)
        for h in getattr(node, "handlers", []):
          visit(h.body)
        visit(getattr(node, "finalbody", []))

  visit(tree.body)
  return defined, imported


def reexport_imports(root: str = ROOT, importers=None) -> list[str]:
  """Every `from mtrl_jax.x import name` (in the files under `importers`) where module x
  is not a package and only imports `name` from elsewhere."""
  files = module_files(root)
  names = {}
  for module, path in files.items():
    if os.path.basename(path) != "__init__.py":
      with open(path) as f:
        names[module] = _top_level_names(ast.parse(f.read(), path))
  if importers is None:
    importers = [os.path.join(os.path.dirname(root), d) for d in IMPORTERS]
  problems = []
  for top in importers:
    for dirpath, _, filenames in os.walk(top):
      for f in sorted(filenames):
        if not f.endswith(".py"):
          continue
        path = os.path.join(dirpath, f)
        with open(path) as fh:
          tree = ast.parse(fh.read(), path)
        for node in ast.walk(tree):
          if not (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module in names):
            continue
          defined, imported = names[node.module]
          for a in node.names:
            if (
                a.name in imported
                and a.name not in defined
                and f"{node.module}.{a.name}" not in files
            ):
              rel = os.path.relpath(path, os.path.dirname(root))
              problems.append(
                  f"{rel}:{node.lineno} imports {a.name} from {node.module}, "
                  "which only imports it"
              )
  return problems


def test_names_are_imported_from_the_module_that_defines_them(tmp_path):
  problems = reexport_imports()
  assert (
      not problems
  ), "imports through a re-export (import from the defining module):\n" + "\n".join(problems)
  # The walker itself: a name passed on by a plain module is caught, one passed on
  # by a package's __init__ or defined where it is imported from is not.
  pkg = tmp_path / "mtrl_jax"
  (pkg / "sub").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  (pkg / "sub" / "__init__.py").write_text("from mtrl_jax.sub.new import Thing\n")
  (pkg / "sub" / "new.py").write_text("class Thing:\n  pass\n")
  (pkg / "sub" / "old.py").write_text("from mtrl_jax.sub.new import Thing  # noqa\n")
  (pkg / "user.py").write_text(
      "from mtrl_jax.sub.old import Thing\n"
      "from mtrl_jax.sub import Thing\n"
      "from mtrl_jax.sub.new import Thing\n"
  )
  found = reexport_imports(str(pkg))
  assert found == [
      os.path.join("mtrl_jax", "user.py") + ":1 imports Thing from "
      "mtrl_jax.sub.old, which only imports it"
  ], found
