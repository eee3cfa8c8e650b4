"""The ENVGRPO loop end to end on a tiny config: runs, writes its files, resumes exactly."""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest

from configs import calculator as calc_config
from experiments import report
from mtrl_jax import checkpoint
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.run import experiment, rl

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("no_curves")


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _run_comparable(rows):
  return [{k: v for k, v in r.items() if not k.startswith(RUN_BOUND_PREFIXES)} for r in rows]


def smoke_config(steps=4):
  c = calc_config.get_config("smoke=True")
  c.rl.steps = steps
  return c


def test_build_rejects_bad_configs_with_named_fields():
  c = smoke_config()
  c.loss.algorithm = "gspo"
  c.loss.aggregation = "seq-mean-token-sum"
  with pytest.raises(ValueError, match="aggregation"):
    experiment.build(c)
  c = smoke_config()
  c.tree.joint_mode = "diagonal"
  with pytest.raises(ValueError, match="joint_mode"):
    experiment.build(c)
  c = smoke_config()
  c.tree.num_turns, c.tree.num_generations = 8, 16
  with pytest.raises(ValueError, match="max_generations"):
    experiment.build(c)
  c = smoke_config()
  c.env.max_tokens = 1000
  with pytest.raises(ValueError, match="length_buckets"):
    experiment.build(c)
  c = smoke_config()
  with pytest.raises(AttributeError):  # the config is locked in the entry point
    c.lock()
    c.loss.algorithmm = "grpo"


def test_smoke_run_writes_every_artifact(smoke_run, tmp_path):
  workdir, summary = smoke_run.workdir, smoke_run.summary()
  for name in ("config.json", "metrics.jsonl", "summary.json", "curves.png"):
    assert os.path.exists(os.path.join(workdir, name)), name
  assert os.listdir(os.path.join(workdir, "tb"))
  assert sorted(os.listdir(os.path.join(workdir, "rollouts"))) == [
      f"step_{i:06d}.jsonl" for i in (1, 2, 3)
  ]
  with open(os.path.join(workdir, "rollouts", "step_000001.jsonl")) as f:
    node = json.loads(f.readline())
  for key in (
      "node_id",
      "parent_id",
      "parent_action",
      "turn",
      "rewards",
      "returns",
      "advantages",
      "terminated",
  ):
    assert key in node, key
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2, 3]
  assert "eval/greedy/success" in rows[0] and "train/loss" in rows[1]
  for key in (
      "time/generation",
      "time/environment",
      "time/train",
      "time/device_idle",
      "engine/kv_reuse",
      "engine/prefill_tokens",
      "engine/slot_occupancy",
  ):
    assert key in rows[1], key
  # Sampler equals trainer: the first update's ratio compares the tree-packed
  # recomputation with the engine's logprobs, token by token (float32 rounding).
  for r in rows[1:]:
    assert r["train/logp_gap_max"] < 1e-5, r["train/logp_gap_max"]
  # Compile count is flat after warm-up (docs/design.md invariant 5).
  assert rows[1]["compiles/train_step"] == rows[3]["compiles/train_step"] == 1
  assert rows[1]["compiles/engine"] == rows[3]["compiles/engine"]
  assert summary["best"]["step"] in (0, 2, 3)
  table = report.summary_table([workdir])
  assert "| run |" in table and "run |" in table.splitlines()[2]
  png = report.plot_learning_curves([workdir, workdir], str(tmp_path / "curve.png"))
  with open(png, "rb") as f:
    assert f.read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_killed_run_resumes_exactly(smoke_run, tmp_path):
  """SIGKILL after step 1, restart: steps 2..3 equal the uninterrupted shared run's."""
  killed = str(tmp_path / "killed")
  cmd = [
      sys.executable,
      "-m",
      "experiments.train",
      *smoke_run.flags,
      f"--workdir={killed}",
      "--progress=false",
  ]
  proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
  deadline = time.time() + 240
  try:
    while time.time() < deadline and proc.poll() is None:
      path = os.path.join(killed, "metrics.jsonl")
      if os.path.exists(path) and any(r["step"] == 1 for r in _rows(killed)):
        break
      time.sleep(0.05)
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  assert any(r["step"] == 1 for r in _rows(killed)), "the run never reached step 1"
  rl.run(smoke_run.config(), killed, progress=False)
  assert _run_comparable(_rows(killed)) == _run_comparable(smoke_run.rows())


# A precompiled run (docs/design.md invariant 5) is checked with its resume in
# tests/train/test_schedule_resume.py: one run pays for both.


def test_shape_plan_sizes_the_engine_from_the_config():
  from mtrl_jax.rollout import plan_tree
  from mtrl_jax.rollout.train_batch import logit_buckets
  from mtrl_jax.run import shapes

  c = smoke_config()
  c.sft.until_success = 0.5
  c.sft.check_tasks = 40  # larger than every tree level and the eval batch
  exp = experiment.build(c)
  plan = shapes.plan_shapes(exp, row_multiple=2, local_shards=2)
  tree = plan_tree(exp.tree, exp.rl.roots_per_step, exp.rl.max_length, exp.sampling.max_new_tokens)
  # Slots per shard hold the widest level's samples, the held-out tasks and the
  # SFT check tasks; capacity the largest prompt plus a completion.
  widest = max(tree.max_level_generations, exp.eval.num_tasks, 40)
  assert plan.engine.slots * 2 >= widest and plan.engine.slots % 8 == 0
  prompt = max(exp.rl.prompt_buckets or exp.rl.length_buckets)
  assert plan.engine.capacity >= prompt + exp.sampling.max_new_tokens + 1
  assert plan.fanout == exp.tree.num_generations
  assert {s.greedy for s in plan.samplings} == {False, True}  # training and evaluation
  assert all(r % 2 == 0 for r in plan.train_rows)
  assert plan.packing == "tree" and plan.train_lens == (exp.rl.max_length,)
  assert plan.train_shapes() == [
      (b, l, k) for b in plan.train_rows for l in plan.train_lens for k in logit_buckets(l)
  ]
  c.rl.packing = "rows"
  c.engine.slots, c.engine.capacity = 24, 512
  plan = shapes.plan_shapes(experiment.build(c), row_multiple=2, local_shards=2)
  # Rows: one trained-token slot per position (K = L).
  assert plan.train_shapes() == [(b, l, l) for b in plan.train_rows for l in plan.train_lens]
  assert (plan.engine.slots, plan.engine.capacity) == (24, 512)


def test_precompile_gives_stacked_train_steps_an_agent_axis():
  """`shapes.precompile` with a stacked train step: the engine compiles on the params it
  is given, every train spec gets a leading agent axis; a plain step: plain specs
  (recording fakes, no compile)."""
  from mtrl_jax.rollout.train_batch import as_arrays
  from mtrl_jax.run import shapes

  class Engine:

    def __init__(self):
      self.calls = []

    def precompile(self, params, samplings, num_stop_ids, fanout, threads):
      self.calls.append((params, len(samplings), fanout))
      return 7

  class Step:

    def __init__(self, num_agents=None):
      self.num_agents, self.specs = num_agents, []

    def lower(self, spec):
      self.specs.append(spec)
      return []  # nothing to compile

  plan = shapes.plan_shapes(experiment.build(smoke_config()), row_multiple=2, local_shards=2)
  n_specs = len(plan.train_specs())
  for states, step, kind in (
      ("params_AxP", Step(2), "stacked"),
      ("params_P", Step(), "plain"),
  ):
    engine = Engine()
    info = shapes.precompile(plan, [(engine, states, 1)], [step])
    expected = "params_AxP" if kind == "stacked" else "params_P"
    assert engine.calls == [(expected, len(plan.samplings), plan.fanout)]
    assert info["engine_programs"] == 7
    assert len(step.specs) == n_specs
    for spec, plain in zip(step.specs, plan.train_specs()):
      lead = (2,) if kind == "stacked" else ()
      assert {k: v.shape for k, v in as_arrays(spec).items()} == {
          k: lead + v.shape for k, v in as_arrays(plain).items()
      }


@pytest.mark.slow
def test_rollouts_one_step_ahead_are_one_update_stale_and_resume_exactly(tmp_path):
  """rl.max_staleness=1: step t+1's rollout runs during update t with the parameters
  update t started from. A run killed after its step-1 checkpoint (saved while step 2's
  rollout was in flight) and resumed equals the uninterrupted one, curriculum included:
  the checkpoint keeps those parameters, the stream with the in-flight draw undone, and
  the level moves that step 1's success decided; `curriculum/level` labels the level
  each step's tasks came from."""

  def config(steps):
    c = smoke_config(steps)
    c.rl.max_staleness = 1
    c.loss.is_correction = "tis"
    c.rl.dump_every = 0
    c.eval.every = 10  # evaluations at 0 and the end only
    c.checkpoint.every, c.checkpoint.keep = 1, 4
    c.sft.steps = 0  # an untrained policy fails every task: the level drops one per step
    c.curriculum.enabled = True
    c.curriculum.start_level, c.curriculum.window, c.curriculum.lower_below = 2, 1, 0.5
    return c

  full = str(tmp_path / "full")
  collections = []  # (thread, collector on?) of each garbage collection
  callback = lambda phase, _: phase == "start" and collections.append(
      (threading.current_thread().name, gc.isenabled())
  )
  gc.callbacks.append(callback)
  try:
    rl.run(config(3), full, progress=False)
  finally:
    gc.callbacks.remove(callback)
  assert gc.isenabled()  # given back at the end of the run
  # While rollouts ran ahead the collector was off and ran on the main thread alone,
  # between steps (never on the producer's thread).
  off = [name for name, enabled in collections if not enabled]
  assert len(off) >= 3 and set(off) == {threading.main_thread().name}, collections
  rows = _rows(full)
  assert [r.get("rollout/staleness") for r in rows] == [None, 0.0, 1.0, 1.0]
  assert all(r["time/rollout_wait"] >= 0 for r in rows[1:]) and "train/loss" in rows[2]
  assert [r["rollout/success"] for r in rows[1:]] == [0.0, 0.0, 0.0]
  # Steps 1 and 2 were drawn at the start level (2 was drawn before 1's success was
  # seen); the drop step 1 decided reaches step 3; step 2's drop, the draws after it.
  assert [r["curriculum/level"] for r in rows[1:]] == [2.0, 2.0, 1.0]
  killed = str(tmp_path / "killed")  # the full run as a kill after step 1 leaves it
  shutil.copytree(full, killed)
  for folder in ("ckpt", "best"):
    for name in os.listdir(os.path.join(killed, folder)):
      if name.isdigit() and int(name) > 1:
        shutil.rmtree(os.path.join(killed, folder, name))
  rl.run(config(3), killed, progress=False)
  assert _run_comparable(_rows(killed)) == _run_comparable(rows)
  c = config(3)
  c.rl.max_staleness = 2
  with pytest.raises(ValueError, match="rl.max_staleness=2; allowed: 0"):
    experiment.build(c)


@pytest.mark.slow
def test_an_interrupted_run_finishes_its_checkpoint_in_flight_and_leaves_no_thread(
    tmp_path, monkeypatch
):
  """Ctrl-C (KeyboardInterrupt) right after the step-1 save started in the background:
  the run closes its checkpointer on the way out, so checkpoint 1 is complete, no
  partial directory is left and no writer thread outlives the run."""
  c = smoke_config(steps=3)
  c.sft.steps, c.eval.every, c.rl.dump_every = 0, 10, 0
  c.checkpoint.every = 1
  save = checkpoint.Checkpointer.save

  def save_then_interrupt(self, step, *args, **kwargs):
    saved = save(self, step, *args, **kwargs)
    if step == 1:
      raise KeyboardInterrupt
    return saved

  monkeypatch.setattr(checkpoint.Checkpointer, "save", save_then_interrupt)
  before = {t.ident for t in threading.enumerate()}
  workdir = str(tmp_path / "run")
  with pytest.raises(KeyboardInterrupt):
    rl.run(c, workdir, progress=False)
  left = [
      t.name
      for t in threading.enumerate()
      if t.ident not in before and t.is_alive() and not t.daemon
  ]
  assert not left, left
  ckpt_dir = os.path.join(workdir, "ckpt")
  assert checkpoint.step_dirs(ckpt_dir) == [0, 1]
  assert sorted(os.listdir(ckpt_dir)) == ["0", "1"]  # no partial (tmp) directory
  monkeypatch.undo()
  c.rl.steps = 2  # and it resumes from there
  rl.run(c, workdir, progress=False)
  assert [r["step"] for r in _rows(workdir)] == [0, 1, 2]
