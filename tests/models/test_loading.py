"""HF checkpoint import/export, checked against transformers' own forward.

Tiny random Llama / Qwen2 / Qwen3 models are built with transformers (float32,
every parameter randomised, biases and norm scales included, so a wrong
layout cannot hide behind zeros or ones), saved, loaded with
`from_pretrained`, and their logits compared with transformers' forward.
"""

import functools
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import save_file

from mtrl_jax import models
from mtrl_jax import sharding
from mtrl_jax.models import loading

TOL = 1e-4  # float32 logits of magnitude ~10-30 differ by ~1e-5 from reordered sums

_ARCH = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
}


def _hf_model(family, seed=0, **kw):
  """A tiny transformers model with every parameter randomised."""
  base = dict(
      vocab_size=101,
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=2,
      num_attention_heads=4,
      num_key_value_heads=2,
      rms_norm_eps=1e-6,
  )
  base.update(kw)
  config_cls, model_cls = _ARCH[family]
  torch.manual_seed(seed)
  model = model_cls(config_cls(**base, attn_implementation="eager")).eval()
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.2 * torch.randn_like(p))
      elif name.endswith("bias"):
        p.copy_(0.2 * torch.randn_like(p))
      elif "embed_tokens" in name:
        p.copy_(torch.randn_like(p))
      else:  # Linear [out, in]: unit-variance outputs
        p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
  return model


@functools.partial(jax.jit, static_argnums=0)
def _jit_forward(graphdef, state, tokens, positions, mask):
  return nnx.merge(graphdef, state)(tokens, positions, mask)


def _logits(model, tokens, mask=None, positions=None):
  """Our logits (jitted: one compilation per model config and argument kind)."""
  out = np.asarray(_jit_forward(*nnx.split(model), tokens, positions, mask))
  assert out.dtype == np.float32
  return out


def _hf_logits(model, tokens, mask=None, positions=None):
  kw = {}
  if mask is not None:
    kw = dict(
        attention_mask=torch.tensor(mask, dtype=torch.long),
        position_ids=torch.tensor(positions, dtype=torch.long),
    )
  with torch.no_grad():
    return model(torch.tensor(tokens, dtype=torch.long), **kw).logits.numpy()


def _tokens(vocab, shape=(3, 10), seed=0):
  return np.random.RandomState(seed).randint(0, vocab, shape).astype(np.int32)


def _left_padded(vocab):
  """Tokens, validity mask and positions of a batch with left padding."""
  # Same shape as `_tokens`, so one compilation serves both.
  tokens = _tokens(vocab, seed=1)
  lengths = np.array([10, 5, 2])
  mask = np.arange(10)[None, :] >= (10 - lengths)[:, None]
  positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
  return tokens, mask, positions


def _state_arrays(model):
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model))}


CASES = {
    # name: (family, transformers config kwargs, save_pretrained kwargs)
    "llama-mha-untied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=False), {}),
    "llama-gqa2-tied-bias": (
        "llama",
        dict(tie_word_embeddings=True, attention_bias=True, rope_theta=500000.0),
        {},
    ),
    "llama3-rope-gqa4": (
        "llama",
        dict(
            hidden_size=64,
            num_key_value_heads=1,
            head_dim=16,
            tie_word_embeddings=False,
            rope_theta=10000.0,
            max_position_embeddings=1024,
            # wavelengths 6..19869 straddle both bands (64 and 256): every branch of
            # the llama3 formula (kept, smoothed, divided by factor) is exercised.
            rope_scaling=dict(
                rope_type="llama3",
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=256,
            ),
        ),
        {},
    ),
    "qwen2-gqa2-tied": ("qwen2", dict(tie_word_embeddings=True, rope_theta=1e6), {}),
    "qwen2-gqa4-untied": ("qwen2", dict(num_key_value_heads=1, tie_word_embeddings=False), {}),
    "qwen3-mha-tied-headdim": (
        "qwen3",
        dict(num_key_value_heads=4, head_dim=16, tie_word_embeddings=True),
        {},
    ),
    "qwen3-gqa2-untied-sharded": (
        "qwen3",
        dict(tie_word_embeddings=False, rope_theta=5e5),
        dict(max_shard_size="10KB"),
    ),
    "qwen3-attention-bias": ("qwen3", dict(attention_bias=True, num_key_value_heads=1), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_from_pretrained_matches_transformers(case, tmp_path):
  family, kw, save_kw = CASES[case]
  hf = _hf_model(family, **kw)
  hf.save_pretrained(tmp_path, **save_kw)
  if save_kw:
    assert (tmp_path / loading.INDEX_FILE).exists()
    assert len(list(tmp_path.glob("model-*-of-*.safetensors"))) > 1
  model = loading.from_pretrained(str(tmp_path))
  assert model.cfg.family == family
  assert model.cfg.tie_embeddings == hf.config.tie_word_embeddings

  tokens = _tokens(hf.config.vocab_size)
  want = _hf_logits(hf, tokens)
  # Through the masked forward (every token valid) that the padded batch below
  # takes: one program per case. The unmasked forward is checked by the tests below.
  full = np.ones(tokens.shape, bool)
  got = _logits(model, tokens, full, np.broadcast_to(np.arange(10, dtype=np.int32), tokens.shape))
  assert got.dtype == np.float32
  assert np.abs(want).max() > 1.0  # logits are not near-uniform: a real comparison
  np.testing.assert_allclose(got, want, atol=TOL, rtol=0)

  # Left-padded batch: valid positions agree (padding rows are arbitrary).
  tokens, mask, positions = _left_padded(hf.config.vocab_size)
  want = _hf_logits(hf, tokens, mask, positions)
  got = _logits(model, tokens, mask, positions)
  np.testing.assert_allclose(got[mask], want[mask], atol=TOL, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_round_trip_exact_and_transformers_loads_it(family, tmp_path):
  kw = dict(tie_word_embeddings=family != "qwen2")
  if family == "llama":
    kw.update(
        rope_scaling=dict(
            rope_type="llama3",
            factor=4.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=128,
        )
    )
  hf = _hf_model(family, **kw)
  hf.save_pretrained(tmp_path / "hf")
  model = loading.from_pretrained(str(tmp_path / "hf"))

  # Ours -> ours: bit-exact, both as one file and sharded with an index.
  for name, max_bytes in (("single", 1 << 30), ("sharded", 8 * 1024)):
    out = tmp_path / name
    files = loading.save_pretrained(model, str(out), max_shard_bytes=max_bytes)
    assert (len(files) > 1) == (name == "sharded")
    assert (out / loading.INDEX_FILE).exists() == (name == "sharded")
    again = loading.from_pretrained(str(out))
    assert again.cfg == model.cfg
    a, b = _state_arrays(model), _state_arrays(again)
    assert a.keys() == b.keys()
    for p in a:
      np.testing.assert_array_equal(a[p], b[p], err_msg=str(p))

  # Ours -> transformers: the reference implementation loads it, same logits.
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "sharded"), attn_implementation="eager"
  ).eval()
  assert type(ref) is type(hf)
  tokens = _tokens(hf.config.vocab_size)
  np.testing.assert_allclose(_hf_logits(ref, tokens), _hf_logits(hf, tokens), atol=TOL, rtol=0)
  np.testing.assert_allclose(_logits(model, tokens), _hf_logits(ref, tokens), atol=TOL, rtol=0)


def test_native_model_saves_for_transformers(tmp_path):
  """A model created here (not imported) is readable by transformers."""
  # Shapes of the transformers cases above, so compilations are shared.
  cfg = models.get_preset(
      "tiny", vocab_size=101, mlp_dim=48, tie_embeddings=False, rope_theta=20000.0
  )
  model = models.create_model(cfg, seed=3)
  loading.save_pretrained(model, str(tmp_path))
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), attn_implementation="eager"
  ).eval()
  tokens = _tokens(cfg.vocab_size)
  np.testing.assert_allclose(_logits(model, tokens), _hf_logits(ref, tokens), atol=TOL, rtol=0)


def test_bfloat16_checkpoint(tmp_path):
  """bf16 weights are written as BF16, read back exactly, and upcast on request."""
  hf = _hf_model("qwen3")
  hf.to(torch.bfloat16).save_pretrained(tmp_path / "hf")
  model = loading.from_pretrained(str(tmp_path / "hf"))
  assert model.cfg.param_dtype == "bfloat16"
  assert model.blocks[0].attn.q[...].dtype == jnp.bfloat16
  want = hf.state_dict()["model.layers.0.self_attn.q_proj.weight"].float().numpy()
  np.testing.assert_array_equal(
      np.asarray(model.blocks[0].attn.q[...], np.float32).reshape(32, -1).T, want
  )

  loading.save_pretrained(model, str(tmp_path / "ours"))
  header = loading._SafetensorsFile(str(tmp_path / "ours" / loading.SINGLE_FILE)).header
  assert {v["dtype"] for v in header.values()} == {"BF16"}
  a = _state_arrays(model)
  b = _state_arrays(loading.from_pretrained(str(tmp_path / "ours")))
  for p in a:
    np.testing.assert_array_equal(a[p], b[p], err_msg=str(p))

  # The same bf16 weights, computed in float32, match transformers in float32
  # (a fresh reference: casting `hf` back would keep its bf16-rounded RoPE buffer).
  up = loading.from_pretrained(str(tmp_path / "ours"), dtype="float32")
  assert up.cfg.dtype == "float32" and up.blocks[0].attn.q[...].dtype == jnp.float32
  ref = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path / "ours"), dtype=torch.float32, attn_implementation="eager"
  ).eval()
  tokens = _tokens(hf.config.vocab_size)
  np.testing.assert_allclose(_logits(up, tokens), _hf_logits(ref, tokens), atol=TOL, rtol=0)


@pytest.mark.several_devices
def test_load_onto_mesh(tmp_path):
  hf = _hf_model(
      "qwen3",
      hidden_size=32,
      num_attention_heads=4,
      num_key_value_heads=2,
      vocab_size=100,
      intermediate_size=64,
      tie_word_embeddings=False,
  )
  hf.save_pretrained(tmp_path)
  mesh = sharding.make_mesh((2, 2, 2))
  model = loading.from_pretrained(str(tmp_path), mesh=mesh)
  q = model.blocks[0].attn.q[...]
  assert q.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
  assert len(q.sharding.device_set) == 8
  assert model.lm_head[...].sharding.spec == jax.sharding.PartitionSpec("fsdp", "tensor")
  tokens = _tokens(100, (4, 10))
  got = _logits(model, sharding.shard_batch(tokens, mesh))
  np.testing.assert_allclose(got, _hf_logits(hf, tokens), atol=TOL, rtol=0)


# ------------------------------------------------------------------ errors
def _rewrite(path, edit):
  """Rewrites the single weight file of `path` through `edit(dict) -> dict`."""
  f = str(path / loading.SINGLE_FILE)
  reader = loading._SafetensorsFile(f)
  tensors = {k: np.array(reader.get(k)) for k in reader.keys()}
  del reader
  save_file(edit(tensors), f, metadata={"format": "pt"})


def test_missing_and_unexpected_tensors_are_listed(tmp_path):
  _hf_model("qwen3", tie_word_embeddings=True).save_pretrained(tmp_path)

  def edit(t):
    del t["model.layers.1.self_attn.k_norm.weight"]
    t["model.layers.0.mlp.gate_proj.bias"] = np.zeros(48, np.float32)
    return t

  _rewrite(tmp_path, edit)
  with pytest.raises(ValueError) as err:
    loading.from_pretrained(str(tmp_path))
  msg = str(err.value)
  assert "missing ['model.layers.1.self_attn.k_norm.weight']" in msg
  assert "unexpected ['model.layers.0.mlp.gate_proj.bias']" in msg


def test_tolerated_extras(tmp_path):
  """A tied checkpoint that still stores lm_head, and rotary buffers, load fine."""
  hf = _hf_model("llama", tie_word_embeddings=True)
  hf.save_pretrained(tmp_path)

  def edit(t):
    t["lm_head.weight"] = t["model.embed_tokens.weight"].copy()
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)
    return t

  _rewrite(tmp_path, edit)
  model = loading.from_pretrained(str(tmp_path))
  tokens = _tokens(hf.config.vocab_size)
  np.testing.assert_allclose(_logits(model, tokens), _hf_logits(hf, tokens), atol=TOL, rtol=0)


def test_shape_mismatch_and_missing_files(tmp_path):
  _hf_model("qwen2").save_pretrained(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  cfg["intermediate_size"] = 40
  (tmp_path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(ValueError, match=r"mlp.gate_proj.weight.*\(48, 32\).*\(40, 32\)"):
    loading.from_pretrained(str(tmp_path))
  os.remove(tmp_path / loading.SINGLE_FILE)
  with pytest.raises(FileNotFoundError, match="model.safetensors"):
    loading.from_pretrained(str(tmp_path))
  with pytest.raises(FileNotFoundError, match="config.json"):
    loading.from_pretrained(str(tmp_path / "nowhere"))
  with pytest.raises(ValueError, match="dtype.*allowed"):
    loading.from_pretrained(str(tmp_path), dtype="int8")


def test_unsupported_configs_fail_clearly(tmp_path):
  hf = _hf_model("qwen2")
  hf.save_pretrained(tmp_path)
  cfg = json.loads((tmp_path / "config.json").read_text())
  for key, value, match in (
      ("hidden_act", "gelu", "hidden_act.*silu"),
      ("use_sliding_window", True, "sliding-window"),
      ("model_type", "mistral", "model_type.*allowed"),
  ):
    (tmp_path / "config.json").write_text(json.dumps({**cfg, key: value}))
    with pytest.raises(ValueError, match=match):
      loading.from_pretrained(str(tmp_path))

  # A config that config.json cannot express is refused before anything is written.
  bad = models.get_preset("tiny", family="llama", qk_norm=False, qkv_bias=True, o_bias=False)
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(bad, mesh)):
    model = nnx.eval_shape(lambda: models.Transformer(bad, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="qkv_bias"):
    loading.save_pretrained(model, str(tmp_path / "out"))
  assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_config_defaults_follow_transformers(family, tmp_path):
  """Keys absent from config.json take transformers' defaults."""
  minimal = dict(
      model_type=family,
      vocab_size=64,
      hidden_size=32,
      intermediate_size=48,
      num_hidden_layers=1,
      num_attention_heads=4,
      num_key_value_heads=2,
  )
  (tmp_path / "config.json").write_text(json.dumps(minimal))
  ref = transformers.AutoConfig.from_pretrained(str(tmp_path))
  cfg = models.ModelConfig.from_hf_json(str(tmp_path))
  assert cfg.tie_embeddings == ref.tie_word_embeddings
  assert cfg.rms_eps == ref.rms_norm_eps
  assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
  assert cfg.head_dim == 8
