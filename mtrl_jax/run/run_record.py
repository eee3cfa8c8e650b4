"""What an RL run records: each step's metrics row and the run's summary.

`RunRecord` holds the run's summary (summary.json at the end, and the copy every
checkpoint keeps, so a resumed run carries it on) and gathers one step's row of
metrics.jsonl in the order the loop (`run.rl`) learns it:

  begin     the finalized tree and its rollout statistics, the batch, the update,
            the compile census and the rollout's staleness (and the run's fault
            totals in the summary);
  add       what the step adds later: the curriculum's level, a held-out
            evaluation (`add_text`: the text counters the evaluation counted);
  end_step  the step's text counters, wall times (`metrics.StepTimer`) and
            engine counts, summed, maxed or averaged over processes
            (`across_processes`): the row to write.

The summary's other keys come from the run's milestones: the SFT warm-up, the
precompile, the learning watch, each held-out evaluation with a score, a halt,
a run that trained nothing, and at the end the best checkpoint and compile counts.
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from mtrl_jax import checkpoint, distributed, storage
from mtrl_jax import metrics as metrics_lib
from mtrl_jax.rollout.stats import add_fault_totals, rollout_metrics


def add_counts(a: dict, b: dict) -> dict:
  out = {k: a.get(k, 0) + b.get(k, 0) for k in set(a) | set(b) if not k.endswith("_rate")}
  out["text/retokenize_mismatch_rate"] = out.get("text/retokenize_mismatches", 0) / max(
      out.get("text/completions_checked", 0), 1
  )
  return out


def across_processes(text: dict, times: dict, engine: dict = None) -> dict:
  """This step's text counters and engine token counts summed, engine ratios averaged
  and wall times maxed over processes (the identity with one process); compile counts
  stay per process."""
  engine = engine or {}
  if distributed.process_count() == 1:
    return {**text, **times, **engine}
  parts = distributed.allgather((text, times, engine))
  out = {k: sum(t.get(k, 0) for t, _, _ in parts) for k in text}
  for k in engine:
    vals = [e[k] for _, _, e in parts]
    out[k] = sum(vals) if k.endswith(("tokens", "evictions")) else sum(vals) / len(vals)
  out["text/retokenize_mismatch_rate"] = out.get("text/retokenize_mismatches", 0) / max(
      out.get("text/completions_checked", 0), 1
  )
  out.update({k: max(tm[k] for _, tm, _ in parts) for k in times})
  return out


class RunRecord:
  """The run's summary (`summary`) and the metrics of the step being recorded
  (`metrics`); see the module docstring."""

  def __init__(self, workdir: str):
    self.summary: dict[str, Any] = {"workdir": os.path.abspath(workdir)}
    self.metrics: dict[str, Any] = {}
    self._text: dict = {}  # the step's text counters

  # ---- the run's milestones (summary keys)

  def resumed(self, meta: dict) -> None:
    """Carries on the summary a checkpoint kept (its `meta`)."""
    self.summary.update(meta.get("summary", {}))

  def warmed_up(self, history: list[dict], seconds: float) -> None:
    """The SFT warm-up's history rows and wall time."""
    self.summary.update(
        sft_history=history,
        sft_steps_run=history[-1]["sft_step"] if history else 0,
        sft_seconds=round(seconds, 1),
    )

  def precompiled(self, info) -> None:
    self.summary["precompile"] = info

  def learning(self, watch) -> None:
    """The learning watch's counters (`run.watch.LearningWatch.state`)."""
    self.summary["learning"] = watch.state()

  def evaluated(self, step: int, m: dict) -> None:
    """A held-out evaluation with a score (`m`: its metrics) joins the history."""
    self.summary.setdefault("eval_history", []).append({"step": step, **m})

  def started(self, m: dict) -> None:
    """A fresh run's step-0 evaluation (`m`: its metrics row)."""
    self.summary["eval_start"] = m

  def halted(self, step: int, why: str) -> str:
    """The run halts after `step`; returns the summary's line for it."""
    self.summary["halted"] = f"step {step}: {why}"
    return self.summary["halted"]

  def trained_nothing(self, line: str) -> str:
    self.summary["trained_nothing"] = line
    return line

  def finish(self, best, compiles: dict) -> None:
    """The end of the run: the best checkpoint (`Checkpointer.best`) and compile counts."""
    self.summary.update(best=best, compiles=compiles)

  def write(self, workdir: str) -> None:
    """summary.json and curves.png in `workdir`. summary.json is replaced whole (written
    beside it, then renamed); a file that cannot be written (a full disk) is one warning
    line and the other is still tried: the checkpoints, already complete, keep the
    summary's copy."""
    path = os.path.join(workdir, "summary.json")
    try:
      storage.replace_text(path, json.dumps(self.summary, indent=1, default=float))
    except OSError as e:
      _not_written(path, e)
    png = os.path.join(workdir, "curves.png")
    try:
      metrics_lib.plot_metrics(workdir, out_png=png)
    except OSError as e:
      _not_written(png, e)

  # ---- one step's metrics row

  def begin(
      self, tree, rollout, train_m: dict, census: dict, success_threshold: Optional[float]
  ) -> None:
    """Starts the row of a step: `tree` (every process's finalized roots), `rollout`
    (`run.rollouts.Rollout`: its batch metrics, staleness and text counters), the
    update's metrics `train_m` and the compile census's `census`."""
    self.metrics = {
        **tree.metrics(),
        **rollout_metrics(tree, success_threshold),
        **rollout.batch_metrics,
        **train_m,
        **census,
        "rollout/staleness": float(rollout.staleness),
    }
    self.summary["faults"] = add_fault_totals(self.summary.get("faults"), tree)  # per kind
    self._text = rollout.text_counts  # the rollout's own, counted while it ran

  def add(self, m: dict) -> None:
    self.metrics.update(m)

  def add_text(self, counts: dict) -> None:
    """Text counters counted after the rollout (a held-out evaluation's)."""
    self._text = add_counts(self._text, counts)

  def end_step(self, times: dict, waited: float, first_step: Optional[float], engine: dict):
    """Ends the row and returns it. `times`: the step's `StepTimer.split()`; `waited`:
    seconds the loop waited for the rollout; `first_step`: seconds from the start of
    `rl.train` to the end of the first update (the first step only, else None);
    `engine`: the rollout engine's metrics (time/ and engine/ keys)."""
    times["time/rollout_wait"] = waited  # the loop waiting for the step's rollout
    if first_step is not None:
      times["time/first_step"] = self.summary["time/first_step"] = first_step
    times.update({k: v for k, v in engine.items() if k.startswith("time/")})
    engine = {k: v for k, v in engine.items() if k.startswith("engine/")}
    self.metrics.update(across_processes(self._text, times, engine))
    return self.metrics


def _not_written(path: str, e: OSError) -> None:
  checkpoint.print_warning(f"{path} was not written: {checkpoint.reason(e)}")
