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
`lora_alpha / r` its scale, as ours. `load_adapters` reads such a directory
back onto an adapted architecture (`model.lora.init_from`); a tensor whose
shape does not fit is refused naming the tensor.
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtrl_jax.models import loading, lora as lora_lib
from mtrl_jax.models.config import LoraConfig, ModelConfig

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# Our target -> its Hugging Face module inside a decoder layer.
HF_MODULE = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
             "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
             "down": "mlp.down_proj"}


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
  return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
          "lora_alpha": float(lora.alpha), "lora_dropout": 0.0, "bias": "none",
          "target_modules": sorted(HF_MODULE[t].split(".")[-1] for t in lora.targets),
          "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
          "init_lora_weights": True, "modules_to_save": None,
          "base_model_name_or_path": base_path or None, "inference_mode": True}


def _one_adapter_dir(adapters, lora: LoraConfig, out_dir: str, base_path: str) -> str:
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
  n = len(policies.models)
  return [(os.path.join(out_dir, label), jax.tree.map(lambda x, a=a: x[a], params))
          for a, label in zip(range(n), policies.labels)]


def save_adapters(policies, params, out_dir: str, base_path: str = "") -> list[str]:
  """PEFT adapter directories of a LoRA run's `params` (a train state's): `out_dir`, or
  `out_dir/agent_<a>` per agent. Returns the directories written."""
  step = policies.train_step
  if step.lora is None:
    raise ValueError("export --format=peft: the run has no adapters (model.lora.rank=0); "
                     "allowed: a run with model.lora.rank > 0")
  return [_one_adapter_dir(p, step.lora, d, base_path)
          for d, p in _per_agent(policies, params, out_dir)]


def save_merged(policies, params, out_dir: str) -> list[str]:
  """Merged HF directories (W + scale * A @ B) of `params`: `out_dir`, or one per agent."""
  graphdef = lora_lib.base_graphdef(policies.train_step.model_cfg)
  dirs = []
  for (d, _), merged in zip(_per_agent(policies, params, out_dir), policies.per_policy(params)):
    loading.save_pretrained(nnx.merge(graphdef, merged), d)
    dirs.append(d)
  return dirs


def load_adapters(path: str, cfg: ModelConfig):
  """The adapters of a PEFT LoRA directory `path`, as the adapter state of the adapted
  architecture `cfg` (its rank, alpha and targets must be the directory's).

  Raises:
    ValueError (one line) naming the file, field or tensor that does not fit.
  """
  from safetensors.numpy import load_file
  files = [os.path.join(path, n) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
  missing = [f for f in files if not os.path.isfile(f)]
  if missing:
    raise ValueError(f"model.lora.init_from={path!r} lacks {missing}; allowed: a PEFT LoRA "
                     f"directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
  with open(files[0]) as f:
    got = json.load(f)
  want = adapter_config(cfg.lora)
  for field in ("peft_type", "r", "lora_alpha", "target_modules", "use_rslora", "use_dora"):
    value = sorted(got.get(field) or []) if field == "target_modules" else got.get(field)
    if value != want[field] and not (field in ("use_rslora", "use_dora") and not value):
      raise ValueError(f"{files[0]}: {field}={got.get(field)!r}; allowed: {want[field]!r} "
                       "(model.lora's rank, alpha and targets)")
  tensors = load_file(files[1])
  fresh = lora_lib.init_adapters(cfg)
  out = jax.tree.map(lambda x: x, fresh)
  for (i, target), (a, b) in lora_lib.pairs(fresh).items():
    ab = out["blocks"][i][lora_lib.MODULE_OF[target]][f"{target}_lora"]
    for name, like in (("A", a), ("B", b)):
      key = _key(i, target, name)
      if key not in tensors or tensors[key].shape != like.shape[::-1]:
        shape = tensors[key].shape if key in tensors else "missing"
        raise ValueError(f"{files[1]}: tensor {key} is {shape}; allowed: "
                         f"{tuple(like.shape[::-1])} (the base's layer with rank {cfg.lora.rank})")
      ab[f"lora_{name.lower()}"].set_value(jnp.asarray(tensors[key].T, jnp.float32))
  return out
