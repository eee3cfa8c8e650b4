"""Low-rank adapters over one frozen base (`config.model.lora`).

A model built with `cfg.lora` (`models.config.LoraConfig`) carries, on each
targeted linear layer W [in, out] of every block, an `nnx.LoRA` module with
A [in, r] and B [r, out] (`nnx.LoRAParam`s, float32, B zero) and computes
x @ W + (alpha / r) * x @ A @ B; multi-axis weights (q is [D, H, Dh], o is
[H, Dh, D]) flatten their input axes to `in` and output axes to `out`.

Three parameter states describe such a model, split by variable type:

  graphdef, adapters, base = split(model)     # LoRAParam first, then Param

`base` has exactly the layout of the plain model's `nnx.Param` state, so
`base_graphdef(cfg)` with `base` is the base model (the KL reference with
the adapters off), and `merge(base, adapters, lora)` gives the plain layout
with W + scale * A @ B (sampling, export). Adapter parameters are replicated
over the mesh (they are small).
"""

from __future__ import annotations

import hashlib

import jax
import numpy as np
import jax.numpy as jnp
from flax import nnx

from mtrl_jax import sharding
from mtrl_jax.models.config import LoraConfig, ModelConfig
from mtrl_jax.models.transformer import Transformer

# target -> (the block's submodule, its weight)
MODULE_OF = {
    "q": "attn",
    "k": "attn",
    "v": "attn",
    "o": "attn",
    "gate": "mlp",
    "up": "mlp",
    "down": "mlp",
}


def split(model: Transformer):
  """(graphdef, adapters, base) of an adapted model."""
  return nnx.split(model, nnx.LoRAParam, nnx.Param)


def plain(cfg: ModelConfig) -> ModelConfig:
  """The architecture without adapters."""
  return cfg.replace(lora=None)


def base_graphdef(cfg: ModelConfig, rules=sharding.TRAIN_RULES):
  """The graph of the model without adapters (no weights are materialised)."""
  cfg = plain(cfg)
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    return nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)[0]


def abstract_adapters(cfg: ModelConfig, rules=sharding.TRAIN_RULES):
  """The adapter state of the adapted architecture `cfg` as shapes only (nothing computed)."""
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    return split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))[1]


def _mesh_of(state):
  leaf = jax.tree.leaves(state)[0]
  mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
  return mesh if isinstance(mesh, jax.sharding.Mesh) else sharding.single_device_mesh()


def attach(
    model: Transformer, lora: LoraConfig, seed: int = 0, rules=sharding.TRAIN_RULES
) -> Transformer:
  """An adapted copy of `model` (its weights shared, not copied) with fresh adapters.

  The adapters are those of `Transformer(cfg with lora, rngs=nnx.Rngs(seed))`
  (drawn after the base weights), so an adapted model built from scratch and
  one attached to the same seed's base are the same model.
  """
  if not lora.enabled:
    raise ValueError(f"attach: model.lora.rank={lora.rank}; allowed: > 0")
  cfg = plain(model.cfg).replace(lora=lora)
  _, base = nnx.split(model, nnx.Param)
  mesh = _mesh_of(base)
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    graphdef, _, _ = split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(seed))))
    # The base's draws are traced and dropped: only the adapters are computed.
    adapters = jax.jit(lambda: split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1])()
  return nnx.merge(graphdef, adapters, base)


def init_adapters(cfg: ModelConfig, seed: int = 0, rules=sharding.TRAIN_RULES):
  """Fresh adapters (B zero) of the adapted architecture `cfg`, replicated."""
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    return jax.jit(lambda: split(Transformer(cfg, rngs=nnx.Rngs(seed)))[1])()


def adapters_and_base(model_or_params, fresh):
  """(adapters, base) of an adapted model; of a plain model or `nnx.Param` state:
  (`fresh`, its weights)."""
  if isinstance(model_or_params, nnx.Module):
    if model_or_params.cfg.lora is not None and model_or_params.cfg.lora.enabled:
      return split(model_or_params)[1:]
    return fresh, nnx.state(model_or_params, nnx.Param)
  return fresh, model_or_params


def fingerprint(params) -> str:
  """sha256 of a parameter state's paths, dtypes, shapes and bytes (a base's identity)."""
  from jax.experimental import multihost_utils

  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if not getattr(x, "is_fully_addressable", True):
      x = multihost_utils.process_allgather(x, tiled=True)
    x = np.asarray(x)
    h.update(f"{jax.tree_util.keystr(path)}|{x.dtype}|{x.shape}|".encode())
    h.update(np.ascontiguousarray(x).tobytes())
  return h.hexdigest()


def pairs(adapters):
  """{(layer, target): (A [in, r], B [r, out])} of an adapter state (arrays, or
  ShapeDtypeStructs of an abstract one)."""
  out = {}
  for i, block in adapters["blocks"].items():
    for module in ("attn", "mlp"):
      for name, ab in block.get(module, {}).items():
        out[(int(i), name[: -len("_lora")])] = (ab["lora_a"].get_value(), ab["lora_b"].get_value())
  return out


def _weights(base, adapters, lora: LoraConfig, sign: float):
  scale = sign * lora.scale
  out = jax.tree.map(lambda x: x, base)  # a new State; leaves replaced below
  for (i, target), (a, b) in pairs(adapters).items():
    var = out["blocks"][i][MODULE_OF[target]][target]
    w = var[...]
    delta = (a.astype(jnp.float32) @ b.astype(jnp.float32)) * scale
    var.set_value((w.astype(jnp.float32) + delta.reshape(w.shape)).astype(w.dtype))
  return out


def merge(base, adapters, lora: LoraConfig):
  """The plain parameter state with W + scale * A @ B on every adapted weight
  (computed in float32, stored in W's dtype)."""
  return _weights(base, adapters, lora, 1.0)


def unmerge(merged, adapters, lora: LoraConfig):
  """`merge` undone: W - scale * A @ B (exact up to W's rounding)."""
  return _weights(merged, adapters, lora, -1.0)
