"""LoRA exports: the merged HF directory and the PEFT adapter directory give the unmerged
forward's logits in `transformers` (and `peft`); adapters read back exactly; a tensor that
does not fit the base is refused naming it."""

import json
import os
import re

import jax
import numpy as np
import pytest
from flax import nnx

from mtrl_jax import models, testing
from mtrl_jax.models import loading, lora
from mtrl_jax.models.config import LoraConfig
from mtrl_jax.train import OptimConfig, TrainStep, export_lora
from mtrl_jax.train.policies import SharedPolicy
from mtrl_jax.train.sft import SFTObjective

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LORA = LoraConfig(rank=3, alpha=6.0, targets=("q", "k", "v", "o", "gate", "up", "down"))


@pytest.fixture(scope="module")
def lora_policy(tmp_path_factory):
  """A shared LoRA policy over the tiny base (saved as HF in a directory of its own),
  adapters non-zero; (policies, adapters, base_dir), shared by the module's tests (they
  only read it)."""
  cfg = models.get_preset("tiny")
  base = models.create_model(cfg, seed=0)
  base_dir = str(tmp_path_factory.mktemp("lora_export") / "base")
  loading.save_pretrained(base, base_dir)
  step = TrainStep(lora.attach(base, LORA, seed=0), SFTObjective(), OptimConfig())
  policies = SharedPolicy([base], step, seed=0)
  state = policies.init_state()
  leaves, treedef = jax.tree.flatten(state.params)
  keys = jax.random.split(jax.random.key(3), len(leaves))
  adapters = jax.tree.unflatten(
      treedef, [0.2 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
  )
  return policies, adapters, base_dir


def _ours(policies, adapters, tokens):
  step = policies.train_step
  return testing.logits(nnx.merge(step.graphdef, adapters, step.base), tokens)


def _theirs(model, tokens):
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()


def _tokens():
  return np.random.RandomState(0).randint(0, models.get_preset("tiny").vocab_size, (2, 9))


@pytest.mark.slow
def test_merged_export_loads_in_transformers_with_the_unmerged_logits(tmp_path, lora_policy):
  policies, adapters, _ = lora_policy
  tokens = _tokens()
  ours = _ours(policies, adapters, tokens)
  [out] = export_lora.save_merged(policies, adapters, str(tmp_path / "merged"))
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
  np.testing.assert_allclose(_theirs(hf.eval(), tokens), ours, atol=1e-4, rtol=0)


def test_peft_export_loads_onto_the_transformers_base_with_equal_logits(tmp_path, lora_policy):
  peft = pytest.importorskip("peft")
  policies, adapters, base_dir = lora_policy
  tokens = _tokens()
  ours = _ours(policies, adapters, tokens)
  [out] = export_lora.save_adapters(policies, adapters, str(tmp_path / "peft"), base_dir)
  assert sorted(os.listdir(out)) == [export_lora.ADAPTER_CONFIG, export_lora.ADAPTER_WEIGHTS]
  base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager")
  theirs = _theirs(peft.PeftModel.from_pretrained(base, out).eval(), tokens)
  np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
  # And back: the directory's adapters are ours, bit for bit.
  cfg = models.get_preset("tiny").replace(lora=LORA)
  back = export_lora.load_adapters(out, cfg)
  for x, y in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_an_adapter_that_does_not_fit_the_base_is_refused_naming_the_tensor(tmp_path, lora_policy):
  policies, adapters, _ = lora_policy
  [out] = export_lora.save_adapters(policies, adapters, str(tmp_path / "peft"))
  cfg = models.get_preset("tiny").replace(lora=LORA, mlp_dim=48)  # another base's MLP width
  with pytest.raises(ValueError) as e:
    export_lora.load_adapters(out, cfg)
  msg = str(e.value)
  assert re.search(r"tensor \S+layers\.0\.mlp\.\w+_proj\.lora_[AB]\.weight is \(\d+, \d+\)", msg)
  assert "allowed" in msg and "\n" not in msg
  with open(os.path.join(out, export_lora.ADAPTER_CONFIG)) as f:
    assert json.load(f)["r"] == LORA.rank  # nothing written over
  with pytest.raises(ValueError) as e:
    export_lora.load_adapters(out, cfg.replace(lora=LoraConfig(rank=2, alpha=6.0)))
  assert "r=3" in str(e.value) and "\n" not in str(e.value)
