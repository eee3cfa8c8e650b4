"""Example environments written against the public API only (registered on import)."""

from mtrl_jax.envs.examples import weather  # noqa: F401  (registers "weather")
