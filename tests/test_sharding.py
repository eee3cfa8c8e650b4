"""Sharded forward passes on 8 fake CPU devices equal the single-device one.

Parameters are born sharded (`create_model(cfg, mesh=...)`, same seed), the
batch is sharded over (data, fsdp), and the logits must not depend on the mesh.
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

# mtrl_jax.models first: importing mtrl_jax.sharding on its own first is circular.
from mtrl_jax import models
from mtrl_jax import sharding

pytestmark = pytest.mark.several_devices

# Same float32 math, partitioned differently (sharded contractions sum in
# another order): ~1e-6 at logits of magnitude ~5.
TOL = 1e-5
CFG = models.get_preset("tiny", tie_embeddings=False)  # V 300, D 32, H 4, K 2, F 64
# kv_heads 1 and an odd vocab: the 'tensor' rules for them cannot apply on a 2-way axis.
ODD = CFG.replace(num_kv_heads=1, vocab_size=301)


def _batch(cfg, b=8, l=12):
  rng = np.random.RandomState(0)
  tokens = rng.randint(0, cfg.vocab_size, (b, l)).astype(np.int32)
  lengths = rng.randint(3, l + 1, b)
  mask = np.arange(l)[None, :] >= (l - lengths)[:, None]
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return dict(tokens=tokens, positions=positions, mask=mask)


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, batch):
  return nnx.merge(graphdef, state)(batch["tokens"], batch["positions"], batch["mask"])


def _logits(model, batch):
  return np.asarray(_forward(*nnx.split(model), batch)), np.asarray(batch["mask"])


@functools.lru_cache(maxsize=None)
def _single_device_logits(cfg):
  return _logits(models.create_model(cfg, seed=0), _batch(cfg))[0]


# Every axis split (2x2x2), no data axis (1x4x2), and rules that cannot apply (odd). The
# pure data mesh (8x1x1, every parameter replicated; every run's default) is compared
# with one device, forward and backward, in tests/train/test_train_step.py.
@pytest.mark.parametrize(
    "cfg,shape",
    [(CFG, (2, 2, 2)), (CFG, (1, 4, 2)), (ODD, (2, 2, 2))],
    ids=["2x2x2", "1x4x2", "odd-2x2x2"],
)
def test_sharded_forward_equals_single_device(cfg, shape):
  batch = _batch(cfg)
  want = _single_device_logits(cfg)

  mesh = sharding.make_mesh(shape)
  model = models.create_model(cfg, seed=0, mesh=mesh)
  sharded = sharding.shard_batch(batch, mesh)
  assert sharded["tokens"].sharding.spec == P(("data", "fsdp"), None)
  got, mask = _logits(model, sharded)
  np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=0)
  assert np.abs(want[mask]).max() > 1.0


def test_params_are_sharded():
  mesh = sharding.make_mesh((2, 2, 2))
  model = models.create_model(CFG, seed=0, mesh=mesh)
  q = model.blocks[0].attn.q[...]  # [D, H, Dh] = [32, 4, 8]
  assert q.sharding.spec == P("fsdp", "tensor", None)
  assert q.sharding.shard_shape(q.shape) == (16, 2, 8)
  assert len(q.sharding.device_set) == 8
  assert model.blocks[0].attn.o[...].sharding.spec == P("tensor", None, "fsdp")
  assert model.blocks[0].mlp.down[...].sharding.spec == P("tensor", "fsdp")
  assert model.embed[...].sharding.spec == P("tensor", "fsdp")
  assert model.lm_head[...].sharding.shard_shape((32, 300)) == (16, 150)
  # Norm scales stay replicated.
  assert model.final_norm.scale[...].sharding.is_fully_replicated

  mesh = sharding.make_mesh((1, 4, 2))
  model = models.create_model(CFG, seed=0, mesh=mesh)
  q = model.blocks[0].attn.q[...]
  assert q.sharding.shard_shape(q.shape) == (8, 2, 8)


def test_rules_for_drops_non_dividing_axes():
  mesh = sharding.make_mesh((2, 2, 2))
  assert dict(sharding.rules_for(CFG, mesh)) == dict(sharding.TRAIN_RULES)
  rules = dict(sharding.rules_for(ODD, mesh))
  assert rules["kv_heads"] is None and rules["vocab"] is None  # 1 and 301 on 2 devices
  assert rules["q_heads"] == "tensor" and rules["embed"] == "fsdp"
  assert rules["mlp"] == "tensor"

  model = models.create_model(ODD, seed=0, mesh=mesh)
  assert model.blocks[0].attn.k[...].sharding.spec == P("fsdp", None, None)
  assert model.blocks[0].attn.q[...].sharding.spec == P("fsdp", "tensor", None)
  assert model.embed[...].sharding.spec == P(None, "fsdp")

  # An axis of size 1 divides everything: nothing is dropped.
  assert sharding.rules_for(ODD, sharding.make_mesh((8, 1, 1))) == sharding.TRAIN_RULES


def test_sample_rules_have_no_fsdp():
  mesh = sharding.make_mesh((2, 2, 2))
  shardings = models.state_shardings(
      models.create_model(CFG, seed=0, mesh=mesh), CFG, mesh, sharding.SAMPLE_RULES
  )
  specs = [v.get_value().spec for _, v in nnx.to_flat_state(shardings)]
  assert specs and all("fsdp" not in spec for spec in specs)
  assert any("tensor" in spec for spec in specs)
