"""Concrete task suites built on the environment API; importing this package registers them.

  calculator  the multi-turn calculator tool task (the CPU demo)
  charclass   a one-turn character-class task RL learns from scratch in seconds (learning test)
  coop        the two-agent cooperative arithmetic task
  guess       number guessing: "higher" / "lower" user turns, a tool, per-turn and final grades
  refine      two agents refine a joint code from complementary hints and graded feedback
  code        HumanEval code generation: prompts, rewards, feedback modes, data
  user_chat   a simulated user (LLM) and an LLM judge on one local model
  weather     the example environment of the API docs (a tool, per-turn and final graders)

Each module registers its environment factory (`mtrl_jax.envs.register_env_factory`)
and task source (`mtrl_jax.data.register_task_source`) when imported. The run's
composition root imports this package, so configs can name the tasks by
registry name (`env.factory=calculator`).
"""

from mtrl_jax.tasks import calculator  # noqa: F401
from mtrl_jax.tasks import charclass  # noqa: F401
from mtrl_jax.tasks.code import env as code_env  # noqa: F401
from mtrl_jax.tasks import coop  # noqa: F401
from mtrl_jax.tasks import guess  # noqa: F401
from mtrl_jax.tasks import refine  # noqa: F401
from mtrl_jax.tasks import user_chat  # noqa: F401
from mtrl_jax.tasks import weather  # noqa: F401
