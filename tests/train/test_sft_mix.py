"""SFT steps mixed into RL (`sft.mix_every`, `run.warmup.SFTMix`)."""

import json
import os

import jax
import numpy as np
import pytest

from configs import calculator as calc_config
from mtrl_jax import testing
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.run import components, experiment, rl, warmup
from mtrl_jax.train import optim, sft

pytestmark = pytest.mark.usefixtures("no_curves")


def mix_config(steps=3, every=1):
  c = calc_config.get_config("smoke=True")
  c.rl.steps = steps
  c.sft.mix_every = every
  c.sft.mix_learning_rate = 1e-3
  return c


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def test_bad_mix_settings_fail_before_compute_with_the_field_named():
  for field, value, match in (
      ("mix_every", -1, "sft.mix_every"),
      ("mix_learning_rate", 0.0, "sft.mix_learning_rate"),
      ("mix_learning_rate", float("nan"), "sft.mix_learning_rate"),
      ("updates_per_step", -1, "rl.updates_per_step"),
  ):
    c = mix_config()
    (c.rl if field == "updates_per_step" else c.sft)[field] = value
    with pytest.raises(ValueError, match=match):
      experiment.build(c)
  c = mix_config()
  c.sft.conversations, c.sft.steps = "", 0
  with pytest.raises(ValueError, match="sft.mix_every=1 needs sft.conversations"):
    experiment.build(c)


def test_mix_step_is_a_plain_sft_step_and_leaves_the_rl_optimizer_alone():
  """On the RL state, one mixed step moves the parameters exactly as a plain SFT
  TrainStep from the same parameters and batch; the RL moments and schedule count
  do not move."""
  parts = components.build(experiment.build(mix_config()))
  mix = warmup.SFTMix(parts)
  state = parts.policies.init_state()
  mix.init(state.params)
  start_params = _leaves(state.params)
  rl_opt = _leaves(state.opt_state)

  batch = next(warmup.golden_batcher(parts, seed=parts.exp.seed + 1))  # the mix's first batch
  plain = sft.make_sft_step(
      parts.model, optim.OptimConfig(learning_rate=1e-3), mesh=parts.mesh, step_cfg=parts.exp.step
  )
  plain_state, plain_m = plain(plain.init_state(state.params), None, batch)
  expected = _leaves(plain_state.params)

  state, m = mix(state)
  got = _leaves(state.params)
  assert any(not np.array_equal(a, b) for a, b in zip(got, start_params))
  for a, b in zip(got, expected):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  assert m["nll"] == pytest.approx(float(plain_m["nll"]), rel=1e-6)
  for a, b in zip(_leaves(state.opt_state), rl_opt):
    np.testing.assert_array_equal(a, b)
  assert int(state.step) == 1  # TrainState.step counts both kinds of update

  # The mix keeps its own moments and reads the next batch the next time.
  assert mix.stream_state()["position"] == parts.exp.sft.batch_size
  plain_opt = _leaves(plain_state.opt_state)
  for a, b in zip(_leaves(mix.opt_state), plain_opt):
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
  state, _ = mix(state)
  assert mix.stream_state()["position"] == 2 * parts.exp.sft.batch_size
  for a, b in zip(_leaves(state.opt_state), rl_opt):
    np.testing.assert_array_equal(a, b)


def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(RUN_BOUND_PREFIXES)}
        for line in f
    ]


@pytest.mark.slow
def test_mixed_run_logs_the_sft_term_and_resumes_exactly(tmp_path):
  """2 steps in one go == the run as it stood after step 1, resumed to 2: the mix's
  moments and stream position are in the checkpoint."""
  c = mix_config(steps=2)
  c.rl.dump_every = 0
  c.eval.every = 1  # evaluated at step 1, as a run stopped there is
  c.checkpoint.every = 1  # the step-1 checkpoint the resumed run continues
  full = str(tmp_path / "full")
  rl.run(c, full, progress=False)
  split = testing.stopped_copy(full, str(tmp_path / "split"), 1)
  rl.run(c, split, progress=False)
  rows = _rows(full)
  assert [r["step"] for r in rows] == [0, 1, 2]
  assert all(r["sft_mix/tokens"] > 0 and np.isfinite(r["sft_mix/nll"]) for r in rows[1:])
  assert rows[1]["sft_mix/nll"] != rows[2]["sft_mix/nll"]  # the second step's own batch
  assert _rows(split) == rows


def test_sft_only_control_takes_no_rl_update(tmp_path):
  """`rl.updates_per_step=0` with the mix: rollouts and SFT steps, no RL update
  (the SFT-only arm of docs/ablations.md)."""
  c = mix_config(steps=1)
  c.rl.updates_per_step, c.rl.dump_every = 0, 0
  workdir = str(tmp_path / "sft_only")
  rl.run(c, workdir, progress=False)
  rows = _rows(workdir)
  for r in rows[1:]:
    assert "train/loss" not in r and r["sft_mix/tokens"] > 0
    assert "rollout/success" in r


def test_the_warmup_conversations_take_their_keyword_arguments():
  """`sft.conversation_kwargs` reach the conversation function: here three turns of
  'plain' feedback of the refine task instead of its defaults (two, level feedback)."""
  from configs import refine as refine_config
  from mtrl_jax.tasks import refine

  c = refine_config.get_config()
  c.tree.num_turns = 3
  c.env.kwargs.feedback = "plain"
  exp = experiment.build(c)
  convo = warmup.conversation_maker(exp.sft)(refine.make_task("train", 0))
  assert [role for role, _ in convo] == ["user", "assistant"] * 3
  assert {text for role, text in convo[2::2]} <= {"ok", "no"}
