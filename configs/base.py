"""Base config of an ENVGRPO / ENVGSPO run; task configs start from it.

`mtrl_jax/run/defaults.py` builds it from the config dataclasses, which document every
field; task configs (e.g. `configs/calculator.py`) override what they need. Usage:

  python -m experiments.train --config=configs/base.py --workdir=/tmp/run \
      --config.env.factory=my_pkg.my_env:MyFactory --config.tasks.source=my_pkg.my_env:tasks

A mistyped key fails at start (the config is locked), and `mtrl_jax.train.
experiment.build` rejects unsafe combinations before any compute.
"""

from mtrl_jax import compile_cache
from mtrl_jax.run.defaults import base_config


def get_config(arg=None):
  del arg
  c = base_config()
  # Where compiled programs persist between runs (mtrl_jax/compile_cache.py): 'auto' is
  # $MTRL_JAX_COMPILE_CACHE, else the user's cache directory; '' compiles every program.
  c.compile_cache = compile_cache.AUTO
  return c
