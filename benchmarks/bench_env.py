r"""Host-side cost of one environment step (the calculator task), in Python.

Every policy turn of an RL step goes through `step_environment`: the
environment's `react_to` (parsing, the `calculate` tool, grading) under the
framework's timeout guard, fault classification, reward composition and the
rendering of the new turns into the token ledger. On an accelerator this host
work, not the model, bounds a small model's RL step (docs/performance.md), so
it is measured on its own here: golden episodes of `--tasks` train tasks
(4 environment steps each: two tool calls, two answers), replayed through
`rollout_scripted` with the demo config's limits, reward and renderer.

  guarded     `react_timeout_s` from the config (30 s): react_to runs on a
              pooled worker thread so a hung environment becomes a timeout
              fault;
  inline      `react_timeout_s=None`: no guard, the floor of this path.

Also reported: `Environment.fork` (a deep copy, once per tree branch) and
`Thread.fork`. Each figure is the median of `--repeats` timed passes after
one untimed pass.

Command (CPU, about 10 s):
  .venv/bin/python -m benchmarks.bench_env
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time
import timeit

from absl import app, flags

from configs import calculator as calculator_config
from mtrl_jax.envs import rollout_scripted
from mtrl_jax.run import builders, components
from mtrl_jax.run import experiment as exp_lib
from mtrl_jax.tasks import calculator

_TASKS = flags.DEFINE_integer("tasks", 300, "golden episodes per timed pass")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed passes (the median is reported)")


def _pass(factory, episodes, limits, reward, renderer) -> tuple[float, int]:
  steps = 0
  start = time.perf_counter()
  for task, texts in episodes:
    outs, _ = rollout_scripted(
        factory.create_environment(task), texts, limits, reward_cfg=reward, renderer=renderer
    )
    steps += len(outs)
    assert outs[-1].done and outs[-1].reward.outcome > 0, "golden episode failed"
  return time.perf_counter() - start, steps


def main(argv):
  del argv
  exp = exp_lib.build(calculator_config.get_config())
  renderer = builders.make_renderer(
      exp.tokenizer, builders.make_tokenizer(exp.tokenizer, exp.model.path)
  )
  factory = components.make_factory(exp)
  tasks = [calculator.make_task("train", i) for i in range(_TASKS.value)]
  episodes = [
      (t, [c for r, c in calculator.golden_conversation(t) if r == "assistant"]) for t in tasks
  ]
  rows = []
  for name, timeout in (("guarded", exp.env.react_timeout_s), ("inline", None)):
    limits = dataclasses.replace(exp.env.limits, react_timeout_s=timeout)
    _pass(factory, episodes, limits, exp.reward, renderer)  # warm-up
    times, steps = zip(
        *(_pass(factory, episodes, limits, exp.reward, renderer) for _ in range(_REPEATS.value))
    )
    per_step = statistics.median(times) / steps[0]
    rows.append((f"step_environment, {name} (react_timeout_s={timeout})", steps[0], per_step * 1e3))
  env = factory.create_environment(tasks[0])
  thread = env.initial_thread()
  for name, fn in (("Environment.fork (deepcopy)", env.fork), ("Thread.fork", thread.fork)):
    n = 2000
    per = statistics.median(timeit.repeat(fn, number=n, repeat=_REPEATS.value)) / n
    rows.append((name, n, per * 1e3))
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"{os.cpu_count()} cores; calculator task, {_TASKS.value} golden episodes per pass, "
      f"median of {_REPEATS.value} passes"
  )
  print("| path | calls per pass | ms per call | calls/s |")
  print("|---|---|---|---|")
  for name, n, ms in rows:
    print(f"| {name} | {n} | {ms:.3f} | {1e3 / ms:,.0f} |")


if __name__ == "__main__":
  app.run(main)
