"""Tree expansion on the rollout engine: no level barrier, every cached prefix reused.

`expand_tree` grows one tree per root through a `RolloutPolicy` (decode
slots whose KV cache persists, `mtrl_jax.sampling.engine`) and a
`Transition` (the environments), as events arrive:

  * a node's agents each submit one request for G samples; a root's prompt
    is prefilled once and forked into G slots, a child's request names the
    parent sample's cache, so only the environment's new turns are prefilled;
  * a joint action's environment step goes to the step workers (a thread
    pool, or worker processes: `rollout.workers`, config `env.workers`) as
    soon as its own samples are finished, not when the level's are; with
    `max_concurrency` set, a step past the cap waits in a queue until one in
    flight returns;
  * a step that returns hands its child node's requests to the engine at
    once (the engine admits them between decode chunks), or, under
    `branch_on='user_turn'` when the environment answered with tool turns, a
    continuation of the same action from its own cache;
  * under `joint_mode='marginal'` every combination is stepped (graded) but
    only the aligned ones spawn children (`Tree.child_slot`), named as an
    align tree's children (with a deterministic environment both sample the
    same tokens);
  * with a termination threshold a node's children wait for all of its
    actions (termination depends on their mean reward); without one, each
    action's child starts when the action is stepped;
  * a last-turn step whose environment goes on (not a tool sub-step the action
    continues) is a cut episode, graded as ended there by `Transition.cut`.

Tree semantics do not depend on the schedule: every request's sampling keys
and every step's seed are named by the node's place in the complete tree
(`Node.full_id`), never by arrival order, and `Tree.renumber` puts the nodes
in canonical order at the end. `TreeConfig.schedule='barrier'` runs the same engine
level by level (a level's samples, then its steps, then each sub-step round,
then the next level): the reference for equality tests and the baseline of
the benchmarks.

Keys: level t has the key fold_in(key, t); the G samples of agent i at a
node are drawn as the level-by-level sampler drew them (`policy.request_rows`)
and sub-step round k of a level uses fold_in(level key, k). Environment
steps get `action_seed(call_seed(level key, 'env'), root, node, action,
sub-step)` when `Transition.step` takes a `seed`.

Several processes (`mtrl_jax.distributed`): each process expands the trees
of its own roots (numbered globally) and steps the engine in lockstep with
the others until no process has work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import time
from typing import Any, Optional, Sequence

import jax
import numpy as np

from mtrl_jax import distributed
from mtrl_jax.rollout.completion import Completion
from mtrl_jax.rollout.config import TreeConfig
from mtrl_jax.rollout.inflight import (ActRun, NodeRun, RolloutTimes, action_seed, takes_seed)
from mtrl_jax.rollout.policy import RolloutPolicy, call_key, request_rows
from mtrl_jax.rollout.records import ActionRecord, Transition, step_record
from mtrl_jax.rollout.tree import Tree
from mtrl_jax.rollout.workers import StepWorkers
from mtrl_jax.sampling.slots import Request, Sample
from mtrl_jax.seeds import call_seed


class _Rollout:
  """One `expand_tree` call (see the module docstring)."""

  def __init__(
      self,
      cfg: TreeConfig,
      policy: RolloutPolicy,
      transition: Transition,
      key,
      workers: StepWorkers,
  ):
    self.cfg, self.policy, self.transition, self.key = cfg, policy, transition, key
    self.barrier = cfg.schedule == "barrier"
    self.workers = workers
    self.running = 0  # steps submitted to the workers (in_flight counts the queued too)
    self.queued: collections.deque = collections.deque()  # steps past max_concurrency
    self.tree = Tree(cfg)
    self.close = getattr(transition, "close", None) or (lambda state: None)
    self.cut = getattr(transition, "cut", None)
    self.seeded = takes_seed(transition)
    self.done_q: queue.Queue = queue.Queue()
    self.in_flight = 0
    self.held_steps: list = []  # barrier: (act, substep) waiting for the engine to idle
    self.held_conts: list = []  # barrier: continuation requests waiting for the round
    self.held_nodes: dict = {}  # barrier: level -> requests of its nodes
    self.held_releases: list = []  # barrier: handles released once the held requests are in
    self.open_actions = [0] * cfg.num_turns  # unresolved actions per level
    self.times = RolloutTimes()
    self._keys: dict = {}

  # ------------------------------------------------------------ keys
  def level_key(self, turn: int):
    if turn not in self._keys:
      self._keys[turn] = jax.random.fold_in(self.key, turn)
    return self._keys[turn]

  def env_seed(self, turn: int) -> int:
    if ("env", turn) not in self._keys:
      self._keys[("env", turn)] = call_seed(self.level_key(turn), "env")
    return self._keys[("env", turn)]

  def round_key(self, turn: int, rnd: int):
    if (turn, rnd) not in self._keys:
      self._keys[(turn, rnd)] = jax.random.fold_in(self.level_key(turn), rnd)
    return self._keys[(turn, rnd)]

  def call_key(self, turn: int, rnd: Optional[int], agent: int) -> np.ndarray:
    """`policy.call_key` of the level's (rnd None) or sub-step round's samples of `agent`,
    once per rollout."""
    s = agent if self.policy.separate else 0
    if ("call", turn, rnd, s) not in self._keys:
      base = self.level_key(turn) if rnd is None else self.round_key(turn, rnd)
      self._keys[("call", turn, rnd, s)] = call_key(base, s)
    return self._keys[("call", turn, rnd, s)]

  def level_sizes(self, total_roots: int) -> list[int]:
    """Nodes per level of the complete tree, over every process's roots."""
    sizes, width = [], total_roots
    for t in range(self.cfg.num_turns):
      sizes.append(width)
      width *= self.cfg.branching_at(t)
    return sizes

  # ------------------------------------------------------------ nodes and requests
  def add_node(self, node) -> None:
    cfg = self.cfg
    g = cfg.generations_at(node.turn)
    nr = NodeRun(node, self.tree.node_joint(node), g)
    self.open_actions[node.turn] += len(nr.acts)
    index = node.full_id - self.offsets[node.turn]
    parent = self.runs.get(node.parent_id)
    for i, prompt in enumerate(node.prompts):
      key = self.call_key(node.turn, None, i)
      rows = request_rows(i, index, cfg.num_agents, g, self.policy.separate)
      handle = None
      if parent is not None:
        handle = parent.handles[i][int(parent.joint[node.parent_action, i])]
      req = Request(("node", nr, i), prompt, key, rows, agent=i, parent=handle)
      if self.barrier and node.turn > 0:
        self.held_nodes.setdefault(node.turn, []).append(req)
      else:
        self.policy.submit(req)
    self.runs[node.node_id] = nr

  def on_sample(self, s: Sample) -> None:
    kind = s.tag[0]
    comp = Completion(ids=s.ids, logprobs=s.logprobs, finish_reason=s.finish_reason)
    if kind == "node":
      _, nr, i = s.tag
      nr.comps[i][s.index], nr.handles[i][s.index] = comp, s.handle
      nr.left -= 1
      if nr.left == 0:
        self.tree.set_completions(nr.node, nr.comps)
      for act in nr.acts:
        if (i, s.index) in act.samples:
          act.waiting -= 1
          if act.waiting == 0:
            self.ready_step(act)
      return
    _, act = s.tag  # a tool continuation of `act` (one agent)
    nr, g = act.nr, act.samples[0][1]
    nr.comps[0][g] = nr.comps[0][g].continued(act.context, comp)
    if nr.node.completions is not None:  # else set once the node's last sample is back
      nr.node.completions[0][g] = nr.comps[0][g]
    nr.handles[0][g] = s.handle
    act.segment = comp
    self.ready_step(act)

  # ------------------------------------------------------------ environment steps
  def ready_step(self, act: ActRun) -> None:
    if self.barrier:
      self.held_steps.append(act)
    else:
      self.dispatch_step(act)

  def dispatch_step(self, act: ActRun) -> None:
    nr = act.nr
    node, substep = nr.node, len(act.steps)
    state = node.state if substep == 0 else act.next_state
    comps = act.completions() if substep == 0 else [act.segment]
    kw = {}
    if self.seeded:
      kw["seed"] = action_seed(
          self.env_seed(node.turn), self.root_base + node.root, node.full_id, act.j, substep
      )
    if self.in_flight == 0:
      self._env_since = time.perf_counter()
    self.in_flight += 1
    # At the last turn a step that goes on is a cut, unless a sub-step continues it.
    last = node.turn == self.cfg.num_turns - 1 and self.cut is not None
    may_continue = self.cfg.substeps and substep < self.cfg.max_substeps
    item = (act, state, comps, kw, last, may_continue)
    cap = self.workers.max_concurrency
    if cap and self.running >= cap:
      self.queued.append(item)
    else:
      self.submit_step(*item)

  def submit_step(self, act: ActRun, state, comps, kw: dict, last: bool, may_continue: bool):
    """Hands one step to the workers (`rollout.workers.step_action`)."""
    self.running += 1
    args = (self.transition, state, comps, kw, last, may_continue, self.cfg.num_turns)
    future = self.workers.submit(*args)
    future.add_done_callback(lambda f, a=act, st=state: self.done_q.put((a, st, f)))

  def on_step_done(self, act: ActRun, state, future) -> None:
    self.in_flight -= 1
    self.running -= 1
    if self.in_flight == 0:
      self.times.environment += time.perf_counter() - self._env_since
    # A transition reports environment faults in its record; a dead worker process
    # comes back as a masked step, its pool replaced (`StepWorkers.outcome`) before
    # the next queued step goes in.
    out = self.workers.outcome(future)
    if self.queued:
      self.submit_step(*self.queued.popleft())
    nr = act.nr
    record = step_record(out)
    answered = act.segment if act.steps else act.completions()[-1]
    finish = answered.finish_reason
    act.steps.append(dataclasses.replace(record, done=out.next_state is None, finish_reason=finish))
    if len(act.steps) == 1:
      nr.first_steps -= 1
      if nr.first_steps == 0:
        self.close(nr.node.state)  # every action has forked its own state from it
    else:
      self.close(state)  # an intermediate state belongs to its one action
    act.next_state = out.next_state
    if self.cfg.substeps and record.valid and record.continues_turn:
      if len(act.steps) > self.cfg.max_substeps:
        act.limit_reached = True
      else:
        self.continue_action(act)
        return
    self.resolve(act)

  def continue_action(self, act: ActRun) -> None:
    """Samples ONE more segment of the action's turn from its own cache."""
    nr = act.nr
    prompts = self.transition.prompts(act.next_state)
    if len(prompts) != 1:
      raise ValueError(f"sub-steps need one agent; the transition gave {len(prompts)} prompts")
    prompt = [int(t) for t in prompts[0]]
    g = act.samples[0][1]
    comp = nr.comps[0][g]
    done = nr.node.prompts[0] + [int(t) for t in comp.ids]
    if prompt[: len(done)] != done:
      raise ValueError(
          f"node {nr.node.full_id} action {act.j}: the sub-step context does not extend the "
          "node's prompt and the sampled tokens verbatim (token-in, token-out)"
      )
    act.context = prompt[len(done) :]
    rnd = len(act.steps)
    index = nr.node.full_id - self.offsets[nr.node.turn]
    key = self.call_key(nr.node.turn, rnd, 0)
    rows = request_rows(
        0, index * self.cfg.actions_at(nr.node.turn) + act.j, 1, 1, self.policy.separate
    )
    handle = nr.handles[0][g]
    req = Request(("cont", act), prompt, key, rows, agent=0, parent=handle)
    if self.barrier:
      self.held_conts.append(req)
    else:
      self.policy.submit(req)
    self.release(handle)  # the continuation takes the slot over

  # ------------------------------------------------------------ resolution
  def resolve(self, act: ActRun) -> None:
    nr = act.nr
    node = nr.node
    self.tree.record_action(node, act.j, ActionRecord(tuple(act.steps), act.limit_reached))
    self.open_actions[node.turn] -= 1
    nr.unresolved -= 1
    if self.cfg.termination_threshold is None:
      self.follow(act, self.tree.may_expand(node))
    if nr.unresolved == 0:
      may_expand = self.tree.close_node(node)
      if self.cfg.termination_threshold is not None:
        for a in nr.acts:
          self.follow(a, may_expand)

  def follow(self, act: ActRun, may_expand: bool) -> None:
    """The action's child (or the end of its branch), then its samples' caches."""
    nr = act.nr
    nxt = act.next_state
    if nxt is not None:
      record = nr.node.actions[act.j]
      slot = self.tree.child_slot(nr.node, act.j)  # -1: a marginal node's unaligned one
      if may_expand and record.valid and not act.limit_reached and slot >= 0:
        b = self.cfg.branching_at(nr.node.turn)
        index = nr.node.full_id - self.offsets[nr.node.turn]
        child = self.tree.add_child(
            nr.node,
            act.j,
            self.transition.prompts(nxt),
            nxt,
            full_id=self.offsets[nr.node.turn + 1] + index * b + slot,
        )
        self.add_node(child)
      else:  # terminated node, last turn, masked, truncated or unbranched: the branch ends
        self.close(nxt)
    for i, g in act.samples:
      nr.uses[i, g] -= 1
      if nr.uses[i, g] == 0:
        self.release(nr.handles[i][g])

  def release(self, handle) -> None:
    """No later request names `handle`. Under the barrier schedule the release waits
    until the held requests that may name it are submitted."""
    if self.barrier:
      self.held_releases.append(handle)
    else:
      self.policy.release(handle)

  # ------------------------------------------------------------ the loop
  def gate(self) -> None:
    """Barrier schedule: lets the next phase's work go once the current one is done."""
    if not self.barrier:
      return
    if self.held_steps and not self.policy.busy:  # a round's samples are all finished
      steps, self.held_steps = self.held_steps, []
      for act in steps:
        self.dispatch_step(act)
    if self.held_conts and self.in_flight == 0 and not self.held_steps:
      conts, self.held_conts = self.held_conts, []
      for req in conts:
        self.policy.submit(req)
    for level in sorted(self.held_nodes):
      if any(self.open_actions[:level]) or self.in_flight or self.held_steps or self.held_conts:
        break
      for req in self.held_nodes.pop(level):
        self.policy.submit(req)
    if not (self.held_conts or self.held_nodes):  # every request that may name them is in
      releases, self.held_releases = self.held_releases, []
      for handle in releases:
        self.policy.release(handle)

  def run(self, root_states: Sequence[Any]) -> Tree:
    t_start = time.perf_counter()
    counts = distributed.allgather(len(root_states))
    self.root_base = sum(counts[: jax.process_index()])
    sizes = self.level_sizes(sum(counts))
    self.offsets = list(np.cumsum([0] + sizes))
    self.runs: dict = {}
    multi = distributed.process_count() > 1
    self.policy.start(self.cfg.num_generations)
    for r, state in enumerate(root_states):
      self.add_node(
          self.tree.add_root(self.transition.prompts(state), state, full_id=self.root_base + r)
      )
    while True:
      self.drain(block=False)
      self.gate()
      if not self.policy.busy and self.in_flight:  # nothing to decode: wait for a step
        t0 = time.perf_counter()
        self.drain(block=True, timeout=0.002 if multi else None)
        self.times.device_idle += time.perf_counter() - t0
        if not multi:
          continue
      expect = bool(self.in_flight or self.held_steps or self.held_conts or self.held_nodes)
      if not multi and not (self.policy.busy or expect):
        break
      t0 = time.perf_counter()
      stepping_envs = self.in_flight > 0
      samples, go_on = self.policy.step(expect)
      spent = time.perf_counter() - t0
      self.times.generation += spent
      if stepping_envs:
        self.times.overlap += spent
      else:
        self.times.env_waiting += spent
      for s in samples:
        self.on_sample(s)
      if multi and not go_on:  # no process has work left
        break
    self.stats = self.policy.finish()
    self.times.total = time.perf_counter() - t_start
    self.tree.renumber()
    return self.tree.finalize()

  def drain(self, block: bool, timeout: Optional[float] = None) -> None:
    try:
      item = self.done_q.get(block=block, timeout=timeout)
    except queue.Empty:
      return
    while True:
      self.on_step_done(*item)
      try:
        item = self.done_q.get_nowait()
      except queue.Empty:
        return


def expand_tree(
    cfg: TreeConfig,
    policy: RolloutPolicy,
    transition: Transition,
    root_states: Sequence[Any],
    key: jax.Array,
    *,
    executor: Optional[concurrent.futures.Executor | StepWorkers] = None,
    max_workers: int = 32,
) -> Tree:
  """Rolls out one tree per root state; returns the finalized tree.

  Args:
    cfg: tree semantics (T, G, N, joint mode, termination, discount, baseline,
      branch_on, shape) and the engine's schedule.
    policy: the decode engine with the policy's parameters (`RolloutPolicy`).
    transition: prompts of a state; steps a joint action.
    root_states: one initial state per task; the engine takes ownership and
      closes them (`transition.close`) once every action has stepped from them.
    key: PRNG key of the rollout (see the module docstring).
    executor: where environment steps run: the run's `StepWorkers` (threads or
      worker processes, `rollout.workers`), or a thread pool (default: a pool
      of `max_workers` threads created for this call).
    max_workers: size of the default pool.

  Returns:
    The finalized `Tree` (canonical node order, returns and advantages set);
    `tree.times` (`RolloutTimes`) and `tree.engine` (the engine's counters)
    describe how the rollout went.
  """
  own_pool = executor is None
  if own_pool:
    executor = concurrent.futures.ThreadPoolExecutor(max_workers=max_workers)
  workers = (
      executor if isinstance(executor, StepWorkers) else StepWorkers("threads", executor=executor)
  )
  try:
    run = _Rollout(cfg, policy, transition, key, workers)
    tree = run.run(root_states)
  finally:
    if own_pool:
      executor.shutdown(wait=True)
  tree.times, tree.engine = run.times, run.stats
  return tree
