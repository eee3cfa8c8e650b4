"""ENVGRPO / ENVGSPO: optional SFT warm-up, then tree rollouts -> pack -> train step.

`run(config, workdir)` is the whole training job behind `experiments/train.py`:

  build + validate the experiment (fails before compute)
  resume from workdir/ckpt if a checkpoint exists, else SFT warm-up (optional)
  for each RL step:
    tasks from a seeded, resumable stream -> one environment per root
    tree expansion (one sampler call per level, env steps on a thread pool)
    returns / advantages -> fixed-shape batch (`rollout.batching`: zero-variance
      groups dropped; tree-packed, every token once, or one row per action)
    train step (GRPO / GSPO / REINFORCE, KL to the frozen reference)
    metrics.jsonl + TensorBoard, rollout dumps, checkpoints,
    held-out evaluation every k steps with keep-best under workdir/best

The per-step RNG key is `fold_in(PRNGKey(seed), step)` and the task stream's
position is checkpointed, so a run killed at any point resumes exactly
(DESIGN.md invariant 6).
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from mtrl_jax import checkpoint, data, metrics as metrics_lib, sharding
from mtrl_jax.rollout import dump as dump_lib
from mtrl_jax.rollout import expand_tree
from mtrl_jax.rollout.batching import BatchConfig, make_train_batch
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.policy import TimedPolicy
from mtrl_jax.registry import import_object
from mtrl_jax.sampling import Sampler
from mtrl_jax.train import evaluate as eval_lib
from mtrl_jax.train import experiment as exp_lib
from mtrl_jax.train import shapes as shapes_lib
from mtrl_jax.train.sft import SFTBatcher, make_sft_step
from mtrl_jax.train.objectives import PolicyObjective
from mtrl_jax.train.step import TrainStep


PLOT_KEYS = ("eval/*/success", "rollout/success", "rollout/return", "turn_*/mean_reward",
             "train/loss", "train/kl", "train/clip_frac", "train/entropy", "faults/*")


def _sft_rows(exp, renderer, source) -> list:
  make = import_object(exp.run.sft_conversations, "sft.conversations")
  rows = []
  for i in range(min(exp.run.sft_num_examples, len(source))):
    ledger = renderer.render_conversation(make(source[i]))
    rows.append((np.asarray(ledger.ids, np.int32), np.asarray(ledger.trainable, bool)))
  return rows


class _Run:
  """The state of one training job (the loop body lives in `run`)."""

  def __init__(self, config: ml_collections.ConfigDict, workdir: str):
    self.exp = exp = exp_lib.build(config)
    self.workdir = workdir
    exp_lib.save_config(config, workdir)
    self.mesh = sharding.make_mesh(exp.mesh.shape(jax.device_count()))
    self.row_multiple = self.mesh.shape["data"] * self.mesh.shape["fsdp"]
    self.tokenizer, self.renderer = exp_lib.make_tokenizer(exp)
    self.exp = exp = exp_lib.fit_vocab(exp, self.tokenizer)
    self.model = exp_lib.make_model(exp, self.mesh)
    self.factory = exp_lib.make_factory(exp)
    self.train_tasks = exp_lib.make_task_source(exp, exp.train_split)
    self.eval_tasks = exp_lib.make_task_source(exp, exp.eval_split)
    self.stream = data.TaskStream(self.train_tasks, seed=exp.run.seed)
    objective = PolicyObjective(exp.loss, temperature=exp.sampling.temperature)
    self.train_step = TrainStep(self.model, objective, exp.optim, mesh=self.mesh,
                                step_cfg=exp.step)
    self.shapes = shapes_lib.plan_shapes(exp, self.row_multiple, self.row_multiple)
    self.batch_cfg = BatchConfig(
        packing=exp.run.packing, length_buckets=exp.run.length_buckets,
        row_buckets=self.shapes.train_rows, row_multiple=self.row_multiple,
        pad_id=self.tokenizer.pad_id, zero_variance_filter=exp.run.zero_variance_filter,
        keep_kl=exp.loss.kl_coef > 0)
    self.sampler = Sampler(exp.model, mesh=self.mesh, batch_buckets=self.shapes.sampler_rows,
                           prompt_buckets=self.shapes.prompt_lens)
    stop_ids = self.renderer.fmt.stop_ids
    self.policy = TimedPolicy(self.sampler, None, exp.sampling, stop_ids=stop_ids,
                                pad_id=self.tokenizer.pad_id)
    self.transition = EnvTransition(self.renderer, exp.tree.num_agents, limits=exp.limits,
                                    reward_cfg=exp.reward)
    self.ckpt = checkpoint.Checkpointer(workdir, keep=exp.run.ckpt_keep)
    self.census = metrics_lib.CompileCensus()
    self.census.register("sampler", self.sampler)
    self.census.register("train_step", self.train_step)
    self.key = jax.random.PRNGKey(exp.run.seed)

  def text_metrics(self) -> dict:
    """Re-tokenisation counts of this step (the renderer's counters are cumulative)."""
    now = self.renderer.metrics()
    prev, self._text_prev = getattr(self, "_text_prev", {}), now
    out = {k: v - prev.get(k, 0) for k, v in now.items() if not k.endswith("_rate")}
    checked = out.get("text/completions_checked", 0)
    out["text/retokenize_mismatch_rate"] = out.get("text/retokenize_mismatches", 0) / max(checked, 1)
    return out

  # ------------------------------------------------------------ state
  def ckpt_target(self):
    target = {"train": self.train_step.abstract_state()}
    if self.exp.loss.kl_coef > 0:
      target["ref"] = self.train_step.abstract_state().params
    return target

  def save(self, step: int, state, ref, extra: dict):
    tree = {"train": state}
    if self.exp.loss.kl_coef > 0:
      tree["ref"] = ref
    self.ckpt.save(step, tree, meta={"stream": self.stream.state(), **extra})

  def sft(self, state):
    exp = self.exp
    rows = _sft_rows(exp, self.renderer, self.train_tasks)
    batcher = SFTBatcher(rows, exp.run.sft_batch_size, exp.run.length_buckets,
                         seed=exp.run.seed, pad_id=self.tokenizer.pad_id)
    step_fn = make_sft_step(self.model, exp.sft_optim, mesh=self.mesh, step_cfg=exp.step)
    self.census.register("sft_step", step_fn)
    sft_state = step_fn.init_state(state.params, seed=exp.run.seed)
    history = []
    # Early-stop checks use train tasks the SFT data did not include.
    first = min(len(rows), len(self.train_tasks))
    check = [dict(self.train_tasks[i], task_index=i)
             for i in range(first, min(first + exp.run.sft_check_tasks, len(self.train_tasks)))]
    for i in range(1, exp.run.sft_steps + 1):
      sft_state, m = step_fn(sft_state, None, next(batcher))
      if i % exp.run.sft_check_every == 0 or i == exp.run.sft_steps:
        row = {"sft_step": i, **step_fn.fetch_metrics(m)}
        if exp.run.sft_until_success > 0 and check:
          row["check_success"] = eval_lib.evaluate(
              self.sampler, sft_state.params, self.renderer, self.transition, self.factory,
              check, exp, greedy=True, key=self.key)["success"]
        history.append(row)
        if row.get("check_success", 0.0) >= exp.run.sft_until_success > 0:
          break
    return self.train_step.init_state(sft_state.params, seed=exp.run.seed), history

  # ------------------------------------------------------------ evaluation
  def evaluate(self, params, step: int) -> dict:
    exp = self.exp
    out = {}
    tasks = [dict(self.eval_tasks[i], task_index=i)
             for i in range(min(exp.run.eval_num_tasks, len(self.eval_tasks)))]
    modes = [("greedy", True)] if exp.run.eval_greedy else []
    if exp.run.eval_sampled:
      modes.append(("sampled", False))
    for name, greedy in modes:
      res = eval_lib.evaluate(self.sampler, params, self.renderer, self.transition,
                              self.factory, tasks, exp, greedy=greedy,
                              key=jax.random.fold_in(self.key, 10_000_000 + step))
      out.update({f"eval/{name}/{k}": v for k, v in res.items()})
    return out


def run(config: ml_collections.ConfigDict, workdir: str, *, progress: bool = True) -> dict:
  """Runs (or resumes) a training job in `workdir`; returns a summary dict."""
  r = _Run(config, workdir)
  exp = r.exp
  print(exp_lib.describe(exp), flush=True)
  summary: dict[str, Any] = {"workdir": os.path.abspath(workdir)}
  latest = r.ckpt.latest_step()
  if latest is not None:
    restored, meta = r.ckpt.restore(r.ckpt_target())
    state = restored["train"]
    ref = restored.get("ref")
    r.stream.restore(meta["stream"])
    start = latest
    summary.update(meta.get("summary", {}))
    print(f"resumed from {workdir}/ckpt at step {latest}", flush=True)
  else:
    state = r.train_step.init_state(r.model, seed=exp.run.seed)
    if exp.run.sft_steps:
      t0 = time.time()
      state, history = r.sft(state)
      summary["sft_history"] = history
      summary["sft_steps_run"] = history[-1]["sft_step"] if history else 0
      summary["sft_seconds"] = round(time.time() - t0, 1)
    ref = r.train_step.copy_params(state.params) if exp.loss.kl_coef > 0 else None
    start = 0
  writer = metrics_lib.MetricsWriter(workdir, resume_step=start if latest is not None else None)
  if exp.run.precompile:
    info = shapes_lib.precompile(r.shapes, r.sampler, state.params, r.train_step,
                                 len(r.renderer.fmt.stop_ids))
    print(f"precompiled {info['sampler_programs']} sampler programs in "
          f"{info['sampler_seconds']} s and {info['train_programs']} train-step programs in "
          f"{info['train_seconds']} s", flush=True)
    summary["precompile"] = info

  def eval_and_keep_best(step, state):
    m = r.evaluate(state.params, step)
    score = m.get("eval/greedy/success", m.get("eval/sampled/success"))
    if score is not None:
      r.ckpt.maybe_save_best(step, score, state, meta={"eval": m})
      summary.setdefault("eval_history", []).append({"step": step, **m})
    return m

  bar = None
  if progress:
    from tqdm import tqdm
    bar = tqdm(total=exp.run.rl_steps, initial=start, desc="RL", dynamic_ncols=True)
  if latest is None:
    m = {**eval_and_keep_best(0, state), **r.text_metrics()}
    writer.write(0, m)
    summary["eval_start"] = m
    r.save(0, state, ref, {"summary": summary})
  # Warm-up ends here: the step-0 evaluation and checkpoint compile their
  # one-time helpers (Orbax slices each array it saves once per shape).
  r.census.mark_warm()
  for step in range(start + 1, exp.run.rl_steps + 1):
    timer = metrics_lib.StepTimer()
    key = jax.random.fold_in(r.key, step)
    r.policy.set_states(state.params)
    with timer.section("rollout"):
      tasks = r.stream.next(exp.run.roots_per_step)
      roots = r.transition.root_states(r.factory, tasks)
      tree = expand_tree(exp.tree, r.policy, r.transition, roots, key)
    batch, batch_m = make_train_batch(tree, r.batch_cfg)
    train_m = {}
    with timer.section("train"):
      if batch is not None:
        for _ in range(exp.run.updates_per_step):
          state, dm = r.train_step(state, ref, batch)
        train_m = {f"train/{k}": v for k, v in r.train_step.fetch_metrics(dm).items()}
    if exp.run.ref_reset_every and step % exp.run.ref_reset_every == 0:
      ref = r.train_step.copy_params(state.params)
    m = {**tree.metrics(), **eval_lib.rollout_metrics(tree, exp.run.success_threshold),
         **batch_m, **train_m, **r.census.counts()}
    if exp.run.dump_every and step % exp.run.dump_every == 0:
      dump_lib.write_rollout_dump(tree, dump_lib.dump_path(workdir, step), r.transition.decode)
    if step % exp.run.eval_every == 0 or step == exp.run.rl_steps:
      with timer.section("eval"):
        m.update(eval_and_keep_best(step, state))
    m.update(r.text_metrics())  # after eval: this step's evaluation counts too
    times = timer.split()
    # Generation is timed inside the rollout; the rest of it is environment
    # work (react_to, tools, graders, user simulators, rendering).
    times["time/generation"] = r.policy.pop_seconds()
    times["time/environment"] = times.pop("time/rollout") - times["time/generation"]
    m.update(times)
    writer.write(step, m)
    if step % exp.run.ckpt_every == 0 or step == exp.run.rl_steps:
      r.save(step, state, ref, {"summary": summary})
    if bar is not None:
      bar.set_postfix(reward=f"{m.get('rollout/return', float('nan')):.2f}",
                      success=f"{m.get('rollout/success', float('nan')):.2f}", refresh=False)
      bar.update(1)
  if bar is not None:
    bar.close()
  writer.close()
  r.ckpt.wait()
  best = r.ckpt.best()
  summary["best"] = best
  summary["compiles"] = r.census.counts()
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f, indent=1, default=float)
  metrics_lib.plot_metrics(workdir, PLOT_KEYS, out_png=os.path.join(workdir, "curves.png"))
  r.ckpt.close()
  return summary
