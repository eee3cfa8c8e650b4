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


def _line(text: str, limit: int = 300) -> str:
  text = " ".join(str(text).split())
  return text if len(text) <= limit else text[:limit - 3] + "..."


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
    cause = next((f.message for a in truncated for f in a.faults
                  if f.kind == FaultKind.TRUNCATION), "")
    return (f"every trajectory was truncated ({len(truncated)}; first: {_line(cause, 120)}), "
            f"so every group scored alike ({dropped} dropped by rl.zero_variance_filter); "
            "raise env.max_tokens or env.max_turns")
  if dropped:
    return (f"every group's advantages were 0 ({dropped} groups dropped by "
            "rl.zero_variance_filter): the policy's samples of each task scored alike")
  return "no sample was left to train on"


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
    self.window = collections.deque((tuple(w) for w in state.get("window", ())),
                                    maxlen=rl.masked_window)

  def state(self) -> dict:
    """JSON counters: the run's summary keeps them (resumes go on from them)."""
    return {"steps": self.steps, "trained_steps": self.trained_steps,
            "idle_steps": self.idle_steps, "idle_since": self.idle_since,
            "last_reason": self.last_reason, "solved_steps": self.solved_steps,
            "window": [list(w) for w in self.window]}

  def observe(self, step: int, tree, batch_metrics: dict, *, success: Optional[float] = None,
              last: bool = False) -> tuple[str, str]:
    """(warning, halt reason) of RL step `step` ('' for none); `success`: the step's
    `rollout/success` (1.0: every ended sample succeeded); `last`: the run's last
    step, where a masked window not yet full is judged too."""
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
        self.last_reason = ("every sample succeeded, so every group's rewards were alike "
                            "(nothing left to learn from these tasks)")
        if self.solved_steps == 1:  # once per run of such steps
          warning = (f"step {step} trained no sample: {self.last_reason}; not counted by "
                     "rl.halt_if_idle_steps")
      else:
        self.solved_steps = 0
        self.idle_since = self.idle_since if self.idle_steps else step
        self.idle_steps += 1
        self.last_reason = idle_reason(tree, batch_metrics)
        warning = f"step {step} trained no sample: {self.last_reason}"
        k = self.rl.halt_if_idle_steps
        if k and self.idle_steps >= k:
          halt = (f"rl.halt_if_idle_steps={k}: no sample trained in {self.idle_steps} "
                  f"consecutive steps ({self.idle_since}-{step}); last: {self.last_reason}")
    limit = self.rl.max_masked_fraction
    if not halt and limit < 1.0 and (last or len(self.window) == self.window.maxlen):
      m, n = sum(w[1] for w in self.window), sum(w[2] for w in self.window)
      if n and m / n > limit:
        fault = next((w[3] for w in self.window if w[3]), "none recorded")
        halt = (f"rl.max_masked_fraction={limit:g}: {m} of {n} joint actions "
                f"({m / n:.0%}) were masked in steps {self.window[0][0]}-{step}; first fault: "
                f"{fault}")
    return _line(warning, 500), _line(halt, 500)

  def final(self) -> str:
    """The end-of-run line of a run whose RL steps (all of them, resumes included)
    trained nothing ('' otherwise)."""
    if not self.rl.updates_per_step or self.trained_steps or not self.steps:
      return ""
    return _line(f"the run trained no sample in {self.steps} RL steps; last: "
                 f"{self.last_reason}", 500)
