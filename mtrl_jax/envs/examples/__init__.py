"""Compatibility alias: the example environment moved to `mtrl_jax.tasks.weather`.

`mtrl_jax.envs.examples` is the `mtrl_jax.tasks` package, so
`mtrl_jax.envs.examples.weather:WeatherFactory` keeps working. Nothing in the
package imports this alias (tests/test_layering.py checks it).
"""

from mtrl_jax.registry import alias_module

alias_module(__name__, "mtrl_jax.tasks")
