r"""Start-up time: launch to the first RL step, and precompilation, cold and warm.

  .venv/bin/python -m benchmarks.bench_startup
  .venv/bin/python -m benchmarks.bench_startup --runs=demo --threads=1,2
  .venv/bin/python -m benchmarks.bench_startup --runs=demo --train_threads=1,2
  .venv/bin/python -m benchmarks.bench_startup --runs=launch

Every measurement is a fresh process with its own compilation cache directory
(`compile_cache`, mtrl_jax/compile_cache.py): 'cold' starts it empty, 'warm'
is a second process on the directory the cold one filled, as a second run or
sweep arm on the same machine finds it. Runs:

  coop         `configs/coop.py:smoke=True` through `python -m experiments.train`
               (compiles lazily): seconds from launch until step 1's metrics row
               is written, and the row's `time/first_step` (from the start of
               `rl.train`: after imports and validation).
  coop_pre     the same with `rl.precompile=True`: every engine and train-step
               program compiled before step 1.
  launch       the demo (`configs/calculator.py`) through `python -m
               experiments.train` with `rl.steps=1`: its SFT warm-up (the
               train-step programs compiling beside it), the engine's programs,
               the step-0 evaluation and the first RL update; the precompile
               column's train seconds overlap the warm-up.
  demo         `configs/calculator.py` (the demo): `shapes.precompile` alone, in a
               process that builds the run's parts and compiles every program
               `rl.train` precompiles (no SFT warm-up, no RL step), the
               engine's `--threads` programs at a time and the train step's
               `--train_threads` (a run's: 1).

Targets on 2 quiet cores (docs/performance.md, "Start-up time"): coop cold at
most 60 s to the first RL step, warm at most 15 s; the demo's precompilation at
most half of 146 s; the demo's launch to its first RL update, cold, at most 120 s.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COOP = "--config=configs/coop.py:smoke=True"
# The command-line arguments of each run through `experiments.train`.
_TRAIN_RUNS = {
    "coop": [COOP, "--config.rl.precompile=False"],
    "coop_pre": [COOP, "--config.rl.precompile=True"],
    "launch": ["--config=configs/calculator.py", "--config.rl.steps=1"],
}

_RUNS = flags.DEFINE_list(
    "runs", ["coop", "coop_pre", "demo"], "coop, coop_pre, launch and/or demo"
)
_THREADS = flags.DEFINE_list(
    "threads", ["2"], "demo: engine programs compiled at a time (each a cold and a warm row)"
)
_TRAIN_THREADS = flags.DEFINE_list(
    "train_threads", ["1"], "demo: train-step programs compiled at a time (rows per value)"
)
_WORKER = flags.DEFINE_string("worker", None, "internal: 'demo' runs one precompilation")
_CACHE = flags.DEFINE_string("cache", "", "internal: the worker's compile_cache")


def _demo_worker(cache: str, threads: int, train_threads: int) -> dict:
  """Builds the demo's parts and precompiles them as `rl.train` does (this process)."""
  from configs import calculator
  from mtrl_jax.run import components, experiment, shapes

  c = calculator.get_config()
  c.compile_cache = cache
  exp = experiment.start(c)
  parts = components.build(exp)
  state = parts.policies.init_state()
  info = shapes.precompile(
      parts.shapes,
      *parts.compile_targets(state.params),
      threads=threads,
      train_threads=train_threads,
  )
  return {**info, "backend_compiles": parts.census.counts()["compiles/backend_total"]}


def _first_step_row(path: str):
  if not os.path.exists(path):
    return None
  with open(path) as f:
    for line in f:
      if line.endswith("\n"):
        row = json.loads(line)
        if row.get("step") == 1:
          return row
  return None


def _train(cache: str, workdir: str, args: list) -> dict:
  """One run of `experiments.train` with `args`: launch -> step 1's metrics row
  (polled), and the run's figures."""
  cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      *args,
      f"--workdir={workdir}",
      f"--config.compile_cache={cache}",
      "--progress=false",
  ]
  t0 = time.perf_counter()
  proc = subprocess.Popen(
      cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
  )
  metrics, row, to_first = os.path.join(workdir, "metrics.jsonl"), None, None
  while proc.poll() is None:
    if row is None:
      row = _first_step_row(metrics)
      if row is not None:
        to_first = time.perf_counter() - t0
    time.sleep(0.05)
  out = proc.stdout.read()
  wall = time.perf_counter() - t0
  if proc.returncode:
    raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}:\n{out[-3000:]}")
  row = row or _first_step_row(metrics)
  with open(os.path.join(workdir, "summary.json")) as f:
    pre = json.load(f).get("precompile")
  return {
      "to_first": to_first,
      "first_step": row["time/first_step"],
      "wall": wall,
      "precompile": pre,
      "backend_compiles": row["compiles/backend_total"],
  }


def _demo(cache: str, threads: int, train_threads: int) -> dict:
  cmd = [
      sys.executable,
      "-m",
      "benchmarks.bench_startup",
      "--worker=demo",
      f"--cache={cache}",
      f"--threads={threads}",
      f"--train_threads={train_threads}",
  ]
  t0 = time.perf_counter()
  out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"{' '.join(cmd)} exited {out.returncode}:\n{out.stderr[-3000:]}")
  info = json.loads(out.stdout.strip().splitlines()[-1])
  return {
      "to_first": None,
      "first_step": None,
      "wall": time.perf_counter() - t0,
      "precompile": info,
      "backend_compiles": info["backend_compiles"],
  }


def _fmt(x, spec=".1f"):
  return "-" if x is None else format(x, spec)


def _row(name: str, kind: str, r: dict, entries: int) -> str:
  pre = r["precompile"]
  pre_s = (
      "lazy"
      if pre is None
      else (
          f"{pre['engine_seconds'] + pre['train_seconds']:.1f} = {pre['engine_seconds']} "
          f"({pre['engine_programs']}) + {pre['train_seconds']} ({pre['train_programs']})"
      )
  )
  return (
      f"| {name} | {kind} | {_fmt(r['to_first'])} | {_fmt(r['first_step'])} | {pre_s} | "
      f"{int(r['backend_compiles'])} | {entries} | {r['wall']:.1f} |"
  )


def main(argv):
  del argv
  if _WORKER.value == "demo":
    threads, train_threads = int(_THREADS.value[0]), int(_TRAIN_THREADS.value[0])
    print(json.dumps(_demo_worker(_CACHE.value, threads, train_threads)), flush=True)
    return
  unknown = sorted(set(_RUNS.value) - {*_TRAIN_RUNS, "demo"})
  if unknown:
    raise app.UsageError(
        f"--runs={','.join(_RUNS.value)}; allowed: {', '.join([*_TRAIN_RUNS, 'demo'])}"
    )
  print("command: python -m benchmarks.bench_startup " + " ".join(sys.argv[1:]))
  print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
  print(
      "| run | cache | launch -> step 1 row s | time/first_step s | precompile s "
      "= engine (programs) + train (programs) | backend compiles | cache entries after | process s |"
  )
  print("|---|---|---|---|---|---|---|---|")
  tmp = tempfile.mkdtemp(prefix="bench_startup_")
  try:
    jobs = []
    for run in _RUNS.value:
      if run == "demo":
        jobs += [
            (f"demo, {t} + {tt} threads", lambda c, w, t=int(t), tt=int(tt): _demo(c, t, tt))
            for t in _THREADS.value
            for tt in _TRAIN_THREADS.value
        ]
      else:
        jobs.append((run, lambda c, w, a=_TRAIN_RUNS[run]: _train(c, w, a)))
    for i, (name, fn) in enumerate(jobs):
      cache = os.path.join(tmp, f"cache_{i}")
      for kind in ("cold", "warm"):
        r = fn(cache, os.path.join(tmp, f"run_{i}_{kind}"))
        print(_row(name, kind, r, len(os.listdir(cache))), flush=True)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
