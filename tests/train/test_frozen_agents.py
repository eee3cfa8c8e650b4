"""Frozen agents (`agents.trainable`): a frozen agent acts but never moves by one bit, has
no optimizer state, metrics or batch rows, and exports its starting weights. (All True is
the run without the field: tests/train/test_separate_policies.py, on its runs.)"""

import json
import os

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from configs import coop as coop_config
from mtrl_jax import models
from mtrl_jax.metrics import RUN_BOUND_PREFIXES
from mtrl_jax.models import loading, lora
from mtrl_jax.models.config import LoraConfig
from mtrl_jax.run import experiment, saved
from mtrl_jax.train import StepConfig, export_lora
from mtrl_jax.train.frozen_agents import PartlyFrozenTrainStep
from mtrl_jax.train.policies import StackedPolicies
from mtrl_jax.train.stacked import agent_slice

# The stacked step's own tests build the models and the stacked batches these compare.
from tests.train.test_separate_policies import run_on_one_device
from tests.train.test_stacked import (
    CFG,
    FAST,
    LOSS,
    OPT,
    RATES,
    _batch,
    _models,
    _stacked,
    _stacked_step,
)

STEP = StepConfig(compiler_options=FAST)


def _bits(tree) -> list[bytes]:
  return [np.asarray(x).tobytes() for x in jax.tree.leaves(jax.device_get(tree))]


# ---------------------------------------------------------------- validation
def _config(steps=2, trainable=None):
  c = coop_config.get_config("smoke=True")
  c.agents.share_policy = False
  c.rl.steps = steps
  # As tests/train/test_separate_policies.py: raw advantages and a step penalty give
  # the tiny smoke policy a gradient even when its sibling groups are all-equal.
  c.tree.advantage_mode = "raw"
  c.reward.step_penalty = -0.05
  c.loss.kl_coef = 0.01
  c.rl.dump_every = 0
  c.eval.every = 100  # step 0 and the last step only
  if trainable is not None:
    c.agents.trainable = trainable
  return c


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(trainable=(True,)), r"agents.trainable=\(True,\) has 1 entries; allowed: 2"),
        (dict(trainable=(1, True)), r"agents.trainable=\(1, True\); allowed: True or False"),
        (dict(trainable=(False, False)), "a run that trains nothing; allowed: at least one True"),
        (
            dict(trainable=(False, True), share_policy=True),
            "with agents.share_policy=True.*allowed: all True or empty",
        ),
        (
            dict(trainable=(False, True), lora_rank=4),
            r"agents.trainable=\(False, True\) with model.lora.rank=4 and sft.steps=3",
        ),
    ],
)
def test_bad_trainable_is_refused_in_one_line(change, match):
  c = _config(1)
  c.agents.trainable = change["trainable"]
  if change.get("share_policy"):
    c.agents.share_policy = True
  if change.get("lora_rank"):
    c.model.lora.rank = change["lora_rank"]
  with pytest.raises(experiment.ConfigError, match=match) as e:
    experiment.validate(c)
  assert "\n" not in str(e.value)


def test_all_true_is_allowed_with_a_shared_policy():
  c = coop_config.get_config("smoke=True,share_policy=True")
  c.agents.trainable = (True, True)
  experiment.validate(c)


@pytest.mark.slow
# ---------------------------------------------------------------- the stacked step
def test_frozen_agent_never_moves_and_the_trained_one_updates_as_in_the_full_stack():
  # The frozen agent gets real rows too: the step must not read them.
  stacked = _stacked([_batch(0, 8), _batch(1, 6)])
  ms = _models()
  st = PartlyFrozenTrainStep(ms[0], LOSS, OPT, RATES, (False, True), step_cfg=STEP)
  st.precompile(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype), stacked))
  assert st.num_compiles == 1
  state = st.init_state(ms, seed=0)
  start, start_1 = _bits(agent_slice(state.params, 0)), _bits(agent_slice(state.params, 1))
  assert jax.tree.leaves(state.opt_state)[0].shape[0] == 1  # AdamW state: agent 1 only
  ref = st.copy_params(state.params)
  for _ in range(3):
    state, m = st(state, ref, stacked)
  assert st.num_compiles == 1  # the precompiled program
  assert _bits(agent_slice(state.params, 0)) == start  # bit for bit
  assert [int(s) for s in state.step] == [0, 3]  # the frozen agent took no update
  metrics = st.fetch_metrics(m)
  assert len(metrics) == 1  # the trained agent's only

  full = _stacked_step()  # every agent trained: the StackedTrainStep of the same losses
  fstate = full.init_state(_models(), seed=0)
  fref = full.copy_params(fstate.params)
  for _ in range(3):
    fstate, fm = full(fstate, fref, stacked)
  for x, y in zip(
      jax.tree.leaves(agent_slice(state.params, 1)), jax.tree.leaves(agent_slice(fstate.params, 1))
  ):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-6, atol=1e-6)
  for k in ("loss", "kl", "grad_norm", "learning_rate"):
    assert metrics[0][k] == pytest.approx(full.fetch_metrics(fm)[1][k], rel=1e-5, abs=1e-6), k
  assert _bits(agent_slice(state.params, 1)) != start_1


def test_frozen_lora_agent_exports_its_start_adapters_bit_for_bit(tmp_path):
  base = models.create_model(CFG, seed=0)
  adapted = lora.attach(base, LoraConfig(rank=2, alpha=4.0, targets=("q", "v", "up")), seed=0)
  st = PartlyFrozenTrainStep(adapted, LOSS, OPT, RATES, (False, True), step_cfg=STEP)
  policies = StackedPolicies([base, base], st, seed=0)
  state = policies.init_state()
  leaves, treedef = jax.tree.flatten(state.params)  # non-zero adapters: the merge counts
  state = state.replace(params=jax.tree.unflatten(treedef, [x + 0.1 for x in leaves]))
  out = {}
  for name in ("start", "end"):
    if name == "end":
      for _ in range(2):
        state, _ = st(state, None, _stacked([_batch(0, 8), _batch(1, 8)]))
    peft = export_lora.save_adapters(policies, state.params, str(tmp_path / name / "peft"))
    hf = export_lora.save_merged(policies, state.params, str(tmp_path / name / "hf"))
    out[name] = [load_file(os.path.join(d, export_lora.ADAPTER_WEIGHTS)) for d in peft] + [
        load_file(os.path.join(d, "model.safetensors")) for d in hf
    ]
  for i, same in ((0, True), (1, False), (2, True), (3, False)):  # peft 0, 1; hf 0, 1
    a, b = out["start"][i], out["end"][i]
    equal = all(a[k].tobytes() == b[k].tobytes() for k in a)
    assert equal == same, i


# ---------------------------------------------------------------- a real run
def _rows(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(RUN_BOUND_PREFIXES)}
        for line in f
    ]


def _teammate_config(steps, base, teammate):
  """Agent 0 is a frozen teammate loaded from its own checkpoint `teammate`; agent 1 warms
  up (SFT) from `base` and trains."""
  c = _config(steps, (False, True))
  c.rl.updates_per_step = 2  # the old-logprob forward gathers the trained agent too
  c.model.path = base  # agents.paths must match a checkpoint's architecture
  c.agents.paths = (teammate, "")
  return c


@pytest.mark.slow
def test_a_frozen_teammate_from_agents_paths_stays_bit_identical_in_checkpoints_and_exports(
    tmp_path,
):
  arch = experiment.validate(_config(1, (False, True))).model.arch  # vocabulary fitted
  teammate = models.create_model(arch, seed=7)
  loading.save_pretrained(teammate, str(tmp_path / "teammate"))
  loading.save_pretrained(models.create_model(arch, seed=0), str(tmp_path / "base"))
  # The run stops after step 1 and resumes to step 2 (one CPU device: test_separate_policies).
  workdir = str(tmp_path / "run")
  args = [str(tmp_path / "base"), str(tmp_path / "teammate")]
  run_on_one_device(
      [
          {
              "config": ["tests.train.test_frozen_agents", "_teammate_config", [steps] + args],
              "workdir": workdir,
          }
          for steps in (1, 2)
      ]
  )
  rows = _rows(workdir)
  assert [r["step"] for r in rows] == [0, 1, 2]
  for row in rows[1:]:
    assert not any(k.startswith(("agent_0/train/", "agent_0/batch/")) for k in row)
    assert row["train/loss"] == row["agent_1/train/loss"]
    assert row["batch/actions"] == row["agent_1/batch/actions"]

  latest, first = saved.load_policy(workdir, "latest"), saved.load_policy(workdir, 0)
  assert latest.step == 2
  start = _bits(nnx.state(teammate, nnx.Param))
  assert _bits(agent_slice(latest.saved_params, 0)) == start
  assert _bits(agent_slice(first.saved_params, 0)) == start
  assert _bits(agent_slice(latest.saved_params, 1)) != _bits(agent_slice(first.saved_params, 1))
  start_file = load_file(str(tmp_path / "teammate" / "model.safetensors"))
  saved.export_policy(latest, str(tmp_path / "latest"))  # the step-0 bits are checked above
  for a in (0, 1):
    got = load_file(str(tmp_path / "latest" / f"agent_{a}" / "model.safetensors"))
    assert all(got[k].tobytes() == start_file[k].tobytes() for k in start_file) == (a == 0)
