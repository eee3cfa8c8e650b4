"""Built-in tasks; importing this package registers their factories and task sources."""

from mtrl_jax.envs.tasks import calculator  # noqa: F401
from mtrl_jax.envs.tasks.code import env as code_env  # noqa: F401
from mtrl_jax.envs.tasks import coop  # noqa: F401
