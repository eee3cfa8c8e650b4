"""Tree rollouts: T turns x G generations x N agents, returns, advantages, packing.

`expand_tree` grows one tree per task on the rollout engine (decode slots
whose KV cache persists; environment steps on a thread pool or worker
processes, `rollout.workers`; no level barrier), `Tree.finalize` computes discounted returns and sibling-baseline
advantages, `batching.make_train_batch` packs it into the fixed-shape
`TrainBatch` (`rollout.train_batch`) and
`write_rollout_dump` the per-node JSONL dump. With
`TreeConfig(branch_on='user_turn')` the tree branches at user turns only:
tool calls and their results within a turn are sub-steps of one action.

`mtrl_jax.rollout.env_transition.EnvTransition` adapts `mtrl_jax.envs`
environments to the engine's `Transition` and is imported from its module.
"""

from mtrl_jax.rollout.completion import Completion
from mtrl_jax.rollout.config import TreeConfig, TreePlan, plan_tree
from mtrl_jax.rollout.dump import dump_path, node_records, write_rollout_dump
from mtrl_jax.rollout.engine import expand_tree
from mtrl_jax.rollout.inflight import RolloutTimes
from mtrl_jax.rollout.policy import EnginePolicy, RolloutPolicy, StackedStates
from mtrl_jax.rollout.records import ActionOutcome, ActionRecord, StepRecord, Transition
from mtrl_jax.rollout.returns import advantages, joint_actions
from mtrl_jax.rollout.train_batch import TrainBatch
from mtrl_jax.rollout.tree import Node, Tree

__all__ = [
    "TreeConfig",
    "TreePlan",
    "plan_tree",
    "Tree",
    "Node",
    "Completion",
    "joint_actions",
    "advantages",
    "RolloutPolicy",
    "EnginePolicy",
    "StackedStates",
    "Transition",
    "ActionOutcome",
    "StepRecord",
    "ActionRecord",
    "RolloutTimes",
    "expand_tree",
    "TrainBatch",
    "write_rollout_dump",
    "dump_path",
    "node_records",
]
