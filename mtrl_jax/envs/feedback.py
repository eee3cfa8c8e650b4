"""Compatibility alias: the HumanEval feedback modes moved to `mtrl_jax.tasks.code.feedback`.

`mtrl_jax.envs.feedback` is that module object. Nothing in the package imports
this alias (tests/test_layering.py checks it).
"""

from mtrl_jax.registry import alias_module

alias_module(__name__, "mtrl_jax.tasks.code.feedback")
