"""mtrl_jax: multi-turn reinforcement learning of LLM agents in JAX/Flax NNX.

Array names carry their shape with this letter key (written once, here):

  B  batch (rows of a training or sampling batch)
  P  prompts (before branching; B = P * G)
  G  generations per prompt / node
  N  agents
  T  turns
  L  tokens (sequence length)
  S  KV-cache slots
  V  vocabulary
  D  model width
  H  query heads, K  key/value heads, Dh  head width
  F  MLP hidden width

so `logp_BxL` is a [B, L] array of per-token log-probabilities and
`logits_BxLxV` the model's output.
"""

__version__ = "0.1.0"


def __getattr__(name):
  # The recipes import the whole stack; `import mtrl_jax` stays light.
  if name in ("ENVGRPO", "ENVGSPO"):
    from mtrl_jax.run import recipes

    return getattr(recipes, name)
  raise AttributeError(f"module 'mtrl_jax' has no attribute {name!r}")
