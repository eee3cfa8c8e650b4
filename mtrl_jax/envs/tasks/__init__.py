"""Built-in tasks; importing this package registers their factories and task sources."""

from mtrl_jax.envs.tasks import calculator  # noqa: F401
