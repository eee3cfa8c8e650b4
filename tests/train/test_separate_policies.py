"""One policy per agent in the real loop: per-agent metrics, exact resume, per-agent export."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from configs import coop as coop_config
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.train import experiment, rl, saved


def _config(steps):
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
  return c


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [{k: v for k, v in json.loads(line).items()
             if not k.startswith(RUN_BOUND_PREFIXES)}
            for line in f]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("full"))
  rl.run(_config(3), workdir, progress=False)
  return workdir


@pytest.mark.slow
def test_separate_policies_log_per_agent_and_resume_exactly(full_run, tmp_path):
  rows = _rows(full_run)
  for a in (0, 1):
    for key in ("train/loss", "train/kl", "train/learning_rate", "batch/actions"):
      assert f"agent_{a}/{key}" in rows[1], (a, key)
  assert rows[1]["agent_0/train/learning_rate"] == pytest.approx(1e-3, rel=1e-6)
  assert rows[1]["agent_1/train/learning_rate"] == pytest.approx(3e-3, rel=1e-6)
  assert rows[1]["batch/actions"] == (rows[1]["agent_0/batch/actions"]
                                      + rows[1]["agent_1/batch/actions"])
  for a in (0, 1):  # the second update's ratio sees the first: pi_old is the trainer's
    assert abs(rows[1][f"agent_{a}/train/ratio_mean"] - 1.0) > 1e-6, a
  # Stop after step 2, continue to step 3: the same rows as the uninterrupted run.
  resumed = str(tmp_path / "resumed")
  rl.run(_config(2), resumed, progress=False)
  rl.run(_config(3), resumed, progress=False)
  assert _rows(resumed) == rows


@pytest.mark.slow
def test_export_writes_one_hf_directory_per_agent(full_run, tmp_path):
  torch = pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  policy = saved.load_policy(full_run, "latest")
  info = saved.export_policy(policy, str(tmp_path / "hf"))
  assert [os.path.basename(a["out"]) for a in info["agents"]] == ["agent_0", "agent_1"]
  tokens = np.random.RandomState(0).randint(0, policy.exp.model.arch.vocab_size, (2, 10))
  logits = []
  for a, model in enumerate(policy.models()):
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path / "hf" / f"agent_{a}"), attn_implementation="eager").eval()
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
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


@pytest.mark.parametrize("field, value, match", [
    ("agents.learning_rates", (1e-3,), "1 entries; allowed: 2"),
    ("agents.paths", ("/nonexistent", ""), "no config.json"),
    # Different architectures would need one program per agent (not built): refused.
    ("agents.presets", ("", "small"), r"presets\[1\]='small': its architecture differs"),
])
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
