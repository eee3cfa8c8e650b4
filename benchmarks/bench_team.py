r"""A team of two architectures beside a stacked team of the larger one: RL step time.

  .venv/bin/python -m benchmarks.bench_team

Both arms train `configs/coop.py` (two agents, one policy each, T = 2, G = 4,
--roots roots per step, no SFT warm-up, every program compiled before step 1)
for --steps RL steps, in this process, one after the other:

  stacked   both agents the --large preset, stacked in one engine parameter
            set and one update program (`train.stacked`);
  team      agent 0 the --large preset, agent 1 the --small one: two groups,
            two engines and two update programs (`train.team`).

Each row: the median over steps 2..N of `time/step`, `time/rollout`,
`time/generation` and `time/train` (seconds), and `engine/slot_occupancy`.
The models are fresh presets (no warm-up) whose samples of a task are alike;
raw returns with a step penalty (no zero-variance filter) make every sample
train, so the rows compare the programs, not what the agents say.
"""

import json
import os
import platform
import shutil
import statistics
import sys
import tempfile

from absl import app, flags

from configs import coop
from mtrl_jax import metrics
from mtrl_jax.run import rl

_STEPS = flags.DEFINE_integer("steps", 6, "RL steps per arm (the first is not counted)")
_ROOTS = flags.DEFINE_integer("roots", 16, "roots (tasks) per RL step")
_LARGE = flags.DEFINE_string("large", "small", "preset of the stacked agents and team agent 0")
_SMALL = flags.DEFINE_string("small", "tiny", "preset of team agent 1")
_ARMS = flags.DEFINE_list("arms", ["stacked", "team"], "arms to run, in order")

KEYS = ("time/step", "time/rollout", "time/generation", "time/train", "engine/slot_occupancy")


def arm_config(arm: str):
  """The coop config of one arm (module docstring)."""
  c = coop.get_config()
  c.model.preset = _LARGE.value
  c.sft.steps = 0
  c.rl.steps = _STEPS.value
  c.rl.roots_per_step = _ROOTS.value
  c.rl.dump_every = 0
  c.rl.precompile = True
  c.eval.every = _STEPS.value  # held-out evaluation at step 0 and the last only
  c.eval.num_tasks = 8
  c.checkpoint.every = _STEPS.value
  # Fresh presets' samples of a task are alike (zero-variance groups): raw returns with
  # a step penalty give every sample an advantage, so every step trains.
  c.tree.advantage_mode = "raw"
  c.reward.step_penalty = -0.05
  c.rl.zero_variance_filter = False
  if arm == "team":
    c.agents.presets = ("", _SMALL.value)
  elif arm != "stacked":
    raise ValueError(f"--arms entry {arm!r}; allowed: 'stacked', 'team'")
  return c


def medians(workdir: str) -> dict:
  """Medians of `KEYS` over the RL steps after the first."""
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  rows = [r for r in rows if r.get("step", 0) >= 2 and "time/step" in r]
  return {k: statistics.median(r[k] for r in rows) for k in KEYS}


def main(argv):
  del argv
  metrics.plot_metrics = lambda *args, **kwargs: None  # no curves.png: seconds per run
  print(" ".join(["python -m benchmarks.bench_team"] + sys.argv[1:]))
  print(
      f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
      f"load average {os.getloadavg()[0]:.1f} at start"
  )
  results = {}
  tmp = tempfile.mkdtemp(prefix="bench_team_")
  try:
    for arm in _ARMS.value:
      workdir = os.path.join(tmp, arm)
      rl.run(arm_config(arm), workdir, progress=False)
      results[arm] = medians(workdir)
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  agents = {
      "stacked": f"{_LARGE.value} + {_LARGE.value}",
      "team": f"{_LARGE.value} + {_SMALL.value}",
  }
  print(f"load average {os.getloadavg()[0]:.1f} at the end")
  print("| arm | agents | step s | rollout s | generation s | train s | slot occupancy |")
  print("|---|---|---|---|---|---|---|")
  for arm, m in results.items():
    print(
        f"| {arm} | {agents[arm]} | {m['time/step']:.2f} | {m['time/rollout']:.2f} | "
        f"{m['time/generation']:.2f} | {m['time/train']:.2f} | "
        f"{m['engine/slot_occupancy']:.2f} |"
    )


if __name__ == "__main__":
  app.run(main)
