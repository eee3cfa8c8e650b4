"""Where the rollout engine's arrays live: the mesh, parameter shardings, the KV pool, rows.

Slots are split over the mesh's data x fsdp devices (a batch shard per
device block, so a shard's slots never leave it), parameters are placed with
the sampling rules (no FSDP: weights are gathered once, not per step), and
the KV cache's head axis follows the `kv_heads` rule. Without a mesh the
engine is a process's own (a judge's or user simulator's model): one local
device and no collectives.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from mtrl_jax.models.config import ModelConfig
from mtrl_jax.models.cache import KVCache
from mtrl_jax.models.transformer import Transformer
from mtrl_jax import sharding  # pylint: disable=g-bad-import-order
from mtrl_jax import distributed
from mtrl_jax.sampling.programs import SlotRows


class DeviceLayout:
  """The engine's devices and array placements (see the module docstring).

  Args:
    model_cfg: the model's hyper-parameters.
    mesh: a (data, fsdp, tensor) mesh (its axes are used as Auto) or None.
    num_agents: parameter sets stacked on a leading agent axis (1: shared).
    rules: logical-axis rules of the parameters while sampling.
  """

  def __init__(
      self,
      model_cfg: ModelConfig,
      mesh: Optional[jax.sharding.Mesh],
      num_agents: int,
      rules=sharding.SAMPLE_RULES,
  ):
    self.model_cfg = model_cfg
    self.process_local = mesh is None
    if mesh is None:
      mesh = sharding.make_mesh((1, 1, 1), devices=jax.local_devices()[:1])
    if any(t != AxisType.Auto for t in mesh.axis_types):
      mesh = jax.sharding.Mesh(
          mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names)
      )
    self.mesh = mesh
    self.num_agents = int(num_agents)
    self.num_shards = mesh.shape["data"] * mesh.shape["fsdp"]
    procs = 1 if self.process_local else jax.process_count()
    if self.num_shards % procs:
      raise ValueError(
          f"DecodeEngine: {self.num_shards} batch shards do not split over {procs} processes"
      )
    self.local_shards = self.num_shards // procs
    model_rules = sharding.rules_for(model_cfg, mesh, rules)
    self.kv_axis = dict(model_rules).get("kv_heads")
    with jax.set_mesh(mesh), nnx.logical_axis_rules(model_rules):
      abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
      self.graphdef, abstract_state = nnx.split(abstract)
      self.state_shardings = nnx.get_named_sharding(abstract_state, mesh)

  # ------------------------------------------------------------ the KV pool
  def pool_shape(self, slots: int, capacity: int) -> tuple:
    """[D, A, S + 1, K, C, Dh]: a scratch slot after each (shard, agent)'s S slots."""
    c = self.model_cfg
    return (self.num_shards, self.num_agents, slots + 1, c.num_kv_heads, capacity, c.head_dim)

  def pool_sharding(self) -> NamedSharding:
    return NamedSharding(self.mesh, P(sharding.BATCH_AXES, None, None, self.kv_axis, None, None))

  def new_pool(self, slots: int, capacity: int) -> KVCache:
    shape, dtype, layers = (
        self.pool_shape(slots, capacity),
        self.model_cfg.jnp_dtype,
        self.model_cfg.num_layers,
    )
    make = jax.jit(
        lambda: KVCache(
            k=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
            v=tuple(jnp.zeros(shape, dtype) for _ in range(layers)),
        ),
        out_shardings=self.pool_sharding(),
    )
    return make()

  def abstract_pool(self, slots: int, capacity: int) -> KVCache:
    s = jax.ShapeDtypeStruct(
        self.pool_shape(slots, capacity), self.model_cfg.jnp_dtype, sharding=self.pool_sharding()
    )
    return KVCache(k=(s,) * self.model_cfg.num_layers, v=(s,) * self.model_cfg.num_layers)

  def slot_rows_shape(self, slots: int) -> tuple:
    """[D, A, S + 1]: the slot state beside the pool (`programs.SlotRows`)."""
    return (self.num_shards, self.num_agents, slots + 1)

  def new_slot_rows(self, slots: int) -> SlotRows:
    """Every slot finished (nothing decodes until an admit starts a sample)."""
    shape, sh = self.slot_rows_shape(slots), self.rows_sharding(3)
    zeros = lambda: jnp.zeros(shape, jnp.int32)
    make = jax.jit(
        lambda: SlotRows(zeros(), zeros(), zeros(), jnp.ones(shape, bool)), out_shardings=sh
    )
    return make()

  def abstract_slot_rows(self, slots: int) -> SlotRows:
    shape, sh = self.slot_rows_shape(slots), self.rows_sharding(3)
    i32 = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sh)
    return SlotRows(i32, i32, i32, jax.ShapeDtypeStruct(shape, jnp.bool_, sharding=sh))

  # ------------------------------------------------------------ placement
  def put_params(self, params, stacked: bool):
    """Parameters (or their `ShapeDtypeStruct`s) on the sampling layout."""
    sh = self.state_shardings
    if stacked:
      sh = jax.tree.map(lambda s: NamedSharding(s.mesh, P(None, *s.spec)), sh)
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(params)):
      return jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, sh
      )
    return jax.device_put(params, sh)

  def rows_sharding(self, ndim: int) -> NamedSharding:
    return sharding.batch_sharding(self.mesh, ndim, self.num_shards)

  def put_rows(self, arrays) -> list:
    """Each of this process's [local shards, ...] blocks as a global array split on its
    shard axis; in one transfer where the process holds every device (a call's ~10
    small arrays cost one host-to-device dispatch, not ten)."""
    shardings = [self.rows_sharding(x.ndim) for x in arrays]
    if self.process_local:
      return jax.device_put(list(arrays), shardings)
    return [distributed.global_rows(x, s) for x, s in zip(arrays, shardings)]

  def replicated(self, x):
    if self.process_local:
      return jax.device_put(x, sharding.replicated(self.mesh))
    return distributed.replicated_value(x, sharding.replicated(self.mesh))
