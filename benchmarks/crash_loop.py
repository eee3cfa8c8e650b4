r"""A reproduction loop for crashes of one-step-stale runs (`rl.max_staleness=1`).

  .venv/bin/python -m benchmarks.crash_loop --runs=30
  .venv/bin/python -m benchmarks.crash_loop --runs=6 --config=demo --steps=20 --gc=aggressive

A stale run samples step t + 1 on the rollout producer's thread while step t
updates on the main thread. One stale demo run in nine died with a
segmentation fault inside Python's garbage collector on that thread
(docs/results.md). Each run here is a fresh process under `-X faulthandler`
(a fatal signal prints every thread's Python stack into the run's log), with
a curriculum (the stream is drawn on the main thread while the producer
works), and with `--gc=aggressive` the collector runs every 50 allocations
(`gc.set_threshold(50, 5, 5)`), so a collection lands on the producer thread
far more often than in a normal run. `--malloc_debug` adds PYTHONMALLOC=debug.

Prints one row per run (exit status, RL steps done, seconds) and the crash
rate with its exact 95% upper bound (Clopper-Pearson: 1 - 0.05^(1/n), about
3/n, when no run crashed), so "none in n" says what rate it rules out.
Logs of crashed runs are kept under --logs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from benchmarks.rates import upper_bound

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = {"smoke": "configs/calculator.py:smoke=True", "demo": "configs/calculator.py"}

_RUNS = flags.DEFINE_integer("runs", 30, "fresh stale runs")
_CONFIG = flags.DEFINE_enum("config", "smoke", list(CONFIGS), "which calculator config")
_STEPS = flags.DEFINE_integer("steps", 12, "RL steps per run")
_GC = flags.DEFINE_enum(
    "gc", "aggressive", ["default", "aggressive"], "collector thresholds: Python's, or (50, 5, 5)"
)
_MALLOC_DEBUG = flags.DEFINE_bool("malloc_debug", False, "run with PYTHONMALLOC=debug")
_LOGS = flags.DEFINE_string("logs", "runs/crash_loop", "where crashed runs' logs are kept")

_LAUNCH = """
import gc, runpy, sys
if {aggressive}:
  gc.set_threshold(50, 5, 5)
sys.argv = {argv!r}
runpy.run_module("experiments.train", run_name="__main__")
"""


def one_run(index: int, workdir: str) -> dict:
  argv = [
      "experiments/train.py",
      f"--config={CONFIGS[_CONFIG.value]}",
      f"--workdir={workdir}",
      f"--config.rl.steps={_STEPS.value}",
      "--config.rl.max_staleness=1",
      "--config.loss.is_correction=tis",
      "--config.curriculum.enabled=True",
      f"--config.seed={index}",
      "--config.rl.dump_every=0",
      "--progress=false",
  ]
  env = dict(os.environ, PYTHONPATH=ROOT)
  if _MALLOC_DEBUG.value:
    env["PYTHONMALLOC"] = "debug"
  code = _LAUNCH.format(aggressive=_GC.value == "aggressive", argv=argv)
  t0 = time.time()
  proc = subprocess.run(
      [sys.executable, "-X", "faulthandler", "-c", code],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
  )
  steps = 0
  path = os.path.join(workdir, "metrics.jsonl")
  if os.path.exists(path):
    with open(path) as f:
      steps = max((json.loads(line)["step"] for line in f if line.strip()), default=0)
  return {
      "run": index,
      "status": proc.returncode,
      "steps": steps,
      "seconds": round(time.time() - t0, 1),
      "log": proc.stdout + proc.stderr,
  }


def status_name(code: int) -> str:
  return signal.Signals(-code).name if code < 0 else str(code)


def main(argv):
  del argv
  print(
      f"| run | exit | RL steps | seconds |   ({_CONFIG.value}, {_STEPS.value} steps, "
      f"gc={_GC.value}, malloc_debug={_MALLOC_DEBUG.value})"
  )
  print("|---|---|---|---|")
  crashes = steps = 0
  for i in range(_RUNS.value):
    with tempfile.TemporaryDirectory() as tmp:
      r = one_run(i, os.path.join(tmp, "run"))
    steps += r["steps"]
    if r["status"] != 0:
      crashes += 1
      os.makedirs(_LOGS.value, exist_ok=True)
      log = os.path.join(_LOGS.value, f"run_{i}.log")
      with open(log, "w") as f:
        f.write(r["log"])
    print(f"| {i} | {status_name(r['status'])} | {r['steps']} | {r['seconds']} |", flush=True)
  runs = _RUNS.value
  print(
      f"\n{crashes} of {runs} runs failed ({steps} RL steps); the failure rate is at most "
      f"{upper_bound(crashes, runs):.3f} (95% upper bound)"
      + (f"; logs under {_LOGS.value}" if crashes else "")
  )
  if not crashes:
    shutil.rmtree(_LOGS.value, ignore_errors=True)


if __name__ == "__main__":
  app.run(main)
