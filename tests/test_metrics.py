"""Metrics: jsonl + TensorBoard files parse back, plots are PNGs, timers, compile census."""

import glob
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.test_event_file import read_events
from mtrl_jax.metrics import (
    DEFAULT_PLOT_KEYS,
    CompileCensus,
    MetricsWriter,
    StepTimer,
    _match_keys,
    count_calls,
    plot_metrics,
    read_metrics,
)


def _rows():
  return [
      {
          "reward": 0.1 * s,
          "success": s / 4,
          "heldout/success": 0.5,
          "kl": 1e-3 * s,
          "clip_frac": 0.02,
          "reward/format": 1.0,
          "reward/answer": 0.2 * s,
          "loss": jnp.float32(1.0 / (s + 1)),
      }
      for s in range(4)
  ]


def _tb_scalars(workdir):
  """The TensorBoard scalars of a run directory, read with tensorboardX (test_event_file)."""
  out = {}
  for path in glob.glob(os.path.join(workdir, "tb", "events.out.tfevents.*")):
    for event in read_events(path):
      for v in event.summary.value:
        out.setdefault(v.tag, []).append((event.step, v.simple_value))
  return out


def test_writer_files_parse_back(tmp_path):
  workdir = str(tmp_path)
  with MetricsWriter(workdir) as w:
    for step, row in enumerate(_rows()):
      written = w.write(step, row)
    w.write(4, {"loss": np.float32(np.nan), "reward": 1.0})
  assert written["reward/answer"] == pytest.approx(0.6)
  lines = open(os.path.join(workdir, "metrics.jsonl")).read().splitlines()
  assert len(lines) == 5 and all(json.loads(l)["step"] == i for i, l in enumerate(lines))
  rows = read_metrics(workdir)
  assert rows[2]["success"] == 0.5 and rows[3]["loss"] == pytest.approx(0.25)
  assert math.isnan(rows[4]["loss"])  # kept visible, and the line stays valid JSON
  scalars = _tb_scalars(workdir)
  assert [s for s, _ in scalars["reward"]] == [0, 1, 2, 3, 4]
  assert scalars["reward/answer"][3][1] == pytest.approx(0.6)
  with pytest.raises(ValueError, match="not a scalar"):
    MetricsWriter(str(tmp_path / "x"), tensorboard=False).write(0, {"v": np.ones(3)})


def test_resume_drops_lines_after_the_checkpoint(tmp_path):
  workdir = str(tmp_path)
  with MetricsWriter(workdir, tensorboard=False) as w:
    for step in range(6):
      w.write(step, {"reward": step})
  with MetricsWriter(workdir, resume_step=3, tensorboard=False) as w:
    w.write(4, {"reward": 40})
  assert [(r["step"], r["reward"]) for r in read_metrics(workdir)] == [
      (0, 0),
      (1, 1),
      (2, 2),
      (3, 3),
      (4, 40),
  ]


def test_plot_metrics_writes_a_png(tmp_path):
  workdir = str(tmp_path)
  with MetricsWriter(workdir, tensorboard=False) as w:
    for step, row in enumerate(_rows()):
      # Keys the RL loop writes, which the default keys draw.
      w.write(
          step,
          {
              **row,
              "eval/greedy/success": step / 4,
              "rollout/return": 0.1 * step,
              "turn_0/mean_reward": 0.05 * step,
              "train/loss": 1.0 / (step + 1),
          },
      )
  assert set(_match_keys(DEFAULT_PLOT_KEYS, read_metrics(workdir)[0])) == {
      "eval/greedy/success",
      "rollout/return",
      "turn_0/mean_reward",
      "train/loss",
  }
  out = plot_metrics(workdir)  # default keys, per-evaluation and per-turn keys by glob
  assert out == os.path.join(workdir, "metrics.png")
  with open(out, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"
  from PIL import Image

  with Image.open(out) as img:
    img.verify()
  custom = plot_metrics(workdir, ["kl", "reward/*"], str(tmp_path / "sub" / "kl.png"))
  assert os.path.getsize(custom) > 1000
  with pytest.raises(ValueError, match="available"):
    plot_metrics(workdir, ["nope"])


def test_step_timer_splits_sections():
  timer = StepTimer()
  with timer.section("generation"):
    time.sleep(0.02)
  with timer.section("grading"):
    time.sleep(0.01)
  with timer.section("generation"):
    time.sleep(0.01)
  split = timer.split()
  assert split["time/generation"] >= 0.03 and split["time/grading"] >= 0.01
  assert split["time/step"] >= split["time/generation"] + split["time/grading"]
  assert set(timer.split()) == {"time/step"}  # a new step starts empty


def test_compile_census_counts_compilations():
  census = CompileCensus()
  traced = count_calls(lambda x: x * 2 + 1)
  f = jax.jit(traced)

  class Sampler:
    num_compiles = 3

  census.register("f", lambda: traced.num_traces)
  census.register("sampler", Sampler())
  f(np.ones(3, np.float32))
  f(np.ones(3, np.float32))
  counts = census.counts()
  assert counts["compiles/f"] == 1 and counts["compiles/sampler"] == 3
  backend = counts["compiles/backend_total"]
  assert backend >= 1
  f(np.ones(5, np.float32))  # a new shape: one more executable (numpy input: no eager op)
  counts = census.counts()
  assert counts["compiles/f"] == 2 and counts["compiles/backend_total"] == backend + 1
  with pytest.raises(TypeError, match="register"):
    census.register("bad", 3)
