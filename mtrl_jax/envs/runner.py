"""The framework side of one environment step: `step_environment`.

The rollout engine calls `step_environment` once per (node, joint action)
after appending the policy's completion to the thread(s):

    out = step_environment(env, thread, limits, reward_cfg=reward, renderer=renderer,
                           step_index=t)
    out.reward.total    # r of this joint action (0 when out.masked)
    out.masked          # True: drop the sample from the update (row_weight 0)
    out.done            # True: leaf; out.next_thread is None
    out.next_thread     # else: the child's thread, new turns rendered into its ledger

In a tree, step a fork per child (`child_env = env.fork()`), never the
parent's environment: react_to mutates per-trajectory state. Steps of
different environments may run concurrently in threads; one environment is
never stepped by two threads at once.

It wraps `env.react_to` (or `react_to_joint` when given a list of threads)
and guarantees:
  * every exception is caught and classified (`FaultKind`); infrastructure
    faults are retried `limits.faults.max_retries` times (on the same
    environment object: raise before mutating state, or keep react_to
    idempotent), then the step is masked and the trajectory ends; a react_to
    that breaks the API (a wrong return shape or type, a NaN grade, a bug in
    its code) is a contract fault: masked at once, never retried;
  * the first fault of each (kind, source) is printed once, naming where it
    came from (`fault_report.show_fault_once`);
    model-caused faults (a `ModelFormatError`
    or `ToolError` escaping react_to, invalid tool calls recorded by the
    environment) are counted as invalid calls for the tool penalty;
  * a react_to that runs past `limits.react_timeout_s` is a timeout fault
    (masked, trajectory ends: the environment's state is unknown);
  * a tool call that ran past its `timeout_s` (a timeout fault the
    environment recorded) is infrastructure: the step is masked (reward 0,
    row weight 0; the engine ends the branch), unless
    `limits.faults.tool_timeout == 'tell'`: then the policy reads "timed
    out" in the tool turn and the trajectory goes on, unpenalised;
  * the turn cap (`max_turns` policy turns) and token budget (`max_tokens`
    ledger tokens) are enforced: the trajectory ends as a truncation fault,
    graded by `env.finalize(thread)` (default: no outcome);
  * a next thread that does not extend the given one (the environment
    rewrote earlier turns, or the renderer's template now shows them
    differently, e.g. Qwen3's stripped thinking) is a history rewrite, not
    misuse: its whole history is rendered into a new ledger (the sampled
    tokens stay in the old one, with their action), the step reports
    `history_rewrites`, and the rollout starts a new training segment on
    the rewritten context (`render_thread`);
  * a new tool turn longer than `limits.tool_output_chars` characters is cut
    (with a note in its text, `tools.cap_tool_turns`) before it is tokenised;
  * with a `renderer`, the new turns are rendered into a copy of the
    ledger exactly once, so `next_thread.num_rendered == len(next_thread)`;
  * the reward is composed from the grades (`compose_reward`; each agent's local one
    by `compose_local`): final grades the outcome, per-turn grades the shaping; masked 0.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from mtrl_jax.envs.core import Thread, Turn
from mtrl_jax.envs.fault_report import fault_origin, fault_source, show_fault_once
from mtrl_jax.envs.faults import (
    ContractError,
    Fault,
    FaultKind,
    FaultPolicy,
    InfrastructureError,
    call_with_timeout,
    classify,
)
from mtrl_jax.envs.grades import normalize_grades
from mtrl_jax.envs.reward import (
    RewardBreakdown,
    RewardConfig,
    compose_local,
    compose_reward,
    mean_score,
)
from mtrl_jax.envs.tools import cap_tool_turns
from mtrl_jax.text.ledger import TokenLedger

# Characters of tool output per token of the budget when `max_tool_output_chars`
# is derived: a longer output would not fit the budget with any common tokenizer.
TOOL_CHARS_PER_TOKEN = 16
# The cap on one tool turn when there is no token budget either.
DEFAULT_TOOL_OUTPUT_CHARS = 65_536


@dataclasses.dataclass(frozen=True)
class StepLimits:
  """Framework limits of one trajectory.

  Attributes:
    max_turns: policy turns per trajectory (None: unlimited).
    max_tokens: ledger tokens per trajectory (None: unlimited); checked after
      rendering the environment's turns.
    react_timeout_s: wall-clock limit of one react_to call (None: unlimited).
    faults: penalise / mask / retry policy.
    max_tool_output_chars: characters of one new tool turn; longer output is
      cut before it is tokenised (tokenising 50 MB takes minutes). None:
      `TOOL_CHARS_PER_TOKEN` x `max_tokens`, or `DEFAULT_TOOL_OUTPUT_CHARS`
      without a token budget (`tool_output_chars`).
  """

  max_turns: Optional[int] = None
  max_tokens: Optional[int] = None
  react_timeout_s: Optional[float] = None
  faults: FaultPolicy = FaultPolicy()
  max_tool_output_chars: Optional[int] = None

  def __post_init__(self):
    for name in ("max_turns", "max_tokens", "max_tool_output_chars"):
      v = getattr(self, name)
      if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
        raise ValueError(
            f"StepLimits.{name}={v!r} (config env.{name}); must be a positive int or None"
        )
    if self.react_timeout_s is not None and self.react_timeout_s <= 0:
      raise ValueError(f"StepLimits.react_timeout_s={self.react_timeout_s}; must be > 0 or None")

  @property
  def tool_output_chars(self) -> int:
    """The cap on one new tool turn, in characters (`max_tool_output_chars`)."""
    if self.max_tool_output_chars is not None:
      return self.max_tool_output_chars
    if self.max_tokens is not None:
      return TOOL_CHARS_PER_TOKEN * self.max_tokens
    return DEFAULT_TOOL_OUTPUT_CHARS


@dataclasses.dataclass(frozen=True)
class StepOutcome:
  """What one environment step produced.

  Attributes:
    next_threads: one thread per agent to continue from, or None when the
      trajectory ended (see `next_thread` for the single-agent case).
    grades: name -> Grade returned at this step (plus `env.finalize` grades
      on truncation): the outcome when the step ended the trajectory, the
      shaping otherwise.
    reward: the composed reward, component by component.
    faults: every fault of this step, classified.
    truncated: the framework ended the trajectory (turn cap / token budget).
    masked: the sample must be left out of the update (infrastructure).
    invalid_calls: model-caused faults (penalised calls).
    history_rewrites: agents whose next thread does not extend their
      previous tokens (rendered anew; the rollout starts a new segment).
    local: per agent its local reward (`reward.compose_local`; None where no
      grade scores it alone); () when masked.
  """

  next_threads: Optional[tuple]
  grades: dict
  reward: RewardBreakdown
  faults: tuple
  truncated: bool = False
  masked: bool = False
  invalid_calls: int = 0
  history_rewrites: int = 0
  local: tuple = ()

  @property
  def done(self) -> bool:
    return self.next_threads is None

  @property
  def next_thread(self) -> Optional[Thread]:
    """The single agent's next thread (None when done)."""
    if self.next_threads is None:
      return None
    if len(self.next_threads) != 1:
      raise ValueError(
          f"StepOutcome.next_thread: {len(self.next_threads)} agents; use next_threads"
      )
    return self.next_threads[0]

  def to_dict(self) -> dict:
    """JSON-friendly record for the rollout dump (texts excluded)."""
    return {
        "done": self.done,
        "truncated": self.truncated,
        "masked": self.masked,
        "invalid_calls": self.invalid_calls,
        "history_rewrites": self.history_rewrites,
        "reward": self.reward.metrics(prefix=""),
        "grades": {k: g.to_dict() for k, g in self.grades.items()},
        "faults": [f.to_dict() for f in self.faults],
        "local": [b and b.metrics(prefix="") for b in self.local],
    }


def _validated(result, threads: Sequence[Thread], joint: bool):
  """(next_threads | None, grades dict, rewrote flags) from react_to's answer.

  Raises `ContractError` on misuse. A next thread that rewrote the given
  turns loses its ledger (it no longer describes them) and is flagged: a
  history rewrite.
  """
  if not isinstance(result, tuple) or len(result) != 2:
    got = f"a {len(result)}-tuple" if isinstance(result, tuple) else type(result).__name__
    raise ContractError(f"react_to must return a 2-tuple (next_thread | None, grades), got {got}")
  nxt, grades = result
  if nxt is None and grades is None:
    raise ContractError(
        "react_to returned (None, None): a finished trajectory needs "
        "its final grades (use {} for none)"
    )
  try:
    grades = normalize_grades(grades)
  except (TypeError, ValueError) as e:  # a non-number, NaN or infinite grade
    raise ContractError(f"react_to returned invalid grades: {e}") from None
  for name, g in grades.items():
    if any(a >= len(threads) for a in g.agent_scores):
      raise ContractError(
          f"grade {name!r} has agent_scores for agents {sorted(g.agent_scores)}"
          f"; allowed: agent indices below {len(threads)}"
      )
  if nxt is None:
    return None, grades, []
  if joint and not isinstance(nxt, (list, tuple)):
    raise ContractError(
        f"react_to_joint returned {type(nxt).__name__} as next threads; "
        "expected a list of Threads"
    )
  nxt = list(nxt) if joint else [nxt]
  if len(nxt) != len(threads):
    raise ContractError(f"react_to_joint returned {len(nxt)} threads for {len(threads)} agents")
  for i, (old, new) in enumerate(zip(threads, nxt)):
    if not isinstance(new, Thread):
      raise ContractError(
          f"react_to returned {type(new).__name__} as next thread "
          f"(agent {i}); expected a Thread"
      )
  rewrote = [new.turns[: len(old.turns)] != old.turns for old, new in zip(threads, nxt)]
  nxt = [new.replace(ledger=None) if r else new for new, r in zip(nxt, rewrote)]
  return nxt, grades, rewrote


def history_rewritten(thread: Thread, renderer) -> bool:
  """True when the thread's ledger no longer holds its first turns as the
  renderer's template shows them now (`ChatRenderer.context_view`)."""
  if thread.ledger is None or renderer is None:
    return False
  n = thread.ledger.num_turns
  view = renderer.context_view(thread.turns)[:n]
  return view != renderer.context_view(thread.turns[:n])


def render_thread(thread: Thread, renderer, rewritten: Optional[bool] = None) -> Thread:
  """The thread with its unrendered turns rendered into a copy of its ledger, once.

  A history rewrite (`history_rewritten`: the environment rewrote earlier
  turns, or the template now shows them differently) renders every turn
  into a new ledger instead, as the template shows it (`context_view`), and
  is counted by the renderer (`note_rewrite`). Sampled tokens are never
  changed: they stay in the ledger of the step that sampled them.

  Args:
    thread: a thread whose ledger (None: a new one) holds its first turns.
    renderer: the policy's `ChatRenderer`.
    rewritten: True when the caller knows the history was rewritten (the
      environment changed earlier turns); None: `history_rewritten` decides.
  Raises:
    InfrastructureError when the ledger has an assistant turn left open.
  """
  if rewritten is None:
    rewritten = history_rewritten(thread, renderer)
  if rewritten:
    renderer.note_rewrite()
    thread = thread.replace(ledger=None)
  ledger = TokenLedger() if thread.ledger is None else thread.ledger.copy()
  if ledger.open_turn is not None:
    raise InfrastructureError("thread ledger has an open assistant turn without completion")
  view = renderer.context_view(thread.turns)
  for role, content in view[ledger.num_turns :]:
    renderer.render_turn(ledger, role, content)
  return thread.replace(ledger=ledger)


def step_environment(
    env,
    thread,
    limits: StepLimits = StepLimits(),
    *,
    reward_cfg: Optional[RewardConfig] = None,
    renderer=None,
    step_index: Optional[int] = None,
) -> StepOutcome:
  """Runs one react_to call under the framework's fault, limit and reward rules.

  Args:
    env: the trajectory's `Environment`.
    thread: the thread ending with the policy's message, or a list of them
      (one per agent: calls `react_to_joint`).
    limits: turn cap, token budget, react timeout, fault policy.
    reward_cfg: reward weights (default `RewardConfig()`: outcome only).
    renderer: a `mtrl_jax.text.ChatRenderer` (or one per thread); when given, the environment's
      new turns are rendered into (a copy of) each next thread's ledger and
      the token budget is checked against it.
    step_index: 0-based index of this policy turn in the trajectory (default:
      the number of assistant turns in the thread minus one).

  Returns:
    A `StepOutcome`. Never raises for faults of the environment, tools,
    graders, judges or user simulators.
  """
  reward_cfg = reward_cfg or RewardConfig()
  joint = isinstance(thread, (list, tuple))
  threads = list(thread) if joint else [thread]
  policy = limits.faults
  if step_index is None:
    step_index = max(threads[0].count("assistant") - 1, 0)
  drain = getattr(env, "drain_faults", lambda: [])
  faults = list(drain())
  react = (lambda: env.react_to_joint(threads)) if joint else (lambda: env.react_to(threads[0]))

  def finish(next_threads, outcome_grades, shaping_grades, truncated=False, mask=False):
    for f in faults:
      show_fault_once(f)
    kinds = [f.kind for f in faults]
    invalid = sum(k in policy.penalise for k in kinds)
    masked = mask or any(k in policy.mask for k in kinds)
    local = ()
    if masked:
      reward = RewardBreakdown.zero()  # never scored as reward
    else:
      reward = compose_reward(
          reward_cfg,
          steps=1,
          invalid_calls=invalid,
          outcome=mean_score(outcome_grades) or 0.0,
          shaping=mean_score(shaping_grades) or 0.0,
      )
      local = compose_local(
          reward_cfg,
          len(threads),
          outcome_grades=outcome_grades,
          shaping_grades=shaping_grades,
          steps=1,
          invalid_calls=invalid,
      )
    return StepOutcome(
        None if next_threads is None else tuple(next_threads),
        {**shaping_grades, **outcome_grades},
        reward,
        tuple(faults),
        truncated,
        masked,
        invalid,
        rewrites if next_threads is not None else 0,
        local,
    )

  retries = 0
  rewrites = 0
  while True:
    try:
      result = call_with_timeout(react, limits.react_timeout_s, "react_to")
      next_threads, grades, rewrote = _validated(result, threads, joint)
      if next_threads is not None:
        cap = limits.tool_output_chars
        next_threads = [
            cap_tool_turns(t, 0 if r else len(old.turns), cap)
            for t, old, r in zip(next_threads, threads, rewrote)
        ]
      if next_threads is not None and renderer is not None:
        each = renderer if isinstance(renderer, (list, tuple)) else [renderer] * len(threads)
        rewrote = [r or history_rewritten(t, x) for t, r, x in zip(next_threads, rewrote, each)]
        next_threads = [render_thread(t, x, r) for t, x, r in zip(next_threads, each, rewrote)]
      rewrites = sum(rewrote)
      break
    except Exception as e:  # classified; the run goes on
      kind = classify(e)
      stale = drain()  # faults of the failed attempt
      if kind == FaultKind.INFRASTRUCTURE and retries < policy.max_retries:
        retries += 1
        continue
      faults.extend(stale)
      where = fault_origin(e, env, "react_to_joint" if joint else "react_to")
      faults.append(Fault.from_exception(e, fault_source(e), retries, where))
      # Model-caused: the trajectory ends, penalised. Anything else: no honest
      # reward exists, so the sample is masked.
      return finish(None, {}, {}, mask=kind not in policy.penalise)
  faults.extend(drain())
  if next_threads is None:
    return finish(None, grades, {})

  reason = None
  if limits.max_turns is not None and step_index + 1 >= limits.max_turns:
    reason = f"turn cap reached ({limits.max_turns} policy turns)"
  elif limits.max_tokens is not None:
    used = max(len(t.ledger) if t.ledger is not None else 0 for t in next_threads)
    if used >= limits.max_tokens:
      reason = f"token budget reached ({used} >= {limits.max_tokens} tokens)"
  if reason is None:
    return finish(next_threads, {}, grades)

  # Truncated: this step's per-turn grades stay shaping; finalize's are the outcome.
  faults.append(Fault(FaultKind.TRUNCATION, "framework", reason))
  try:
    final_grades = normalize_grades(env.finalize(next_threads if joint else next_threads[0]))
  except Exception as e:  # classified like any other fault
    faults.append(Fault.from_exception(e, fault_source(e), where=fault_origin(e, env, "finalize")))
    return finish(None, {}, grades, truncated=True, mask=classify(e) not in policy.penalise)
  return finish(None, final_grades, grades, truncated=True)


def rollout_scripted(
    env,
    policy_texts: Sequence,
    limits: StepLimits = StepLimits(),
    *,
    reward_cfg: Optional[RewardConfig] = None,
    renderer=None,
) -> tuple[list[StepOutcome], list[Thread]]:
  """Runs an environment against a scripted policy (a list of assistant texts).

  For tests and for debugging a new environment without a model. With a
  renderer the policy texts are appended like sampled completions
  (trainable, ending with the format's stop id).

  Args:
    env: an `Environment`.
    policy_texts: assistant messages fed in turn by turn; for a multi-agent
      environment, each item is a list with one text per agent.
    limits, reward_cfg, renderer: as `step_environment`.

  Returns:
    (outcomes of the steps taken, the threads the policy saw at each step).
  """
  threads = env.initial_threads() if env.num_agents > 1 else [env.initial_thread()]
  if renderer is not None:
    threads = [render_thread(t, renderer) for t in threads]
  outcomes, seen = [], []
  for i, texts in enumerate(policy_texts):
    texts = list(texts) if env.num_agents > 1 else [texts]
    acted = []
    for t, text in zip(threads, texts):
      if renderer is not None:
        ledger = t.ledger.copy()
        renderer.begin_assistant(ledger)
        ids = renderer.tokenizer.encode(text) + [renderer.fmt.stop_ids[0]]
        renderer.append_completion(ledger, ids, [0.0] * len(ids), True)
        t = t.replace(ledger=ledger)
      acted.append(t.append(Turn("assistant", text)))
    seen.append(acted if env.num_agents > 1 else acted[0])
    out = step_environment(
        env,
        acted if env.num_agents > 1 else acted[0],
        limits,
        reward_cfg=reward_cfg,
        renderer=renderer,
        step_index=i,
    )
    outcomes.append(out)
    if out.done:
      break
    threads = list(out.next_threads)
  return outcomes, seen
