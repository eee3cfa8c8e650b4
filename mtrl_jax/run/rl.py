"""ENVGRPO / ENVGSPO: optional SFT warm-up, then tree rollouts -> pack -> train step.

`run(config, workdir)` is the whole training job; `experiments/train.py` calls
its two halves, `experiment.start` (join the processes, validate: once, before
compute) and `train(exp, config, workdir)`:

  join the processes, validate the experiment (fails before compute)
  resume from workdir/ckpt if a checkpoint exists, else SFT warm-up (optional)
  for each RL step:
    tasks from a seeded, resumable stream -> one environment per root
    tree expansion on the rollout engine (decode slots whose KV cache persists;
      env steps on a thread pool, no level barrier); with rl.max_staleness=1 the
      next step's rollout runs during this step's update (`run.rollouts`)
    returns / advantages -> fixed-shape batch (`rollout.batching`: zero-variance
      groups dropped; tree-packed, every token once, or one row per action)
    train step (GRPO / GSPO / REINFORCE, KL to the frozen reference)
    optional SFT step on golden conversations (`sft.mix_every`, `warmup.SFTMix`)
    metrics.jsonl + TensorBoard, rollout dumps, checkpoints,
    held-out evaluation every k steps with keep-best under workdir/best

The per-step RNG key is `fold_in(PRNGKey(seed), step)` and the run's state
(`run.run_state.RunState`: train state, reference, behaviour parameters,
task stream, SFT mix) is checkpointed whole, so a run killed at any point
resumes exactly (docs/design.md invariant 6).

Several processes (`config.distributed`, docs/multihost.md): every process
runs this same loop; each takes its `distributed.share` of the step's roots
and runs their environments, the engine and train step run on global arrays
(`DecodeEngine`, `rollout.batching.global_batch`), the finalized trees are merged
for metrics and the dump (`rollout.gather`), and process 0 alone writes files.
Checkpoints are saved and restored by every process.

`train` reads top to bottom: build the run's parts, resume or start (warm-up,
precompile, the step-0 evaluation), the RL loop, the end (summary.json, curves).
One RL step is `_Loop.step`: rollout, update, its metrics row, held-out
evaluation, the learning watch and the checkpoint; what the run records (each
step's metrics row, the run's summary) gathers in `run.run_record.RunRecord`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time

import jax
import ml_collections

from mtrl_jax import checkpoint, distributed, storage
from mtrl_jax import metrics as metrics_lib
from mtrl_jax.rollout import dump as dump_lib
from mtrl_jax.rollout.gather import gather_tree
from mtrl_jax.run import components as components_lib
from mtrl_jax.run import evaluate as eval_lib
from mtrl_jax.run import experiment as exp_lib
from mtrl_jax.run import saved, warmup
from mtrl_jax.run import shapes as shapes_lib
from mtrl_jax.run.console import Console, eval_score
from mtrl_jax.run.rollouts import Rollout, RolloutProducer, render_totals, text_counts
from mtrl_jax.run.run_record import RunRecord, across_processes
from mtrl_jax.run.run_state import RunState
from mtrl_jax.run.watch import LearningWatch


def held_out(parts: components_lib.Components, params, step: int) -> dict:
  """`eval/<mode>/<metric>` of the first `eval.num_tasks` held-out tasks (`params`: the
  policy's, or a list with one per agent)."""
  tasks = eval_lib.indexed(parts.eval_tasks, parts.exp.eval.num_tasks)
  key = jax.random.fold_in(parts.key, 10_000_000 + step)
  out = {}
  for mode, greedy in parts.exp.eval.modes:
    res = parts.evaluator(params, tasks, greedy=greedy, key=key)
    out.update({f"eval/{mode}/{k}": v for k, v in res.items()})
  return out


def run(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Runs (or resumes) a training job in `workdir`; returns a summary dict."""
  return train(exp_lib.start(config), config, workdir, progress=progress)


def train(
    exp: exp_lib.Experiment,
    config: ml_collections.ConfigDict,
    workdir: str,
    *,
    progress: bool = True,
) -> dict:
  """Runs (or resumes) the job of `exp`, validated from `config` by `experiment.start`
  (config.json keeps `config`); returns a summary dict.

  The process that writes files holds `workdir`'s lock (`storage.WorkdirLock`) until
  it returns or raises: a second run of the workdir is refused (`ConfigError` naming
  the holder's pid) before it reads or writes anything there.
  """
  launched = time.perf_counter()  # time/first_step counts from here
  with _workdir_held(workdir), contextlib.ExitStack() as closing:
    writes = distributed.is_writer()  # process 0 alone writes files
    saved.check_resume(config, workdir)  # another run's workdir: refused before any compute
    if writes:
      saved.save_config(config, workdir)
    parts = components_lib.build(exp)
    closing.callback(parts.workers.close)  # the run's environment workers, after its rollouts
    if writes:
      print(exp_lib.describe(exp), flush=True)
    mix = warmup.SFTMix(parts) if exp.sft.mix_every else None
    stream = components_lib.make_train_stream(exp, parts.train_tasks)
    run_state = RunState.of(exp, parts.policies, stream, mix, critic_model=parts.critic)
    # With several processes Orbax's background commit runs collectives of its own,
    # which must not interleave with the engine's lockstep calls: saves block there.
    ckpt = checkpoint.Checkpointer(
        workdir, keep=exp.checkpoint.keep, async_save=distributed.process_count() == 1
    )
    closing.callback(_close_on_the_way_out, ckpt)  # every way out; then a no-op
    record = RunRecord(workdir)

    # ---- start: resume the latest checkpoint, or initialise (with SFT warm-up, the
    # train-step programs compiling meanwhile on a thread of their own)
    resumed, start = _resume(ckpt, run_state, record, workdir)
    console = Console(writes, record.summary.get("eval_history"))
    train_compile = _start_train_compile(parts, console, closing)  # None: compiles lazily
    if resumed:
      console.say(f"resumed from {workdir}/ckpt at step {start}")
    else:
      run_state.start(_first_state(parts, console, record))
    writer = (
        metrics_lib.MetricsWriter(workdir, resume_step=start if resumed else None)
        if writes
        else metrics_lib.NullWriter()
    )
    if exp.rl.precompile:
      record.precompiled(_precompile(parts, run_state, mix, console, train_compile))
    producer = RolloutProducer(parts, stream, critic_state=lambda: run_state.critic)
    closing.callback(producer.close)  # an in-flight rollout ends before the checkpointer
    watch = LearningWatch(exp.rl, record.summary.get("learning"))  # a resume's counters go on
    record.learning(watch)
    dump_dir = workdir if writes else ""  # process 0 alone writes rollout dumps
    loop = _Loop(
        parts, run_state, producer, ckpt, writer, watch, console, record, launched, dump_dir
    )
    if not resumed:
      loop.evaluate_start()
    # Warm-up ends here: the step-0 evaluation and checkpoint compile their
    # one-time helpers (Orbax slices each array it saves once per shape).
    parts.census.mark_warm()
    console.rl_start(start + 1, exp.rl.steps, exp.eval.every, exp.rl.precompile)
    console.open_bar(exp.rl.steps, start, progress)

    # ---- the RL loop: rollout -> batch -> update -> metrics, eval, checkpoint
    step = start
    for step in range(start + 1, exp.rl.steps + 1):
      if loop.step(step, first=step == start + 1):
        break  # halted
    if watch.final():  # every RL step of the run (resumes included) trained nothing
      ckpt.wait()  # the last save's summary stays as it was
      console.say(record.trained_nothing(watch.final()))

    # ---- end: flush, summary.json and curves.png
    producer.close()
    console.close_bar()
    writer.close()
    ckpt.wait()
    record.finish(ckpt.best(), parts.census.counts())
    if writes:
      record.write(workdir)
    ckpt.close()
    halted = "halted" in record.summary
    console.end(
        start + 1, step, time.perf_counter() - launched, record.summary["workdir"], halted=halted
    )
    return record.summary


@contextlib.contextmanager
def _workdir_held(workdir: str):
  """Holds `workdir`'s lock in the process that writes files (process 0; the others
  hold nothing): a held lock is refused as a `ConfigError`."""
  if not distributed.is_writer():  # process 0 alone writes files, and locks
    yield
    return
  try:
    lock = storage.WorkdirLock(workdir)
  except storage.WorkdirBusy as e:
    raise exp_lib.ConfigError(str(e)) from None
  with lock:
    yield


def _close_on_the_way_out(ckpt: checkpoint.Checkpointer) -> None:
  """Closes `ckpt` when the run leaves through an exception (Ctrl-C, a fault): a save in
  flight finishes and Orbax's threads end, so the process exits at once with every
  checkpoint it wrote complete. A failed save was reported, or the exception leaving
  is the one to show."""
  try:
    ckpt.close()
  except checkpoint.CheckpointError:
    pass


def _resume(ckpt: checkpoint.Checkpointer, run_state: RunState, record: RunRecord, workdir):
  """Restores the newest checkpoint that reads back (a warning line names each one
  skipped) into `run_state`, and its summary into `record`: (True, its step), or
  (False, 0) when there is none."""
  try:
    latest = ckpt.restore_latest(run_state.target())
  except checkpoint.CheckpointError as e:
    raise exp_lib.ConfigError(
        f"{e}; allowed: repair them, or move {workdir}/ckpt away to start afresh"
    ) from None
  if latest is None:
    return False, 0
  start, restored, meta = latest
  run_state.restore(restored, meta)
  record.resumed(meta)
  return True, start


def _first_state(parts: components_lib.Components, console: Console, record: RunRecord):
  """A fresh run's first train state: the SFT warm-up's (its lines on the console, its
  history in the summary) or, without one, the initial state."""
  sft = parts.exp.sft
  if not sft.steps:
    return parts.policies.init_state()
  t0 = time.time()
  console.sft_start(sft)
  state, history = warmup.warm_up(parts, lambda row: console.sft_row(row, sft.steps))
  console.sft_end(history, sft)
  record.warmed_up(history, time.time() - t0)
  return state


def _start_train_compile(
    parts: components_lib.Components, console: Console, closing: contextlib.ExitStack
):
  """With `rl.precompile`, the train-step programs compiling from now on, on a thread of
  their own (`shapes.TrainCompile`), cancelled if the run leaves early."""
  if not parts.exp.rl.precompile:
    return None
  compiling = shapes_lib.TrainCompile(
      parts.shapes, parts.policies.trained_steps(), critic=parts.critic, progress=console.compiled
  )
  closing.callback(compiling.cancel)
  return compiling


def _precompile(
    parts: components_lib.Components, run_state: RunState, mix, console, train_compile
) -> dict:
  """Compiles the engine's programs and the SFT mix step's, and waits for the
  train-step programs (`train_compile`, a `shapes.TrainCompile` started before the
  warm-up); returns the counts and seconds of both."""
  engines, _ = parts.compile_targets(run_state.state.params)
  info = shapes_lib.precompile_engines(parts.shapes, engines, progress=console.compiled)
  if mix is not None:
    mix.precompile(parts.exp.sft.batch_size)
  return {**info, **train_compile.wait()}


@dataclasses.dataclass
class _Loop:
  """The long-lived parts an RL step uses (`train` builds them) and the step itself:
  rollout -> update -> its metrics row -> evaluation and checkpoint."""

  parts: components_lib.Components
  run_state: RunState  # with the task stream and the SFT mix (`warmup.SFTMix`, or None)
  producer: RolloutProducer
  ckpt: checkpoint.Checkpointer
  writer: object  # `metrics.MetricsWriter` (process 0) or `metrics.NullWriter`
  watch: LearningWatch
  console: Console
  record: RunRecord
  launched: float  # `perf_counter()` at the start of `train`: time/first_step
  dump_dir: str  # where this process writes rollout dumps ('': none)

  @property
  def exp(self) -> exp_lib.Experiment:
    return self.parts.exp

  def step(self, step: int, first: bool) -> str:
    """RL step `step` (`first`: the first of this start or resume); returns why the run
    halts after it ('' to go on)."""
    exp, record = self.exp, self.record
    timer = metrics_lib.StepTimer()
    rollout, waited = self._rollout(step, timer)
    tree = gather_tree(rollout.tree)  # every process's roots, for metrics and the dump
    train_m = self._update(step, rollout, timer)
    first_step = time.perf_counter() - self.launched if first else None
    if exp.rl.ref_reset_every and step % exp.rl.ref_reset_every == 0:
      self.run_state.reset_ref()
    record.begin(tree, rollout, train_m, self.parts.census.counts(), exp.eval.success_threshold)
    if exp.curriculum.enabled:  # may move the level of the next step's tasks
      record.add(self.run_state.stream.observe(record.metrics["rollout/success"]))
    if self.dump_dir and exp.rl.dump_every and step % exp.rl.dump_every == 0:
      dump_lib.write_rollout_dump(
          tree, dump_lib.dump_path(self.dump_dir, step), self.parts.transition.decoders
      )
    if step % exp.eval.every == 0 or step == exp.rl.steps:
      with timer.section("eval"):
        self.producer.wait()  # the next rollout's renderer counts stay its own
        before = render_totals(self.parts.transition.renderers)
        record.add(self.evaluate(step))
        record.add_text(text_counts(self.parts.transition.renderers, before))
    # time/rollout, time/train, time/eval
    m = record.end_step(timer.split(), waited, first_step, rollout.engine_metrics)
    self.writer.write(step, m)
    return self._watch_and_save(step, tree, rollout.batch_metrics, m)

  def _rollout(self, step: int, timer) -> tuple[Rollout, float]:
    """The step's rollout (time/rollout) and the seconds the loop waited for it; with
    rollouts one step ahead, the next step's rollout then starts, to sample during this
    step's update."""
    producer, run_state = self.producer, self.run_state
    with timer.section("rollout"):
      if not producer.pending:  # on time, or the first step after a start or a resume
        if run_state.behaviour is None:
          producer.submit(step, run_state.state.params, version=step - 1)
        else:
          producer.submit(step, run_state.behaviour, version=max(step - 2, 0))
      rollout, waited = producer.result()
    if producer.ahead:  # the next rollout samples during the update, with its parameters
      run_state.next_rollout_ahead()
      if step < self.exp.rl.steps:
        producer.submit(step + 1, run_state.behaviour, version=step - 1)
    return rollout, waited

  def _update(self, step: int, rollout: Rollout, timer) -> dict:
    """The step's updates (time/train): `rl.updates_per_step` policy updates on the
    batch, a separate critic's own, and an SFT mix step when due; returns their metrics."""
    exp, run_state, parts = self.exp, self.run_state, self.parts
    train_step, batch, train_m = parts.policies.train_step, rollout.batch, {}
    with timer.section("train"):
      if batch is not None and exp.rl.updates_per_step:
        if train_step.objective.recompute_old:  # pi_old before the first update
          batch = train_step.old_logprobs(run_state.state.params, batch)
        for _ in range(exp.rl.updates_per_step):
          run_state.state, dm = train_step(run_state.state, run_state.ref, batch)
        train_m = parts.policies.train_metrics(dm)
        if rollout.critic_batch is not None:  # a separate critic's own updates
          run_state.critic, critic_m = parts.critic.update(run_state.critic, rollout.critic_batch)
          train_m.update(critic_m)
      if run_state.mix is not None and run_state.mix.due(step):
        run_state.state, mix_m = run_state.mix(run_state.state)
        train_m.update({f"sft_mix/{k}": mix_m[k] for k in ("nll", "grad_norm", "tokens")})
    return train_m

  def _watch_and_save(self, step: int, tree, batch_m: dict, m: dict) -> str:
    """The learning watch's verdict on the step (its warnings on the console), then the
    checkpoint when due; returns why the run halts ('' to go on)."""
    last = step == self.exp.rl.steps
    warning, halt = self.watch.observe(
        step, tree, batch_m, success=m.get("rollout/success"), metrics=m, last=last
    )
    self.record.learning(self.watch)
    for line in warning.splitlines():  # one line per warning
      self.console.say(f"warning: {line}")
    self.ckpt.check()  # a background save that failed (a full disk) ends the run at the next step
    if step % self.exp.checkpoint.every == 0 or last or halt:
      self.save(step)  # a halted run's last step is saved too
    if halt:  # once the save has written its copy of the summary: a resume is not halted
      self.ckpt.wait()
      self.console.say(f"halted at {self.record.halted(step, halt)}")
    self.console.step_done(m)
    return halt

  def evaluate(self, step: int) -> dict:
    """Held-out evaluation at `step`: a scored one may be the best checkpoint and joins
    the summary's history; its console line; returns its metrics."""
    self.producer.wait()  # an in-flight rollout shares the engine
    policies, state = self.parts.policies, self.run_state.state
    m = held_out(self.parts, policies.sampler_states(state.params), step)
    score = eval_score(m)
    if score is not None:
      self.ckpt.maybe_save_best(step, score, policies.to_saved(state), meta={"eval": m})
      self.record.evaluated(step, m)
    self.console.evaluated(step, m)
    return m

  def evaluate_start(self) -> None:
    """A fresh run's step 0: held-out evaluation of the first state (its metrics row and
    the summary's `eval_start`), then its checkpoint."""
    renderers = self.parts.transition.renderers
    before = render_totals(renderers)
    m = self.evaluate(0)
    m.update(across_processes(text_counts(renderers, before), {}))
    self.writer.write(0, m)
    self.record.started(m)
    self.save(0)

  def save(self, step: int) -> None:
    tree, meta = self.run_state.checkpoint_tree(in_flight=self.producer.pending)
    self.ckpt.save(step, tree, meta={**meta, "summary": self.record.summary})
