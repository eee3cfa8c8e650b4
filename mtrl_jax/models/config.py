"""Model hyper-parameters: a frozen dataclass, presets, and import from HF `config.json`."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import jax.numpy as jnp

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# The linear layers a low-rank adapter may target: attention q/k/v/o and the
# SwiGLU MLP's gate/up/down (never embeddings, the LM head or norms).
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


EMBED_INITS = ("unit", "scaled")  # `ModelConfig.embed_init`


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters over a frozen base (`config.model.lora`, `mtrl_jax.models.lora`).

  Each targeted weight W [in, out] gains A [in, r] @ B [r, out] scaled by
  alpha / rank; B starts at zero, so an adapted model starts as its base.

  Attributes:
    rank: r; 0 trains every weight in full (no adapters).
    alpha: the adapter's scale numerator (scale = alpha / rank); > 0.
    targets: which of `LORA_TARGETS` get adapters (in every block).
    init_from: a PEFT LoRA directory (adapter_config.json +
      adapter_model.safetensors, as `export --format=peft` writes) whose tensors
      start the adapters; '' starts them fresh. Its r, lora_alpha and
      target_modules must be rank, alpha and targets. Not part of the
      architecture: ignored by == and hash (a jitted program's static key).
  """

  rank: int = 0
  alpha: float = 32.0
  targets: tuple = LORA_TARGETS
  init_from: str = dataclasses.field(default="", compare=False)

  def __post_init__(self):
    if isinstance(self.targets, str):
      object.__setattr__(self, "targets", (self.targets,))
    object.__setattr__(self, "targets", tuple(self.targets))
    if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
      raise ValueError(
          f"config model.lora.rank={self.rank!r}; allowed: an integer >= 0 (0: full fine-tuning)"
      )
    if (
        isinstance(self.alpha, bool)
        or not isinstance(self.alpha, (int, float))
        or not 0 < self.alpha < float("inf")
    ):
      raise ValueError(f"config model.lora.alpha={self.alpha!r}; allowed: a finite number > 0")
    unknown = [t for t in self.targets if t not in LORA_TARGETS]
    if unknown or not self.targets or len(set(self.targets)) != len(self.targets):
      raise ValueError(
          f"config model.lora.targets={self.targets!r}; allowed: distinct "
          f"names among {list(LORA_TARGETS)}, at least one"
      )
    if not isinstance(self.init_from, str) or (self.init_from and not self.enabled):
      raise ValueError(
          f"config model.lora.init_from={self.init_from!r} with model.lora.rank="
          f"{self.rank}; allowed: '' or a PEFT adapter directory with rank > 0"
      )

  @property
  def enabled(self) -> bool:
    return self.rank > 0

  @property
  def scale(self) -> float:
    return float(self.alpha) / self.rank


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder-only transformer of the Llama / Qwen2 / Qwen3 family.

  Hashable, so it can be a static argument of jitted functions.
  """

  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  family: str = "qwen3"  # llama | qwen2 | qwen3: only documents the origin.
  rope_theta: float = 10000.0
  # HF rope_scaling as a sorted tuple of (key, value) pairs; only 'llama3' is
  # supported besides None (plain RoPE).
  rope_scaling: Optional[tuple] = None
  rms_eps: float = 1e-6
  tie_embeddings: bool = True
  qkv_bias: bool = False  # Qwen2: bias on q/k/v projections.
  o_bias: bool = False  # Llama attention_bias=True puts a bias on o_proj too.
  qk_norm: bool = False  # Qwen3: per-head RMSNorm on q and k before RoPE.
  max_seq_len: int = 4096
  param_dtype: str = "float32"
  dtype: str = "float32"  # compute dtype; norms, softmax and logits stay float32.
  remat: bool = False  # rematerialise each block in the backward pass.
  # 'xla': masked einsum attention (any device); 'cudnn': cuDNN's fused flash
  # attention through jax.nn.dot_product_attention with the boolean mask (GPU,
  # bf16/fp16): no [L, L] scores kept for the backward pass.
  attention: str = "xla"
  # Low-rank adapters on the linear layers (`mtrl_jax.models.lora`); None: none.
  lora: Optional[LoraConfig] = None
  # How a model built from scratch draws its embedding (a checkpoint's is loaded as
  # saved): 'unit', standard deviation 1; 'scaled', 1/sqrt(d_model), so that with tied
  # embeddings a fresh model's logits are of unit scale (docs/internals.md,
  # "Initialisation": 'unit' saturates them and a warm-up barely moves a fresh model).
  embed_init: str = "unit"
  # A linear value head on the final hidden state (`Transformer.values_at`): the
  # critic of `critic.kind` != 'none', trained with the policy; never exported.
  value_head: bool = False

  def __post_init__(self):
    if self.attention not in ("xla", "cudnn"):
      raise ValueError(f"ModelConfig.attention={self.attention!r}; allowed: ['cudnn', 'xla']")
    if self.embed_init not in EMBED_INITS:
      raise ValueError(f"ModelConfig.embed_init={self.embed_init!r}; allowed: {list(EMBED_INITS)}")
    for name in ("param_dtype", "dtype"):
      if getattr(self, name) not in _DTYPES:
        raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r}; allowed: {sorted(_DTYPES)}")
    if self.family not in ("llama", "qwen2", "qwen3"):
      raise ValueError(f"ModelConfig.family={self.family!r}; allowed: ['llama', 'qwen2', 'qwen3']")
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"ModelConfig.num_heads={self.num_heads} must be a multiple of "
          f"num_kv_heads={self.num_kv_heads}"
      )

  @property
  def jnp_param_dtype(self):
    return _DTYPES[self.param_dtype]

  @property
  def jnp_dtype(self):
    return _DTYPES[self.dtype]

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Parameter count (embeddings counted once when tied)."""
    d, h, k, dh, f = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
    attn = d * h * dh + 2 * d * k * dh + h * dh * d
    if self.qkv_bias:
      attn += h * dh + 2 * k * dh
    if self.o_bias:
      attn += d
    if self.qk_norm:
      attn += 2 * dh
    block = attn + 3 * d * f + 2 * d
    emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
    return self.num_layers * block + emb + d

  def flops_per_token(self, seq_len: int) -> float:
    """Forward FLOPs per token: 2 * matmul params plus attention scores/values."""
    d, h, k, dh, f = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.mlp_dim
    matmul = d * h * dh + 2 * d * k * dh + h * dh * d + 3 * d * f
    per_layer = 2 * matmul + 2 * 2 * seq_len * h * dh
    return self.num_layers * per_layer + 2 * d * self.vocab_size

  # ---------------------------------------------------------------- HF import
  @classmethod
  def from_hf_dict(cls, hf: dict[str, Any], **overrides) -> "ModelConfig":
    """Builds a config from the dict of an HF `config.json`."""
    model_type = hf.get("model_type", "llama")
    if model_type not in ("llama", "qwen2", "qwen3"):
      raise ValueError(
          f"config.json model_type={model_type!r}; allowed: ['llama', 'qwen2', 'qwen3']"
      )
    # Features the transformer does not implement must fail here, not give
    # silently different logits.
    if hf.get("hidden_act", "silu") != "silu":
      raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}; allowed: ['silu']")
    if hf.get("mlp_bias"):
      raise ValueError("config.json mlp_bias=True; allowed: [False]")
    layer_types = set(hf.get("layer_types") or ["full_attention"])
    if hf.get("use_sliding_window") or layer_types != {"full_attention"}:
      raise ValueError(
          f"config.json use_sliding_window={hf.get('use_sliding_window')}, layer_types "
          f"{sorted(layer_types)}: sliding-window attention is not supported; allowed: "
          f"use_sliding_window=False, layer_types all 'full_attention'"
      )
    num_heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // num_heads
    attention_bias = bool(hf.get("attention_bias", False))
    rope_scaling = hf.get("rope_scaling")
    if rope_scaling is None and isinstance(hf.get("rope_parameters"), dict):
      rp = hf["rope_parameters"]
      if rp.get("rope_type", "default") != "default":
        rope_scaling = rp
    if rope_scaling is not None:
      kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
      if kind in (None, "default"):
        rope_scaling = None
      elif kind != "llama3":
        raise ValueError(f"config.json rope_scaling type {kind!r}; allowed: [None, 'llama3']")
      else:
        rope_scaling = tuple(
            sorted((k, v) for k, v in rope_scaling.items() if isinstance(v, (int, float, str)))
        )
    rope_theta = hf.get("rope_theta")
    if rope_theta is None and isinstance(hf.get("rope_parameters"), dict):
      rope_theta = hf["rope_parameters"].get("rope_theta")
    torch_dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
    dtype = torch_dtype if torch_dtype in _DTYPES else "float32"
    kw = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=hf.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        mlp_dim=hf["intermediate_size"],
        family=model_type,
        rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
        rope_scaling=rope_scaling,
        rms_eps=float(hf.get("rms_norm_eps", 1e-6)),
        # transformers' default is untied for all three families.
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=(model_type == "qwen2") or attention_bias,
        o_bias=attention_bias,
        qk_norm=(model_type == "qwen3"),
        max_seq_len=int(hf.get("max_position_embeddings", 4096)),
        param_dtype=dtype,
        dtype=dtype,
    )
    kw.update(overrides)
    return cls(**kw)

  @classmethod
  def from_hf_json(cls, path: str, **overrides) -> "ModelConfig":
    """Reads `config.json` (a file, or the directory holding it)."""
    if os.path.isdir(path):
      path = os.path.join(path, "config.json")
    with open(path) as f:
      return cls.from_hf_dict(json.load(f), **overrides)

  def to_hf_dict(self) -> dict[str, Any]:
    """The HF `config.json` dict describing this model."""
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[
        self.family
    ]
    out = {
        "architectures": [arch],
        "model_type": self.family,
        "vocab_size": self.vocab_size,
        "hidden_size": self.d_model,
        "num_hidden_layers": self.num_layers,
        "num_attention_heads": self.num_heads,
        "num_key_value_heads": self.num_kv_heads,
        "head_dim": self.head_dim,
        "intermediate_size": self.mlp_dim,
        "hidden_act": "silu",
        "rope_theta": self.rope_theta,
        "rms_norm_eps": self.rms_eps,
        "tie_word_embeddings": self.tie_embeddings,
        "max_position_embeddings": self.max_seq_len,
        "torch_dtype": self.param_dtype,
    }
    if self.rope_scaling is not None:
      out["rope_scaling"] = dict(self.rope_scaling)
    if self.family == "llama":
      out["attention_bias"] = self.o_bias
    if self.family == "qwen3":
      out["attention_bias"] = self.qkv_bias
    return out


# Presets. `tiny` keeps tests fast; `small` is the CPU demo policy (byte-level
# vocab of 256 bytes + specials); `bench` is the 2-layer Qwen3-shaped model of
# the sampler/train benchmarks; the rest match public checkpoints' shapes.
PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=300,
        d_model=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        mlp_dim=64,
        family="qwen3",
        qk_norm=True,
        max_seq_len=512,
    ),
    "small": ModelConfig(
        vocab_size=320,
        d_model=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=384,
        family="qwen3",
        qk_norm=True,
        max_seq_len=1024,
    ),
    "bench": ModelConfig(
        vocab_size=8192,
        d_model=256,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        mlp_dim=768,
        family="qwen3",
        qk_norm=True,
        max_seq_len=2048,
    ),
    "qwen2-0.5b": ModelConfig(
        vocab_size=151936,
        d_model=896,
        num_layers=24,
        num_heads=14,
        num_kv_heads=2,
        head_dim=64,
        mlp_dim=4864,
        family="qwen2",
        qkv_bias=True,
        rope_theta=1e6,
        max_seq_len=32768,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "qwen2.5-coder-3b": ModelConfig(
        vocab_size=151936,
        d_model=2048,
        num_layers=36,
        num_heads=16,
        num_kv_heads=2,
        head_dim=128,
        mlp_dim=11008,
        family="qwen2",
        qkv_bias=True,
        rope_theta=1e6,
        max_seq_len=32768,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "qwen3-0.6b": ModelConfig(
        vocab_size=151936,
        d_model=1024,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=3072,
        family="qwen3",
        qk_norm=True,
        rope_theta=1e6,
        max_seq_len=40960,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "qwen3-1.7b": ModelConfig(
        vocab_size=151936,
        d_model=2048,
        num_layers=28,
        num_heads=16,
        num_kv_heads=8,
        head_dim=128,
        mlp_dim=6144,
        family="qwen3",
        qk_norm=True,
        rope_theta=1e6,
        max_seq_len=40960,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
    "llama3.2-1b": ModelConfig(
        vocab_size=128256,
        d_model=2048,
        num_layers=16,
        num_heads=32,
        num_kv_heads=8,
        head_dim=64,
        mlp_dim=8192,
        family="llama",
        rope_theta=500000.0,
        rms_eps=1e-5,
        rope_scaling=(
            ("factor", 32.0),
            ("high_freq_factor", 4.0),
            ("low_freq_factor", 1.0),
            ("original_max_position_embeddings", 8192),
            ("rope_type", "llama3"),
        ),
        max_seq_len=131072,
        param_dtype="bfloat16",
        dtype="bfloat16",
    ),
}


def get_preset(name: str, dtype: Optional[str] = None, **overrides) -> ModelConfig:
  """Returns a preset by name, with field overrides.

  Args:
    name: a key of `PRESETS`.
    dtype: sets both `param_dtype` and `dtype` (e.g. 'bfloat16'); None keeps
      the preset's.
    **overrides: other `ModelConfig` fields.
  """
  if name not in PRESETS:
    raise ValueError(f"model preset {name!r}; allowed: {sorted(PRESETS)}")
  if dtype:
    overrides = {"param_dtype": dtype, "dtype": dtype, **overrides}
  return PRESETS[name].replace(**overrides)
