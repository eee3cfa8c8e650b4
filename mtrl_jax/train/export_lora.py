"""Low-rank adapters to and from files: merged Hugging Face directories and PEFT adapters.

Two exports of a LoRA run's policies (`model.lora`), one directory per agent
when each agent has its own adapters (`agent_<a>`, as `Policies.labels`):

  * `save_merged`: the plain model with W + scale * A @ B merged in, an HF
    directory (`models.loading.save_pretrained`) that `transformers` loads alone;
  * `save_adapters` (`--format=peft`): a PEFT LoRA directory,
    `adapter_config.json` + `adapter_model.safetensors`, that `peft` loads onto
    the base (`PeftModel.from_pretrained(base, path)`).

PEFT's layout of a target, e.g. q: `base_model.model.model.layers.<i>.self_attn.q_proj
.lora_A.weight` [r, in] = A^T and `...lora_B.weight` [out, r] = B^T, with
`lora_alpha / r` its scale, as ours. `model.lora.init_from` starts a run's
adapters from such a directory (`init_dirs`: one per agent or one for all):
`check_adapters` holds it against the run's config and base from its header alone
(validation), `load_adapters` reads its tensors (a fresh start); a field or tensor
that does not fit is refused in one line naming it.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtrl_jax.models import loading, lora as lora_lib
from mtrl_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Our target -> its Hugging Face module inside a decoder layer.
HF_MODULE = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}


def _key(layer: int, target: str, ab: str) -> str:
  return f"base_model.model.model.layers.{layer}.{HF_MODULE[target]}.lora_{ab}.weight"


def peft_tensors(adapters) -> dict[str, np.ndarray]:
  """PEFT's state dict of one policy's adapters (float32 numpy)."""
  out = {}
  for (i, target), (a, b) in lora_lib.pairs(adapters).items():
    out[_key(i, target, "A")] = np.ascontiguousarray(np.asarray(a, np.float32).T)
    out[_key(i, target, "B")] = np.ascontiguousarray(np.asarray(b, np.float32).T)
  return out


def adapter_config(lora: LoraConfig, base_path: str = "") -> dict:
  """PEFT's `adapter_config.json` of `lora`."""
  return {
      "peft_type": "LORA",
      "task_type": "CAUSAL_LM",
      "r": lora.rank,
      "lora_alpha": float(lora.alpha),
      "lora_dropout": 0.0,
      "bias": "none",
      "target_modules": sorted(HF_MODULE[t].split(".")[-1] for t in lora.targets),
      "fan_in_fan_out": False,
      "use_rslora": False,
      "use_dora": False,
      "init_lora_weights": True,
      "modules_to_save": None,
      "base_model_name_or_path": base_path or None,
      "inference_mode": True,
  }


def write_adapters(adapters, lora: LoraConfig, out_dir: str, base_path: str = "") -> str:
  """One PEFT adapter directory of one policy's `adapters` (an adapter state); returns it."""
  from safetensors.numpy import save_file

  os.makedirs(out_dir, exist_ok=True)
  tensors = peft_tensors(jax.device_get(adapters))
  save_file(tensors, os.path.join(out_dir, ADAPTER_WEIGHTS), metadata={"format": "pt"})
  with open(os.path.join(out_dir, ADAPTER_CONFIG), "w") as f:
    json.dump(adapter_config(lora, base_path), f, indent=1)
  return out_dir


def _per_agent(policies, params, out_dir: str) -> list[tuple[str, object]]:
  """(directory, one policy's tree) of each policy of `params` (a state's params)."""
  if not policies.per_agent:
    return [(out_dir, params)]
  return [
      (os.path.join(out_dir, label), p)
      for label, p in zip(policies.labels, policies.agent_params(params))
  ]


def save_adapters(policies, params, out_dir: str, base_path: str = "") -> list[str]:
  """PEFT adapter directories of a LoRA run's `params` (a train state's): `out_dir`, or
  `out_dir/agent_<a>` per agent. Returns the directories written."""
  step = policies.train_step
  if step.lora is None:
    raise ValueError(
        "export --format=peft: the run has no adapters (model.lora.rank=0); "
        "allowed: a run with model.lora.rank > 0"
    )
  return [
      write_adapters(p, step.lora, d, base_path) for d, p in _per_agent(policies, params, out_dir)
  ]


def save_merged(policies, params, out_dir: str) -> list[str]:
  """Merged HF directories (W + scale * A @ B) of `params`: `out_dir`, or one per agent."""
  graphdefs = [nnx.graphdef(m) for m in policies.models]  # each policy's plain model
  dirs = []
  for (d, _), g, merged in zip(
      _per_agent(policies, params, out_dir), graphdefs, policies.per_policy(params)
  ):
    loading.save_pretrained(nnx.merge(g, merged), d)
    dirs.append(d)
  return dirs


# adapter_config.json fields that must equal the run's config (their config field), and
# those whose non-default values would change what the tensors mean (must be off).
_MATCH = {
    "r": "model.lora.rank",
    "lora_alpha": "model.lora.alpha",
    "target_modules": "model.lora.targets",
}
_OFF = (
    "use_rslora",
    "use_dora",
    "fan_in_fan_out",
    "modules_to_save",
    "rank_pattern",
    "alpha_pattern",
    "layers_to_transform",
)
_OURS = {hf.split(".")[-1]: ours for ours, hf in HF_MODULE.items()}


def init_dirs(path: str, labels: list[str]) -> list[str]:
  """The PEFT directory each policy starts from (`model.lora.init_from`): `path` for
  every policy, or with per-agent `labels` `path/<label>` each when `path` holds those
  (as `save_adapters` writes a per-agent run) and no adapter_config.json itself."""
  if labels and not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
    dirs = [os.path.join(path, label) for label in labels]
    if all(os.path.isdir(d) for d in dirs):
      return dirs
  return [path] * max(len(labels), 1)


def _read_config(path: str) -> dict:
  file = os.path.join(path, ADAPTER_CONFIG)
  try:
    with open(file) as f:
      got = json.load(f)
    if not isinstance(got, dict):
      raise ValueError("not a JSON object")
    return got
  except (OSError, ValueError) as e:
    raise ValueError(
        f"model.lora.init_from: {file} does not read ({' '.join(str(e).split())});"
        " allowed: a PEFT adapter_config.json"
    ) from None


def _wanted(field: str, lora: LoraConfig):
  if field == "target_modules":
    return tuple(t for t in LORA_TARGETS if t in lora.targets)
  return lora.rank if field == "r" else float(lora.alpha)


def _given(field: str, value):
  if field == "target_modules" and isinstance(value, list):
    return tuple(t for t in LORA_TARGETS if t in {_OURS.get(v, v) for v in value}) + tuple(
        sorted(v for v in value if v not in _OURS)
    )
  return value


def check_adapters(path: str, cfg: ModelConfig) -> dict[str, tuple]:
  """Checks the PEFT directory `path` against the adapted architecture `cfg` without
  reading its tensors: adapter_config.json's r, lora_alpha and target_modules equal
  `cfg.lora`'s rank, alpha and targets (no rsLoRA, DoRA, per-module ranks or saved
  modules), and the safetensors file holds every adapter of every layer with the base's
  shapes and nothing else. Returns {tensor name: our (A or B) shape}.

  Raises:
    ValueError (one line) naming the directory, file, field or tensor that does not fit.
  """
  from safetensors import safe_open

  files = [os.path.join(path, n) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
  missing = [os.path.basename(f) for f in files if not os.path.isfile(f)]
  if missing:
    raise ValueError(
        f"model.lora.init_from={path!r} lacks {missing}; allowed: a PEFT LoRA "
        f"directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS}), or one per agent "
        "(agent_<a>/) with agents.share_policy=False"
    )
  got = _read_config(path)
  if got.get("peft_type", "LORA") != "LORA" or got.get("bias", "none") != "none":
    raise ValueError(
        f"model.lora.init_from: {files[0]} has peft_type={got.get('peft_type')!r}"
        f", bias={got.get('bias')!r}; allowed: peft_type='LORA', bias='none'"
    )
  for field in _OFF:
    if got.get(field):
      raise ValueError(
          f"model.lora.init_from: {files[0]} has {field}={got[field]!r}; "
          "allowed: unset / false (plain LoRA, one rank and scale for all)"
      )
  for field, name in _MATCH.items():
    given, want = _given(field, got.get(field)), _wanted(field, cfg.lora)
    if given != want:
      raise ValueError(
          f"model.lora.init_from: {files[0]} has {field}={got.get(field)!r} but "
          f"{name}={want!r}; allowed: {name}={given!r} (the adapters' own)"
      )
  expected = {}
  for (i, target), (a, b) in lora_lib.pairs(lora_lib.abstract_adapters(cfg)).items():
    expected[_key(i, target, "A")], expected[_key(i, target, "B")] = a.shape, b.shape
  try:
    with safe_open(files[1], framework="numpy") as f:
      shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
  except Exception as e:  # a truncated or foreign file: safetensors' own error types
    raise ValueError(
        f"model.lora.init_from: {files[1]} does not read "
        f"({' '.join(str(e).split())}); allowed: a safetensors file"
    ) from None
  for key, like in expected.items():
    if shapes.get(key) != like[::-1]:
      raise ValueError(
          f"model.lora.init_from: {files[1]}: tensor {key} is "
          f"{shapes.get(key, 'missing')}; allowed: {like[::-1]} (the base's layer "
          f"with rank {cfg.lora.rank})"
      )
  extra = sorted(set(shapes) - set(expected))
  if extra:
    raise ValueError(
        f"model.lora.init_from: {files[1]}: tensor {extra[0]} is no adapter of "
        f"this base ({len(extra)} such); allowed: the {len(expected)} adapter "
        f"tensors of {cfg.num_layers} layers"
    )
  return expected


def load_adapters(path: str, cfg: ModelConfig):
  """The adapters of a PEFT LoRA directory `path` (`check_adapters` first), as the
  adapter state of the adapted architecture `cfg`, float32.

  Raises:
    ValueError (one line) naming the file, field or tensor that does not fit.
  """
  from safetensors.numpy import load_file

  check_adapters(path, cfg)
  tensors = load_file(os.path.join(path, ADAPTER_WEIGHTS))
  out = jax.tree.map(lambda x: x, lora_lib.abstract_adapters(cfg))
  for (i, target), (a, b) in lora_lib.pairs(out).items():
    ab = out["blocks"][i][lora_lib.MODULE_OF[target]][f"{target}_lora"]
    for name, like in (("A", a), ("B", b)):
      value = jnp.asarray(tensors[_key(i, target, name)].T, like.dtype)
      ab[f"lora_{name.lower()}"].set_value(value)
  return out


def start_adapters(cfg: ModelConfig, labels: list[str]):
  """The adapters `cfg.lora.init_from` gives each policy (one per label, one for a shared
  policy), or None without `init_from`."""
  if cfg.lora is None or not cfg.lora.init_from:
    return None
  return [load_adapters(d, cfg) for d in init_dirs(cfg.lora.init_from, labels)]
