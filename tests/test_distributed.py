"""Multi-host runs (`mtrl_jax.distributed`, `experiments/launch_local.py`) on CPU processes.

One shared sequence of runs (they dominate the time, about 2 minutes on 2 cores):
  1. the 2-step calculator smoke run (no SFT) as 2 processes x 2 devices, process 1
     SIGKILLed after step 1: the survivor stops on its own (the coordinator's
     heartbeat) in < 60 s;
  2. both processes restarted: the run resumes from the last checkpoint;
  3. the same run in one process on 4 devices, started when process 1 is killed: it
     trains while the survivor waits out the heartbeat, which would leave a core idle.
The resumed 2-process run's metrics equal the 1-process run's (floats within
1e-5; the keys that depend on how rows are packed per process are listed in
LAYOUT_KEYS) and so do the final parameters; process 0 alone wrote files.
"""

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from configs import calculator as calc_config
from mtrl_jax import distributed, testing
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.run import experiment

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 2
DEVICES = 2  # per process of the 2-process run; the 1-process run has all 4
FLAGS = [
    "--config=" + os.path.join(ROOT, "configs", "calculator.py") + ":smoke=True",
    f"--config.rl.steps={STEPS}",
    "--config.sft.steps=0",
    # Raw returns as advantages: every step's update is non-zero, so the
    # final parameters check the train step, not just the init.
    "--config.tree.advantage_mode=raw",
    "--config.tree.advantage_std_norm=False",
    "--progress=false",
]
# Depend on how each process packs its own trees into rows (the trained
# samples and the loss do not): tree packing stores a prefix shared by roots
# on different processes once per process.
LAYOUT_KEYS = (
    "batch/rows",
    "batch/padding_fraction",
    "batch/tokens_trained",
    "batch/tokens_rows_equivalent",
)


def _config():
  c = calc_config.get_config("smoke=True")
  c.rl.steps, c.sft.steps, c.tree.advantage_mode = STEPS, 0, "raw"
  c.tree.advantage_std_norm = False
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def _committed_steps(workdir) -> list[int]:
  """Steps whose checkpoint Orbax has committed (renamed from its temporary directory)."""
  ckpt = os.path.join(workdir, "ckpt")
  return sorted(int(d) for d in os.listdir(ckpt) if d.isdigit()) if os.path.isdir(ckpt) else []


def _params(workdir):
  """Final train-state parameters of a run's last checkpoint, on one device."""
  import jax
  import orbax.checkpoint as ocp

  step = _committed_steps(workdir)[-1]
  path = os.path.join(workdir, "ckpt", str(step), "state")
  ck = ocp.StandardCheckpointer()
  meta = ck.metadata(path)
  meta = getattr(meta, "item_metadata", meta)
  dev = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=dev), meta)
  leaves = jax.tree_util.tree_leaves_with_path(ck.restore(path, target)["train"]["params"])
  return step, {jax.tree_util.keystr(k): np.asarray(v) for k, v in leaves}


def _launch(workdir, grace_s=50):
  cmd = [
      sys.executable,
      "-u",
      "-m",
      "experiments.launch_local",
      "--num_processes=2",
      f"--devices_per_process={DEVICES}",
      f"--grace_s={grace_s}",
      "--heartbeat_timeout_s=10",
      "--",
      *FLAGS,
      f"--workdir={workdir}",
  ]
  return subprocess.Popen(
      cmd,
      cwd=ROOT,
      env=testing.cpu_env(DEVICES),  # launch_local sets each process's count anyway
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
  )


def test_config_errors_are_one_line_naming_the_field():
  with pytest.raises(
      ValueError, match=r"^config distributed.mode='pod'; allowed: \['off', 'auto', 'explicit'\]$"
  ):
    distributed.DistributedConfig(mode="pod")
  with pytest.raises(ValueError, match=r"distributed.coordinator_address=''"):
    distributed.DistributedConfig(mode="explicit", num_processes=2, process_id=0)
  with pytest.raises(
      ValueError, match=r"distributed.process_id=2; allowed: an integer in \[0, 2\)"
  ):
    distributed.DistributedConfig(
        mode="explicit", coordinator_address="127.0.0.1:1234", num_processes=2, process_id=2
    )
  c = _config()
  c.distributed.heartbeat_timeout_s = 0
  with pytest.raises(experiment.ConfigError, match="distributed.heartbeat_timeout_s=0"):
    experiment.validate(c)


def test_shares_are_contiguous_blocks_in_process_order():
  for n, count in ((8, 2), (7, 3), (2, 4)):
    blocks = [list(range(n))[distributed.share(n, i, count)] for i in range(count)]
    assert sum(blocks, []) == list(range(n))
    assert max(map(len, blocks)) - min(map(len, blocks)) <= 1
  assert distributed.allgather({"a": 1}) == [{"a": 1}]  # one process: the identity


def _one_process(workdir):
  """The same run in one process on the same 4 devices, started in the background."""
  return subprocess.Popen(
      [sys.executable, "-m", "experiments.train", *FLAGS, f"--workdir={workdir}"],
      cwd=ROOT,
      env=testing.cpu_env(2 * DEVICES),
      stdout=subprocess.DEVNULL,
      stderr=subprocess.PIPE,
      text=True,
  )


@pytest.fixture
def background():
  """The subprocesses a test starts and leaves running; any still running when it ends
  is killed."""
  procs = []
  yield procs
  for p in procs:
    if p.poll() is None:
      p.kill()
      p.wait()


@pytest.mark.slow
def test_two_processes_equal_one_and_resume_after_a_kill(tmp_path, background):
  single, multi = str(tmp_path / "single"), str(tmp_path / "multi")
  # 2 processes x 2 devices; process 1 is killed once step 1 is logged and a
  # checkpoint is committed (Orbax saves in the background: a row can land first).
  proc = _launch(multi)
  lines = []
  reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
  reader.start()
  killed_at, deadline = None, time.time() + 240
  while proc.poll() is None and time.time() < deadline:
    path = os.path.join(multi, "metrics.jsonl")
    if (
        killed_at is None
        and os.path.exists(path)
        and _committed_steps(multi)
        and any(r["step"] == 1 for r in _rows(multi))
    ):
      pid1 = int(re.search(r"\[launch\] process 1 pid (\d+)", "".join(lines)).group(1))
      os.kill(pid1, signal.SIGKILL)
      killed_at = time.time()
      background.append(_one_process(single))
    time.sleep(0.05)
  if proc.poll() is None:
    proc.kill()
  proc.wait()
  reader.join(timeout=10)
  proc.wait()
  out = "".join(lines)
  assert killed_at is not None, out[-3000:]
  stopped_after = time.time() - killed_at
  assert proc.returncode != 0, out[-3000:]
  assert "[launch] process 1 failed first" in out, out[-3000:]
  assert "[launch] killing" not in out, "the survivor did not stop on its own:\n" + out[-3000:]
  assert stopped_after < 60, stopped_after
  assert max(r["step"] for r in _rows(multi)) < STEPS  # really interrupted

  # Restart both: resumes from the last checkpoint and finishes.
  proc = _launch(multi)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert "resumed from" in out, out[-3000:]

  # The one-process run, started at the kill.
  [one_process] = background
  _, err = one_process.communicate(timeout=600)
  assert one_process.returncode == 0, err[-3000:]

  one, two = _rows(single), _rows(multi)
  assert [r["step"] for r in two] == [r["step"] for r in one] == list(range(STEPS + 1))
  for a, b in zip(one, two):
    keys = {k for k in a if not k.startswith(RUN_BOUND_PREFIXES) and k not in LAYOUT_KEYS}
    assert keys == {k for k in b if not k.startswith(RUN_BOUND_PREFIXES) and k not in LAYOUT_KEYS}
    for k in sorted(keys):
      assert b[k] == pytest.approx(a[k], abs=1e-5), (a["step"], k, a[k], b[k])
  assert any(r.get("train/grad_norm", 0) > 0 for r in one)
  (s1, p1), (s2, p2) = _params(single), _params(multi)
  assert s1 == s2 == STEPS and p1.keys() == p2.keys()
  for k in p1:
    np.testing.assert_allclose(p2[k], p1[k], atol=1e-5, rtol=0, err_msg=k)

  # One writer: one TensorBoard file per launch, no row written twice, one
  # dump per step, and process 1 printed no summary.
  assert len(os.listdir(os.path.join(multi, "tb"))) == 2
  assert sorted(os.listdir(os.path.join(multi, "rollouts"))) == [
      f"step_{i:06d}.jsonl" for i in range(1, STEPS + 1)
  ]
  for name in ("config.json", "summary.json", "curves.png"):
    assert os.path.exists(os.path.join(multi, name)), name
  assert '[p1]  "workdir"' not in out and '[p0]  "workdir"' in out
