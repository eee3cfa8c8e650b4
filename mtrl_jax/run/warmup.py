"""The SFT warm-up of a run and SFT steps mixed into RL, on golden conversations.

A run's supervised phases, on the SFT step of `train/sft.py` (`SFTObjective`,
`SFTBatcher`): the warm-up before RL (`warm_up`, `sft.steps`), with its
greedy success check (`sft.until_success`), and one NLL step after every
`sft.mix_every`-th RL update (`SFTMix`). Rows are the golden conversations
of the first `sft.num_examples` train tasks (`sft.conversations`, or your
own JSONL file through `file_conversation`).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Mapping, Optional

import numpy as np
from flax import nnx

from mtrl_jax import distributed
from mtrl_jax.registry import import_object
from mtrl_jax.rollout.train_batch import batch_spec
from mtrl_jax.run.evaluate import indexed
from mtrl_jax.train import optim
from mtrl_jax.train.sft import SFTBatcher, make_sft_step


def conversation_rows(make_conversation: Callable, renderer, tasks, count: int) -> list:
  """(ids, trainable) rows of the golden conversations of the first `count` tasks."""
  rows = []
  for i in range(min(count, len(tasks))):
    ledger = renderer.render_conversation(make_conversation(tasks[i]))
    rows.append((np.asarray(ledger.ids, np.int32), np.asarray(ledger.trainable, bool)))
  return rows


def conversation_maker(cfg) -> Callable:
  """task -> [(role, content), ...]: `sft.conversations` with `sft.conversation_kwargs`."""
  return functools.partial(
      import_object(cfg.conversations, "sft.conversations"), **dict(cfg.conversation_kwargs)
  )


@functools.lru_cache(maxsize=8)
def _read_conversations(path: str) -> tuple:
  """The (role, content) pairs of each line of the JSONL file `path`, read once."""
  with open(path) as f:
    rows = [json.loads(line) for line in f if line.strip()]
  if not rows:
    raise ValueError(f"sft.conversation_kwargs path={path!r} holds no conversations")
  return tuple(tuple((m["role"], m["content"]) for m in r["messages"]) for r in rows)


def file_conversation(task: Mapping[str, Any], path: str) -> list[tuple[str, str]]:
  """Conversation `task['index'] % n` of the n in the JSONL file `path` (one
  {"messages": [{"role", "content"}, ...]} per line; the `mtrl_jax.tasks` sources
  put the index in each task, a task without one gets the first): your own SFT data, with
  `sft.conversations='mtrl_jax.run.warmup:file_conversation'` and
  `sft.conversation_kwargs={'path': path}`. A system turn is trained on as context
  only; the environment's own system prompt is not added to SFT rows."""
  rows = _read_conversations(path)
  return list(rows[int(task.get("index", 0)) % len(rows)])


def golden_batcher(parts, seed: int, renderer=None) -> SFTBatcher:
  """Batches of the golden conversations of the first `sft.num_examples` train tasks,
  rendered by `renderer` (default the run's) and shuffled with `seed` (the warm-up's
  stream, or `SFTMix`'s with another seed)."""
  exp, cfg = parts.exp, parts.exp.sft
  renderer = parts.renderer if renderer is None else renderer
  rows = conversation_rows(conversation_maker(cfg), renderer, parts.train_tasks, cfg.num_examples)
  return SFTBatcher(
      rows, cfg.batch_size, exp.rl.length_buckets, seed=seed, pad_id=renderer.tokenizer.pad_id
  )


class SFTMix:
  """SFT steps mixed into RL (`sft.mix_every` > 0): the supervised term of
  InstructGPT's PPO-ptx, taken as an alternating step rather than a summed loss.

  After every `mix_every`-th RL update the policy takes one NLL step
  (`SFTObjective`) on a batch of golden conversations, the warm-up's rows in an
  order shuffled with seed + 1. The step has its own AdamW moments and a
  constant rate `sft.mix_learning_rate`, so the RL optimizer's moments and
  schedule see RL gradients only; `TrainState.step` counts both kinds of update.
  The moments (`opt_state`) and the stream position (`stream_state`) go into
  the checkpoint, so a resumed run takes the same steps.

  Args:
    parts: the run's `run.components.Components` (one shared policy).
  """

  def __init__(self, parts):
    exp = parts.exp
    self.every, self.mesh = exp.sft.mix_every, parts.mesh
    self.batcher = golden_batcher(parts, seed=exp.seed + 1)
    cfg = optim.OptimConfig(
        learning_rate=exp.sft.mix_learning_rate, grad_clip_norm=exp.optim.grad_clip_norm
    )
    self.step_fn = make_sft_step(parts.model, cfg, mesh=parts.mesh, step_cfg=exp.step)
    parts.census.register("sft_mix_step", self.step_fn)
    self.opt_state = None  # `init` or `restore` sets it

  def due(self, rl_step: int) -> bool:
    return rl_step % self.every == 0

  def init(self, params):
    """Fresh moments for the policy's `params`."""
    self.opt_state = self.step_fn.init_state(params).opt_state

  def abstract_opt_state(self):
    """The restore target of `opt_state`."""
    return self.step_fn.abstract_state().opt_state

  def stream_state(self) -> dict:
    return self.batcher.get_state()

  def restore(self, opt_state, stream_state: Mapping[str, Any]):
    self.opt_state = opt_state
    self.batcher.set_state(stream_state)

  def __call__(self, state):
    """One SFT step of the RL `state` (donated): returns (new state, host metrics)."""
    rl_opt = state.opt_state
    new, m = self.step_fn(
        dataclasses.replace(state, opt_state=self.opt_state),
        None,
        distributed.take_rows(next(self.batcher), self.mesh),
    )
    self.opt_state = new.opt_state
    return dataclasses.replace(new, opt_state=rl_opt), self.step_fn.fetch_metrics(m)

  def precompile(self, num_rows: int):
    """Compiles the step for every length bucket (rows of any bucket may come)."""
    for length in self.batcher.length_buckets:
      self.step_fn.precompile(batch_spec(num_rows, length, length))


def warm_up(parts, report: Optional[Callable[[dict], None]] = None) -> tuple[Any, list[dict]]:
  """The SFT warm-up of a run: returns (RL TrainState of the warmed-up params, history).

  `parts` is the run's `run.components.Components`. Rows are the golden
  conversations of the first `sft.num_examples` train tasks. Every
  `sft.check_every` steps (and at the last) a history row is logged; with
  `sft.until_success` > 0 it holds the greedy success on the next
  `sft.check_tasks` train tasks (not in the SFT data), and SFT stops once that
  reaches the threshold. `report(row)`, if given, sees each history row as it is
  logged (the console's progress lines).

  A team of several architectures (`train.team`) warms up one start per group
  (`Policies.warm_starts`), each on the rows its own tokenizer renders, in
  lockstep; a history row holds the mean over the groups of each metric.
  """
  exp, cfg = parts.exp, parts.exp.sft
  optim_cfg = optim.OptimConfig(
      learning_rate=cfg.learning_rate,
      total_steps=max(cfg.steps, 1),
      grad_clip_norm=exp.optim.grad_clip_norm,
  )
  starts = parts.policies.warm_starts(parts.model)
  batchers, step_fns, states = [], [], []
  for g, (model, agent) in enumerate(starts):
    batchers.append(
        golden_batcher(parts, seed=exp.seed, renderer=parts.transition.renderers[agent])
    )
    step_fns.append(make_sft_step(model, optim_cfg, mesh=parts.mesh, step_cfg=exp.step))
    parts.census.register("sft_step" if g == 0 else f"sft_step_{g}", step_fns[-1])
    states.append(step_fns[-1].init_state(nnx.state(model, nnx.Param), seed=exp.seed))
  check = indexed(parts.train_tasks, cfg.check_tasks, start=len(batchers[0].source))
  params = lambda: parts.policies.warmed([s.params for s in states])
  history = []
  for i in range(1, cfg.steps + 1):
    fetched = []
    for g, (step_fn, batcher) in enumerate(zip(step_fns, batchers)):
      states[g], m = step_fn(states[g], None, distributed.take_rows(next(batcher), parts.mesh))
      fetched.append(m)
    if i % cfg.check_every and i != cfg.steps:
      continue
    host = [step_fn.fetch_metrics(m) for step_fn, m in zip(step_fns, fetched)]
    row = {"sft_step": i, **{k: float(np.mean([h[k] for h in host])) for k in host[0]}}
    if cfg.until_success > 0 and check:
      row["check_success"] = parts.evaluator(
          parts.policies.one_for_all(params()), check, greedy=True, key=parts.key
      )["success"]
    history.append(row)
    if report is not None:
      report(row)
    if row.get("check_success", 0.0) >= cfg.until_success > 0:
      break
  return parts.policies.init_state(params()), history
