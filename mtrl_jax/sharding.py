"""Device mesh, logical-axis rules and batch shardings.

One mesh with axes (`data`, `fsdp`, `tensor`). Parameters carry logical axis
names (see `mtrl_jax.models.transformer`); one rules table maps them onto mesh
axes for training, a second one (no FSDP) for sampling. A rule whose mesh axis
does not divide the model dimension it shards is dropped for that model, so
tiny test models run on any mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Protocol, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P


class ModelDims(Protocol):
  """The model sizes the rules need (`mtrl_jax.models.ModelConfig` has them); a protocol,
  because models import this module, not the other way round."""

  vocab_size: int
  d_model: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int


MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")

# logical name -> mesh axis (None: replicated). Training: FSDP shards the
# model width, tensor parallelism shards heads / MLP / vocab.
TRAIN_RULES: tuple[tuple[str, Optional[str]], ...] = (
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("mlp", "tensor"),
    ("norm", None),
)
# Sampling: no FSDP (weights are gathered once, not every decode step).
SAMPLE_RULES: tuple[tuple[str, Optional[str]], ...] = tuple(
    (name, None if axis == "fsdp" else axis) for name, axis in TRAIN_RULES
)


@dataclasses.dataclass(frozen=True)
class MeshConfig:
  """Mesh shape; -1 in one axis takes the remaining devices.

  Attributes:
    data: devices the batch rows are split over (-1: the remaining devices).
    fsdp: devices parameters and optimizer state are sharded over (the batch
      rows are split over them too).
    tensor: devices each weight matrix is split over.
  """

  data: int = -1
  fsdp: int = 1
  tensor: int = 1

  def shape(self, num_devices: int) -> tuple[int, int, int]:
    dims = [self.data, self.fsdp, self.tensor]
    if dims.count(-1) > 1:
      raise ValueError(f"MeshConfig {dims}: at most one axis may be -1")
    known = int(np.prod([d for d in dims if d != -1]))
    if -1 in dims:
      if num_devices % known:
        raise ValueError(f"MeshConfig {dims}: {num_devices} devices not divisible by {known}")
      dims[dims.index(-1)] = num_devices // known
    if int(np.prod(dims)) != num_devices:
      raise ValueError(
          f"MeshConfig data*fsdp*tensor={dims} uses {int(np.prod(dims))} devices; "
          f"{num_devices} are available"
      )
    return tuple(dims)


def make_mesh(shape: Sequence[int] = (-1, 1, 1), devices=None) -> jax.sharding.Mesh:
  """A (data, fsdp, tensor) mesh with Auto axis types over `devices`."""
  devices = list(devices if devices is not None else jax.devices())
  dims = MeshConfig(*shape).shape(len(devices))
  return jax.make_mesh(dims, MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices)


def single_device_mesh() -> jax.sharding.Mesh:
  return make_mesh((1, 1, 1), devices=jax.devices()[:1])


def _logical_sizes(cfg: ModelDims) -> dict[str, int]:
  return {
      "vocab": cfg.vocab_size,
      "embed": cfg.d_model,
      "q_heads": cfg.num_heads,
      "kv_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim,
      "mlp": cfg.mlp_dim,
      "norm": cfg.d_model,
  }


def rules_for(
    cfg: ModelDims, mesh: jax.sharding.Mesh, rules=TRAIN_RULES
) -> tuple[tuple[str, Optional[str]], ...]:
  """`rules` with every mapping dropped whose mesh axis does not divide the dim."""
  sizes = _logical_sizes(cfg)
  out = []
  for name, axis in rules:
    if axis is not None and sizes.get(name, 0) % mesh.shape[axis]:
      axis = None
    out.append((name, axis))
  return tuple(out)


def batch_sharding(
    mesh: jax.sharding.Mesh, ndim: int = 2, batch_size: Optional[int] = None
) -> NamedSharding:
  """Shards the leading (batch) axis over data x fsdp, the rest replicated."""
  axes = BATCH_AXES
  if batch_size is not None and batch_size % (mesh.shape["data"] * mesh.shape["fsdp"]):
    axes = ("data",) if batch_size % mesh.shape["data"] == 0 else None
  return NamedSharding(mesh, P(axes, *([None] * (ndim - 1))))


def replicated(mesh: jax.sharding.Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def shard_batch(batch, mesh: jax.sharding.Mesh):
  """device_put every array of a batch pytree with its leading axis sharded."""
  return jax.tree.map(
      lambda x: jax.device_put(x, batch_sharding(mesh, np.ndim(x), np.shape(x)[0]))
      if np.ndim(x)
      else jax.device_put(x, replicated(mesh)),
      batch,
  )
