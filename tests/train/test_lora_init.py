"""`model.lora.init_from`: a PEFT adapter directory starts the adapters. A run's exported
adapters start a new run with that run's logits (shared and per agent); a directory that
does not fit the base, or that the config contradicts, is refused in one line before
anything is built, and nothing on disk changes. That run's checkpoint is refused over
other weights in its base directory."""

import functools
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import calculator as calc_config
from configs import coop as coop_config
from mtrl_jax import models, sharding
from mtrl_jax.models import loading, lora
from mtrl_jax.models.config import LoraConfig
from mtrl_jax.run import components, experiment, rl, saved
from mtrl_jax.train import export_lora

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.usefixtures("no_curves")
TINY = models.get_preset("tiny")


def _calc(base_dir="", steps=1, init_from=""):
  c = calc_config.get_config("smoke=True")
  c.model.lora.rank, c.model.lora.alpha = 4, 8.0
  c.model.lora.init_from = init_from
  c.model.path = base_dir
  c.sft.steps = 0  # adapters over the base of model.path: what init_from starts from
  c.tree.advantage_std_norm = False
  c.tree.advantage_mode = "raw"  # the step trains even when sibling groups tie
  c.reward.step_penalty = -0.05
  c.rl.steps, c.rl.dump_every = steps, 0
  return c


@functools.cache
def _forward(model_cfg):
  """The jitted plain forward of `model_cfg`'s base, (merged weights, tokens) -> logits."""
  graphdef = lora.base_graphdef(model_cfg)
  return jax.jit(lambda merged, tokens: nnx.merge(graphdef, merged)(tokens))


def _logits(policies, params, tokens):
  """Every policy's logits of `tokens` with `params` merged onto the base, [P, B, L, V]."""
  forward = _forward(policies.train_step.model_cfg)
  return np.stack(
      [np.asarray(forward(merged, jnp.asarray(tokens))) for merged in policies.per_policy(params)]
  )


def _policies(config):
  """The policies (and their train step) of a validated `config`, without the rest of a run."""
  exp = experiment.validate(config)
  mesh = sharding.make_mesh(exp.mesh.shape(jax.device_count()))
  return components.make_policies(exp, components.make_model(exp, mesh), mesh)


def _snapshot(path):
  out = {}
  for d, _, files in os.walk(path):
    for f in files:
      with open(os.path.join(d, f), "rb") as fh:
        out[os.path.relpath(os.path.join(d, f), path)] = fh.read()
  return out


def _write(path, snapshot):
  """Puts `path` back to `snapshot` (a `_snapshot` of it)."""
  for name in set(_snapshot(path)) - set(snapshot):
    os.remove(os.path.join(path, name))
  for name, data in snapshot.items():
    with open(os.path.join(path, name), "wb") as f:
      f.write(data)


@pytest.fixture(scope="module")
def adapted_run(tmp_path_factory, no_curves):
  """(base_dir, workdir): one RL step trained adapters over the seed-0 tiny base saved in
  base_dir (tests that change base_dir's files put them back)."""
  root = tmp_path_factory.mktemp("adapted_run")
  base_dir = str(root / "base")
  loading.save_pretrained(models.create_model(TINY, seed=0), base_dir)
  workdir = str(root / "run")
  rl.run(_calc(base_dir), workdir, progress=False)  # one RL step trains the adapters
  return base_dir, workdir


@pytest.mark.slow  # the adapted run's RL step compiles its programs (~11 s on 2 cores)
def test_init_from_a_runs_exported_adapters_gives_that_runs_logits(tmp_path, adapted_run):
  base_dir, workdir = adapted_run
  trained = saved.load_policy(workdir, "latest")
  assert any(
      np.abs(np.asarray(x)).max() > 0 for x in jax.tree.leaves(trained.saved_params)
  )  # B moved off zero
  [peft_dir] = export_lora.save_adapters(
      trained.parts.policies, trained.saved_params, str(tmp_path / "peft"), base_dir
  )
  policies = _policies(_calc(base_dir, init_from=peft_dir))
  state = policies.init_state()
  for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(trained.saved_params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  tokens = np.random.RandomState(0).randint(0, TINY.vocab_size, (2, 11))
  got = _logits(policies, state.params, tokens)
  np.testing.assert_array_equal(got, _logits(trained.parts.policies, trained.saved_params, tokens))
  fresh = _policies(_calc(base_dir))
  assert not np.array_equal(_logits(fresh, fresh.init_state().params, tokens), got)


@pytest.mark.slow  # needs the adapted run (above)
def test_a_checkpoint_over_another_base_is_refused_in_one_line(adapted_run):
  base_dir, workdir = adapted_run
  ckpt = os.path.join(workdir, "ckpt")
  before, base = _snapshot(ckpt), _snapshot(base_dir)
  # The same directory, other weights: the adapters no longer fit what they adapted.
  loading.save_pretrained(models.create_model(TINY, seed=1), base_dir)
  try:
    assert _snapshot(base_dir) != base
    with pytest.raises(experiment.ConfigError) as e:
      rl.run(_calc(base_dir), workdir, progress=False)
  finally:
    _write(base_dir, base)
  msg = str(e.value)
  assert "base" in msg and "sha256" in msg and "allowed" in msg and "\n" not in msg
  assert _snapshot(ckpt) == before  # nothing lost


@pytest.mark.slow  # two coop smoke runs, a step each (~10 s on 2 cores)
def test_per_agent_adapters_start_each_agent_from_its_own_directory(tmp_path):
  def config(init_from=""):
    c = coop_config.get_config("smoke=True")
    c.agents.share_policy = False
    c.model.lora.rank, c.model.lora.init_from = 2, init_from
    c.sft.steps = 0
    return c

  policies = _policies(config())
  params = policies.init_state().params
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  params = jax.tree.unflatten(
      treedef, [0.1 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  )  # agents differ
  dirs = export_lora.save_adapters(policies, params, str(tmp_path / "peft"))
  assert [os.path.basename(d) for d in dirs] == ["agent_0", "agent_1"]
  again = _policies(config(str(tmp_path / "peft")))
  tokens = np.random.RandomState(1).randint(0, TINY.vocab_size, (2, 7))
  got, want = _logits(again, again.init_state().params, tokens), _logits(policies, params, tokens)
  np.testing.assert_array_equal(got, want)
  assert not np.array_equal(got[0], got[1])
  # One directory starts every agent.
  one = _policies(config(dirs[1]))
  got = _logits(one, one.init_state().params, tokens)
  np.testing.assert_array_equal(got[0], want[1])
  np.testing.assert_array_equal(got[1], want[1])


def _adapters(tmp_path, name, cfg=TINY, rank=4, alpha=8.0, targets=None):
  """A PEFT directory of non-zero adapters for `cfg` (fitting the tiny base by default)."""
  lora_cfg = LoraConfig(rank=rank, alpha=alpha, targets=targets or LoraConfig().targets)
  adapters = lora.init_adapters(cfg.replace(lora=lora_cfg))
  adapters = jax.tree.map(lambda x: x + 0.01, adapters)
  return export_lora.write_adapters(adapters, lora_cfg, str(tmp_path / name))


def _truncate(path):
  file = os.path.join(path, export_lora.ADAPTER_WEIGHTS)
  with open(file, "rb") as f:
    head = f.read(40)
  with open(file, "wb") as f:
    f.write(head)
  return path


@pytest.mark.parametrize(
    "make, change, needles",
    [
        (
            lambda t: _adapters(t, "wide", TINY.replace(mlp_dim=48)),
            {},
            [r"tensor base_model.model.model.layers.0.mlp.", ".lora_", "is (", "allowed: ("],
        ),
        (
            lambda t: _adapters(t, "deep", TINY.replace(num_layers=3)),
            {},
            ["tensor base_model.model.model.layers.2.", "no adapter of this base", "2 layers"],
        ),
        (
            lambda t: _adapters(t, "r8", rank=8),
            {},
            ["adapter_config.json has r=8 but model.lora.rank=4", "allowed: model.lora.rank=8"],
        ),
        (
            lambda t: _adapters(t, "qv", targets=("q", "v")),
            {},
            ["target_modules=['q_proj', 'v_proj']", "allowed: model.lora.targets=('q', 'v')"],
        ),
        (
            lambda t: str(t / "nowhere"),
            {},
            ["model.lora.init_from=", "nowhere", "lacks ['adapter_config.json',", "allowed"],
        ),
        (
            lambda t: _truncate(_adapters(t, "cut")),
            {},
            ["adapter_model.safetensors does not read", "allowed: a safetensors file"],
        ),
        (
            lambda t: _adapters(t, "ok"),
            {"sft.steps": 3},
            ["config sft.steps=3 with model.lora.init_from=", "allowed: sft.steps=0"],
        ),
        (
            lambda t: "",
            {"rl.ref_reset_every": 2},  # adapters' own refusals: at validation too
            ["config rl.ref_reset_every=2 with model.lora.rank=4", "allowed"],
        ),
    ],
)
def test_adapters_that_do_not_fit_are_refused_in_one_line_before_anything_is_built(
    tmp_path, make, change, needles
):
  path = make(tmp_path)
  c = _calc(init_from=path)
  for key, value in change.items():
    group, field = key.split(".")
    c[group][field] = value
  before = _snapshot(tmp_path)
  with pytest.raises(experiment.ConfigError) as e:
    experiment.validate(c)
  msg = str(e.value)
  assert "\n" not in msg and "allowed" in msg, msg
  for needle in needles:
    assert needle in msg, (needle, msg)
  assert _snapshot(tmp_path) == before  # nothing read is changed, nothing written


def test_the_train_command_refuses_a_misfit_with_exit_status_2_and_writes_nothing(tmp_path):
  path = _adapters(tmp_path, "r8", rank=8)
  workdir = tmp_path / "run"
  before = _snapshot(path)
  out = subprocess.run(
      [
          sys.executable,
          "-m",
          "experiments.train",
          "--config=configs/calculator.py:smoke=True",
          "--config.sft.steps=0",
          "--config.model.lora.rank=4",
          f"--config.model.lora.init_from={path}",
          f"--workdir={workdir}",
          "--progress=false",
      ],
      cwd=ROOT,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 2, out.stderr[-2000:]
  assert out.stderr.count("\n") == 1 and "model.lora.rank" in out.stderr, out.stderr
  assert not workdir.exists() and _snapshot(path) == before
