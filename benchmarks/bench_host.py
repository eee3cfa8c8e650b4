r"""Where the host time of one RL step goes: a profile of every Python thread, by category.

  .venv/bin/python -m benchmarks.bench_host
  .venv/bin/python -m benchmarks.bench_host --config=configs/calculator.py:smoke=True --steps=2

Builds the run's parts as `rl.train` does (`components.build`, `RunState`,
`RolloutProducer`; the programs `rl.precompile` names are compiled first when the
config asks for it), starts from the initial (random) policy, or after `--sft_steps`
steps of the config's SFT warm-up (without its success checks), with no evaluation or
checkpoint, and with `--all_groups` (default) keeps every group in the train batch
(`rl.zero_variance_filter=False`: the random policy's groups all score alike, and the
filter would leave no train step). It runs `--warmup` RL steps to compile, then
profiles `--steps` steps of the loop's body (rollout, train batch, train step, step
metrics).

Every Python thread is profiled: the main thread with its own `cProfile.Profile`, and
each thread started after that (the run's environment-step pool, `env.workers`; the
rollout producer's thread when rollouts run ahead) with one of its own, enabled by a
`threading.setprofile` hook when the profiled steps begin. The environment-step pool
lives for the run, and the calculator tool runs on `envs/faults.py`'s pooled timed-call
workers; the benchmark gives the profiled steps a fresh pool of each, so their threads
start, and are profiled, there too (`env.workers='processes'`: the worker processes are
not profiled, only the engine's side of their steps). The
output names the threads covered, and the threads running before (idle in the profiled
steps, not covered).

Attribution. Each function's self time (tottime) goes to a category by its module path
(`RULES`: path prefix, optionally a function-name fragment, first match wins; unmatched
Python goes to "other python"). C functions (numpy, builtins) take the category of their
callers, in proportion to the time spent under each caller, except:
  - jax/jaxlib C functions that hand data to or wait on the device (`DEVICE_C`:
    block_until_ready, array to numpy, device_put, executables, ...) -> "device / waiting",
    as do the jax Python functions that block on a result or copy to the device
    (`Array._value`, `block_until_ready`, `batched_device_put`; in `RULES`);
  - lock acquires (`with lock` too) and queue waits (`WAIT_C`) -> "thread waits": a
    thread blocked on another (the engine waiting for environment steps, idle pool
    workers). These are listed apart, with where they wait, and left out of the host
    total.
A jitted call runs through a C object that cProfile does not see as a call, so its
dispatch and any synchronous execution counts as its caller's self time; on the CPU
backend most of a program's execution is waited for in `DEVICE_C` functions instead.
Shares are of the step's wall time; threads overlap, so categories can add up past 100%.
"""

from __future__ import annotations

import cProfile
import collections
import os
import re
import sys
import threading
import time

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file(
    "config", os.path.join("configs", "calculator.py"), "the run's config file"
)
_STEPS = flags.DEFINE_integer("steps", 3, "RL steps profiled")
_WARMUP = flags.DEFINE_integer("warmup", 1, "RL steps run before profiling (compiles)")
_TOP = flags.DEFINE_integer("top", 15, "functions listed by self time")
_SFT_STEPS = flags.DEFINE_integer(
    "sft_steps", 0, "SFT warm-up steps first (fixed count, no success checks); 0: random policy"
)
_ALL_GROUPS = flags.DEFINE_bool(
    "all_groups",
    True,
    "set rl.zero_variance_filter=False: the random policy's groups are all equal, and the "
    "filter would leave no batch and no train step to profile",
)

DEVICE = "device / waiting"
WAITS = "thread waits"
OTHER = "other python"
C_LABEL = "C (callers' categories)"

# (module path prefix, function-name fragments or None for any, category); first match wins.
# Paths are relative to the repository root or site-packages (`module_path`).
RULES = (
    ("mtrl_jax/sampling/engine.py", ("submit", "_admit"), "admission"),
    ("mtrl_jax/sampling/admission.py", None, "admission"),
    ("mtrl_jax/sampling/calls.py", ("admit",), "admission"),
    ("mtrl_jax/sampling/slots.py", ("take", "available", "lcp"), "admission"),
    ("mtrl_jax/sampling/", None, "sampling bookkeeping"),
    ("mtrl_jax/rollout/engine.py", None, "engine scheduling"),
    ("mtrl_jax/rollout/inflight.py", None, "engine scheduling"),
    ("mtrl_jax/rollout/policy.py", None, "engine scheduling"),
    ("mtrl_jax/run/rollouts.py", None, "engine scheduling"),
    ("mtrl_jax/rollout/tree_packing.py", None, "packing"),
    ("mtrl_jax/rollout/batching.py", None, "packing"),
    ("mtrl_jax/rollout/train_batch.py", None, "packing"),
    ("mtrl_jax/buckets.py", None, "packing"),
    ("mtrl_jax/envs/grades.py", None, "grading"),
    ("mtrl_jax/envs/reward.py", None, "grading"),
    ("mtrl_jax/graders/", None, "grading"),
    ("mtrl_jax/tasks/", ("grade", "score", "similarity", "success"), "grading"),
    ("mtrl_jax/rollout/env_transition.py", None, "environment react_to"),
    ("mtrl_jax/envs/", None, "environment react_to"),
    ("mtrl_jax/tasks/", None, "environment react_to"),
    ("mtrl_jax/text/", None, "rendering and tokenising"),
    ("mtrl_jax/rollout/", None, "tree bookkeeping"),
    ("mtrl_jax/train/step.py", None, "train step dispatch"),
    ("mtrl_jax/train/policies.py", None, "train step dispatch"),
    ("mtrl_jax/train/update.py", None, "train step dispatch"),
    ("mtrl_jax/train/forward.py", None, "train step dispatch"),
    ("mtrl_jax/train/objectives.py", None, "train step dispatch"),
    ("mtrl_jax/train/optim.py", None, "train step dispatch"),
    ("mtrl_jax/losses/", None, "train step dispatch"),
    ("optax/", None, "train step dispatch"),
    ("flax/", None, "train step dispatch"),
    ("jax/_src/array.py", ("_value", "block_until_ready", "__array__"), DEVICE),
    ("jax/_src/api.py", ("block_until_ready", "device_get"), DEVICE),
    ("jax/_src/interpreters/pxla.py", ("batched_device_put",), DEVICE),
    ("jax/", None, "jax python (dispatch, pytrees)"),
    ("jaxlib/", None, "jax python (dispatch, pytrees)"),
)
CATEGORIES = (
    "engine scheduling",
    "admission",
    "sampling bookkeeping",
    "environment react_to",
    "rendering and tokenising",
    "grading",
    "tree bookkeeping",
    "packing",
    "train step dispatch",
    "jax python (dispatch, pytrees)",
    DEVICE,
    OTHER,
)
# Fragments of a C function's pstats name (`{method 'x' of 'y' objects}`, `<built-in ...>`).
DEVICE_C = (
    "block_until_ready",
    "_single_device_array_to_np_array",
    "device_put",
    "batched_device_put",
    "copy_to_host",
    "_copy_single_device_array_to_host_async",
    "jaxlib",
    "xla_extension",
    "ArrayImpl",
    "PjitFunction",
)
WAIT_C = (
    "'acquire' of '_thread.lock'",
    "'acquire' of '_thread.RLock'",
    "'__enter__' of '_thread.lock'",
    "'__enter__' of '_thread.RLock'",
    "'get' of '_queue.SimpleQueue'",
    "built-in method time.sleep",
    "'poll' of 'select",
)


def module_path(filename: str) -> str:
  """`filename` relative to the repository root or site-packages ('~' for C functions)."""
  f = filename.replace(os.sep, "/")
  for marker in ("/site-packages/", "/dist-packages/"):
    if marker in f:
      return f.rsplit(marker, 1)[1]
  for top in ("mtrl_jax/", "benchmarks/", "configs/", "experiments/"):
    i = f.rfind("/" + top)
    if i >= 0:
      return f[i + 1 :]
    if f.startswith(top):
      return f
  return f


def category(filename: str, func: str) -> str:
  """The category of a Python function's self time, by `RULES` (unmatched: other python)."""
  path = module_path(filename)
  for prefix, names, cat in RULES:
    if path.startswith(prefix) and (names is None or any(n in func for n in names)):
      return cat
  return OTHER


def c_category(name: str) -> str | None:
  """A C function's own category (device / waiting, thread waits), or None: its callers'."""
  if any(w in name for w in WAIT_C):
    return WAITS
  if any(d in name for d in DEVICE_C):
    return DEVICE
  return None


def attribute(stats: dict) -> tuple[dict, dict]:
  """Self time per category, and per function, from a `pstats.Stats.stats` dict."""
  by_cat: dict[str, float] = collections.defaultdict(float)
  by_func: dict[tuple, float] = collections.defaultdict(float)

  def own(key):
    filename, _, func = key
    if filename == "~":
      return c_category(func)
    return category(filename, func)

  for key, (_, _, tt, _, callers) in stats.items():
    by_func[key] += tt
    cat = own(key)
    if cat is not None:
      by_cat[cat] += tt
      continue
    # A C function: its callers' categories, in proportion to the time under each.
    parts = {c: v[2] for c, v in callers.items()}
    total = sum(parts.values())
    if not parts or total <= 0:
      by_cat[OTHER] += tt
      continue
    for c, t in parts.items():
      by_cat[own(c) or OTHER] += tt * t / total
  return by_cat, by_func


class ThreadProfiles:
  """A `cProfile.Profile` for the main thread and one for every thread started between
  `start()` and `stop()`. Threads already running at `start()` are not covered (Python
  3.11 cannot profile another running thread); `uncovered` names them. No profiler is
  touched from another thread while its own thread runs.

  From Python 3.12 `cProfile` runs on `sys.monitoring`, whose events are process-wide
  and which holds one profiler at a time: the main thread's profiler then records every
  thread (`merged`), already running ones too, and no per-thread profiler is started.
  """

  merged = sys.version_info >= (3, 12)

  def __init__(self):
    self._lock = threading.Lock()
    self.profiles: list[tuple[threading.Thread, cProfile.Profile]] = []
    self._main = cProfile.Profile()
    self.uncovered: list[str] = []

  def _hook(self, frame, event, arg):
    del frame, event, arg
    prof = cProfile.Profile()
    with self._lock:
      self.profiles.append((threading.current_thread(), prof))
    prof.enable()  # replaces this hook for the rest of the thread

  def start(self) -> None:
    main = threading.main_thread()
    if not self.merged:
      self.uncovered = [t.name for t in threading.enumerate() if t is not main]
      threading.setprofile(self._hook)
    self._main.enable()

  def stop(self) -> None:
    self._main.disable()
    if not self.merged:
      threading.setprofile(None)

  def stats(self) -> list[tuple[str, dict]]:
    """(thread name, pstats dict) per profiled thread, the main thread first; a thread
    that recorded nothing after `start()` (a worker idle throughout) is left out."""
    with self._lock:
      profiles = [(threading.main_thread(), self._main), *self.profiles]
    out = []
    for thread, prof in profiles:
      prof.create_stats()  # pstats.Stats refuses a profile with no entries
      if prof.stats:
        out.append((thread.name, prof.stats))
    return out


def _build(config):
  from mtrl_jax.run import components, experiment, shapes
  from mtrl_jax.run import warmup
  from mtrl_jax.run.rollouts import RolloutProducer
  from mtrl_jax.run.run_state import RunState

  exp = experiment.start(config)
  parts = components.build(exp)
  policies = parts.policies
  stream = components.make_train_stream(exp, parts.train_tasks)
  run_state = RunState.of(exp, policies, stream, None, critic_model=parts.critic)
  if exp.sft.steps:  # a briefly trained policy
    t0 = time.perf_counter()
    state, _ = warmup.warm_up(parts)
    print(f"SFT warm-up: {exp.sft.steps} steps in {time.perf_counter() - t0:.1f} s", flush=True)
  else:
    state = policies.init_state()  # the initial (random) policy
  run_state.start(state)
  if exp.rl.precompile:
    t0 = time.perf_counter()
    shapes.precompile(
        parts.shapes,
        *parts.compile_targets(run_state.state.params),
        critic=parts.critic,
    )
    print(f"precompiled in {time.perf_counter() - t0:.1f} s", flush=True)
  producer = RolloutProducer(parts, stream, critic_state=lambda: run_state.critic)
  return exp, parts, run_state, producer


def _step(step, exp, parts, run_state, producer) -> dict:
  """The RL loop's body for `step` (rl.py `_train`, without eval, checkpoint, dump)."""
  from mtrl_jax import metrics as metrics_lib
  from mtrl_jax.rollout.gather import gather_tree
  from mtrl_jax.rollout.stats import rollout_metrics

  policies, train_step = parts.policies, parts.policies.train_step
  timer = metrics_lib.StepTimer()
  with timer.section("rollout"):
    if not producer.pending:
      if run_state.behaviour is None:
        producer.submit(step, run_state.state.params, version=step - 1)
      else:
        producer.submit(step, run_state.behaviour, version=max(step - 2, 0))
    rollout, waited = producer.result()
  if producer.ahead:
    run_state.next_rollout_ahead()
    producer.submit(step + 1, run_state.behaviour, version=step - 1)
  batch = rollout.batch
  tree = gather_tree(rollout.tree)
  train_m = {}
  with timer.section("train"):
    if batch is not None and exp.rl.updates_per_step:
      if train_step.objective.recompute_old:
        batch = train_step.old_logprobs(run_state.state.params, batch)
      for _ in range(exp.rl.updates_per_step):
        run_state.state, dm = train_step(run_state.state, run_state.ref, batch)
      train_m = policies.train_metrics(dm)  # fetches the update's metrics (waits for it)
  m = {
      **tree.metrics(),
      **rollout_metrics(tree, exp.eval.success_threshold),
      **rollout.batch_metrics,
      **train_m,
  }
  times = timer.split()
  times["time/rollout_wait"] = waited
  times.update(
      {k: v for k, v in rollout.engine_metrics.items() if k.startswith(("time/", "engine/"))}
  )
  m.update(times)
  return m


LOGGED = (
    "time/step",
    "time/rollout",
    "time/generation",
    "time/environment",
    "time/env_waiting",
    "time/train",
    "engine/slot_occupancy",
)


def thread_kind(name: str) -> str:
  """A thread's name without its pool and worker numbers ('ThreadPoolExecutor-3_0')."""
  if name == threading.main_thread().name:
    return "main"
  return re.sub(r"(-\d+)?(_\d+)?$", "", name)


def report(threads: list[tuple[str, dict]], wall: float, steps: int, top: int) -> str:
  """The markdown table by category, the per-thread split and the top functions."""
  cats: dict[str, float] = collections.defaultdict(float)
  funcs: dict[tuple, float] = collections.defaultdict(float)
  lines = ["| thread | busy s/step | thread waits s/step |", "|---|---|---|"]
  per_name: dict[str, list] = {}
  waiters: dict[tuple, float] = collections.defaultdict(float)  # (thread kind, caller)
  for name, stats in threads:
    by_cat, by_func = attribute(stats)
    for key, (_, _, tt, _, callers) in stats.items():
      if key[0] == "~" and c_category(key[2]) == WAITS:
        if not callers:  # a wait under way when the counts were cleared
          waiters[(thread_kind(name), f"(caller not recorded) {key[2]}")] += tt
        for c, v in callers.items():
          waiters[(thread_kind(name), f"{module_path(c[0])}:{c[1]} {c[2]}")] += v[2]
    for k, v in by_cat.items():
      cats[k] += v
    for k, v in by_func.items():
      funcs[k] += v
    kind = thread_kind(name)
    agg = per_name.setdefault(kind, [0, 0.0, 0.0])
    agg[0] += 1
    agg[1] += sum(v for k, v in by_cat.items() if k != WAITS)
    agg[2] += by_cat.get(WAITS, 0.0)
  for kind, (n, busy, waits) in per_name.items():
    lines.append(
        f"| {kind} ({n} thread{'s' * (n > 1)}) | {busy / steps:.3f} | {waits / steps:.3f} |"
    )
  per_step = wall / steps
  out = [
      "| category | s/step | share of step wall |",
      "|---|---|---|",
  ]
  busy = 0.0
  for cat in CATEGORIES:
    s = cats.get(cat, 0.0) / steps
    busy += s
    out.append(f"| {cat} | {s:.3f} | {100 * s / per_step:.1f}% |")
  out.append(
      f"| **host total (all threads, thread waits apart)** | {busy:.3f} | {100 * busy / per_step:.1f}% |"
  )
  w = cats.get(WAITS, 0.0) / steps
  out.append(f"| thread waits (locks, queues; apart) | {w:.3f} | {100 * w / per_step:.1f}% |")
  out += ["", *lines, "", "thread waits by where they wait (top 8):", ""]
  out += ["| s/step | thread | caller |", "|---|---|---|"]
  for (kind, where), t in sorted(waiters.items(), key=lambda kv: -kv[1])[:8]:
    out.append(f"| {t / steps:.3f} | {kind} | `{where}` |")
  out += ["", f"top {top} functions by self time (all threads):", ""]
  out += ["| s/step | category | function |", "|---|---|---|"]
  for key, tt in sorted(funcs.items(), key=lambda kv: -kv[1])[:top]:
    filename, line, func = key
    cat = c_category(func) if filename == "~" else category(filename, func)
    where = func if filename == "~" else f"{module_path(filename)}:{line} {func}"
    out.append(f"| {tt / steps:.3f} | {cat or C_LABEL} | `{where}` |")
  return "\n".join(out)


def main(argv):
  del argv
  from mtrl_jax.envs import faults

  config = _CONFIG.value
  if _ALL_GROUPS.value:
    config.rl.zero_variance_filter = False
  config.sft.steps = _SFT_STEPS.value
  if _SFT_STEPS.value:
    config.sft.until_success, config.sft.check_every = 0.0, _SFT_STEPS.value
  print("command: python -m benchmarks.bench_host " + " ".join(sys.argv[1:]))
  print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
  profiles = ThreadProfiles()
  exp, parts, run_state, producer = _build(config)
  try:
    step = 0
    for _ in range(_WARMUP.value):
      step += 1
      t0 = time.perf_counter()
      _step(step, exp, parts, run_state, producer)
      print(f"warm-up step {step}: {time.perf_counter() - t0:.1f} s", flush=True)
    before = parts.census.counts()
    rows = []
    # Fresh pools, started in the profiled steps and so profiled (the warm-up's stay idle):
    # the environment steps' (closed, the next step starts a new one) and the calculator
    # tool's timed-call workers (its guard, `envs/faults.py`).
    parts.workers.close()
    faults._WORKERS = faults._TimedWorkers()
    profiles.start()
    t0 = time.perf_counter()
    for _ in range(_STEPS.value):
      step += 1
      rows.append(_step(step, exp, parts, run_state, producer))
    wall = time.perf_counter() - t0
    profiles.stop()
    after = parts.census.counts()
  finally:
    producer.close()
  threads = profiles.stats()
  n = _STEPS.value
  print(
      f"\nprofiled steps {step - n + 1}-{step}: {wall / n:.2f} s wall per step "
      f"(under the profiler); load average {os.getloadavg()[0]:.2f} at the end"
  )
  compiles = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
  print(f"compiles during the profiled steps: {compiles or 'none'}")
  if profiles.merged:
    print("threads covered: every thread, in one profile (Python 3.12+: sys.monitoring)")
  else:
    names = collections.Counter(thread_kind(t) for t, _ in threads)
    print("threads covered: " + ", ".join(f"{k} x{v}" for k, v in names.items()))
  print(
      "threads not covered (running before the profiled steps; idle in them): "
      + (", ".join(profiles.uncovered) or "none")
  )
  print("\nthe run's own metrics for those steps (mean):\n")
  print("| metric | mean | per step |")
  print("|---|---|---|")
  for k in LOGGED:
    vals = [r[k] for r in rows if k in r]
    if vals:
      print(f"| {k} | {sum(vals) / len(vals):.3f} | {', '.join(f'{v:.2f}' for v in vals)} |")
  print("\nhost time by category (self time, all threads):\n")
  print(report(threads, wall, n, _TOP.value))


if __name__ == "__main__":
  app.run(main)
