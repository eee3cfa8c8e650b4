"""The researcher-facing environment API: Turn, Thread, Environment, EnvironmentFactory.

An environment sees text only. After every policy completion the framework
calls `env.react_to(thread)`, where the thread's last turn is the policy's
message, and the environment answers

    (next_thread, None)     continue (next_thread has the env's new turns appended)
    (next_thread, grades)   continue, with per-turn grades (shaping)
    (None, grades)          stop, with the final grades (outcome)

An episode the tree cuts (the environment would go on past the tree's last
turn) is graded as ended there by `env.on_cut(thread)` (default: `finalize`,
else a failure: the bottom of the factory's `outcome_range`).

`grades` is a `Grade`, a list of them, or a dict name -> Grade. The
framework (`mtrl_jax.envs.runner.step_environment`) renders the new turns into
the thread's token ledger once, enforces the turn cap and token budget, and
catches and classifies every fault. Factories are found by registry name or
import path (`mtrl_jax.envs.registry`).
"""

from __future__ import annotations

import copy
import dataclasses
from types import MappingProxyType
from typing import Any, Mapping, Optional, Sequence, Union

from mtrl_jax.envs.faults import ContractError, Fault, FaultKind

ROLES = ("system", "user", "assistant", "tool")


@dataclasses.dataclass(frozen=True)
class Turn:
  """One message of a conversation.

  Attributes:
    role: 'system', 'user', 'assistant' (the policy) or 'tool'.
    content: the text.
    name: the tool's name for tool turns; an agent's name in multi-agent
      threads; None otherwise.
    metadata: free-form annotations (e.g. {'ok': False} on an error tool
      turn); not rendered.
  """

  role: str
  content: str
  name: Optional[str] = None
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    if self.role not in ROLES:
      raise ValueError(f"Turn.role={self.role!r}; allowed: {list(ROLES)}")
    if not isinstance(self.content, str):
      raise TypeError(f"Turn.content must be str, got {type(self.content).__name__}")
    object.__setattr__(self, "metadata", MappingProxyType(dict(self.metadata)))

  def __deepcopy__(self, memo):
    return self  # immutable

  def __reduce__(self):
    return (Turn, (self.role, self.content, self.name, dict(self.metadata)))

  def to_dict(self) -> dict:
    out = {"role": self.role, "content": self.content}
    if self.name is not None:
      out["name"] = self.name
    if self.metadata:
      out["metadata"] = dict(self.metadata)
    return out


@dataclasses.dataclass(frozen=True)
class Thread:
  """An ordered conversation plus the token ledger of its rendered prefix.

  Immutable: `append` returns a new thread. `ledger` (a
  `mtrl_jax.text.TokenLedger`, or None before rendering) covers the first
  `num_rendered` turns; the framework renders the rest, once.

  Attributes:
    turns: the messages, oldest first.
    metadata: the task's metadata (e.g. the expected answer) and anything
      the environment wants to carry along. Private per branch: the framework
      hands each branch of a tree its own deep copy (`fork`, before every
      react_to), so a change made in place (`thread.metadata['tries'] += 1`)
      is seen by the threads of this branch only, never by its siblings.
      `with_metadata` returns a new thread with a changed copy.
    ledger: token records of `turns[:num_rendered]`.
    seed: the seed of the model calls this step's `react_to` makes (user
      simulator, judges, expert), set by the framework from (step, root,
      node, action, agent, turn) (`mtrl_jax.seeds.call_seed`);
      None outside a rollout. Derive one seed per call with
      `call_seed(thread.seed, 'what')`; never share a counter.
  """

  turns: tuple = ()
  metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  ledger: Any = None
  seed: Optional[int] = dataclasses.field(default=None, compare=False)

  def __post_init__(self):
    turns = tuple(self.turns)
    for i, t in enumerate(turns):
      if not isinstance(t, Turn):
        raise TypeError(f"Thread.turns[{i}] must be a Turn, got {type(t).__name__}")
    object.__setattr__(self, "turns", turns)

  @classmethod
  def from_messages(cls, messages: Sequence, metadata: Optional[Mapping] = None) -> "Thread":
    """From Turns, (role, content) pairs or {'role', 'content', ...} dicts."""
    turns = []
    for m in messages:
      if isinstance(m, Turn):
        turns.append(m)
      elif isinstance(m, Mapping):
        turns.append(Turn(**m))
      else:
        turns.append(Turn(*m))
    return cls(tuple(turns), dict(metadata or {}))

  def append(self, *turns: Turn) -> "Thread":
    """A new thread with `turns` added (same ledger, metadata)."""
    return dataclasses.replace(self, turns=self.turns + tuple(turns))

  def replace(self, **changes) -> "Thread":
    return dataclasses.replace(self, **changes)

  def with_metadata(self, **updates) -> "Thread":
    return dataclasses.replace(self, metadata={**self.metadata, **updates})

  def fork(self) -> "Thread":
    """A thread for one branch: its own copy of the ledger and of the metadata
    (a deep copy; `SharedResource`s in it are shared), so neither appending to
    it nor changing its metadata in place touches this thread."""
    ledger = None if self.ledger is None else self.ledger.copy()
    return dataclasses.replace(self, ledger=ledger, metadata=copy.deepcopy(dict(self.metadata)))

  @property
  def num_rendered(self) -> int:
    """How many leading turns the ledger holds (0 without a ledger)."""
    return 0 if self.ledger is None else self.ledger.num_turns

  def __len__(self):
    return len(self.turns)

  def last(self, role: Optional[str] = None) -> Optional[Turn]:
    """The last turn (of `role` if given), or None."""
    for t in reversed(self.turns):
      if role is None or t.role == role:
        return t
    return None

  @property
  def last_assistant(self) -> str:
    """Content of the last policy message ('' if none)."""
    t = self.last("assistant")
    return "" if t is None else t.content

  def count(self, role: str) -> int:
    return sum(t.role == role for t in self.turns)

  def to_dict(self) -> dict:
    return {"turns": [t.to_dict() for t in self.turns], "metadata": dict(self.metadata)}


Grades = Union[None, Any, Sequence[Any], Mapping[str, Any]]


class Environment:
  """Base class of environments. Override `react_to` (and maybe `initial_thread`).

  One instance serves one trajectory (see `EnvironmentFactory`), so it may
  keep per-trajectory state in attributes. For tree rollouts the framework
  calls `fork()` at branch points; the default deep copy is right for plain
  Python state, and objects deriving from `SharedResource` (judges, user
  simulators, caches) are shared rather than copied. Override `fork` when
  the environment holds external resources (a container, a connection).

  Args:
    metadata: the task's metadata; kept as `self.metadata`.
    tools: a `ToolSet` (or None); `system_prompt()` includes its schemas.
    system: a system prompt preamble.
  """

  num_agents: int = 1

  def __init__(self, metadata: Optional[Mapping] = None, tools=None, system: str = ""):
    self.metadata = dict(metadata or {})
    self.tools = tools
    self.system = system

  # ----------------------------------------------------------------- the API
  def react_to(self, thread: Thread):
    """Reacts to the policy's last message.

    Returns:
      (next_thread, None) | (next_thread, grades) | (None, grades).
    """
    raise NotImplementedError(f"{type(self).__name__} must implement react_to(thread)")

  def react_to_joint(self, threads: Sequence[Thread]):
    """Multi-agent step: one thread per agent, each ending with that agent's message.

    Returns:
      (next_threads | None, grades); the grades score the joint action. The
      default serves single-agent environments by calling `react_to`.
    """
    if len(threads) != 1:
      raise NotImplementedError(
          f"{type(self).__name__} got {len(threads)} agent threads but does not implement "
          "react_to_joint(threads)"
      )
    next_thread, grades = self.react_to(threads[0])
    return (None if next_thread is None else [next_thread]), grades

  def system_prompt(self) -> str:
    """The system message: `system` plus the tool schemas (if any)."""
    system, tools = getattr(self, "system", ""), getattr(self, "tools", None)
    if tools is not None and len(tools):
      return tools.system_prompt(system)
    return system

  def initial_thread(self) -> Thread:
    """The conversation before the policy's first turn.

    Default: the system prompt (if any) then `metadata['messages']` (list of
    {'role', 'content'}) or `metadata['prompt']` as one user turn.
    """
    metadata = getattr(self, "metadata", {})
    turns = []
    system = self.system_prompt()
    if system:
      turns.append(Turn("system", system))
    if "messages" in metadata:
      turns += list(Thread.from_messages(metadata["messages"]).turns)
    elif "prompt" in metadata:
      turns.append(Turn("user", str(metadata["prompt"])))
    else:
      raise ValueError(
          f"{type(self).__name__}.initial_thread: metadata needs 'prompt' or "
          f"'messages' (got keys {sorted(metadata)}); or override initial_thread"
      )
    return Thread(tuple(turns), dict(metadata))

  def initial_threads(self) -> list[Thread]:
    """One starting thread per agent (default: `[initial_thread()]`)."""
    return [self.initial_thread()]

  def finalize(self, thread: Thread) -> Grades:
    """Grades of a trajectory the framework truncated (turn cap / token budget).

    Default None: a truncated trajectory earns no outcome reward.
    """
    del thread
    return None

  def on_cut(self, thread) -> Grades:
    """Final grades of an episode the tree cut: after the tree's last turn
    (`tree.num_turns`) this environment would have gone on.

    The framework grades the cut episode as ended at that turn: the step's
    reward becomes what it would be had `react_to` returned
    `(None, on_cut(thread))` (outcome from these grades, the step's
    penalties, no shaping). Grade it as a natural end does: run the
    trajectory graders (a task not finished is a failure), so that quitting
    at the tree's depth never pays more than failing there.

    Args:
      thread: the thread the environment would continue (with its new
        turns); for a multi-agent environment the list of agent threads.

    Returns:
      Grades; None (the default when `finalize` returns None) or no grades:
      the framework scores the cut as a failure, the bottom of the
      factory's `outcome_range`. Default: `finalize(thread)`.
    """
    return self.finalize(thread)

  def fork(self) -> "Environment":
    """An independent copy for one branch of a tree rollout (default: deep copy).

    Raises:
      ContractError (`fork_error_message`) when an attribute cannot be copied.
    """
    try:
      return copy.deepcopy(self)
    except (TypeError, copy.Error, NotImplementedError, AttributeError) as e:
      raise ContractError(fork_error_message(self, e)) from e

  def close(self) -> None:
    """Releases external resources at the end of the trajectory (default: nothing)."""

  # ----------------------------------------------------------------- helpers
  def report_fault(self, kind, message: str, source: str = "environment") -> None:
    """Records a fault the environment recovered from (e.g. it told the policy)."""
    self._faults().append(Fault(FaultKind.parse(kind), source, message))

  def drain_faults(self) -> list[Fault]:
    """Faults recorded since the last call (the framework calls it every step)."""
    faults = list(self._faults())
    self._faults().clear()
    return faults

  def _faults(self) -> list:
    if "_pending_faults" not in self.__dict__:
      self.__dict__["_pending_faults"] = []
    return self.__dict__["_pending_faults"]

  def run_tools(self, thread: Thread, tools=None) -> Optional[Thread]:
    """Runs the tool calls of the policy's last message.

    Returns:
      The thread with one tool turn per call appended (faults recorded), or
      None when the message has no tool call.
    """
    tools = tools if tools is not None else getattr(self, "tools", None)
    if tools is None:
      raise ValueError(f"{type(self).__name__}.run_tools: no ToolSet (pass tools= to __init__)")
    results = tools.execute(thread.last_assistant)
    self._faults().extend(results.faults)
    self.last_tool_results = results
    if not results.any_calls:
      return None
    return thread.append(*results.turns)


def fork_error_message(obj, exc: BaseException) -> str:
  """The one-line explanation of an environment (or a thread's metadata) that
  cannot be forked, e.g. because it holds a lock (deepcopy: "cannot pickle
  '_thread.lock' object"). The start-up check and the rollout both use it."""
  name = type(obj).__name__
  fix = f", or override {name}.fork()" if isinstance(obj, Environment) else ""
  return (
      f"{name}.fork failed ({type(exc).__name__}: {exc}): a tree copies the environment "
      f"and each thread's metadata at every branch (deep copies); derive the class of an "
      f"object that must be shared, not copied (a lock, a connection, a model, a cache), "
      f"from mtrl_jax.envs.SharedResource{fix}"
  )


class EnvironmentFactory:
  """Creates a fresh environment per trajectory: state is never shared across rollouts.

  Attributes:
    outcome_range: (lowest, highest) score of the final grades its
      environments return; the start-up reward-dominance check compares step
      and tool penalties with this gap (`graders.check_reward_dominance`).
    num_agents: agents of the environments it creates, when the factory
      knows it (None: not declared). Config validation builds one environment
      and compares its `num_agents` with `tree.num_agents` (and with this).
  """

  outcome_range: tuple[float, float] = (0.0, 1.0)
  num_agents: Optional[int] = None

  def create_environment(self, metadata: Mapping) -> Environment:
    raise NotImplementedError(f"{type(self).__name__} must implement create_environment")

  def max_graded_turns(self, task_kwargs: Mapping) -> Optional[int]:
    """The most turns of one trajectory that return per-turn grades, for tasks made
    with `task_kwargs`; None (the default): any turn may. The start-up dominance
    check bounds what shaping can add with it (`graders.check_reward_dominance`)."""
    del task_kwargs
    return None
