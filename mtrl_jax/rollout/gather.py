"""Every process's finalized tree, merged: exact metrics and one dump for a multi-host step.

Each process expands the trees of its own share of the step's roots
(`mtrl_jax.distributed.share`). For logging, `gather_tree` sends every
process's finalized nodes (without their environment states) through the
host all-gather and merges them in process order: roots are renumbered
`offset + root` and node ids shifted, so the merged tree holds exactly the
roots, nodes, rewards, returns and advantages of a single-process run over
the same roots (node ids differ: a single process numbers a level's nodes
across all roots first). Its `metrics()` and the rollout statistics are then
the single-process ones, not an average of per-process averages, and process
0 writes one dump per step.

The cost is host traffic of one tree per step (token ids, rewards, infos) to
every process, the same size as the step's rollout dump; the train batch
never takes this path (its rows stay on their process, `batching.global_batch`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from mtrl_jax import distributed
from mtrl_jax.rollout.tree import Tree


def portable_nodes(tree: Tree) -> list:
  """The tree's nodes without environment states (they stay on their process)."""
  return [dataclasses.replace(n, state=None) for n in tree.nodes]


def merge_trees(cfg, parts) -> Tree:
  """One finalized `Tree` of `parts`: (nodes, num_roots) per process, in process order."""
  out = Tree(cfg)
  for nodes, num_roots in parts:
    offset = len(out.nodes)
    for n in nodes:
      children = (
          None if n.children_B is None else np.where(n.children_B >= 0, n.children_B + offset, -1)
      )
      out.nodes.append(
          dataclasses.replace(
              n,
              node_id=n.node_id + offset,
              root=n.root + out.num_roots,
              parent_id=n.parent_id + offset if n.parent_id >= 0 else -1,
              children_B=children,
          )
      )
    out.num_roots += num_roots
  out.finalized = True
  return out


def gather_tree(tree: Tree) -> Tree:
  """Every process's part of the step's trees merged (the tree itself with one process)."""
  if distributed.process_count() == 1:
    return tree
  return merge_trees(tree.cfg, distributed.allgather((portable_nodes(tree), tree.num_roots)))
