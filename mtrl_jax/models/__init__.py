"""Policy / reference models: config, NNX transformer, KV cache, checkpoint import."""

from __future__ import annotations

import jax
from flax import nnx

from mtrl_jax import sharding
from mtrl_jax.models.config import PRESETS, ModelConfig, get_preset
from mtrl_jax.models.cache import KVCache, init_cache
from mtrl_jax.models.transformer import Transformer

__all__ = [
    "ModelConfig",
    "PRESETS",
    "get_preset",
    "Transformer",
    "KVCache",
    "init_cache",
    "create_model",
    "state_shardings",
]


def create_model(
    cfg: ModelConfig, *, seed: int = 0, mesh=None, rules=sharding.TRAIN_RULES
) -> Transformer:
  """Builds a randomly initialised model with parameters born sharded on `mesh`.

  Args:
    cfg: model hyper-parameters.
    seed: parameter RNG seed.
    mesh: a (data, fsdp, tensor) mesh; default: one device.
    rules: logical-axis rules (filtered by `sharding.rules_for`).
  """
  mesh = mesh if mesh is not None else sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    return Transformer(cfg, rngs=nnx.Rngs(seed))


def state_shardings(model_or_state, cfg: ModelConfig, mesh, rules=sharding.TRAIN_RULES):
  """NamedShardings for every parameter, from its logical axis names."""
  state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    return nnx.get_named_sharding(state, mesh)
