"""The fixed set of array shapes an RL run uses, and compiling all of them up front.

A jitted function compiles once per shape bucket (docs/design.md invariant 5), so
`plan_shapes` derives every bucket from the config alone:

  engine slots      KV slots per agent per batch shard (`config.engine.slots`;
                    0: the widest tree level's samples, or the evaluation's
                    roots, if more, split over the process's shards);
  engine capacity   cache columns per slot (`config.engine.capacity`; 0: the
                    largest prompt bucket + max_new_tokens + 1);
  engine programs   admit (new-token buckets) and decode (window buckets) of
                    `sampling.slots.EngineConfig`, for the training sampling
                    and the evaluations' (greedy, sampled);
  train rows        rl.packing='rows': a quarter, a half and all of the
                    tree's rows (the zero-variance filter keeps a
                    policy-dependent subset); 'tree': all of the tree's rows
                    (the row layout's count bounds the packed one) halved
                    down to a 32nd, since packed trees fill few rows;
  train lengths     'rows': `rl.length_buckets`; 'tree': the largest of them
                    (bin packing fills rows, so one length serves);
  trained tokens    'tree': a quarter, a half or all of the row length
                    (`train_batch.logit_buckets`): the LM head runs there;
                    'rows': the row length (one slot per position).

Every engine and train-step program then compiles before the first RL step, so
the compile census stays flat for the rest of the run: `precompile` on one
thread, or, in `run.rl.train`, the train-step programs on a thread of their own
(`TrainCompile`) beside the checkpoint restore and the SFT warm-up, the engine's
after the warm-up (`precompile_engines`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
import time
from typing import Sequence

import jax

from mtrl_jax.buckets import round_up
from mtrl_jax.rollout import plan_tree
from mtrl_jax.rollout.train_batch import TrainBatch, batch_spec, logit_buckets
from mtrl_jax.sampling import EngineConfig
from mtrl_jax.train.compile import lower_values


@dataclasses.dataclass(frozen=True)
class ShapePlan:
  """Buckets of one RL run (see the module docstring)."""

  engine: EngineConfig
  samplings: tuple  # SamplingConfig of every kind of rollout (training, evaluations)
  fanout: int  # the most samples one request asks for (G)
  train_rows: tuple
  train_lens: tuple
  packing: str = "rows"
  values: bool = False  # batches carry a critic's value fields

  def train_shapes(self) -> list[tuple[int, int, int]]:
    """(rows, length, trained tokens per row) of every train program."""
    logits = logit_buckets if self.packing == "tree" else lambda l: (l,)
    return [(b, l, k) for b in self.train_rows for l in self.train_lens for k in logits(l)]

  def train_specs(self) -> list[TrainBatch]:
    """The batch specs (`jax.ShapeDtypeStruct`s) of every train program."""
    return [batch_spec(*shape, values=self.values) for shape in self.train_shapes()]


def plan_shapes(exp, row_multiple: int, local_shards: int) -> ShapePlan:
  """The buckets of an experiment (`run.experiment.Experiment`) as one process plans
  them (`per_process`); `local_shards`: the process's batch shards."""
  rl, sft, ev, tree = exp.rl, exp.sft, exp.eval, exp.tree
  n = tree.num_agents
  plan = plan_tree(tree, rl.roots_per_step, rl.max_length, exp.sampling.max_new_tokens)
  # Samples in flight at once, per parameter set: a level's, or an evaluation's roots.
  agents_per_set = n if exp.agents.share_policy else 1
  widest = max(
      plan.max_level_generations * agents_per_set // n,
      ev.num_tasks * agents_per_set,
      sft.check_tasks * agents_per_set if sft.steps else 0,
  )
  slots = exp.engine.slots or round_up(-(-widest // local_shards), 8)
  slots = max(slots, tree.num_generations)
  prompt = max(rl.prompt_buckets or rl.length_buckets)
  capacity = exp.engine.capacity or round_up(prompt + exp.sampling.max_new_tokens + 1, 16)
  engine = EngineConfig(
      slots=slots,
      capacity=capacity,
      chunk=exp.engine.chunk,
      decode_rows=exp.engine.decode_rows,
      admit_rows=exp.engine.admit_rows,
      reuse=exp.engine.reuse,
      overlap=exp.engine.overlap,
  )
  greedy = dataclasses.replace(exp.sampling, greedy=True)
  samplings = [exp.sampling]
  if ev.greedy or (sft.steps and sft.until_success > 0):
    samplings.append(greedy)
  if ev.sampled:
    samplings.append(
        dataclasses.replace(exp.sampling, greedy=False, temperature=1.0, top_p=1.0, top_k=0)
    )
  total = plan.rows
  if rl.packing == "tree":
    fractions, train_lens = (32, 16, 8, 4, 2, 1), (rl.max_length,)
  else:
    fractions, train_lens = (4, 2, 1), tuple(rl.length_buckets)
  train_rows = tuple(sorted({round_up(max(total // d, 1), row_multiple) for d in fractions}))
  return ShapePlan(
      engine=engine,
      samplings=tuple(samplings),
      fanout=tree.num_generations,
      train_rows=train_rows,
      train_lens=train_lens,
      packing=rl.packing,
      values=exp.critic.head,
  )


def per_process(exp, num_processes: int):
  """`exp` as one of `num_processes` processes plans it: its share of the roots,
  held-out tasks and SFT check tasks (the largest share when they do not divide)."""
  if num_processes == 1:
    return exp
  share = lambda n: -(-n // num_processes)
  return dataclasses.replace(
      exp,
      rl=dataclasses.replace(exp.rl, roots_per_step=share(exp.rl.roots_per_step)),
      eval=dataclasses.replace(exp.eval, num_tasks=share(exp.eval.num_tasks)),
      sft=dataclasses.replace(exp.sft, check_tasks=share(exp.sft.check_tasks)),
  )


def precompile(
    shapes: ShapePlan,
    engines: Sequence[tuple],
    train_steps: Sequence,
    threads: int = 2,
    train_threads: int = 1,
    critic=None,
    progress=None,
) -> dict:
  """Compiles every engine and train-step program of `shapes` before it returns (the
  engine's first, as `precompile_engines`, then `TrainCompile`'s); returns their
  counts and seconds. `rl.train` instead starts the `TrainCompile` before the SFT
  warm-up and compiles the engine's programs after it."""
  info = precompile_engines(shapes, engines, threads, progress)
  return {**info, **TrainCompile(shapes, train_steps, train_threads, critic, progress).wait()}


def precompile_engines(
    shapes: ShapePlan, engines: Sequence[tuple], threads: int = 2, progress=None
):
  """Compiles every engine program of `shapes`, `threads` at a time (XLA compiles off
  the Python lock); returns {'engine_programs', 'engine_seconds'}.

  `engines`: (engine, the parameters it samples with, number of stop ids) per
  engine (`Components.compile_targets`: one, or one per group of a team).
  `progress(kind, done, total)`, if given, is called with kind 'engine', with done 0
  before the first program and after each one."""
  t0 = time.perf_counter()
  engine_programs = 0
  for engine, params, num_stop_ids in engines:
    kw = {}
    if progress is not None:
      before = engine_programs
      kw["progress"] = lambda d, n, b=before: progress("engine", b + d, b + n)
    engine_programs += engine.precompile(
        params, shapes.samplings, num_stop_ids, shapes.fanout, threads=threads, **kw
    )
  return {"engine_programs": engine_programs, "engine_seconds": round(time.perf_counter() - t0, 1)}


class TrainCompile:
  """The train-step programs of `shapes` compiling on a thread of their own, from
  construction until `wait`.

  They need the shapes and the steps' abstract states, not parameters, so a fresh run
  compiles them beside its checkpoint restore and SFT warm-up (`run.rl.train`): on an
  accelerator the warm-up runs on the device while the host compiles.

  `train_steps`: the update programs (a `TrainStep` or `StackedTrainStep`, one per
  group of a team). Programs are lowered one after another on the thread (tracing
  is Python) and compiled `train_threads` at a time on others, so lowering the next
  overlaps compiling the last (runs use one: more did not finish sooner on 2 CPU
  cores or on a 16-core GPU host, docs/performance.md "Start-up time"). With a
  critic the value passes compile too: a head's on the policy's step, a separate
  independent critic's value pass and update (`critic`, a
  `train.separate_critic.SeparateCritic`) on the same buckets; a centralized
  critic's joint rows have lengths of their own and compile on first use.
  `progress('train-step', done, total)`, if given, is called from the thread with
  done 0 before the first program and after each one.
  """

  def __init__(
      self,
      shapes: ShapePlan,
      train_steps: Sequence,
      train_threads: int = 1,
      critic=None,
      progress=None,
  ):
    self._units = _train_units(shapes, train_steps, critic)
    self._threads = train_threads
    self._report = (
        (lambda n: progress("train-step", n, len(self._units))) if progress else (lambda n: None)
    )
    self._cancelled = threading.Event()
    self._error = None
    self._seconds = None
    self._thread = threading.Thread(target=self._run, name="train-step-compile")
    self._thread.start()

  def _run(self) -> None:
    t0 = time.perf_counter()
    try:
      _compile_all(self._units, self._threads, self._report, self._cancelled)
    except BaseException as e:  # noqa: BLE001  (raised again by `wait`, on the run's thread)
      self._error = e
    self._seconds = round(time.perf_counter() - t0, 1)

  def wait(self) -> dict:
    """Blocks until every program compiled (raising what the thread raised); returns
    {'train_programs', 'train_seconds' (the thread's), 'train_waited_seconds' (this
    call's)}."""
    t0 = time.perf_counter()
    self._thread.join()
    if self._error is not None:
      raise self._error
    return {
        "train_programs": len(self._units),
        "train_seconds": self._seconds,
        "train_waited_seconds": round(time.perf_counter() - t0, 1),
    }

  def cancel(self) -> None:
    """Stops after the programs compiling now (a run leaving early: its process exits
    without waiting for the rest); a no-op once done."""
    self._cancelled.set()
    self._thread.join()


def _train_units(shapes: ShapePlan, train_steps: Sequence, critic) -> list:
  """`TrainCompile`'s units: per program, a function giving its lowered computations."""
  units = []
  for train_step in train_steps:
    agents = getattr(train_step, "num_agents", None)  # a StackedTrainStep: [A, ...] batches
    for spec in shapes.train_specs():
      if agents is not None:
        spec = jax.tree.map(lambda v: jax.ShapeDtypeStruct((agents,) + v.shape, v.dtype), spec)
      units.append(functools.partial(train_step.lower, spec))
      if shapes.values:  # a value head: the rollout's value pass
        rules = train_step.rules if agents is None else train_step.inner.rules
        units.append(lambda s=train_step, b=spec, r=rules: [lower_values(s, b, r)])
  if critic is not None:
    units += _critic_units(shapes, critic)
  return units


def _compile_all(units: Sequence, threads: int, done, cancelled: threading.Event) -> None:
  """Lowers each unit on this thread (tracing is Python) and compiles what it gives
  `threads` units at a time (XLA compiles off the interpreter lock); `done(n)` sees 0,
  then the units compiled, in order. Once `cancelled` is set no unit starts lowering
  or compiling."""
  done(0)
  with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as ex:
    compiling = []
    for unit in units:
      if cancelled.is_set():
        break
      lowered = unit()
      compile = lambda ls=lowered: None if cancelled.is_set() else [l.compile() for l in ls]
      compiling.append(ex.submit(compile))
    for n, future in enumerate(compiling, 1):
      if future.result() is not None:  # None: cancelled
        done(n)


def _critic_units(shapes: ShapePlan, critic) -> list:
  """A separate independent critic's programs for every train bucket of `shapes` (its
  batches are the packed tree's, with the value fields): the update and the value pass
  per bucket, as `precompile`'s units; none for a centralized critic (its joint rows
  compile on use)."""
  if critic.kind != "independent":
    return []
  step, units = critic.step, []
  for spec in dataclasses.replace(shapes, values=True).train_specs():
    units.append(functools.partial(step.lower, spec))
    units.append(lambda b=spec: [lower_values(step, b, step.rules)])
  return units
