"""One policy per agent in the real loop: per-agent metrics, exact resume, per-agent export;
every agent trainable (`agents.trainable`) is the run without the field.

The runs train in one process on one CPU device (`run_on_one_device`, which the other
modules of real coop runs use too): the suite's 8 fake devices would split every engine
call and update 8 ways, and the runs of one process share the tiny model's programs.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import coop as coop_config
from mtrl_jax import testing
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.run import experiment, saved

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Trains each job of argv[1] (JSON) in turn: the config `module.function(*args)` builds,
# into `workdir`. A job with "resume_of": [run, step] continues the workdir `run` as it
# stood after `step` (`testing.stopped_copy`). No curves.png is drawn (matplotlib takes
# seconds per run; no test here reads it).
_RUN_JOBS = """
import importlib, json, sys
from mtrl_jax import metrics, testing
from mtrl_jax.run import rl
metrics.plot_metrics = lambda *args, **kwargs: None
for job in json.loads(sys.argv[1]):
  module, function, args = job["config"]
  config = getattr(importlib.import_module(module), function)(*args)
  if job.get("resume_of"):
    run, step = job["resume_of"]
    testing.stopped_copy(run, job["workdir"], step)
  rl.run(config, job["workdir"], progress=False)
"""


def run_on_one_device(jobs: list) -> None:
  """Trains `jobs` in turn in one process on one CPU device (see `_RUN_JOBS`): each a dict
  with "config": [module, function, args], "workdir" and optionally "resume_of"."""
  done = subprocess.run(
      [sys.executable, "-c", _RUN_JOBS, json.dumps(jobs)],
      cwd=ROOT,
      env=testing.cpu_env(1),
      capture_output=True,
      text=True,
      timeout=1800,
  )
  assert done.returncode == 0, done.stderr[-5000:]


def _config(steps, trainable=None):
  c = coop_config.get_config("smoke=True")
  c.agents.share_policy = False
  c.agents.learning_rates = (1e-3, 3e-3)
  c.rl.steps = steps
  # The tiny smoke policy's sibling groups are often all-equal; raw advantages (the
  # returns, with a step penalty) still give every agent a gradient.
  c.tree.advantage_mode = "raw"
  c.reward.step_penalty = -0.05  # a non-zero return even when the smoke policy fails
  c.loss.kl_coef = 0.01  # the references are per agent too
  c.rl.updates_per_step = 2  # each agent's clipped ratio reads its own old logprobs
  c.rl.dump_every = 0
  c.eval.every = 1  # a run stopped after step 1 evaluates there too (its last step)
  c.checkpoint.every = 1  # the step-1 checkpoint the resumed run starts from
  if trainable is not None:
    c.agents.trainable = tuple(trainable)
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(RUN_BOUND_PREFIXES)}
        for line in f
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """The runs the tests below read (their rows are compared, never written):

  full       the uninterrupted 2-step run (SFT warm-up, then RL steps 1-2)
  resumed    that run as it stood after step 1 (its step-1 checkpoint and rows, what a
             run stopped there leaves), continued to step 2
  all_true   the 1-step run with agents.trainable=(True, True)
  """
  me = "tests.train.test_separate_policies"

  def train(base):
    full = {"config": [me, "_config", [2]], "workdir": f"{base}/full"}
    run_on_one_device(
        [
            full,
            dict(full, workdir=f"{base}/resumed", resume_of=[f"{base}/full", 1]),
            {"config": [me, "_config", [1, [True, True]]], "workdir": f"{base}/all_true"},
        ]
    )

  # Built once per `pytest` run: the first xdist worker to ask builds it, the others reuse it.
  base = testing.built_once(tmp_path_factory, "separate_policies_runs", train)
  full, resumed, all_true = (os.path.join(base, name) for name in ("full", "resumed", "all_true"))
  return {
      "full": full,
      "resumed": _rows(resumed),
      "all_true": _rows(all_true),
  }


@pytest.mark.slow
def test_separate_policies_log_per_agent_and_resume_exactly(runs):
  rows = _rows(runs["full"])
  for a in (0, 1):
    for key in ("train/loss", "train/kl", "train/learning_rate", "batch/actions"):
      assert f"agent_{a}/{key}" in rows[1], (a, key)
  assert rows[1]["agent_0/train/learning_rate"] == pytest.approx(1e-3, rel=1e-6)
  assert rows[1]["agent_1/train/learning_rate"] == pytest.approx(3e-3, rel=1e-6)
  assert rows[1]["batch/actions"] == (
      rows[1]["agent_0/batch/actions"] + rows[1]["agent_1/batch/actions"]
  )
  for a in (0, 1):  # the second update's ratio sees the first: pi_old is the trainer's
    assert abs(rows[1][f"agent_{a}/train/ratio_mean"] - 1.0) > 1e-6, a
  # Stopped after step 1, continued to step 2: the same rows as the uninterrupted run.
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert runs["resumed"] == rows


@pytest.mark.slow
def test_all_agents_trainable_is_the_run_without_the_field(runs):
  assert runs["all_true"] == _rows(runs["full"])[:2]
  assert "agent_0/train/loss" in runs["all_true"][1]


@pytest.mark.slow
def test_export_writes_one_hf_directory_per_agent(runs, tmp_path):
  full_run = runs["full"]
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  policy = saved.load_policy(full_run, "latest")
  info = saved.export_policy(policy, str(tmp_path / "hf"))
  assert [os.path.basename(a["out"]) for a in info["agents"]] == ["agent_0", "agent_1"]
  tokens = np.random.RandomState(0).randint(0, policy.exp.model.arch.vocab_size, (2, 10))
  logits = []
  for a, model in enumerate(policy.models()):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf" / f"agent_{a}"), attn_implementation="eager"
    ).eval()
    ours = testing.logits(model, tokens)
    with torch.no_grad():
      theirs = hf(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=0)
    logits.append(ours)
  # Both started from the same warmed-up weights; their own updates made them differ.
  assert np.abs(logits[0] - logits[1]).max() > 1e-4
  with pytest.raises(ValueError, match="models"):
    policy.model  # noqa: B018  (one policy per agent: there is no single model)
  # Keep-best: one decision on the joint held-out success; best/ holds every agent.
  best = saved.load_policy(full_run, "best")
  assert best.step in [r["step"] for r in _rows(full_run) if "eval/greedy/success" in r]
  assert len(best.models()) == 2


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("agents.learning_rates", (1e-3,), "1 entries; allowed: 2"),
        ("agents.paths", ("/nonexistent", ""), "no config.json"),
    ],
)
def test_bad_agents_config_is_refused_in_one_line(field, value, match):
  c = _config(1)
  group, name = field.split(".")
  c[group][name] = value
  with pytest.raises(experiment.ConfigError, match=match):
    experiment.validate(c)
  c = _config(1)
  c.agents.presets = ("tiny", "")  # the smoke config's own architecture: accepted
  experiment.validate(c)
  c = coop_config.get_config("smoke=True,share_policy=True")
  c.agents.learning_rates = (1e-3, 1e-3)
  with pytest.raises(experiment.ConfigError, match="share_policy=False"):
    experiment.validate(c)
