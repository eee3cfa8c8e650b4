"""Static analysis of generated code for the aux/main code task.

Text-level helpers shared by the reward (`rewards.py`) and the feedback
transitions (`mtrl_jax/tasks/code/feedback.py`). They reproduce the behaviour of the
reference environment (docs/comlrl.md section 3.1), quirks included, because
reward values and feedback texts depend on them:

* `cleanup_code` keeps only `def` blocks by indentation, so a nested `def`
  starts a new block and the outer body lines after it are lost;
* `extract_test_cases` keeps only single-line asserts that start with
  `assert` + whitespace and mention `candidate`;
* `discarded_aux_calls` (the reward's -0.5 check) only matches `aux (x)`
  written with exactly one space and one character between the parentheses;
* `is_thin_wrapper` re-enters docstring mode on a closing triple quote that
  stands on its own line, so the code after such a docstring is not seen and
  the function counts as an empty-bodied wrapper.

One deliberate difference: the reference's AST misuse analyser judged
"assigned but never used" while still walking the tree, before it had seen the
later uses, so it flagged every `x = aux(...)`. `misused_aux_calls` collects
all uses first, which is what its messages describe.
"""

from __future__ import annotations

import ast
import re

_DEF_LINE = re.compile(r"^(\s*)def\s+\w+\s*\(")
_PROSE = re.compile(r"^[A-Z][a-z].*[.!?:]$")
_CODE_MARKERS = ("def ", "return ", "if ", "for ", "while ", "=", "(", ")", "[", "]")
_IMPORT_LINES = (
    re.compile(r"^from\s+[\w\.]+\s+import\s+.*$"),
    re.compile(r"^import\s+[\w\.,\s]+$"),
)


def extract_imports(prompt: str) -> str:
  """The distinct `import ...` / `from ... import ...` lines of a problem prompt."""
  found = []
  for line in (prompt or "").split("\n"):
    line = line.strip()
    if any(p.match(line) for p in _IMPORT_LINES) and line not in found:
      found.append(line)
  return "\n".join(found)


def _indent(line: str) -> int:
  return len(line) - len(line.lstrip())


def _in_block(line: str, base_indent: int) -> bool:
  return line.startswith(" " * (base_indent + 1)) or line.startswith("\t")


def cleanup_code(code: str) -> str:
  """Strips markdown fences and prose; keeps only the `def` blocks.

  Returns:
    The def blocks joined by blank lines, or "" if none is left.
  """
  if not code or not isinstance(code, str):
    return ""
  code = re.sub(r"```python\s*\n?", "", code)
  code = re.sub(r"```\s*\n?", "", code)
  lines = code.split("\n")
  blocks, current, base = [], None, 0
  i = 0
  while i < len(lines):
    line, stripped = lines[i], lines[i].strip()
    if _DEF_LINE.match(line):
      if current:
        blocks.append(current)
      current, base = [line], _indent(line)
    elif current is not None:
      if not stripped or _in_block(line, base):
        current.append(line)
      elif stripped.startswith(('"""', "'''")):
        # A docstring written at the def's own indentation: keep to its end.
        current.append(line)
        quote = stripped[:3]
        if not (stripped.endswith(quote) and len(stripped) > 3):
          i += 1
          while i < len(lines):
            current.append(lines[i])
            if quote in lines[i]:
              break
            i += 1
      else:
        blocks.append(current)
        current = None
    i += 1
  if current:
    blocks.append(current)
  kept = []
  for line in "\n\n".join("\n".join(b) for b in blocks).split("\n"):
    s = line.strip()
    if (
        s
        and not s.startswith(("#", '"""', "'''"))
        and not any(m in line for m in _CODE_MARKERS)
        and _PROSE.match(s)
    ):
      continue  # a line of prose such as "Here is the solution:"
    kept.append(line)
  result = "\n".join(kept).strip()
  return result if re.search(r"def\s+\w+\s*\(", result) else ""


def extract_function(code: str, name: str) -> str:
  """The first definition of function `name` in `cleanup_code(code)`, or ""."""
  if not code or not name:
    return ""
  header = re.compile(rf"^(\s*)def\s+{re.escape(name)}\s*\(")
  found, inside, base = [], False, 0
  for line in cleanup_code(code).split("\n"):
    if header.match(line):
      found, inside, base = [line], True, _indent(line)
    elif inside:
      if not line.strip() or _in_block(line, base):
        found.append(line)
      else:
        break
  return "\n".join(found).strip()


def check_function_definition(code: str, name: str, description: str) -> tuple[bool, str]:
  """Whether `name` is defined in `code` and has a `return`; with a message."""
  func = extract_function(code, name)
  if not func:
    return False, f"{description} not defined"
  if not re.search(r"return\s+", func):
    return False, f"{description} missing return statement"
  return True, f"{description} properly defined with return statement"


def check_syntax(code: str, description: str) -> tuple[bool, str, dict | None]:
  """(ok, message, {'line', 'offset', 'msg'} of the SyntaxError or None)."""
  try:
    ast.parse(code)
    return True, f"{description} syntax OK", None
  except SyntaxError as e:
    return (
        False,
        f"{description} has syntax error: {e}",
        {"line": e.lineno, "offset": e.offset, "msg": e.msg},
    )


def combine_code(aux: str, main: str, imports: str = "") -> str:
  """imports + cleaned aux + cleaned main, separated by blank lines."""
  parts = [imports, cleanup_code(aux), cleanup_code(main)]
  return "\n\n".join(p for p in parts if p)


def extract_test_cases(test_code: str, entry_point: str) -> list[str]:
  """The asserts of `check(candidate)` with `candidate` renamed to `entry_point`.

  Only single lines that start with `assert`, whitespace, and mention
  `candidate`; de-duplicated in order.
  """
  if not test_code or not entry_point:
    return []
  match = re.search(r"def check\(candidate\):(.*?)(?=\n\ndef|\Z)", test_code, re.DOTALL)
  if not match:
    return []
  cases = []
  for line in match.group(1).strip().split("\n"):
    line = line.strip()
    if (
        line.startswith("assert")
        and "candidate" in line
        and re.match(r"assert\s+[^\n]*candidate[^\n]*", line)
        and line not in cases
    ):
      cases.append(line)
  return [c.replace("candidate", entry_point) for c in cases]


def calls_aux(main_code: str, aux_name: str = "aux") -> bool:
  """Whether the main function's text contains a call `aux(`."""
  return bool(main_code) and re.search(rf"\b{re.escape(aux_name)}\s*\(", main_code) is not None


def is_thin_wrapper(main_code: str, aux_name: str = "aux") -> bool:
  """Empty body, `return ...aux...`, or `x = aux(...)` then `return x`."""
  if not main_code:
    return False
  body, in_doc = [], False
  for line in main_code.split("\n"):
    s = line.strip()
    if not s:
      continue
    if s.startswith(('"""', "'''")):
      in_doc = not (s.endswith(s[:3]) and len(s) > 3)
      continue
    if in_doc:
      in_doc = '"""' not in s and "'''" not in s
      continue
    if s.startswith("#") or s.startswith("def "):
      continue
    body.append(s)
  if not body:
    return True
  if len(body) == 1:
    return body[0].startswith("return ") and aux_name in body[0]
  if len(body) == 2:
    m = re.search(rf"(\w+)\s*=\s*{re.escape(aux_name)}\s*\(", body[0])
    return bool(m) and body[1] == f"return {m.group(1)}"
  return False


def discarded_aux_calls(main_code: str, aux_name: str = "aux") -> list[str]:
  """The reward's check for aux calls whose value is dropped (narrow regex)."""
  if not main_code or aux_name not in main_code:
    return []
  a = re.escape(aux_name)
  bad = (rf"^{a}\s\([^)]\)$", rf"^{a}\s\([^)]\);?\s$", rf"^\s{a}\s\([^)]\)\s*$")
  found = []
  for n, line in enumerate(main_code.split("\n"), 1):
    s = line.strip()
    if s and not s.startswith("#") and re.search(rf"{a}\s\([^)]\)", s):
      if any(re.search(p, s) for p in bad):
        found.append(f"Line {n}: {s}")
  return found


def misused_aux_calls(main_code: str, aux_name: str = "aux") -> list[str]:
  """Feedback's AST check: standalone aux calls, results never used or overwritten.

  Returns:
    'Line N: reason' strings (line numbers within `main_code`).
  """
  if not main_code or aux_name not in main_code:
    return []
  try:
    tree = ast.parse(main_code)
  except SyntaxError:
    return []
  parent = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
  loads, stores = {}, {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
      loads.setdefault(node.id, []).append(node.lineno)
    elif isinstance(node, ast.Assign):
      for t in node.targets:
        if isinstance(t, ast.Name):
          stores.setdefault(t.id, []).append(node.lineno)
  problems = []
  calls = [
      n
      for n in ast.walk(tree)
      if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == aux_name
  ]
  for call in sorted(calls, key=lambda n: (n.lineno, n.col_offset)):
    up = parent.get(call)
    reason = None
    if up is None or isinstance(up, ast.Expr):
      reason = "standalone call (not assigned)"
    elif isinstance(up, ast.Assign):  # other parents (return, argument, ...) use it
      for t in up.targets:
        if not isinstance(t, ast.Name):
          continue
        later_uses = [l for l in loads.get(t.id, []) if l > up.lineno]
        later_sets = [l for l in stores.get(t.id, []) if l > up.lineno]
        if not later_uses:
          reason = f"assigned to {t.id} but never used"
        elif later_sets and min(later_sets) < min(later_uses):
          reason = f"assigned to {t.id} but reassigned on line {min(later_sets)} before use"
        if reason:
          break
    if reason:
      problems.append(f"Line {call.lineno}: {reason}")
  return problems
