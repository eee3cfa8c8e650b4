"""`SharedResource`: objects an environment holds but must not copy when it forks.

Lives at the bottom of the package because both the text-generation services
(`mtrl_jax.sampling.generation`) and the environment API (`mtrl_jax.envs`) are
built on it; `mtrl_jax.envs` re-exports it.
"""


class SharedResource:
  """Mixin: deep copies return the object itself.

  For things an environment holds but must not duplicate when it is forked
  at a tree branch point: model-backed judges and user simulators, caches,
  connections. They must be safe to use from several forks at once.
  """

  def __deepcopy__(self, memo):
    return self
