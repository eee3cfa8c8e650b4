"""How big one RL step's tree is and the memory it needs, checked before compute.

A tree's width multiplies: each node of depth t has `branching_at(t)` children
(G, or G^N joint actions in cross mode), so T = 2, N = 3, G = 8 in cross mode
grows 512 children per node and its engine, sized for the widest level, needs
a KV cache far beyond any machine. `estimate` counts the step from the config
alone (`rollout.plan_tree` for the tree, `run.shapes.plan_shapes` for the
engine slots and the packed rows):

  tree          nodes, joint actions and sampled completions (segments, with
                branch_on='user_turn') and tokens (completions x
                sampling.max_new_tokens), per root and per step;
  KV cache      slots x capacity x layers x 2 (keys, values) x kv_heads x
                head_dim x bytes of model.dtype, over every batch shard (and
                every agent with separate policies);
  packed batch  the largest planned train batch: rows x rl.max_length tokens
                x `BATCH_BYTES_PER_TOKEN` (its int32 / float32 arrays).

`check_memory` refuses, in one line naming the fields and what would fit, a
step whose KV cache and batch exceed the memory there is: the accelerators'
(`memory_stats()['bytes_limit']`, summed over this process's devices) or, on
CPU, the host's available RAM (`MemAvailable` of /proc/meminfo). Activations
and parameters come on top, so the check only refuses what cannot fit at
all. `experiment.start` checks it (it touches the devices, so validation
alone does not) and prints `describe(estimate)`; an in-process sweep checks
every arm before the first one runs.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
  from mtrl_jax.run.experiment import Experiment

GIB = 1024**3
# The packed batch's arrays per token: tokens, positions, ends, and per trained token
# prev, target, action, loss mask, old logprob, advantage (int32 / float32, K <= L).
BATCH_BYTES_PER_TOKEN = 4 * 9


@dataclasses.dataclass(frozen=True)
class TreeEstimate:
  """One RL step's size (see the module docstring); `*_per_root` are per task."""

  roots: int
  nodes: int
  joint_actions: int
  completions: int
  sampled_tokens: int
  slots: int  # KV slots over every shard and agent
  capacity: int  # cache columns per slot
  kv_bytes: int
  batch_bytes: int

  @property
  def total_bytes(self) -> int:
    return self.kv_bytes + self.batch_bytes

  def per_root(self, field: str) -> int:
    return getattr(self, field) // self.roots


def estimate(exp: Experiment) -> TreeEstimate:
  """Counts one RL step of `exp` as this process runs it.

  Args:
    exp: the experiment (its groups validated).
  Returns:
    The TreeEstimate.
  """
  import jax
  import jax.numpy as jnp

  from mtrl_jax.rollout import plan_tree
  from mtrl_jax.run import shapes as shapes_lib

  n = jax.process_count()
  data, fsdp, _ = exp.mesh.shape(jax.device_count())
  rows = max(1, data * fsdp // n)  # this process's batch shards
  local = shapes_lib.per_process(exp, n)
  tree, rl = local.tree, local.rl
  plan = plan_tree(tree, rl.roots_per_step, rl.max_length, exp.sampling.max_new_tokens)
  actions = sum(k * tree.actions_at(t) for t, k in enumerate(plan.level_nodes))
  shapes = shapes_lib.plan_shapes(local, rows, rows)
  agents = 1 if exp.agents.share_policy else tree.num_agents  # one cache per parameter set
  slots = shapes.engine.slots * rows * agents
  arch = exp.model.arch
  per_column = 2 * arch.num_layers * arch.num_kv_heads * arch.head_dim
  kv = slots * shapes.engine.capacity * per_column * jnp.dtype(arch.dtype).itemsize
  batch = max(shapes.train_rows) * max(shapes.train_lens) * BATCH_BYTES_PER_TOKEN
  return TreeEstimate(
      roots=rl.roots_per_step,
      nodes=plan.nodes,
      joint_actions=actions,
      completions=plan.generations,
      sampled_tokens=plan.generations * exp.sampling.max_new_tokens,
      slots=slots,
      capacity=shapes.engine.capacity,
      kv_bytes=int(kv),
      batch_bytes=int(batch),
  )


def available_memory() -> tuple[Optional[int], str]:
  """(bytes, where) this process can hold: its accelerators' memory, else the host's
  available RAM; (None, why) when neither is known."""
  import jax

  devices = jax.local_devices()
  if devices and devices[0].platform != "cpu":
    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
    if all(limits):
      return int(sum(limits)), f"{len(devices)} {devices[0].platform} device(s)"
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024, "available host RAM (/proc/meminfo)"
  except OSError:
    pass
  return None, "unknown"


def describe(e: TreeEstimate) -> str:
  """One line: the step's tree and memory."""
  return (
      f"tree per step ({e.roots} roots): {e.nodes} nodes ({e.per_root('nodes')} per root), "
      f"{e.joint_actions} joint actions, {e.completions} completions, "
      f"{e.sampled_tokens} sampled tokens ({e.per_root('sampled_tokens')} per root); "
      f"memory: KV cache {e.kv_bytes / GIB:.2f} GiB ({e.slots} slots x {e.capacity}), "
      f"packed batch {e.batch_bytes / GIB:.2f} GiB"
  )


def check_memory(exp: Experiment, available: Optional[int] = None, where: str = "") -> TreeEstimate:
  """The step's estimate; refused when its KV cache and batch exceed the memory there is.

  Args:
    exp: the experiment.
    available: bytes to fit in (default: `available_memory()`).
    where: what `available` is, for the message.
  Returns:
    The TreeEstimate.
  Raises:
    ValueError: one line naming the tree's fields, the estimate and what would fit.
  """
  e = estimate(exp)
  if available is None:
    available, where = available_memory()
  if available is None or e.total_bytes <= available:
    return e
  tree, roots = exp.tree, exp.rl.roots_per_step
  per_root = max(e.total_bytes - e.batch_bytes, 1) / roots  # the KV cache grows with roots
  fit = int((available - e.batch_bytes) // per_root) if available > e.batch_bytes else 0
  fix = (
      f"rl.roots_per_step <= {fit}"
      if fit >= 1
      else "a narrower tree (tree.num_generations, tree.num_turns, tree.joint_mode='align' or "
      "'marginal' instead of 'cross'), a shorter sampling.max_new_tokens or env.max_tokens"
  )
  raise ValueError(
      f"config tree (T={tree.num_turns}, G={tree.num_generations}, N={tree.num_agents}, "
      f"joint_mode={tree.joint_mode!r}) with rl.roots_per_step={roots} and "
      f"sampling.max_new_tokens={exp.sampling.max_new_tokens} needs "
      f"{e.total_bytes / GIB:.1f} GiB (KV cache {e.kv_bytes / GIB:.1f} GiB for {e.slots} slots "
      f"x {e.capacity} columns, packed batch {e.batch_bytes / GIB:.1f} GiB) over the "
      f"{available / GIB:.1f} GiB of {where}; allowed: {fix}"
  )
