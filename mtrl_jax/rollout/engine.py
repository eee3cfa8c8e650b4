"""Level-by-level tree expansion: one sampler call per level, concurrent env steps.

The engine never loops over nodes around the sampler: the prompts of every
(node, agent) of a level, across all roots, go to ONE `PolicySampler.sample`
call (the sampler prefills each prompt once and forks G continuations). The
level's environment steps (one per joint action) then run on a thread pool,
so a slow tool or judge does not serialise the level.

The engine is independent of how environments represent state: it talks to a
`Transition`, which gives the prompt ids of a node state and steps a joint
action. `mtrl_jax.rollout.env_transition.EnvTransition` adapts
`mtrl_jax.envs` environments (threads, token ledgers, grades, faults); tests
use scripted transitions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
from typing import Any, Optional, Protocol, Sequence

import jax

from mtrl_jax.rollout.config import TreeConfig
from mtrl_jax.rollout.policy import PolicySampler
from mtrl_jax.rollout.tree import Completion, Node, Tree


@dataclasses.dataclass
class ActionOutcome:
  """What one environment step of a joint action produced.

  Attributes:
    next_state: the child's state (per-agent histories), or None when the
      environment ended the episode on this action.
    reward: r of the joint action (composed grade score; 0 when none).
    valid: False for an infrastructure fault: the action is masked, never rewarded.
    info: JSON-able details for the rollout dump (grades, faults, feedback).
  """

  next_state: Any
  reward: float
  valid: bool = True
  info: Optional[dict] = None


class Transition(Protocol):
  """The environment side of a tree, in terms of opaque node states."""

  def prompts(self, state: Any) -> list[list[int]]:
    """Prompt token ids (full context) of each agent at a node with `state`."""
    ...

  def step(self, state: Any, actions: Sequence[Completion]) -> ActionOutcome:
    """Applies one joint action (one completion per agent) to `state`.

    Must not mutate `state`: siblings branch from the same state. It runs on
    a worker thread, concurrently with the level's other steps.
    """
    ...

  # Optional: `close(state)` releases a state's resources; the engine calls it
  # once no branch will step the state again (after its level, or when a
  # returned next state becomes no child).


def _level_key(key: jax.Array, turn: int) -> jax.Array:
  return jax.random.fold_in(key, turn)


def expand_tree(cfg: TreeConfig, policy: PolicySampler, transition: Transition,
                root_states: Sequence[Any], key: jax.Array, *,
                executor: Optional[concurrent.futures.Executor] = None,
                max_workers: int = 32) -> Tree:
  """Rolls out one tree per root state and computes returns and advantages.

  Args:
    cfg: tree semantics (T, G, N, joint mode, termination, discount, baseline).
    policy: answers one batched request per level.
    transition: prompts of a state; steps a joint action.
    root_states: one initial state per task.
    key: PRNG key; level t samples with `fold_in(key, t)`.
    executor: thread pool for environment steps (default: a pool of
      `max_workers` threads created for this call).
    max_workers: size of the default pool.

  Returns:
    The finalized `Tree` (every node recorded, returns and advantages set).
  """
  tree = Tree(cfg)
  for state in root_states:
    tree.add_root(transition.prompts(state), state)
  own_pool = executor is None
  if own_pool:
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers)
  try:
    frontier = list(tree.nodes)
    for turn in range(cfg.num_turns):
      if not frontier:
        break
      sample_level(tree, frontier, policy, _level_key(key, turn))
      frontier = step_level(tree, frontier, transition, executor)
  finally:
    if own_pool:
      executor.shutdown(wait=True)
  return tree.finalize()


def sample_level(tree: Tree, frontier: Sequence[Node], policy: PolicySampler,
                 key: jax.Array) -> None:
  """Samples G completions for every (node, agent) of a level in ONE policy call."""
  n, g = tree.cfg.num_agents, tree.cfg.num_generations
  prompts = [p for node in frontier for p in node.prompts]
  agent_ids = [i for _ in frontier for i in range(n)]
  results = policy.sample(prompts, agent_ids, g, key)
  if len(results) != len(prompts):
    raise ValueError(f"policy returned {len(results)} results for {len(prompts)} prompts")
  for k, node in enumerate(frontier):
    tree.set_completions(node, results[k * n:(k + 1) * n])


def step_level(tree: Tree, frontier: Sequence[Node], transition: Transition,
               executor: concurrent.futures.Executor) -> list[Node]:
  """Steps every joint action of a level concurrently; records rewards; adds children.

  Returns:
    The next level's nodes, in (node, joint action) order.
  """
  joint_BxN = tree.joint_BxN
  b, n = joint_BxN.shape

  def run(node: Node, j: int) -> ActionOutcome:
    actions = [node.completions[i][joint_BxN[j, i]] for i in range(n)]
    out = transition.step(node.state, actions)
    if not isinstance(out, ActionOutcome):
      raise TypeError(f"Transition.step returned {type(out).__name__}; expected ActionOutcome")
    return out

  close = getattr(transition, "close", None) or (lambda state: None)
  futures = [[executor.submit(run, node, j) for j in range(b)] for node in frontier]
  children = []
  for node, node_futures in zip(frontier, futures):
    outcomes = [f.result() for f in node_futures]
    infos = [dict(o.info or {}) for o in outcomes]
    may_expand = tree.record(node, [float(o.reward) for o in outcomes],
                             [bool(o.valid) for o in outcomes], infos)
    for j, o in enumerate(outcomes):
      if o.next_state is None:
        continue
      if may_expand and o.valid:
        children.append(tree.add_child(node, j, transition.prompts(o.next_state),
                                       o.next_state))
      else:  # terminated node, last turn, or masked action: the branch ends here
        close(o.next_state)
    close(node.state)  # every branch stepped from it has forked its own state
  return children

