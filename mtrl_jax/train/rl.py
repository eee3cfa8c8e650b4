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
      next step's rollout runs during this step's update (`train.rollouts`)
    returns / advantages -> fixed-shape batch (`rollout.batching`: zero-variance
      groups dropped; tree-packed, every token once, or one row per action)
    train step (GRPO / GSPO / REINFORCE, KL to the frozen reference)
    optional SFT step on golden conversations (`sft.mix_every`, `sft.SFTMix`)
    metrics.jsonl + TensorBoard, rollout dumps, checkpoints,
    held-out evaluation every k steps with keep-best under workdir/best

The per-step RNG key is `fold_in(PRNGKey(seed), step)` and the run's state
(`train.run_state.RunState`: train state, reference, behaviour parameters,
task stream, SFT mix) is checkpointed whole, so a run killed at any point
resumes exactly (docs/design.md invariant 6).

Several processes (`config.distributed`, docs/multihost.md): every process
runs this same loop; each takes its `distributed.share` of the step's roots
and runs their environments, the engine and train step run on global arrays
(`DecodeEngine`, `rollout.batching.global_batch`), the finalized trees are merged
for metrics and the dump (`rollout.gather`), and process 0 alone writes files.
Checkpoints are saved and restored by every process.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from typing import Any

import jax
import ml_collections

from mtrl_jax import checkpoint, distributed, metrics as metrics_lib, storage
from mtrl_jax.rollout import dump as dump_lib
from mtrl_jax.rollout.gather import gather_tree
from mtrl_jax.rollout.stats import add_fault_totals, rollout_metrics
from mtrl_jax.train import components as components_lib
from mtrl_jax.train.console import Console, eval_score
from mtrl_jax.train import evaluate as eval_lib
from mtrl_jax.train import experiment as exp_lib
from mtrl_jax.train import shapes as shapes_lib
from mtrl_jax.train import saved
from mtrl_jax.train import sft as sft_lib
from mtrl_jax.train.rollouts import RolloutProducer, render_totals, text_counts
from mtrl_jax.train.run_state import RunState
from mtrl_jax.train.watch import LearningWatch


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


def _first_state(parts: components_lib.Components, console: Console, summary: dict):
  """A fresh run's first train state: the SFT warm-up's (its lines on the console, its
  history in `summary`) or, without one, the initial state."""
  sft = parts.exp.sft
  if not sft.steps:
    return parts.policies.init_state()
  t0 = time.time()
  console.sft_start(sft)
  state, history = sft_lib.warm_up(parts, lambda row: console.sft_row(row, sft.steps))
  console.sft_end(history, sft)
  summary.update(
      sft_history=history,
      sft_steps_run=history[-1]["sft_step"] if history else 0,
      sft_seconds=round(time.time() - t0, 1),
  )
  return state


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
  if not distributed.is_writer():  # process 0 alone writes files, and locks
    with contextlib.ExitStack() as closing:
      return _train(exp, config, workdir, launched, progress, closing)
  try:
    lock = storage.WorkdirLock(workdir)
  except storage.WorkdirBusy as e:
    raise exp_lib.ConfigError(str(e)) from None
  with lock, contextlib.ExitStack() as closing:
    return _train(exp, config, workdir, launched, progress, closing)


def _close_on_the_way_out(ckpt: checkpoint.Checkpointer) -> None:
  """Closes `ckpt` when the run leaves through an exception (Ctrl-C, a fault): a save in
  flight finishes and Orbax's threads end, so the process exits at once with every
  checkpoint it wrote complete. A failed save was reported, or the exception leaving
  is the one to show."""
  try:
    ckpt.close()
  except checkpoint.CheckpointError:
    pass


def _train(
    exp: exp_lib.Experiment,
    config: ml_collections.ConfigDict,
    workdir: str,
    launched: float,
    progress: bool,
    closing: contextlib.ExitStack,
) -> dict:
  writes = distributed.is_writer()  # process 0 alone writes files
  saved.check_resume(config, workdir)  # another run's workdir: refused before any compute
  if writes:
    saved.save_config(config, workdir)
  parts = components_lib.build(exp)
  if writes:
    print(exp_lib.describe(exp), flush=True)
  policies, train_step = parts.policies, parts.policies.train_step
  mix = sft_lib.SFTMix(parts) if exp.sft.mix_every else None
  stream = components_lib.make_train_stream(exp, parts.train_tasks)
  run_state = RunState.of(exp, policies, stream, mix, critic_model=parts.critic)
  # With several processes Orbax's background commit runs collectives of its own,
  # which must not interleave with the engine's lockstep calls: saves block there.
  ckpt = checkpoint.Checkpointer(
      workdir, keep=exp.checkpoint.keep, async_save=distributed.process_count() == 1
  )
  closing.callback(_close_on_the_way_out, ckpt)  # every way out; then a no-op
  summary: dict[str, Any] = {"workdir": os.path.abspath(workdir)}

  # ---- start: resume the latest checkpoint, or initialise (with SFT warm-up)
  try:  # the newest checkpoint that reads back (a warning line names each one skipped)
    latest = ckpt.restore_latest(run_state.target())
  except checkpoint.CheckpointError as e:
    raise exp_lib.ConfigError(
        f"{e}; allowed: repair them, or move {workdir}/ckpt away to start afresh"
    ) from None
  resumed = latest is not None
  if resumed:
    start, restored, meta = latest
    run_state.restore(restored, meta)
    summary.update(meta.get("summary", {}))
  console = Console(writes, summary.get("eval_history"))
  say = console.say  # one line on the console (above the progress bar), process 0 only
  if resumed:
    say(f"resumed from {workdir}/ckpt at step {start}")
  else:
    start = 0
    run_state.start(_first_state(parts, console, summary))

  def save(step):
    tree, meta = run_state.checkpoint_tree(in_flight=producer.pending)
    ckpt.save(step, tree, meta={**meta, "summary": summary})

  def evaluate(step) -> dict:
    producer.wait()  # an in-flight rollout shares the engine
    m = held_out(parts, policies.sampler_states(run_state.state.params), step)
    score = eval_score(m)
    if score is not None:
      ckpt.maybe_save_best(step, score, policies.to_saved(run_state.state), meta={"eval": m})
      summary.setdefault("eval_history", []).append({"step": step, **m})
    console.evaluated(step, m)
    return m

  writer = (
      metrics_lib.MetricsWriter(workdir, resume_step=start if resumed else None)
      if writes
      else metrics_lib.NullWriter()
  )
  if exp.rl.precompile:
    info = shapes_lib.precompile(
        parts.shapes,
        *parts.compile_targets(run_state.state.params),
        critic=parts.critic,
        progress=console.compiled,
    )
    if mix is not None:
      mix.precompile(exp.sft.batch_size)
    summary["precompile"] = info
  producer = RolloutProducer(parts, stream, critic_state=lambda: run_state.critic)
  closing.callback(producer.close)  # an in-flight rollout ends before the checkpointer
  watch = LearningWatch(exp.rl, summary.get("learning"))  # a resumed run's counters go on
  summary["learning"] = watch.state()
  if not resumed:
    before = render_totals(parts.transition.renderers)
    m = evaluate(0)
    m.update(across_processes(text_counts(parts.transition.renderers, before), {}))
    writer.write(0, m)
    summary["eval_start"] = m
    save(0)
  # Warm-up ends here: the step-0 evaluation and checkpoint compile their
  # one-time helpers (Orbax slices each array it saves once per shape).
  parts.census.mark_warm()
  console.rl_start(start + 1, exp.rl.steps, exp.eval.every, exp.rl.precompile)
  console.open_bar(exp.rl.steps, start, progress)
  step = start

  # ---- the RL loop: rollout -> batch -> update -> metrics, eval, checkpoint
  for step in range(start + 1, exp.rl.steps + 1):
    timer = metrics_lib.StepTimer()
    with timer.section("rollout"):
      if not producer.pending:  # on time, or the first step after a start or a resume
        if run_state.behaviour is None:
          producer.submit(step, run_state.state.params, version=step - 1)
        else:
          producer.submit(step, run_state.behaviour, version=max(step - 2, 0))
      rollout, waited = producer.result()
    if producer.ahead:  # the next rollout samples during the update, with its parameters
      run_state.next_rollout_ahead()
      if step < exp.rl.steps:
        producer.submit(step + 1, run_state.behaviour, version=step - 1)
    batch, batch_m, engine_m = rollout.batch, rollout.batch_metrics, rollout.engine_metrics
    tree = gather_tree(rollout.tree)  # every process's roots, for metrics and the dump
    train_m = {}
    with timer.section("train"):
      if batch is not None and exp.rl.updates_per_step:
        if train_step.objective.recompute_old:  # pi_old before the first update
          batch = train_step.old_logprobs(run_state.state.params, batch)
        for _ in range(exp.rl.updates_per_step):
          run_state.state, dm = train_step(run_state.state, run_state.ref, batch)
        train_m = policies.train_metrics(dm)
        if rollout.critic_batch is not None:  # a separate critic's own updates
          run_state.critic, critic_m = parts.critic.update(run_state.critic, rollout.critic_batch)
          train_m.update(critic_m)
      if mix is not None and mix.due(step):
        run_state.state, mix_m = mix(run_state.state)
        train_m.update({f"sft_mix/{k}": mix_m[k] for k in ("nll", "grad_norm", "tokens")})
    first_step = time.perf_counter() - launched if step == start + 1 else None
    if exp.rl.ref_reset_every and step % exp.rl.ref_reset_every == 0:
      run_state.reset_ref()
    m = {
        **tree.metrics(),
        **rollout_metrics(tree, exp.eval.success_threshold),
        **batch_m,
        **train_m,
        **parts.census.counts(),
        "rollout/staleness": float(rollout.staleness),
    }
    summary["faults"] = add_fault_totals(summary.get("faults"), tree)  # run totals per kind
    if exp.curriculum.enabled:  # may move the level of the next step's tasks
      m.update(stream.observe(m["rollout/success"]))
    if writes and exp.rl.dump_every and step % exp.rl.dump_every == 0:
      dump_lib.write_rollout_dump(
          tree, dump_lib.dump_path(workdir, step), parts.transition.decoders
      )
    text = rollout.text_counts  # the rollout's own, counted while it ran
    if step % exp.eval.every == 0 or step == exp.rl.steps:
      with timer.section("eval"):
        producer.wait()  # the next rollout's renderer counts stay its own
        before = render_totals(parts.transition.renderers)
        m.update(evaluate(step))
        text = add_counts(text, text_counts(parts.transition.renderers, before))
    times = timer.split()  # time/rollout, time/train, time/eval
    times["time/rollout_wait"] = waited  # the loop waiting for the step's rollout
    if first_step is not None:  # from the start of `train` to the end of the first update
      times["time/first_step"] = summary["time/first_step"] = first_step
    times.update({k: v for k, v in engine_m.items() if k.startswith("time/")})
    engine_m = {k: v for k, v in engine_m.items() if k.startswith("engine/")}
    m.update(across_processes(text, times, engine_m))
    writer.write(step, m)
    warning, halt = watch.observe(
        step, tree, batch_m, success=m.get("rollout/success"), metrics=m, last=step == exp.rl.steps
    )
    summary["learning"] = watch.state()
    for line in warning.splitlines():  # one line per warning
      say(f"warning: {line}")
    ckpt.check()  # a background save that failed (a full disk) ends the run at the next step
    if step % exp.checkpoint.every == 0 or step == exp.rl.steps or halt:
      save(step)  # a halted run's last step is saved too
    if halt:  # once the save has written its copy of the summary: a resume is not halted
      ckpt.wait()
      summary["halted"] = f"step {step}: {halt}"
      say(f"halted at {summary['halted']}")
    console.step_done(m)
    if halt:
      break
  if watch.final():  # every RL step of the run (resumes included) trained nothing
    ckpt.wait()  # the last save's summary stays as it was
    summary["trained_nothing"] = watch.final()
    say(summary["trained_nothing"])

  # ---- end: flush, summary, curves
  producer.close()
  console.close_bar()
  writer.close()
  ckpt.wait()
  summary.update(best=ckpt.best(), compiles=parts.census.counts())
  if writes:
    with open(os.path.join(workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=1, default=float)
    metrics_lib.plot_metrics(workdir, out_png=os.path.join(workdir, "curves.png"))
  ckpt.close()
  console.end(
      start + 1,
      step,
      time.perf_counter() - launched,
      summary["workdir"],
      halted="halted" in summary,
  )
  return summary
