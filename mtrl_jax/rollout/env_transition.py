"""The engine's `Transition` over `mtrl_jax.envs` environments (threads, ledgers, grades).

A node's state is the trajectory's environment plus one thread per agent whose
token ledger holds every turn rendered so far (each agent's full history).
Stepping a joint action forks the environment (`Environment.fork`, so sibling
branches never share mutable state), appends each agent's completion to a
fork of its ledger exactly as sampled, and runs `step_environment`, which
calls `react_to` / `react_to_joint`, classifies faults, composes the reward
and renders the environment's new turns into the child's ledgers once.

A step of an environment that offers tools (a non-empty `tools` ToolSet) records
per agent its tool calls in `details['tool_calls']`: the tool turns the
environment answered with, one per call (0 on a step that ended the episode);
`rollout.stats.tool_metrics` reads them. Environments without tools record none.

A step whose new turns end with a `tool` turn (for every agent) reports
`continues_turn=True`: the environment waits for the policy, not the user.
A step whose next thread does not extend the previous tokens (a history
rewrite: the environment changed earlier turns, or a Qwen3-style template
strips earlier thinking) never continues the action: its context is rendered
anew and the child node is a new training segment, while the action keeps
its own tokens and advantage.
The engine turns that into a sub-step under `branch_on='user_turn'` and
ignores it under 'every_turn'. Every step, sub-steps included, counts as one
policy turn for `StepLimits.max_turns`.

Seeds: the engine hands each step a seed named by (step key, root, node,
action, sub-step); agent i's thread gets `call_seed(seed, i, turn)` as
`Thread.seed`, which the environment's user simulator, judges and experts
derive their own call seeds from. Replies then depend on the node, not on
thread order, so 1 or 32 workers and a resumed run give the same tree.

A sampled id the tokenizer cannot decode (a model vocabulary larger than the
tokenizer's) ends the episode as a model format fault, penalised like an
invalid call; the environment never sees the message.

Nothing an environment's code does kills the run. A task that is not a
mapping, or a factory (or `initial_thread`) that raises, makes a failed root
(`root_states`): its prompt is empty and every joint action of it is masked
with the root's fault (a contract fault for a bug, `faults.classify`). An
environment (or thread metadata) that cannot be forked masks the action with a
contract fault naming `fork` and `SharedResource` (`core.fork_error_message`).
Each fault is shown once on the console (`fault_report.show_fault_once`).
Thread metadata is private per branch: every acted thread is a `Thread.fork`.

Cut episodes (`cut`): when a step at the tree's last turn continues, the
engine asks the transition to grade the episode as ended there: the
environment's `on_cut` grades (default `finalize`, else the failure outcome,
the bottom of `outcome_range`) replace the step's per-turn grades in its
reward, so a cut pays what failing at that turn pays, never more. The first
cut of a run prints one line naming `tree.num_turns` and `env.max_turns`.
The first per-turn grades under `reward.shaping_weight=0` print one line too
(`reward.note_unweighted_shaping`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mtrl_jax.envs import StepLimits, StepOutcome, Thread, Turn, step_environment
from mtrl_jax.envs.core import fork_error_message
from mtrl_jax.envs.cuts import cut_notice, grade_cut
from mtrl_jax.envs.fault_report import (
    fault_origin,
    fault_source,
    show_fault_once,
    show_notice_once,
)
from mtrl_jax.envs.runner import render_thread
from mtrl_jax.envs.faults import ContractError, Fault, FaultKind, classify
from mtrl_jax.envs.reward import (
    RewardBreakdown,
    RewardConfig,
    compose_local,
    compose_reward,
    mean_score,
    note_unweighted_shaping,
)
from mtrl_jax.rollout.records import ActionOutcome, StepRecord
from mtrl_jax.rollout.completion import Completion
from mtrl_jax.seeds import call_seed
from mtrl_jax.text import ChatRenderer


@dataclasses.dataclass(frozen=True)
class EnvState:
  """State of a tree node: the branch's environment and per-agent threads.

  Attributes:
    env: the `Environment` of this branch (forked before every step).
    threads: one fully rendered thread per agent (no open assistant turn).
    steps: policy messages (environment steps) taken so far: the step index
      of the next step, sub-steps included.
    fault: set on a failed root (no environment; `root_states`): the fault
      every joint action of it records, masked.
  """

  env: Any
  threads: tuple
  steps: int = 0
  fault: Optional[Fault] = None


def _record(out: StepOutcome, details: dict, continues_turn: bool = False) -> StepRecord:
  """The engine's record of one `step_environment` outcome."""
  parts = out.reward.metrics(prefix="")
  parts.pop("total")
  return StepRecord(
      reward=out.reward.total,
      valid=not out.masked,
      continues_turn=continues_turn,
      truncated=out.truncated,
      parts=parts,
      faults=tuple(out.faults),
      details=details,
      local_rewards=tuple(None if b is None else b.total for b in out.local),
  )


class EnvTransition:
  """Adapts environments to the tree engine.

  Args:
    renderer: the `ChatRenderer` of the policy's chat format, or one per agent
      (agents with tokenizers of their own, `run.groups`); an agent's stop
      ids must be the ones its sampler stops at.
    num_agents: N; every environment must have `num_agents == N`.
    limits: turn cap / token budget / timeout / fault policy of each step.
    reward_cfg: reward composition weights (`mtrl_jax.envs.RewardConfig`).
    outcome_range: (lowest, highest) final-grade score of the factory's
      environments (`EnvironmentFactory.outcome_range`); a cut episode the
      environment does not grade scores the lowest (`cut`).
  """

  def __init__(
      self,
      renderer: ChatRenderer | Sequence[ChatRenderer],
      num_agents: int = 1,
      *,
      limits: StepLimits = StepLimits(),
      reward_cfg=None,
      outcome_range: tuple = (0.0, 1.0),
  ):
    self.renderers = (
        tuple(renderer) if isinstance(renderer, (list, tuple)) else (renderer,) * num_agents
    )
    if len(self.renderers) != num_agents:
      raise ValueError(f"EnvTransition: {len(self.renderers)} renderers for {num_agents} agents")
    self.num_agents = num_agents
    self.limits = limits
    self.reward_cfg = reward_cfg
    self.failure_outcome = float(outcome_range[0])

  # ---------------------------------------------------------------- roots
  def root_state(self, env) -> EnvState:
    """The root state of one trajectory: the env's initial per-agent threads, rendered."""
    n = getattr(env, "num_agents", 1)
    if n != self.num_agents:
      raise ValueError(
          f"{type(env).__name__}.num_agents={n} but the tree has num_agents={self.num_agents}"
      )
    threads = env.initial_threads() if n > 1 else [env.initial_thread()]
    if len(threads) != n:
      raise ValueError(
          f"{type(env).__name__}.initial_threads returned {len(threads)} threads for {n} agents"
      )
    return EnvState(env, tuple(map(render_thread, threads, self.renderers)), 0)

  def root_states(self, factory, metadatas: Sequence[Mapping]) -> list[EnvState]:
    """One fresh environment per task from an `EnvironmentFactory`.

    Never raises for a bad task or a failing factory: that root becomes a
    failed root (`failed_root`) whose actions are all masked with its fault.
    """
    states = []
    for k, metadata in enumerate(metadatas):
      if not isinstance(metadata, Mapping):
        text = repr(metadata)
        fault = Fault(
            FaultKind.CONTRACT,
            "task_source",
            f"task {k} of the step is {type(metadata).__name__}, not a mapping "
            f"of metadata: {text[:80]}{' ...' * (len(text) > 80)}",
            where="TaskSource.__getitem__",
        )
        states.append(self.failed_root(fault))
        continue
      env = None
      try:
        env = factory.create_environment(metadata)
        states.append(self.root_state(env))
      except Exception as e:  # classified; the other roots go on
        method = "create_environment" if env is None else "initial_thread"
        where = fault_origin(e, factory if env is None else env, method)
        if env is not None:
          env.close()
        states.append(self.failed_root(Fault.from_exception(e, fault_source(e), where=where)))
    return states

  def failed_root(self, fault: Fault) -> EnvState:
    """The state of a root whose environment could not be made: empty prompts,
    `fault` recorded (masked) on every joint action. Shows the fault once."""
    show_fault_once(fault)
    empty = tuple(render_thread(Thread(), r) for r in self.renderers)
    return EnvState(None, empty, 0, fault)

  # ---------------------------------------------------------------- Transition
  def prompts(self, state: EnvState) -> list[list[int]]:
    out = []
    for thread, renderer in zip(state.threads, self.renderers):
      ledger = thread.ledger.copy()
      out.append(renderer.begin_assistant(ledger))
    return out

  def step(
      self, state: EnvState, actions: Sequence[Completion], seed: Optional[int] = None
  ) -> ActionOutcome:
    """Steps one joint action; `seed` (from the engine) seeds the environment's model calls."""
    if state.fault is not None:  # a failed root
      return self._masked(state.fault)
    for i, comp in enumerate(actions):
      vocab = self.renderers[i].tokenizer.vocab_size
      ids = np.asarray(comp.ids)
      bad = ids[(ids < 0) | (ids >= vocab)]
      if bad.size:
        return self._undecodable(i, bad.tolist(), vocab)
    env = None
    try:  # the branch's own environment and threads (metadata included)
      env = state.env.fork()
      forked = [t.fork() for t in state.threads]
    except Exception as e:  # classified; the sibling branches go on
      fault = self._fork_fault(state.env if env is None else state.threads[0], e)
      if env is not None:
        env.close()
      return self._masked(fault)
    acted = []
    for i, (thread, comp, renderer) in enumerate(zip(forked, actions, self.renderers)):
      ledger = thread.ledger
      renderer.begin_assistant(ledger)
      text = renderer.append_completion(
          ledger,
          comp.ids.tolist(),
          comp.logprobs.tolist(),
          finished_by_stop=comp.finish_reason == "stop",
      )
      name = f"agent_{i}" if self.num_agents > 1 else None
      agent_seed = None if seed is None else call_seed(seed, i, state.steps)
      acted.append(
          thread.replace(ledger=ledger, seed=agent_seed).append(Turn("assistant", text, name=name))
      )
    out = step_environment(
        env,
        acted,
        self.limits,
        reward_cfg=self.reward_cfg,
        renderer=self.renderers,
        step_index=state.steps,
    )
    details = {
        "grades": {k: g.to_dict() for k, g in out.grades.items()},
        "invalid_calls": out.invalid_calls,
        "history_rewrites": out.history_rewrites,
    }
    offers_tools = bool(getattr(state.env, "tools", None))  # a ToolSet is falsy when empty
    if out.done:
      env.close()
      if offers_tools:  # an ended episode's calls, if any, got no tool turn
        details["tool_calls"] = [0] * len(actions)
      return ActionOutcome(None, _record(out, details))
    if not out.masked:  # a continuing step's grades are all per-turn grades
      note_unweighted_shaping(self.reward_cfg or RewardConfig(), out.grades)
    new_turns = [nxt.turns[len(old.turns) :] for old, nxt in zip(acted, out.next_threads)]
    details["env_turns"] = [[t.content for t in turns] for turns in new_turns]
    details["env_roles"] = [[t.role for t in turns] for turns in new_turns]
    if offers_tools:  # one tool turn per call (`ToolSet.execute`), per agent
      details["tool_calls"] = [sum(t.role == "tool" for t in turns) for turns in new_turns]
    waits = not out.history_rewrites and all(
        turns and turns[-1].role == "tool" for turns in new_turns
    )
    return ActionOutcome(
        EnvState(env, tuple(out.next_threads), state.steps + 1),
        _record(out, details, continues_turn=waits),
    )

  def cut(self, out: ActionOutcome, num_turns: int) -> ActionOutcome:
    """Grades an episode the tree cut (a step at its last turn that went on) as ended.

    The step's reward becomes what it would be had `react_to` ended the episode
    with the cut's grades (`envs.cuts.grade_cut`): outcome from them, the step's
    own step and tool penalties, no shaping (its per-turn grades stay in the
    record's `grades`). Closes the branch's environment.

    Args:
      out: the step's outcome, with a next state.
      num_turns: the tree's depth (`tree.num_turns`), for the notice.

    Returns:
      The outcome with no next state and `StepRecord.cut` set.
    """
    state, record = out.next_state, out.step
    threads = list(state.threads)
    grades, faults, masked = grade_cut(
        state.env,
        threads if self.num_agents > 1 else threads[0],
        self.failure_outcome,
        self.limits.faults,
        num_turns,
    )
    state.env.close()
    show_notice_once("tree/cut_episodes", cut_notice(num_turns, self.limits.max_turns))
    for f in faults:
      show_fault_once(f)
    cfg = self.reward_cfg or RewardConfig()
    invalid = int(record.details.get("invalid_calls", 0))
    local = ()
    if masked:
      reward = RewardBreakdown.zero()
    else:
      reward = compose_reward(
          cfg, steps=1, invalid_calls=invalid, outcome=mean_score(grades) or 0.0
      )
      local = compose_local(
          cfg,
          self.num_agents,
          outcome_grades=grades,
          shaping_grades={},
          steps=1,
          invalid_calls=invalid,
      )
    parts = reward.metrics(prefix="")
    parts.pop("total")
    details = {**record.details, "cut_grades": {k: g.to_dict() for k, g in grades.items()}}
    step = dataclasses.replace(
        record,
        reward=reward.total,
        valid=not masked,
        continues_turn=False,
        parts=parts,
        faults=tuple(record.faults) + tuple(faults),
        details=details,
        cut=True,
        local_rewards=tuple(None if b is None else b.total for b in local),
    )
    return ActionOutcome(None, step)

  def _fork_fault(self, obj, exc: Exception) -> Fault:
    """The fault of a fork (of an environment or a thread) that raised: a contract
    fault naming `fork` and `SharedResource` for a copy that failed, else
    classified as raised."""
    where = fault_origin(exc, obj, "fork")
    if isinstance(exc, ContractError):
      return Fault(FaultKind.CONTRACT, "environment", str(exc), where=where)
    if classify(exc) == FaultKind.CONTRACT:
      return Fault(FaultKind.CONTRACT, "environment", fork_error_message(obj, exc), where=where)
    return Fault.from_exception(exc, fault_source(exc), where=where)

  def _masked(self, fault: Fault) -> ActionOutcome:
    """A masked, ended action that records `fault` (shown once)."""
    show_fault_once(fault)
    out = StepOutcome(None, {}, RewardBreakdown.zero(), (fault,), masked=True)
    return ActionOutcome(None, _record(out, {"invalid_calls": 0}))

  def _undecodable(self, agent: int, bad: list, vocab: int) -> ActionOutcome:
    """The outcome of a message with ids outside the tokenizer: a model format fault."""
    policy = self.limits.faults
    fault = Fault(
        FaultKind.MODEL_FORMAT,
        "framework",
        f"agent {agent} sampled ids {sorted(set(bad))[:8]} outside the tokenizer's "
        f"vocabulary [0, {vocab})",
    )
    masked = fault.kind in policy.mask
    invalid = int(fault.kind in policy.penalise)
    reward = (
        RewardBreakdown.zero()
        if masked
        else compose_reward(self.reward_cfg or RewardConfig(), steps=1, invalid_calls=invalid)
    )
    show_fault_once(fault)
    out = StepOutcome(None, {}, reward, (fault,), masked=masked, invalid_calls=invalid)
    return ActionOutcome(None, _record(out, {"invalid_calls": invalid}))

  def close(self, state: Optional[EnvState]) -> None:
    """Releases a state's environment once no branch will step it again."""
    if state is not None and state.env is not None:
      state.env.close()

  @property
  def decoders(self) -> tuple:
    """Each agent's token ids -> text (its tokenizer's `decode`): the rollout dump's."""
    return tuple(r.tokenizer.decode for r in self.renderers)
