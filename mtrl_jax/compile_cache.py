"""JAX's persistent compilation cache: compiled programs survive the process.

Every run (and every sweep arm) on a machine shares one cache directory, so a
program compiled once is loaded from disk by later runs instead of compiled
again (docs/performance.md, "Start-up time"). `setup` points JAX at it; the
entry points call it once per run (`run.experiment.start`), before the first
compile. The config's top-level `compile_cache` says where:

  'auto'   (the default) `$MTRL_JAX_COMPILE_CACHE` if set (empty: off), else
           `$XDG_CACHE_HOME/mtrl_jax/xla`, else `~/.cache/mtrl_jax/xla`;
  ''       off: every program is compiled;
  a path   that directory (`~` expands).

Every program is cached, however fast it compiled: a warm start loads the many
small ones too. A cached executable is the same XLA executable a compile would
give, so results stay bit-identical: the key covers the program, the compile
options, XLA_FLAGS and the jax version, and also the directory itself (XLA's own
caches live under it), so a copied or moved directory starts cold. A directory
that cannot be used is reported in one line and the run compiles without it; an
unreadable entry (a process killed while writing it) is compiled again, with a
JAX warning each time, until the directory is cleared. Nothing removes old
entries: `rm -r` the directory to reclaim its space.
"""

from __future__ import annotations

import os
import sys

ENV = "MTRL_JAX_COMPILE_CACHE"
AUTO = "auto"


def directory(setting: str) -> str:
  """The cache directory `setting` names ('' : off); see the module docstring.

  Raises:
    ValueError (one line naming `compile_cache`) for a setting that is not a string.
  """
  if not isinstance(setting, str):
    raise ValueError(
        f"config compile_cache={setting!r}; allowed: 'auto', '' (off) or a directory path"
    )
  if setting == AUTO:
    if ENV in os.environ:
      setting = os.environ[ENV]
    else:
      base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
      setting = os.path.join(base, "mtrl_jax", "xla")
  return os.path.abspath(os.path.expanduser(setting)) if setting else ""


def setup(setting: str = AUTO) -> str:
  """Points JAX's persistent compilation cache at `directory(setting)` (or turns it
  off); returns the directory in use ('' when off). Calling it again with the same
  setting changes nothing.

  Raises:
    ValueError (one line) for a setting that is not a string.
  """
  path = directory(setting)
  if path:
    try:
      os.makedirs(path, exist_ok=True)
      if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError("not writable")
    except OSError as e:
      print(
          f"compile_cache {path!r} cannot be used ({e}); compiling without a persistent cache",
          file=sys.stderr,
          flush=True,
      )
      path = ""
  import jax
  from jax.experimental.compilation_cache import compilation_cache

  current = jax.config.jax_compilation_cache_dir
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  if (os.path.abspath(current) if current else "") != path:
    jax.config.update("jax_compilation_cache_dir", path or None)
    compilation_cache.reset_cache()  # JAX opens its cache once; the next compile reopens it
  return path
