r"""Rollout time with environment steps on threads vs in worker processes (`env.workers`).

A CPU-heavy environment: the coop task whose every `react_to_joint` first
spends `--react_ms` of pure Python (a counting loop, its length calibrated
once on this process, so the work is fixed whatever the interpreter lock
does). The policy is `testing.FakePolicy` (random byte tokens, no model), so
the rollout is the engine's scheduling plus the environment steps: T = 2,
G = 4 (align), 2 agents, `--roots` roots, 4 + 16 = 20 joint steps per root.

  threads    env.workers='threads': 32 pool threads in this process, one
             interpreter lock for all of them and the engine's loop;
  processes  env.workers='processes': one worker process per CPU
             (`env.max_concurrency=0`), the transition sent once per worker,
             each step's state and outcome pickled.

Each mode: one untimed rollout (it starts the process pool), then the
median of `--repeats` timed rollouts (wall-clock, and the CPU time the
engine's own process spent: under 'threads' it runs every react_to too),
and the serial work the steps hold (steps x react_ms of CPU) for scale.

Command (CPU, about a minute on 2 cores):
  PYTHONPATH=. .venv/bin/python -m benchmarks.bench_workers
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import jax
from absl import app, flags

from mtrl_jax.envs import RewardConfig
from mtrl_jax.rollout import TreeConfig, expand_tree
from mtrl_jax.rollout.env_transition import EnvTransition
from mtrl_jax.rollout.workers import StepWorkers, usable_cpus
from mtrl_jax.tasks import coop
from mtrl_jax.testing import FakePolicy, byte_renderer

_ROOTS = flags.DEFINE_integer("roots", 16, "roots per rollout")
_REACT_MS = flags.DEFINE_float("react_ms", 20.0, "pure-Python milliseconds per react_to")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed rollouts per mode (the median is reported)")
_MODES = flags.DEFINE_list("modes", ["threads", "processes"], "env.workers values to time")


def busy(iterations: int) -> int:
  x = 0
  for i in range(iterations):
    x += i * i % 7
  return x


def calibrate(ms: float) -> int:
  """Loop iterations that take `ms` milliseconds of CPU time on this process (CPU, not
  wall-clock time: on a loaded machine the wall clock counts other processes' turns)."""
  n = 300_000
  t0 = time.process_time()
  busy(n)
  return max(1, int(n * ms / 1e3 / (time.process_time() - t0)))


class BusyCoopEnv(coop.CoopEnv):
  """The coop task whose every joint step first spends a fixed amount of Python."""

  def __init__(self, metadata, iterations: int):
    super().__init__(metadata)
    self.iterations = iterations

  def react_to_joint(self, threads):
    busy(self.iterations)
    return super().react_to_joint(threads)


class BusyFactory:
  outcome_range = (0.0, 1.0)

  def __init__(self, iterations: int):
    self.iterations = iterations

  def create_environment(self, metadata):
    return BusyCoopEnv(metadata, self.iterations)


def _rollout(workers, transition, factory, k: int) -> tuple[float, float, int]:
  """(wall seconds, this process's CPU seconds, joint steps) of one rollout."""
  cfg = TreeConfig(num_turns=2, num_generations=4, num_agents=2)
  roots = transition.root_states(factory, [coop.make_task("train", i) for i in range(_ROOTS.value)])
  policy = FakePolicy(vocab=64, max_new_tokens=8)
  t0, c0 = time.perf_counter(), time.process_time()
  tree = expand_tree(cfg, policy, transition, roots, jax.random.key(k), executor=workers)
  steps = sum(len(n.actions) for n in tree.nodes)
  return time.perf_counter() - t0, time.process_time() - c0, steps


def main(argv):
  del argv
  iterations = calibrate(_REACT_MS.value)
  factory = BusyFactory(iterations)
  rows = []
  for mode in _MODES.value:
    transition = EnvTransition(
        byte_renderer(), num_agents=2, reward_cfg=RewardConfig(shaping_weight=1.0)
    )
    workers = StepWorkers(mode, 0, transition)
    try:
      t0 = time.perf_counter()
      _rollout(workers, transition, factory, 0)  # warm-up: starts the pool
      first = time.perf_counter() - t0
      timed = [_rollout(workers, transition, factory, k + 1) for k in range(_REPEATS.value)]
    finally:
      workers.close()
    seconds = statistics.median(t for t, _, _ in timed)
    cpu = statistics.median(c for _, c, _ in timed)
    rows.append((mode, workers.size, timed[0][2], first, seconds, cpu))
  load = os.getloadavg()
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"{usable_cpus()} of {os.cpu_count()} cores usable, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; "
      f"coop, FakePolicy, T=2 G=4 N=2, {_ROOTS.value} roots, react_to {_REACT_MS.value:g} ms "
      f"of Python ({iterations:,} loop iterations); median of {_REPEATS.value} rollouts"
  )
  base = rows[0][4]
  print(
      "| env.workers | pool | joint steps | react_to CPU (s) | first rollout (s) | "
      "rollout (s) | engine process CPU (s) | speed-up |"
  )
  print("|---|---|---|---|---|---|---|---|")
  for mode, size, steps, first, seconds, cpu in rows:
    work = steps * _REACT_MS.value / 1e3
    print(
        f"| {mode} | {size} | {steps} | {work:.1f} | {first:.2f} | {seconds:.2f} | {cpu:.2f} | "
        f"{base / seconds:.2f}x |"
    )


if __name__ == "__main__":
  app.run(main)
