"""SFT warm-up: masked cross-entropy on the trainable tokens of example conversations.

The masks are the RL ones: a row is a rendered conversation (its token
ledger's `ids`) and its `trainable` flags (policy tokens only), so the warm-up
teaches exactly the tokens RL later trains. SFT runs on the train-step
machinery (`TrainStep` with `SFTObjective`): same shardings, micro-batching,
non-finite handling and compile-once-per-bucket behaviour.

Data: a list / Python iterable of `(ids, trainable)` rows, or any
random-access source of `{"ids", "trainable"}` records (e.g. a TFDS
`as_data_source`), served in epoch-shuffled fixed-shape batches by
`SFTBatcher`, whose position goes into the checkpoint's host state.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from typing import Any, Callable, Mapping, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from flax import nnx

from mtrl_jax import distributed, sharding
from mtrl_jax.buckets import bucket, round_up
from mtrl_jax.data import epoch_order
from mtrl_jax.registry import import_object
from mtrl_jax.rollout.train_batch import TrainBatch, batch_spec, from_rows
from mtrl_jax.train import optim
from mtrl_jax.train.evaluate import indexed
from mtrl_jax.train.objectives import train_mask
from mtrl_jax.train.step import StepConfig, TrainStep


@dataclasses.dataclass(frozen=True)
class SFTObjective:
  """Token-mean negative log-likelihood of the trainable tokens.

  loss = -sum_{b,k} m[b,k] logp[b,k] / sum_{b,k} m[b,k], with m the trained
  tokens of a `TrainBatch` minus padding rows (row_weight 0).
  """

  @property
  def needs_ref(self) -> bool:
    return False

  def terms(self, logp_BxK, ref_logp_BxK, entropy_BxK, batch):
    del ref_logp_BxK
    mask_BxK = train_mask(batch)
    maskf = mask_BxK.astype(jnp.float32)
    # where, not multiply: masked positions never reach the loss or its gradient.
    num = -jnp.sum(jnp.where(mask_BxK, logp_BxK, 0.0))
    sums = {
        "nll_sum": jax.lax.stop_gradient(num),
        "tokens": maskf.sum(),
        "rows": jnp.any(mask_BxK, axis=-1).astype(jnp.float32).sum(),
    }
    if entropy_BxK is not None:
      sums["entropy_sum"] = jnp.sum(jnp.where(mask_BxK, entropy_BxK, 0.0))
    return num, maskf.sum(), sums

  def merge(self, a, b):
    return {k: a[k] + b[k] for k in a}

  def finalize(self, sums):
    tokens = sums["tokens"]
    nll = sums["nll_sum"] / jnp.maximum(tokens, 1.0)
    out = {"nll": nll, "perplexity": jnp.exp(nll), "tokens": tokens, "rows": sums["rows"]}
    if "entropy_sum" in sums:
      out["entropy"] = sums["entropy_sum"] / jnp.maximum(tokens, 1.0)
    return out


def make_sft_step(
    model,
    optim_cfg: optim.OptimConfig,
    mesh=None,
    step_cfg: StepConfig = StepConfig(),
    rules=sharding.TRAIN_RULES,
) -> TrainStep:
  """A `TrainStep` minimising `SFTObjective`; call it as `step(state, None, batch)`."""
  return TrainStep(model, SFTObjective(), optim_cfg, mesh=mesh, step_cfg=step_cfg, rules=rules)


def _row(example) -> tuple[np.ndarray, np.ndarray]:
  if isinstance(example, Mapping):
    ids, trainable = example["ids"], example["trainable"]
  else:
    ids, trainable = example
  return np.asarray(ids, np.int64), np.asarray(trainable, bool)


def pack_sft_rows(
    rows: Sequence,
    length_buckets: Sequence[int],
    *,
    pad_id: int = 0,
    num_rows: Optional[int] = None,
    row_multiple: int = 1,
) -> TrainBatch:
  """Right-pads example rows into one fixed-shape SFT batch (each row a single-path tree,
  `rollout.train_batch.from_rows`, with one trained-token slot per position).

  Args:
    rows: `(ids, trainable_mask)` pairs (or dicts with those keys), e.g. a
      ledger's `ids` and `trainable`; position 0 must not be trainable.
    length_buckets: allowed lengths L; the smallest holding the longest row.
    pad_id: id of padding tokens.
    num_rows: batch rows B (>= len(rows)); default len(rows) rounded up to
      `row_multiple`. Padding rows get row_weight 0.
    row_multiple: B is a multiple of this (e.g. the data-parallel size).
  Returns:
    The `TrainBatch` (B x L x L).
  """
  parsed = [_row(r) for r in rows]
  for i, (ids, trainable) in enumerate(parsed):
    if ids.ndim != 1 or ids.shape != trainable.shape or ids.size == 0:
      raise ValueError(
          f"SFT row {i}: ids {ids.shape} and trainable {trainable.shape} must be "
          "equal-length, non-empty 1-D sequences"
      )
    if trainable[0]:
      raise ValueError(
          f"SFT row {i}: position 0 is trainable, but it has no prediction "
          "(it must be context, e.g. a role header)"
      )
  longest = max((ids.size for ids, _ in parsed), default=1)
  length = bucket(longest, length_buckets, "SFT row length")
  if num_rows is None:
    num_rows = round_up(max(len(parsed), 1), row_multiple)
  elif num_rows < len(parsed) or num_rows % row_multiple:
    raise ValueError(
        f"pack_sft_rows num_rows={num_rows}: must be >= len(rows)={len(parsed)} "
        f"and a multiple of row_multiple={row_multiple}"
    )
  tokens_BxL = np.full((num_rows, length), pad_id, np.int32)
  loss_mask_BxL = np.zeros((num_rows, length), bool)
  row_weight_B = np.zeros((num_rows,), np.float32)
  for b, (ids, trainable) in enumerate(parsed):
    tokens_BxL[b, : ids.size] = ids
    loss_mask_BxL[b, : ids.size] = trainable
    row_weight_B[b] = 1.0
  # K = L: one SFT program per (rows, length), whatever the rows' trained counts.
  return from_rows(tokens_BxL, loss_mask_BxL, row_weight_B=row_weight_B, num_logits=length)


class SFTBatcher:
  """Endless epoch-shuffled SFT batches with a resumable position.

  Epoch e visits the rows in `permutation(seed, e)`; batches run across epoch
  boundaries. `get_state()` / `set_state()` give the position for the
  checkpoint's host state, so a resumed run sees the same batches.

  Args:
    source: random-access rows (a list, or a TFDS data source from
      `builder.as_data_source(split)`); other iterables are read into a list.
    batch_size: rows per batch (B).
    length_buckets: allowed row lengths (see `pack_sft_rows`).
    seed: shuffling seed.
    shuffle: False keeps the source order.
    pad_id: id of padding tokens.
  """

  def __init__(
      self,
      source,
      batch_size: int,
      length_buckets: Sequence[int],
      *,
      seed: int = 0,
      shuffle: bool = True,
      pad_id: int = 0,
  ):
    if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
      source = list(source)
    if len(source) == 0:
      raise ValueError("SFTBatcher: the source has no rows")
    if batch_size < 1:
      raise ValueError(f"SFTBatcher batch_size={batch_size}; allowed: an integer >= 1")
    self.source, self.batch_size, self.length_buckets = source, batch_size, tuple(length_buckets)
    self.seed, self.shuffle, self.pad_id = seed, shuffle, pad_id
    self.position = 0  # rows consumed so far, over all epochs
    self._cached_epoch, self._cached_order = None, None

  def _order(self, epoch: int) -> np.ndarray:
    if self._cached_epoch != epoch:
      self._cached_order = epoch_order(len(self.source), self.seed, epoch, self.shuffle)
      self._cached_epoch = epoch
    return self._cached_order

  def __iter__(self):
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    n = len(self.source)
    rows = []
    for pos in range(self.position, self.position + self.batch_size):
      epoch, i = divmod(pos, n)
      rows.append(self.source[int(self._order(epoch)[i])])
    self.position += self.batch_size
    return pack_sft_rows(rows, self.length_buckets, pad_id=self.pad_id, num_rows=self.batch_size)

  def get_state(self) -> dict:
    return {"position": self.position, "seed": self.seed}

  def set_state(self, state: Mapping[str, Any]):
    if int(state["seed"]) != self.seed:
      raise ValueError(f"SFTBatcher.set_state: checkpoint seed {state['seed']} != {self.seed}")
    self.position = int(state["position"])


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
  `sft.conversations='mtrl_jax.train.sft:file_conversation'` and
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
    parts: the run's `train.components.Components` (one shared policy).
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

  `parts` is the run's `train.components.Components`. Rows are the golden
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
