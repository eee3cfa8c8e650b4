"""Compatibility alias: the built-in tasks moved to `mtrl_jax.tasks`.

`mtrl_jax.envs.tasks` and every submodule under it (`.calculator`, `.coop`,
`.code.env`, ...) are the module objects of `mtrl_jax.tasks`, so configs that
name the old paths (e.g. `mtrl_jax.envs.tasks.calculator:EXTRA_SPECIALS`) keep
working. Nothing in the package imports this alias (tests/test_layering.py
checks it): importing `mtrl_jax.envs` never imports the tasks above it.
"""

from mtrl_jax.registry import alias_module

alias_module(__name__, "mtrl_jax.tasks")
