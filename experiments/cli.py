"""How every entry point runs: a refusal is one line on stderr, never the `--help` text.

    from experiments import cli
    ...
    if __name__ == "__main__":
      cli.run(main)

`run` is `absl.app.run` with two changes. A flag that cannot be parsed (an
unknown flag, a mistyped `--config.<key>`, a key inside a dict-valued field
that the config file does not set, a value of the wrong type, a missing
required flag, a config file that does not load) and an `app.UsageError` or
`experiment.ConfigError` raised by `main` print ONE line, `error: <message>`,
naming the flag or field and what is allowed, and exit with status
`EXIT_REFUSED` (2) without a traceback. absl would print the module's flag
help in front of a `UsageError` and a 50-line traceback for a mistyped config
key. A fault of the run itself keeps its traceback.
"""

from __future__ import annotations

import difflib
import re
import sys
from typing import Callable, NoReturn, Optional, Sequence

from absl import app, flags
from ml_collections import config_dict
from ml_collections.config_flags import config_flags

EXIT_REFUSED = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports it


def one_line(text) -> str:
  """`text` with every run of whitespace (newlines included) as one space."""
  return " ".join(str(text).split())


def refuse(message) -> NoReturn:
  """Prints `error: <message>` as one line on stderr and exits with `EXIT_REFUSED`."""
  sys.stdout.flush()
  sys.stderr.write(f"error: {one_line(message)}\n")
  sys.stderr.flush()
  sys.exit(EXIT_REFUSED)


def _override_paths(name: str, argv: Sequence[str]) -> list[str]:
  """The dotted fields of `--<name>.a.b=v` / `--no<name>.a.b` overrides, in order."""
  pattern = re.compile(rf"^--?(?:no)?{re.escape(name)}\.([^=]+)")
  return [m.group(1) for m in map(pattern.match, argv) if m]


def _config_spec(flag, argv: Sequence[str]):
  """The config file argument of config flag `flag` in argv, else its default."""
  spec = None
  for i, arg in enumerate(argv):
    m = re.match(rf"^--?{re.escape(flag.name)}(=(.*))?$", arg)
    if m:
      spec = m.group(2) if m.group(1) else (argv[i + 1] if i + 1 < len(argv) else None)
  return spec if spec is not None else flag.default


def _field_error(name: str, config, path: str) -> Optional[str]:
  """Why override `--<name>.<path>` does not name a field of `config`; None when it does."""
  node, walked = config, []
  for part in path.split("."):
    where = ".".join([name] + walked)
    if not isinstance(node, config_dict.ConfigDict):
      return (
          f"--{name}.{path}: {where} is a {type(node).__name__} value, not a group; "
          f"allowed: --{where}=<value>"
      )
    if part not in node:
      keys = sorted(node.keys())
      close = difflib.get_close_matches(part, keys, n=1)
      hint = f" (did you mean {close[0]!r}?)" if close else ""
      whole = f", or the whole dict: --{where}='{{\"{part}\": ...}}'" if len(walked) >= 2 else ""
      return f"--{name}.{path}: {where} has no field {part!r}{hint}; allowed: {keys}{whole}"
    node = node[part]
    walked.append(part)
  return None


def _load_error(name: str, spec, err) -> str:
  """One line for config file `spec` of flag `--<name>` that did not load: its last line
  (the exception itself, after ml_collections' traceback or list of attempts)."""
  lines = [line.strip() for line in str(err).splitlines() if line.strip()]
  last = lines[-1] if lines else type(err).__name__
  return (
      f"--{name}={spec}: {last}; allowed: a config file path[:arg] whose "
      "get_config(arg) returns a ConfigDict"
  )


def _unloaded(value) -> Optional[Exception]:
  """The load error ml_collections keeps in place of a config file that did not load."""
  if isinstance(value, config_flags._ErrorConfig):  # pylint: disable=protected-access
    return object.__getattribute__(value, "_error")
  return None


def _config_flags(flag_values) -> list:
  return [
      flag_values[n]
      for n in list(flag_values)
      if config_flags.is_config_flag(flag_values[n]) and flag_values[n].name == n
  ]


def _parse_error(err: Exception, argv: Sequence[str], flag_values) -> str:
  """One line for a non-absl error while parsing: the config flag or override it came from."""
  for flag in _config_flags(flag_values):
    spec = _config_spec(flag, argv)
    try:
      config = flag.parser.parse(spec) if isinstance(spec, str) else spec
    except Exception as e:  # the config file itself does not load
      return _load_error(flag.name, spec, e)
    if _unloaded(config) is not None:
      return _load_error(flag.name, spec, _unloaded(config))
    for path in _override_paths(flag.name, argv):
      msg = _field_error(flag.name, config, path)
      if msg:
        return msg
    return f"--{flag.name}: {type(err).__name__}: {one_line(err)}"
  return f"{type(err).__name__}: {one_line(err)}"


def _flag_error(err: Exception, flag_values) -> str:
  """One line for an absl flag error: a missing required flag with its help, a config
  file that raised with its exception, a value that did not parse with the flag's type."""
  msg = one_line(err)
  m = re.match(r"^flag --([^=\s]+)=", msg)
  flag = flag_values[m.group(1)] if m and m.group(1) in flag_values else None
  if flag is None:
    return msg
  loading = re.match(r"^flag --[^=\s]+=(.*?): Error whilst parsing config file", msg)
  if config_flags.is_config_flag(flag) and loading:
    return _load_error(flag.name, loading.group(1), err)
  if "must have a value other than None" in msg:
    return f"--{flag.name} is required; allowed: {flag.help}"
  if "allowed" in msg:
    return msg
  return msg + f"; allowed: a value of type {flag.flag_type()}"


def parse_flags(argv: Sequence[str], flag_values=flags.FLAGS) -> list[str]:
  """Parses `argv` into `flag_values`; any failure is refused in one line (`refuse`)."""
  try:
    rest = flag_values(list(argv))
  except flags.Error as e:
    refuse(_flag_error(e, flag_values))
  except Exception as e:  # config_flags raises plain errors for a bad --config.<key>
    refuse(_parse_error(e, argv, flag_values))
  for flag in _config_flags(flag_values):  # a config file that did not load fails late
    if _unloaded(flag.value) is not None:
      refuse(_load_error(flag.name, _config_spec(flag, argv), _unloaded(flag.value)))
  return rest


def call_main(main: Callable, argv: list[str]):
  """Calls `main(argv)`; a `UsageError` or `ConfigError` it raises is refused in one line.
  A `checkpoint.CheckpointError` (a save failed: the run ends, its last checkpoint
  intact) is one line too, `error: <message>`, with exit status 1. Ctrl-C (SIGINT) ends
  with one line saying that the same command resumes from the last checkpoint (a
  checkpoint is written whole or not at all), exit status `EXIT_INTERRUPTED` (130)."""
  exp = sys.modules.get("mtrl_jax.run.experiment")  # loaded if main can raise ConfigError
  refusals = (app.UsageError,) + ((exp.ConfigError,) if exp is not None else ())
  ckpt = sys.modules.get("mtrl_jax.checkpoint")
  storage = (ckpt.CheckpointError,) if ckpt is not None else ()
  try:
    return main(argv)
  except refusals as e:
    refuse(e)
  except storage as e:
    sys.stdout.flush()
    sys.stderr.write(f"error: {one_line(e)}\n")
    sys.exit(1)
  except KeyboardInterrupt:
    sys.stdout.flush()
    sys.stderr.write(
        "\nstopped by Ctrl-C; the same command resumes from the last "
        "checkpoint under --workdir (a run without one starts afresh)\n"
    )
    sys.exit(EXIT_INTERRUPTED)


def run(main: Callable, argv: Optional[Sequence[str]] = None) -> None:
  """`absl.app.run(main)` whose refusals are one line each (see the module docstring)."""
  app.run(lambda args: call_main(main, args), argv=argv, flags_parser=parse_flags)
