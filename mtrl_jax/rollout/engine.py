"""Level-by-level tree expansion: one sampler call per level, concurrent env steps.

The engine never loops over nodes around the sampler: the prompts of every
(node, agent) of a level, across all roots, go to ONE `PolicySampler.sample`
call (the sampler prefills each prompt once and forks G continuations). The
level's environment steps (one per joint action) then run on a thread pool,
so a slow tool or judge does not serialise the level.

With `TreeConfig.branch_on='user_turn'` an action whose step answered with
tool turns only (`ActionOutcome.continues_turn`) does not branch: the engine
samples ONE continuation segment for every such action of the level (one
sampler call per sub-step round), appends it to the action's `Completion`
(after the context the environment rendered) and steps again, until the
environment hands over to the user (a child node) or stops. The action's
reward is the sum of its steps' rewards; a masked step masks the action.

Model calls inside environments (user simulators, judges, experts) are
reproducible: when `Transition.step` takes a `seed` keyword, each step gets
`call_seed(level key, root, node, joint action, sub-step round)`, a function
of the step's key and the node's identity alone, so neither the thread pool's
order nor the number of workers changes what a simulator says.

With several processes (`mtrl_jax.distributed`) every process expands the
trees of its own roots: a level runs while any process still has nodes (a
process whose trees ended joins the level's sampler call with no prompts), and
so does each sub-step round, because the sampler call is one global program.

The engine is independent of how environments represent state: it talks to a
`Transition`, which gives the prompt ids of a node state and steps a joint
action. `mtrl_jax.rollout.env_transition.EnvTransition` adapts
`mtrl_jax.envs` environments (threads, token ledgers, grades, faults); tests
use scripted transitions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import inspect
from typing import Any, Optional, Protocol, Sequence

import jax
import numpy as np

from mtrl_jax import distributed
from mtrl_jax.rollout.config import TreeConfig
from mtrl_jax.rollout.policy import PolicySampler
from mtrl_jax.rollout.tree import Completion, Node, Tree
from mtrl_jax.seeds import call_seed


@dataclasses.dataclass
class ActionOutcome:
  """What one environment step of a joint action produced.

  Attributes:
    next_state: the state to continue from (per-agent histories), or None
      when the environment ended the episode on this action.
    reward: r of this step (composed grade score; 0 when none).
    valid: False for an infrastructure fault: the action is masked, never rewarded.
    info: JSON-able details for the rollout dump (grades, faults, feedback).
    continues_turn: the environment answered with tool turns only and waits
      for the same policy turn to go on (its new turns end with a tool turn).
      Under branch_on='user_turn' the engine then samples a continuation
      instead of a child; under 'every_turn' it is ignored.
  """

  next_state: Any
  reward: float
  valid: bool = True
  info: Optional[dict] = None
  continues_turn: bool = False


class Transition(Protocol):
  """The environment side of a tree, in terms of opaque node states."""

  def prompts(self, state: Any) -> list[list[int]]:
    """Prompt token ids (full context) of each agent at a node with `state`.

    A state reached by a step must extend the stepped state's prompt plus the
    sampled ids verbatim (token-in, token-out); the engine checks it for
    sub-step continuations.
    """
    ...

  def step(self, state: Any, actions: Sequence[Completion]) -> ActionOutcome:
    """Applies one joint action (one single-segment completion per agent) to `state`.

    Must not mutate `state`: siblings branch from the same state. It runs on
    a worker thread, concurrently with the level's other steps. A transition
    whose `step` accepts a `seed` keyword gets the step's seed (an int named
    by (step key, root, node, action, sub-step); see `action_seed`) for the
    model calls its environment makes.
    """
    ...

  # Optional: `close(state)` releases a state's resources. The engine owns
  # every state it is given or returned (root states included) and calls it
  # once no branch will step the state again: after its level, after its
  # sub-step, or when a returned next state becomes no child.


def _level_key(key: jax.Array, turn: int) -> jax.Array:
  return jax.random.fold_in(key, turn)


def action_seed(level_seed: int, node: Node, action: int, substep: int = 0) -> int:
  """Seed of one environment step: (level seed, root, node, joint action, sub-step).

  `level_seed` is `call_seed(level_key, 'env')` (the level key folds the
  step's key with the turn). Node ids follow creation order, which the
  engine fixes (parents before children, children in (node, action) order),
  so the seed names the same step in every run with the same key, whatever
  the worker threads do.
  """
  return call_seed(level_seed, node.root, node.node_id, action, substep)


def _takes_seed(transition) -> bool:
  try:
    params = inspect.signature(transition.step).parameters
  except (TypeError, ValueError):
    return False
  return "seed" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def expand_tree(cfg: TreeConfig, policy: PolicySampler, transition: Transition,
                root_states: Sequence[Any], key: jax.Array, *,
                executor: Optional[concurrent.futures.Executor] = None,
                max_workers: int = 32) -> Tree:
  """Rolls out one tree per root state and computes returns and advantages.

  Args:
    cfg: tree semantics (T, G, N, joint mode, termination, discount, baseline,
      branch_on).
    policy: answers one batched request per level (and per sub-step round).
    transition: prompts of a state; steps a joint action.
    root_states: one initial state per task; the engine takes ownership and
      closes them (`transition.close`) once their level is stepped.
    key: PRNG key; level t samples with `fold_in(key, t)`, its sub-step
      round k >= 1 with `fold_in(fold_in(key, t), k)`.
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
      # Several processes sample each level together (one global sampler
      # call): a process whose trees ended still takes part while any has nodes.
      if not distributed.any_process(bool(frontier)):
        break
      level_key = _level_key(key, turn)
      sample_level(tree, frontier, policy, level_key, turn)
      frontier = step_level(tree, frontier, transition, executor, policy=policy, key=level_key)
  finally:
    if own_pool:
      executor.shutdown(wait=True)
  return tree.finalize()


def sample_level(tree: Tree, frontier: Sequence[Node], policy: PolicySampler,
                 key: jax.Array, turn: Optional[int] = None) -> None:
  """Samples G completions for every (node, agent) of a level in ONE policy call
  (one each below a chain's root: `TreeConfig.generations_at`); `turn` names the
  level when this process's `frontier` may be empty (other processes' is not)."""
  turn = frontier[0].turn if turn is None else turn
  n, g = tree.cfg.num_agents, tree.cfg.generations_at(turn)
  prompts = [p for node in frontier for p in node.prompts]
  agent_ids = [i for _ in frontier for i in range(n)]
  results = policy.sample(prompts, agent_ids, g, key)
  if len(results) != len(prompts):
    raise ValueError(f"policy returned {len(results)} results for {len(prompts)} prompts")
  for k, node in enumerate(frontier):
    tree.set_completions(node, results[k * n:(k + 1) * n])


@dataclasses.dataclass
class _Action:
  """One joint action of a level while its (sub-)steps run."""

  node: Node
  j: int
  outcome: Optional[ActionOutcome] = None  # of the last step
  reward: float = 0.0
  valid: bool = True
  steps: list = dataclasses.field(default_factory=list)  # every step's info
  substeps: int = 0
  limit_reached: bool = False

  def absorb(self, out: ActionOutcome, finish_reason: str) -> None:
    if not isinstance(out, ActionOutcome):
      raise TypeError(f"Transition.step returned {type(out).__name__}; expected ActionOutcome")
    if out.continues_turn and out.next_state is None:
      raise ValueError("Transition.step returned continues_turn=True without a next_state")
    self.outcome = out
    self.reward += float(out.reward)
    self.valid = self.valid and bool(out.valid)
    self.steps.append({**(out.info or {}), "step_reward": float(out.reward),
                       "valid": bool(out.valid), "continues_turn": bool(out.continues_turn),
                       "finish_reason": finish_reason})

  @property
  def wants_more(self) -> bool:
    """The environment waits for a continuation of this (valid) action."""
    return self.valid and self.outcome.continues_turn and not self.limit_reached

  def info(self, substeps: bool) -> dict:
    if not substeps:  # 'every_turn': the step's own info, unchanged
      return dict(self.outcome.info or {})
    out = dict(self.steps[-1])
    out.pop("step_reward")
    if self.limit_reached:
      out["done"] = out["truncated"] = True
      out["faults"] = list(out.get("faults", [])) + [
          {"kind": "truncation", "source": "framework", "retries": 0,
           "message": f"sub-step limit reached ({self.substeps} continuations): the "
                      "environment still waited for the policy"}]
    out["action_reward"] = self.reward
    out["substeps"] = self.steps
    return out


def _run_steps(transition: Transition, executor: concurrent.futures.Executor,
               jobs: Sequence[tuple], key: Optional[jax.Array] = None,
               substep: int = 0) -> None:
  """Runs `(action, state, completions)` steps concurrently; each action absorbs its outcome.

  With a level `key` and a transition that takes seeds, each step gets its
  `action_seed`.
  """
  seeded = key is not None and _takes_seed(transition)
  level_seed = call_seed(key, "env") if seeded else None
  futures = []
  for action, state, comps in jobs:
    kw = {"seed": action_seed(level_seed, action.node, action.j, substep)} if seeded else {}
    futures.append(executor.submit(transition.step, state, comps, **kw))
  for (action, _, comps), future in zip(jobs, futures):
    action.absorb(future.result(), comps[-1].finish_reason)


def step_level(tree: Tree, frontier: Sequence[Node], transition: Transition,
               executor: concurrent.futures.Executor, *, policy: Optional[PolicySampler] = None,
               key: Optional[jax.Array] = None) -> list[Node]:
  """Steps every joint action of a level concurrently; records rewards; adds children.

  Under branch_on='user_turn' the actions' sub-steps run here too, which
  needs the `policy` and the level's `key`. The key also seeds the
  environments' model calls (`action_seed`); without it they get no seed.

  Returns:
    The next level's nodes, in (node, joint action) order.
  """
  if frontier:
    joint_BxN = tree.node_joint(frontier[0])  # a level's nodes share their depth
  else:  # this process's trees ended; its sub-step rounds still meet the others'
    joint_BxN = np.zeros((0, tree.cfg.num_agents), np.int64)
  b, n = joint_BxN.shape
  close = getattr(transition, "close", None) or (lambda state: None)
  actions = [_Action(node, j) for node in frontier for j in range(b)]
  _run_steps(transition, executor, [
      (a, a.node.state, [a.node.completions[i][joint_BxN[a.j, i]] for i in range(n)])
      for a in actions], key)
  for node in frontier:
    close(node.state)  # every branch stepped from it has forked its own state
  if tree.cfg.substeps:
    if policy is None or key is None:
      raise ValueError("step_level with branch_on='user_turn' needs the policy and the key")
    _continue_actions(tree, actions, policy, transition, executor, key)

  children = []
  for k, node in enumerate(frontier):
    node_actions = actions[k * b:(k + 1) * b]
    may_expand = tree.record(node, [a.reward for a in node_actions],
                             [a.valid for a in node_actions],
                             [a.info(tree.cfg.substeps) for a in node_actions],
                             [a.substeps for a in node_actions])
    for a in node_actions:
      nxt = a.outcome.next_state
      if nxt is None:
        continue
      if may_expand and a.valid and not a.limit_reached:
        children.append(tree.add_child(node, a.j, transition.prompts(nxt), nxt))
      else:  # terminated node, last turn, masked or truncated action: the branch ends here
        close(nxt)
  return children


def _continue_actions(tree: Tree, actions: Sequence[_Action], policy: PolicySampler,
                     transition: Transition, executor: concurrent.futures.Executor,
                     key: jax.Array) -> None:
  """Sub-steps: continues every action whose environment waits for the policy.

  Round k samples ONE segment for each waiting action of the level in one
  policy call (key `fold_in(key, k)`), appends it (after the context the
  environment rendered) to the action's completion and steps the action's
  own state again. An action still waiting after `max_substeps` rounds ends
  as a truncation.
  """
  cfg = tree.cfg
  close = getattr(transition, "close", None) or (lambda state: None)
  for rnd in range(1, cfg.max_substeps + 2):
    waiting = [a for a in actions if a.wants_more]
    if not distributed.any_process(bool(waiting)):  # every process's rounds together
      return
    if rnd > cfg.max_substeps:
      for a in waiting:
        a.limit_reached = True  # its next state is closed by step_level
      return
    prompts = []
    for a in waiting:
      agent_prompts = transition.prompts(a.outcome.next_state)
      if len(agent_prompts) != 1:
        raise ValueError(f"sub-steps need one agent; the transition gave {len(agent_prompts)} "
                         "prompts")
      prompts.append(list(agent_prompts[0]))
    results = policy.sample(prompts, [0] * len(prompts), 1, jax.random.fold_in(key, rnd))
    if len(results) != len(prompts) or any(len(r) != 1 for r in results):
      raise ValueError(f"policy returned {[len(r) for r in results]} completions for "
                       f"{len(prompts)} prompts x 1 generation (sub-step round {rnd})")
    jobs = []
    for a, prompt, (segment,) in zip(waiting, prompts, results):
      g = int(tree.node_joint(a.node)[a.j, 0])
      comp = a.node.completions[0][g]
      done = a.node.prompts[0] + [int(t) for t in comp.ids]
      if prompt[:len(done)] != done:
        raise ValueError(
            f"node {a.node.node_id} action {a.j}: the sub-step context does not extend the "
            "node's prompt and the sampled tokens verbatim (token-in, token-out)")
      a.node.completions[0][g] = comp.continued(prompt[len(done):], segment)
      a.substeps += 1
      jobs.append((a, a.outcome.next_state, [segment]))
    _run_steps(transition, executor, jobs, key, rnd)
    for _, state, _ in jobs:
      close(state)  # an intermediate state belongs to its one action
