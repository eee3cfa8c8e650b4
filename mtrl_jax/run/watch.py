"""Is the run learning? Why a step trained no sample, and when the run halts for it.

A step trains no sample when its batch is empty (`rollout.batching`): every
sample was masked (infrastructure faults), or every group's advantages were 0
and the zero-variance filter dropped it, which is what happens when every
trajectory is truncated (all score alike) or a weak policy fails every task
the same way. `LearningWatch.observe` reads the finalized tree and the batch
metrics of each RL step and returns

  a warning (one line) when the step trained nothing, with the reason;
  a halt reason (one line) after `rl.halt_if_idle_steps` such steps in a row,
    where a step on which every sample succeeded does not count: a converged
    policy's groups are all alike too, but there is nothing wrong to halt for
    (it warns once per run of such steps, and resets the count),
    or when more than `rl.max_masked_fraction` of the joint actions of the
    last `rl.masked_window` steps were masked (with the first fault's message).

Given the step's metrics row (`metrics=`), it also warns (one line each, once per
run of such steps) after `STALL_STEPS` consecutive steps

  with no valid tool call (`tools/valid_calls` 0) where the environment offers
    tools: the policy answers without them;
  with no episode past its first turn (`rollout/past_first_turn` 0) in a tree
    that leaves room for more turns: the multi-turn run trains single-turn
    episodes.

Several warnings of one step come joined by newlines, one line each. Idle and
zero-variance warnings name the config fields to try (`IDLE_HINT`).

The RL loop prints them, stops on a halt (summary.json records it under
`halted`, `experiments/train.py` exits with status 3) and at the end says in
one line when the run trained nothing at all (`trained_nothing`). The watch's
counters are JSON (`state`), kept in the run's summary, so a resumed run goes
on counting where its checkpoint left off.
"""

from __future__ import annotations

import collections
from typing import Optional

from mtrl_jax.envs.faults import FaultKind

# Consecutive RL steps without a valid tool call (an environment that offers tools), or
# without an episode past its first turn (a tree with room for more), before a warning.
STALL_STEPS = 3
# What to try when the samples of each group score alike (every config field named exists).
IDLE_HINT = (
    "try: raise sampling.temperature or tree.num_generations (G) for samples that "
    "differ; raise optim.learning_rate if the policy barely moves; add a KL term "
    "(loss.kl_coef > 0) if it collapsed onto one answer, or lower loss.kl_coef if it "
    "holds the policy at its reference"
)


def _line(text: str, limit: int = 300) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[: limit - 3] + "..."


def _fault_text(fault) -> str:
  return _line(f"{fault.kind.value} from {fault.source}: {fault.message}", 240)


def masked_actions(tree) -> tuple[int, int, str]:
  """(masked joint actions, recorded joint actions, the first masked action's first fault)."""
  masked = total = 0
  first = ""
  for node in tree.nodes:
    if not node.recorded:
      continue
    total += len(node.valid_B)
    for b, action in enumerate(node.actions or []):
      if node.valid_B[b]:
        continue
      masked += 1
      faults = [] if action is None else action.faults
      if not first and faults:
        first = _fault_text(faults[0])
  return masked, total, first


def idle_reason(tree, batch_metrics: dict) -> str:
  """Why a step whose batch is empty trained nothing, from its tree and batch metrics."""
  masked, total, first = masked_actions(tree)
  if total and masked == total:
    return f"every sample was masked ({masked} joint actions; first fault: {first or 'none'})"
  ended = [a for node in tree.nodes for a in node.actions or [] if a is not None and a.ended]
  truncated = [a for a in ended if a.steps[-1].truncated or a.limit_reached]
  dropped = int(batch_metrics.get("batch/zero_variance_groups", 0))
  if ended and len(truncated) == len(ended):
    cause = next(
        (f.message for a in truncated for f in a.faults if f.kind == FaultKind.TRUNCATION), ""
    )
    return (
        f"every trajectory was truncated ({len(truncated)}; first: {_line(cause, 120)}), "
        f"so every group scored alike ({dropped} dropped by rl.zero_variance_filter); "
        "raise env.max_tokens or env.max_turns"
    )
  if dropped:
    return (
        f"every group's advantages were 0 ({dropped} groups dropped by "
        f"rl.zero_variance_filter): the policy's samples of each task scored alike; "
        f"{IDLE_HINT}"
    )
  return f"no sample was left to train on; {IDLE_HINT}"


def _allows_turns(tree) -> bool:
  """The tree leaves room for a second policy turn in an episode: more than one tree turn,
  or tool sub-steps (`tree.branch_on='user_turn'`)."""
  cfg = getattr(tree, "cfg", None)
  return cfg is not None and (cfg.num_turns > 1 or getattr(cfg, "branch_on", "") == "user_turn")


class LearningWatch:
  """Counts steps that trained nothing and masked actions; decides warnings and halts.

  Args:
    rl: the run's `RLConfig` (halt_if_idle_steps, max_masked_fraction,
      masked_window, updates_per_step: 0 is a control that trains nothing by
      design, so it never warns or halts for idleness).
    state: `state()` of a previous watch (a resumed run), or None.
  """

  def __init__(self, rl, state: Optional[dict] = None):
    self.rl = rl
    state = state or {}
    self.steps = int(state.get("steps", 0))
    self.trained_steps = int(state.get("trained_steps", 0))
    self.idle_steps = int(state.get("idle_steps", 0))
    self.idle_since = int(state.get("idle_since", 0))
    self.last_reason = str(state.get("last_reason", ""))
    self.solved_steps = int(state.get("solved_steps", 0))
    self.toolless_steps = int(state.get("toolless_steps", 0))
    self.first_turn_steps = int(state.get("first_turn_steps", 0))
    self.window = collections.deque(
        (tuple(w) for w in state.get("window", ())), maxlen=rl.masked_window
    )

  def state(self) -> dict:
    """JSON counters: the run's summary keeps them (resumes go on from them)."""
    return {
        "steps": self.steps,
        "trained_steps": self.trained_steps,
        "idle_steps": self.idle_steps,
        "idle_since": self.idle_since,
        "last_reason": self.last_reason,
        "solved_steps": self.solved_steps,
        "toolless_steps": self.toolless_steps,
        "first_turn_steps": self.first_turn_steps,
        "window": [list(w) for w in self.window],
    }

  def stalls(self, step: int, tree, metrics: dict) -> list[str]:
    """The warnings of `STALL_STEPS` consecutive steps without a valid tool call or without
    an episode past its first turn, read from the step's metrics row (each once per run
    of such steps). A step that logs no `tools/*` (no tools offered) or no
    `rollout/past_first_turn` (no valid episode) neither counts nor resets."""
    out, k = [], STALL_STEPS
    if "tools/valid_calls" in metrics:
      self.toolless_steps = 0 if metrics["tools/valid_calls"] > 0 else self.toolless_steps + 1
      if self.toolless_steps == k:
        out.append(
            f"no valid tool call in {k} consecutive steps ({step - k + 1}-{step}) of an "
            f"environment that offers tools: the policy makes no call, or only calls that fail "
            f"(tools/turns_with_call {metrics.get('tools/turns_with_call', 0.0):.2f}, "
            f"tools/parse_failures_per_call "
            f"{metrics.get('tools/parse_failures_per_call', 0.0):.2f}); check that the "
            "prompt shows the tools and the call syntax the parser reads, or warm up on "
            "tool-calling conversations (sft.steps)"
        )
    if "rollout/past_first_turn" in metrics and _allows_turns(tree):
      past = metrics["rollout/past_first_turn"] > 0
      self.first_turn_steps = 0 if past else self.first_turn_steps + 1
      if self.first_turn_steps == k:
        out.append(
            f"no episode went past its first turn in {k} consecutive steps "
            f"({step - k + 1}-{step}; rollout/past_first_turn 0): the environment ends every "
            "episode at the policy's first message, so the multi-turn tree trains single-turn "
            "episodes; see why in a rollout dump (rl.dump_every), or set tree.num_turns=1 if "
            "the environment is single-turn by design"
        )
    return out

  def observe(
      self,
      step: int,
      tree,
      batch_metrics: dict,
      *,
      success: Optional[float] = None,
      metrics: Optional[dict] = None,
      last: bool = False,
  ) -> tuple[str, str]:
    """(warning, halt reason) of RL step `step` ('' for none; several warnings joined by
    newlines, one line each); `success`: the step's `rollout/success` (1.0: every ended
    sample succeeded); `metrics`: the step's metrics row (`tools/*`,
    `rollout/past_first_turn`: `stalls`); `last`: the run's last step, where a masked
    window not yet full is judged too."""
    warning = halt = ""
    self.steps += 1
    masked, total, first = masked_actions(tree)
    self.window.append((step, masked, total, first))
    if self.rl.updates_per_step:
      if batch_metrics.get("batch/actions", 0) > 0:
        self.trained_steps += 1
        self.idle_steps = self.solved_steps = 0
      elif success is not None and success >= 1.0 and masked < total:
        self.idle_steps = 0
        self.solved_steps += 1
        self.last_reason = (
            "every sample succeeded, so every group's rewards were alike "
            "(nothing left to learn from these tasks)"
        )
        if self.solved_steps == 1:  # once per run of such steps
          warning = (
              f"step {step} trained no sample: {self.last_reason}; not counted by "
              "rl.halt_if_idle_steps"
          )
      else:
        self.solved_steps = 0
        self.idle_since = self.idle_since if self.idle_steps else step
        self.idle_steps += 1
        self.last_reason = idle_reason(tree, batch_metrics)
        warning = f"step {step} trained no sample: {self.last_reason}"
        k = self.rl.halt_if_idle_steps
        if k and self.idle_steps >= k:
          halt = (
              f"rl.halt_if_idle_steps={k}: no sample trained in {self.idle_steps} "
              f"consecutive steps ({self.idle_since}-{step}); last: {self.last_reason}"
          )
    limit = self.rl.max_masked_fraction
    if not halt and limit < 1.0 and (last or len(self.window) == self.window.maxlen):
      m, n = sum(w[1] for w in self.window), sum(w[2] for w in self.window)
      if n and m / n > limit:
        fault = next((w[3] for w in self.window if w[3]), "none recorded")
        halt = (
            f"rl.max_masked_fraction={limit:g}: {m} of {n} joint actions "
            f"({m / n:.0%}) were masked in steps {self.window[0][0]}-{step}; first fault: "
            f"{fault}"
        )
    warnings = ([warning] if warning else []) + self.stalls(step, tree, metrics or {})
    return "\n".join(_line(w, 600) for w in warnings), _line(halt, 700)

  def final(self) -> str:
    """The end-of-run line of a run whose RL steps (all of them, resumes included)
    trained nothing ('' otherwise)."""
    if not self.rl.updates_per_step or self.trained_steps or not self.steps:
      return ""
    return _line(
        f"the run trained no sample in {self.steps} RL steps; last: {self.last_reason}", 500
    )
