"""The engine's `Transition` over `mtrl_jax.envs` environments (threads, ledgers, grades).

A node's state is the trajectory's environment plus one thread per agent whose
token ledger holds every turn rendered so far (each agent's full history).
Stepping a joint action forks the environment (`Environment.fork`, so sibling
branches never share mutable state), appends each agent's completion to a
fork of its ledger exactly as sampled, and runs `step_environment`, which
calls `react_to` / `react_to_joint`, classifies faults, composes the reward
and renders the environment's new turns into the child's ledgers once.

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
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from mtrl_jax.envs import StepLimits, StepOutcome, Turn, step_environment
from mtrl_jax.envs.runner import render_thread
from mtrl_jax.envs.faults import Fault, FaultKind
from mtrl_jax.envs.reward import RewardBreakdown, RewardConfig, compose_reward
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
  """

  env: Any
  threads: tuple
  steps: int = 0


def _record(out: StepOutcome, details: dict, continues_turn: bool = False) -> StepRecord:
  """The engine's record of one `step_environment` outcome."""
  parts = out.reward.metrics(prefix="")
  parts.pop("total")
  return StepRecord(reward=out.reward.total, valid=not out.masked, continues_turn=continues_turn,
                    truncated=out.truncated, parts=parts, faults=tuple(out.faults),
                    details=details)


class EnvTransition:
  """Adapts environments to the tree engine.

  Args:
    renderer: the `ChatRenderer` of the policy's chat format; its stop ids
      must be the sampler's stop ids.
    num_agents: N; every environment must have `num_agents == N`.
    limits: turn cap / token budget / timeout / fault policy of each step.
    reward_cfg: reward composition weights (`mtrl_jax.envs.RewardConfig`).
  """

  def __init__(self, renderer: ChatRenderer, num_agents: int = 1, *,
               limits: StepLimits = StepLimits(), reward_cfg=None):
    self.renderer = renderer
    self.num_agents = num_agents
    self.limits = limits
    self.reward_cfg = reward_cfg

  # ---------------------------------------------------------------- roots
  def root_state(self, env) -> EnvState:
    """The root state of one trajectory: the env's initial per-agent threads, rendered."""
    n = getattr(env, "num_agents", 1)
    if n != self.num_agents:
      raise ValueError(f"{type(env).__name__}.num_agents={n} but the tree has "
                       f"num_agents={self.num_agents}")
    threads = env.initial_threads() if n > 1 else [env.initial_thread()]
    if len(threads) != n:
      raise ValueError(f"{type(env).__name__}.initial_threads returned {len(threads)} "
                       f"threads for {n} agents")
    return EnvState(env, tuple(render_thread(t, self.renderer) for t in threads), 0)

  def root_states(self, factory, metadatas: Sequence[Mapping]) -> list[EnvState]:
    """One fresh environment per task from an `EnvironmentFactory`."""
    return [self.root_state(factory.create_environment(m)) for m in metadatas]

  # ---------------------------------------------------------------- Transition
  def prompts(self, state: EnvState) -> list[list[int]]:
    out = []
    for thread in state.threads:
      ledger = thread.ledger.copy()
      out.append(self.renderer.begin_assistant(ledger))
    return out

  def step(self, state: EnvState, actions: Sequence[Completion],
           seed: Optional[int] = None) -> ActionOutcome:
    """Steps one joint action; `seed` (from the engine) seeds the environment's model calls."""
    vocab = self.renderer.tokenizer.vocab_size
    for i, comp in enumerate(actions):
      ids = np.asarray(comp.ids)
      bad = ids[(ids < 0) | (ids >= vocab)]
      if bad.size:
        return self._undecodable(i, bad.tolist(), vocab)
    env = state.env.fork()
    acted = []
    for i, (thread, comp) in enumerate(zip(state.threads, actions)):
      ledger = thread.ledger.copy()
      self.renderer.begin_assistant(ledger)
      text = self.renderer.append_completion(ledger, comp.ids.tolist(), comp.logprobs.tolist(),
                                             finished_by_stop=comp.finish_reason == "stop")
      name = f"agent_{i}" if self.num_agents > 1 else None
      agent_seed = None if seed is None else call_seed(seed, i, state.steps)
      acted.append(thread.replace(ledger=ledger, seed=agent_seed).append(
          Turn("assistant", text, name=name)))
    out = step_environment(env, acted, self.limits, reward_cfg=self.reward_cfg,
                           renderer=self.renderer, step_index=state.steps)
    details = {"grades": {k: g.to_dict() for k, g in out.grades.items()},
               "invalid_calls": out.invalid_calls, "history_rewrites": out.history_rewrites}
    if out.done:
      env.close()
      return ActionOutcome(None, _record(out, details))
    new_turns = [nxt.turns[len(old.turns):] for old, nxt in zip(acted, out.next_threads)]
    details["env_turns"] = [[t.content for t in turns] for turns in new_turns]
    details["env_roles"] = [[t.role for t in turns] for turns in new_turns]
    waits = (not out.history_rewrites
             and all(turns and turns[-1].role == "tool" for turns in new_turns))
    return ActionOutcome(EnvState(env, tuple(out.next_threads), state.steps + 1),
                         _record(out, details, continues_turn=waits))

  def _undecodable(self, agent: int, bad: list, vocab: int) -> ActionOutcome:
    """The outcome of a message with ids outside the tokenizer: a model format fault."""
    policy = self.limits.faults
    fault = Fault(FaultKind.MODEL_FORMAT, "framework",
                  f"agent {agent} sampled ids {sorted(set(bad))[:8]} outside the tokenizer's "
                  f"vocabulary [0, {vocab})")
    masked = fault.kind in policy.mask
    invalid = int(fault.kind in policy.penalise)
    reward = (RewardBreakdown.zero() if masked else
              compose_reward(self.reward_cfg or RewardConfig(), steps=1, invalid_calls=invalid))
    out = StepOutcome(None, {}, reward, (fault,), masked=masked, invalid_calls=invalid)
    return ActionOutcome(None, _record(out, {"invalid_calls": invalid}))

  def close(self, state: Optional[EnvState]) -> None:
    """Releases a state's environment once no branch will step it again."""
    if state is not None:
      state.env.close()

  def decode(self, ids) -> str:
    return self.renderer.tokenizer.decode(ids)
