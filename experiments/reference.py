"""Writes the references generated from the code: docs/config.md and docs/metrics.md.

  python -m experiments.reference           # rewrites both files
  python -m experiments.reference --check   # exit status 1 when either differs

docs/config.md lists every field of every config group (`run.defaults.GROUPS`)
by its dotted name: its type, the base config's default (and the dataclass's
own where a run departs from it, `RUN_CHOICES`), what validation allows, and
what it does. The description is the field's entry in its dataclass's
docstring `Attributes:` section; the allowed values are what the dataclass's
validation says when it refuses a value (the text after `allowed:` or `must
be` in its one-line error), found by constructing the group with sentinel
values. docs/metrics.md renders `mtrl_jax.run.glossary.SECTIONS`.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import re
import sys
import typing

from absl import flags
from ml_collections import config_dict

from experiments import cli
from mtrl_jax.run import defaults, glossary

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_DOC = os.path.join("docs", "config.md")
METRICS_DOC = os.path.join("docs", "metrics.md")
COMMAND = "python -m experiments.reference"
# The one config field outside a group (`defaults.base_config`).
SEED_LINE = "parameter init, sampling and data order all derive from it"

_CHECK = flags.DEFINE_bool(
    "check",
    False,
    "exit with status 1 when a file differs from what the code gives, instead of writing it",
)


def attribute_docs(cls) -> dict[str, str]:
  """name -> its entry in `cls`'s docstring `Attributes:` section, as one line."""
  lines = (inspect.getdoc(cls) or "").splitlines()
  start = next((i for i, line in enumerate(lines) if line.strip() == "Attributes:"), None)
  if start is None:
    return {}
  out, entry, indent = {}, [], None
  for line in lines[start + 1 :]:
    if not line.strip():
      continue
    depth = len(line) - len(line.lstrip())
    if indent is None:
      indent = depth
    if depth < indent:  # the section ended
      break
    if depth == indent:  # an entry: `name: text`, or `a, b: text` for several names
      m = re.match(r"(\w+(?:, \w+)*)(?: \([^)]*\))?:\s*(.*)", line.strip())
      entry = [m.group(2) if m else line.strip()]
      for name in m.group(1).split(", ") if m else ():
        out[name] = entry
    else:
      entry.append(line.strip())
  return {k: " ".join(" ".join(v).split()) for k, v in out.items()}


class _Sentinel:

  def __repr__(self):
    return "<sentinel>"


_SENTINELS = (_Sentinel(), "\x00sentinel", -987654)


def allowed_text(cls, kwargs: dict, name: str) -> str:
  """What `cls`'s validation allows for field `name`: the `allowed:` / `must be` part of
  each distinct refusal of a sentinel value (the other fields as in `kwargs`); '' when it
  refuses none."""
  found = []
  for sentinel in _SENTINELS:
    try:
      cls(**{**kwargs, name: sentinel})
    except ValueError as e:
      msg = cli.one_line(e)
      if f"{name}=" not in msg:
        continue  # another field's check, or a refusal that does not name this one
      m = re.search(r"(?:allowed: |must be )(.*)", msg)
      if m and m.group(1) not in found:
        found.append(m.group(1))
    except Exception:  # pylint: disable=broad-except
      continue  # a sentinel of a type the check does not expect says nothing
  return "; ".join(found)


def _plain(value):
  if isinstance(value, config_dict.FieldReference):
    return value.get()
  if isinstance(value, config_dict.ConfigDict):
    return value.to_dict()
  return value


def _type_name(hint, default) -> str:
  if isinstance(default, dict):
    return "dict"
  args = typing.get_args(hint)
  if typing.get_origin(hint) is typing.Union and type(None) in args:
    rest = [a for a in args if a is not type(None)]
    return " or ".join(_type_name(a, None) for a in rest) + " or None"
  return getattr(hint, "__name__", str(hint).replace("typing.", ""))


def _library_default(field: dataclasses.Field):
  if field.default is not dataclasses.MISSING:
    return field.default
  if field.default_factory is not dataclasses.MISSING:
    return field.default_factory()
  return dataclasses.MISSING


def field_rows(prefix: str, cls, values: dict) -> list[dict]:
  """One row per field of dataclass `cls` present in `values` (the base config's group),
  a nested dataclass group's fields after its own row."""
  hints = typing.get_type_hints(cls)
  docs = attribute_docs(cls)
  fields = {f.name: f for f in dataclasses.fields(cls)}
  rows = []
  for name, value in values.items():
    hint = hints[name]
    lib = _library_default(fields[name])
    nested = dataclasses.is_dataclass(hint) and isinstance(value, dict)
    library = (
        "required"
        if lib is dataclasses.MISSING
        else f"`{lib!r}`"
        if not nested and lib != value
        else ""
    )
    allowed = "" if nested else allowed_text(cls, values, name)
    if not allowed and hint is bool:
      allowed = "True or False"
    rows.append(
        {
            "name": f"{prefix}.{name}",
            "type": "group" if nested else _type_name(hint, value),
            "default": "" if nested else repr(value),
            "library": library,
            "allowed": allowed,
            "doc": docs.get(name, ""),
            "source": cls.__name__,
        }
    )
    if nested:
      rows += field_rows(f"{prefix}.{name}", hint, value)
  return rows


def config_rows() -> list[dict]:
  """Every config field (see the module docstring), in the base config's order."""
  rows = [
      {
          "name": "seed",
          "type": "int",
          "default": repr(defaults.base_config().seed),
          "library": "",
          "allowed": "",
          "doc": SEED_LINE,
          "source": "base_config",
      }
  ]
  for group, (cls, _) in defaults.GROUPS.items():
    values = {k: _plain(v) for k, v in defaults.group_defaults(group).items()}
    rows += field_rows(group, cls, values)
  return rows


def undocumented() -> list[str]:
  """Config fields whose dataclass docstring has no `Attributes:` entry for them."""
  return [r["name"] for r in config_rows() if not r["doc"]]


def _cell(text: str) -> str:
  return text.replace("|", "\\|")


def config_markdown() -> str:
  """The text of docs/config.md."""
  rows = config_rows()
  out = [
      "# Config reference",
      "",
      f"Generated by `{COMMAND}` from the config dataclasses (`mtrl_jax/run/defaults.py`, "
      "`GROUPS`); edit their docstrings, not this file. Set a field with "
      "`--config.<group>.<field>=<value>` (or a config file's `get_config`). *default* is "
      "the base config's; *(library: ...)* is the dataclass's own where a run departs "
      "from it. *allowed* is what validation says when it refuses a value; a run checks "
      "more at start (`mtrl_jax/run/experiment.py`).",
      "",
  ]
  header = ["| field | type | default | allowed | what it does |", "|---|---|---|---|---|"]
  out += ["## Top level", ""] + header
  out += [_row(rows[0]), ""]
  for group, (cls, _) in defaults.GROUPS.items():
    summary = (inspect.getdoc(cls) or "").split("\n")[0]
    out += [f"## `{group}`", "", f"`{cls.__module__}.{cls.__name__}`: {summary}", ""] + header
    out += [_row(r) for r in rows if r["name"].startswith(group + ".")]
    out.append("")
  return "\n".join(out)


def _row(r: dict) -> str:
  doc = r["doc"] or f"(no entry in `{r['source']}`'s docstring)"
  default = f"`{r['default']}`" if r["default"] else ""
  if r["library"]:
    default += f" (library: {r['library']})"
  return (
      "| "
      + " | ".join(_cell(x) for x in (f"`{r['name']}`", r["type"], default, r["allowed"], doc))
      + " |"
  )


def metrics_markdown() -> str:
  """The text of docs/metrics.md."""
  holes = ", ".join(f"`<{k}>` {what}" for k, (_, what) in glossary.PLACEHOLDERS.items())
  out = [
      "# Metrics glossary",
      "",
      f"Generated by `{COMMAND}` from `mtrl_jax/run/glossary.py` (`SECTIONS`); edit the "
      "table there, not this file. Every RL step writes one row to "
      "`workdir/metrics.jsonl` and TensorBoard (`workdir/tb`); a key appears in a row "
      f"only when its part of the run ran that step. Placeholders: {holes}. Units: *reward* "
      "is the composed reward's scale, *nats* a log-probability difference, *s* seconds.",
      "",
  ]
  for title, intro, entries in glossary.SECTIONS:
    out += [f"## {title}", ""] + ([intro[0].upper() + intro[1:] + ".", ""] if intro else [])
    out += ["| key | meaning | unit |", "|---|---|---|"]
    out += [
        "| " + " | ".join(_cell(x) for x in (f"`{p}`", meaning, unit)) + " |"
        for p, meaning, unit in entries
    ]
    out.append("")
  return "\n".join(out)


def documents() -> dict[str, str]:
  """Path (relative to the repository root) -> the text the code gives it."""
  return {CONFIG_DOC: config_markdown(), METRICS_DOC: metrics_markdown()}


def stale(root: str = ROOT) -> list[str]:
  """The documents whose file differs from what the code gives (or is missing)."""
  out = []
  for rel, text in documents().items():
    path = os.path.join(root, rel)
    if not os.path.exists(path) or open(path).read() != text:
      out.append(rel)
  return out


def main(argv):
  del argv
  if _CHECK.value:
    bad = stale()
    if bad:
      print(f"out of date: {', '.join(bad)}; run `{COMMAND}`", file=sys.stderr)
      sys.exit(1)
    return
  for rel, text in documents().items():
    with open(os.path.join(ROOT, rel), "w") as f:
      f.write(text)
    print(f"wrote {rel}")


if __name__ == "__main__":
  cli.run(main)
