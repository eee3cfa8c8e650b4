"""The RL loop's rollouts: on time (`rl.max_staleness=0`) or one step ahead of the update (1).

With max_staleness 0 step t's rollout runs when step t begins, with the
parameters after update t - 1: on-policy, the loop exactly as it always ran.
With 1 the rollout of step t + 1 starts on a background thread as soon as
step t's rollout is back, with the parameters update t starts from (so rollout
t + 1 samples with the parameters of update t - 1), and runs while update t
trains: the device and the environments work on the next batch during the
update. The samples' behaviour logprobs are the sampler's; the update's
clipped ratio takes the trainer's own old logprobs and `loss.is_correction`
(TIS / MIS) corrects for the one step between them. Which parameters sample
which step is fixed by the step alone, so the run is deterministic and a
resumed run (the checkpoint keeps the behaviour parameters and the task
stream with the in-flight rollout's draw undone, `data.CurriculumStream.rewound`)
continues as if never stopped. Evaluation waits for an in-flight rollout (they share the
engine).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import gc
import time
from typing import Any, Optional

import jax

from mtrl_jax import distributed
from mtrl_jax.rollout import expand_tree
from mtrl_jax.rollout.critic import critic_advantages
from mtrl_jax.rollout.stats import engine_metrics


def render_totals(renderers) -> dict:
  """The re-tokenisation counters (cumulative) of the agents' renderers, each renderer
  counted once (`EnvTransition.renderers`: one per agent, often the same one)."""
  total: dict = {}
  for r in {id(r): r for r in renderers}.values():
    for k, v in r.metrics().items():
      if not k.endswith("_rate"):
        total[k] = total.get(k, 0) + v
  return total


def text_counts(renderers, since: dict) -> dict:
  """The renderers' re-tokenisation counters since the snapshot `since` (a
  `render_totals`), with this span's mismatch rate."""
  now = render_totals(renderers)
  out = {k: v - since.get(k, 0) for k, v in now.items() if not k.endswith("_rate")}
  checked = out.get("text/completions_checked", 0)
  out["text/retokenize_mismatch_rate"] = out.get("text/retokenize_mismatches", 0) / max(checked, 1)
  return out


@dataclasses.dataclass
class Rollout:
  """One step's rollout: this process's tree, its train batch and metrics."""

  step: int
  tree: Any
  batch: Optional[dict]
  batch_metrics: dict
  engine_metrics: dict  # `rollout.stats.engine_metrics` of this process's rollout
  staleness: int  # updates between the sampling parameters and the update they feed
  text_counts: dict  # the renderer's re-tokenisation counts during this rollout
  critic_batch: Any = None  # a separate critic's train batch (`train.separate_critic`)


class RolloutProducer:
  """Starts step rollouts (`submit`) and hands them back in order (`result`).

  With rollouts ahead (`rl.max_staleness=1`) Python's cyclic garbage collector
  runs on the main thread alone, between steps: it is off from the start to
  `close`, and `result` collects (the young generations every step, all of them
  every `FULL_COLLECT_EVERY` steps) while no rollout runs. An automatic
  collection would run on whichever thread allocated last, finalising the main
  thread's garbage (train states, batches) on the producer's thread mid-rollout;
  one stale run in nine once died of a segmentation fault in the collector on
  that thread (docs/results.md; `benchmarks/crash_loop.py` is the loop that
  looks for it).
  """

  FULL_COLLECT_EVERY = 10

  def __init__(self, parts, stream, critic_state=None):
    # critic_state: a separate critic's current train state (a callable; rollouts with a
    # critic run on time, after the previous step's updates).
    self.parts, self.stream, self.critic_state = parts, stream, critic_state
    self.ahead = parts.exp.rl.max_staleness > 0
    self._pool = concurrent.futures.ThreadPoolExecutor(1) if self.ahead else None
    self._pending: Optional[concurrent.futures.Future] = None
    self._collector_was_on = self.ahead and gc.isenabled()
    if self.ahead:
      gc.disable()
    self._results = 0

  @property
  def pending(self) -> bool:
    return self._pending is not None

  def submit(self, step: int, params, version: int) -> None:
    """Starts step `step`'s rollout with `params` (the policy after `version` updates).

    Takes the step's tasks from the stream now, on the calling thread, so the
    stream advances in step order.
    """
    exp = self.parts.exp
    tasks = self.stream.next(exp.rl.roots_per_step)  # every process: the same stream
    key = jax.random.fold_in(self.parts.key, step)
    staleness = step - 1 - version

    def produce():
      parts = self.parts
      before = render_totals(parts.transition.renderers)  # nothing else renders meanwhile
      parts.rollout_policy.set_states(parts.policies.sampler_states(params))
      roots = parts.transition.root_states(parts.factory, tasks[distributed.share(len(tasks))])
      tree = expand_tree(
          exp.tree, parts.rollout_policy, parts.transition, roots, key, executor=parts.workers
      )
      critic = critic_batch = None
      if exp.critic.enabled:  # the critic's advantages replace the sibling baselines
        if parts.critic is not None:  # a model of its own
          values, rows = parts.critic.values(self.critic_state().params, tree)
        else:  # a value head on the policies
          values = parts.policies.critic_values(params, tree, parts.batch_cfg)
        adv, targets = critic_advantages(tree, values, exp.critic.advantage_config())
        for node, adv_NxG in zip(tree.nodes, adv):
          node.advantages_NxG = adv_NxG
        if parts.critic is not None:
          critic_batch = parts.critic.batch(tree, values, targets, rows)
        else:
          critic = (values, targets)
      batch, batch_m = parts.policies.make_batch(tree, parts.batch_cfg, critic)
      return Rollout(
          step,
          tree,
          batch,
          batch_m,
          engine_metrics(tree),
          staleness,
          text_counts(parts.transition.renderers, before),
          critic_batch,
      )

    future = concurrent.futures.Future()
    if self._pool is None:
      future.set_result(produce())
    else:
      future = self._pool.submit(produce)
    self._pending = future

  def result(self) -> tuple[Rollout, float]:
    """The submitted rollout and how long the caller waited for it."""
    t0 = time.perf_counter()
    out = self._pending.result()
    self._pending = None
    if self.ahead:  # on the main thread, no rollout running (see the class docstring)
      self._results += 1
      gc.collect(2 if self._results % self.FULL_COLLECT_EVERY == 0 else 1)
    return out, time.perf_counter() - t0

  def wait(self) -> None:
    """Blocks until an in-flight rollout is done (the engine is then free)."""
    if self._pending is not None:
      concurrent.futures.wait([self._pending])

  def close(self) -> None:
    """Waits for an in-flight rollout and gives the collector back; a second call does
    nothing more."""
    self.wait()
    if self._pool is not None:
      self._pool.shutdown()
    if self._collector_was_on:
      self._collector_was_on = False
      gc.enable()
