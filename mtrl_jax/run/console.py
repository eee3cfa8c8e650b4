"""What a training run says on the console: one line per phase, on process 0 only.

`rl.train` prints through a `Console`; the lines go to stderr (above the
progress bar when there is one), a few per phase, as each starts, goes on and ends
(a resumed run first says `resumed from <workdir>/ckpt at step N`):

  sft: up to 200 steps of 8 rows from 64 golden conversations; stops early once greedy
    success on 100 held-back train tasks reaches 0.3 (checked every 25 steps)
  sft: step 25/200 nll 1.204 check_success 0.12 (14 s)
  sft: stopped at step 75 of 200: check_success 0.31 >= 0.3 (41 s)
  compiling 24 engine programs
  compiled 24/24 engine programs (52 s)
  compiling 18 train-step programs
  compiled 3/18 train-step programs (41 s)
  eval at step 0: greedy success 0.33 return -0.12 turns 3.1 | best success 0.33 at step 0
  rl: steps 1-130, held-out evaluation every 10 steps
  done: 130 RL steps (1-130) in 8 min 12 s; best eval success 0.80 at step 120; files in ...

Warnings and halts (`run.watch`) go through the same `say`. With
`--progress=false` (`experiments/train.py`) the bar is off but these lines
stay: they are few. The bar's postfix names what it shows: `root_return`
(`rollout/return`) and `train_success` (`rollout/path_success`) of the step's
training rollouts (docs/metrics.md), not the held-out evaluation's.
The `format_*` functions build the lines from plain values, so they are tested
without a run.
"""

from __future__ import annotations

import math
import sys
import threading
import time
from typing import Callable, Mapping, Optional, Sequence


def duration(seconds: float) -> str:
  """'41 s', '8 min 12 s', '1 h 3 min'."""
  s = int(round(seconds))
  if s < 60:
    return f"{s} s"
  if s < 3600:
    return f"{s // 60} min {s % 60} s"
  return f"{s // 3600} h {s % 3600 // 60} min"


def _num(value, digits: int = 2) -> str:
  try:
    value = float(value)
  except (TypeError, ValueError):
    return "n/a"
  return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def format_sft_start(sft) -> str:
  """The warm-up's first line: its size and its stop rule (`SFTConfig` fields)."""
  line = (
      f"sft: up to {sft.steps} steps of {sft.batch_size} rows from {sft.num_examples} "
      "golden conversations; "
  )
  if sft.until_success > 0 and sft.check_tasks:
    return line + (
        f"stops early once greedy success on {sft.check_tasks} held-back train "
        f"tasks reaches {sft.until_success:g} (checked every {sft.check_every} "
        "steps)"
    )
  return line + "no early stop"


def format_sft_row(row: Mapping, steps: int, seconds: float) -> str:
  """A warm-up progress line from a history row (`sft_step`, `nll`, `check_success`)."""
  line = f"sft: step {row['sft_step']}/{steps} nll {_num(row.get('nll'), 3)}"
  if "check_success" in row:
    line += f" check_success {_num(row['check_success'])}"
  return f"{line} ({duration(seconds)})"


def format_sft_end(
    history: Sequence[Mapping], steps: int, until_success: float, seconds: float
) -> str:
  """The warm-up's last line: where it stopped, why, and its last loss."""
  if not history:
    return f"sft: done, no step run ({duration(seconds)})"
  last = history[-1]
  done = last["sft_step"]
  if done < steps:  # the early stop
    why = f"check_success {_num(last.get('check_success'))} >= {until_success:g}"
    return f"sft: stopped at step {done} of {steps}: {why} ({duration(seconds)})"
  line = f"sft: done, {done} steps in {duration(seconds)}, nll {_num(last.get('nll'), 3)}"
  if "check_success" in last:
    below = "<" if last["check_success"] < until_success else ">="
    line += f", check_success {_num(last['check_success'])} ({below} {until_success:g})"
  return line


def format_compiled(kind: str, done: int, total: int, seconds: float) -> str:
  """'compiling 18 train-step programs' (done 0), else 'compiled 3/18 ... (41 s)'."""
  if done == 0:
    return f"compiling {total} {kind} programs"
  return f"compiled {done}/{total} {kind} programs ({duration(seconds)})"


def eval_score(metrics: Mapping) -> Optional[float]:
  """The success keep-best ranks evaluations by: greedy's, else sampled's (None: neither)."""
  return metrics.get("eval/greedy/success", metrics.get("eval/sampled/success"))


def format_eval(step: int, metrics: Mapping, best: Optional[tuple[float, int]]) -> str:
  """One held-out evaluation: success, return and turns per mode (`eval/<mode>/*`),
  and the best success so far as (success, step)."""
  modes = [k.split("/")[1] for k in metrics if k.startswith("eval/") and k.endswith("/success")]
  parts = [
      f"{mode} success {_num(metrics[f'eval/{mode}/success'])} return "
      f"{_num(metrics.get(f'eval/{mode}/return'))} turns "
      f"{_num(metrics.get(f'eval/{mode}/turns'), 1)}"
      for mode in modes
  ]
  line = f"eval at step {step}: " + ("; ".join(parts) or "no metrics")
  if best is not None:
    line += f" | best success {_num(best[0])} at step {best[1]}"
  return line


def format_postfix(metrics: Mapping) -> dict[str, str]:
  """The progress bar's postfix: the step's training rollouts (docs/metrics.md)."""
  return {
      "root_return": _num(metrics.get("rollout/return")),
      "train_success": _num(metrics.get("rollout/path_success")),
  }


def format_rl_start(first: int, last: int, eval_every: int, precompiled: bool) -> str:
  """The RL loop's first line: its steps, the evaluation cadence, and when it compiles."""
  if first > last:
    return f"rl: nothing left to run (step {last} of {last} done)"
  line = f"rl: steps {first}-{last}, held-out evaluation every {eval_every} steps"
  return line if precompiled else line + "; programs compile on first use"


def format_end(
    first: int,
    last: int,
    seconds: float,
    best: Optional[tuple[float, int]],
    workdir: str,
    halted: bool = False,
) -> str:
  """The run's last line: steps run, best held-out success and its step, time (from the
  start of `rl.train`), files."""
  ran = last - first + 1
  line = f"done: {ran} RL steps ({first}-{last})" if ran > 0 else "done: no RL step run"
  line += f" in {duration(seconds)}"
  if halted:
    line += f", halted at step {last}"
  if best is not None:
    line += f"; best eval success {_num(best[0])} at step {best[1]}"
  return f"{line}; files in {workdir} (summary.json, metrics.jsonl, curves.png, ckpt/, best/)"


class Console:
  """The run's console lines and progress bar (silent where `enabled` is False: not
  process 0).

  Args:
    enabled: this process writes (process 0).
    history: the run's `eval_history` so far (a resumed run's best goes on).
    stream: where lines go (default stderr, looked up at each line).
    clock: seconds, for the compile and warm-up timings.
    every_s: the least seconds between two compile-progress lines of one kind.
  """

  def __init__(
      self,
      enabled: bool,
      history: Sequence[Mapping] = (),
      stream=None,
      clock: Callable[[], float] = time.perf_counter,
      every_s: float = 15.0,
  ):
    self.enabled, self.stream, self.clock, self.every_s = enabled, stream, clock, every_s
    self.bar = None
    self.best: Optional[tuple[float, int]] = None
    for row in history or ():
      self._keep_best(row["step"], row)
    self._compile: dict[str, tuple[float, float]] = {}  # kind -> (start, last line)
    self._sft_t0, self._sft_tenth = 0.0, 0
    self._lock = threading.Lock()

  def say(self, line: str):
    """One line on the console (above the progress bar), process 0 only; whole, when
    several threads say lines (the train-step programs compile on one of their own)."""
    if not self.enabled:
      return
    out = self.stream or sys.stderr
    with self._lock:
      if self.bar is not None:
        self.bar.write(line, file=out)
      else:
        out.write(line + "\n")
        out.flush()

  # ---- phases
  def sft_start(self, sft):
    self._sft_t0, self._sft_tenth = self.clock(), 0
    self.say(format_sft_start(sft))

  def sft_row(self, row: Mapping, steps: int):
    """A warm-up history row: printed when it crosses a tenth of the steps (or is the last)."""
    i = row["sft_step"]
    tenth = i * 10 // max(steps, 1)
    if tenth > self._sft_tenth or i == steps:
      self._sft_tenth = tenth
      self.say(format_sft_row(row, steps, self.clock() - self._sft_t0))

  def sft_end(self, history: Sequence[Mapping], sft):
    self.say(format_sft_end(history, sft.steps, sft.until_success, self.clock() - self._sft_t0))

  def compiled(self, kind: str, done: int, total: int):
    """Compile progress (`run.shapes.precompile`'s `progress`): a line as a kind
    starts, as it ends, and in between at most every `every_s` seconds."""
    now = self.clock()
    if done == 0:
      self._compile[kind] = (now, now)
      self.say(format_compiled(kind, 0, total, 0.0))
      return
    start, last = self._compile.get(kind, (now, now))
    if done >= total or now - last >= self.every_s:
      self._compile[kind] = (start, now)
      self.say(format_compiled(kind, done, total, now - start))

  def _keep_best(self, step: int, metrics: Mapping):
    score = eval_score(metrics)
    if score is not None and (self.best is None or score > self.best[0]):
      self.best = (float(score), step)

  def evaluated(self, step: int, metrics: Mapping):
    """A held-out evaluation's line, with the best success so far (none when nothing
    was evaluated: `eval.num_tasks=0`)."""
    if not metrics:
      return
    self._keep_best(step, metrics)
    self.say(format_eval(step, metrics, self.best))

  def rl_start(self, first: int, last: int, eval_every: int, precompiled: bool):
    self.say(format_rl_start(first, last, eval_every, precompiled))

  def end(self, first: int, last: int, seconds: float, workdir: str, halted: bool = False):
    """The run's summary line, with the best evaluation this run has seen (resumes too)."""
    self.say(format_end(first, last, seconds, self.best, workdir, halted))

  # ---- the progress bar
  def open_bar(self, total: int, initial: int, progress: bool):
    """The RL progress bar (tqdm), where `progress` and this process writes."""
    if progress and self.enabled:
      from tqdm import tqdm

      self.bar = tqdm(total=total, initial=initial, desc="RL", dynamic_ncols=True)

  def step_done(self, metrics: Mapping):
    """Advances the bar by one RL step, its postfix the step's training rollouts."""
    if self.bar is not None:
      self.bar.set_postfix(format_postfix(metrics), refresh=False)
      self.bar.update(1)

  def close_bar(self):
    if self.bar is not None:
      self.bar.close()
      self.bar = None
