"""Checkpoint import/export in the Hugging Face layout (config.json + safetensors).

`from_pretrained(path)` reads a local Llama / Qwen2 / Qwen3 directory, single
file (`model.safetensors`) or sharded (`model.safetensors.index.json`), into a
`Transformer` whose parameters are placed straight onto their NamedShardings:
the model is built abstractly (`nnx.eval_shape`), never randomly initialised,
and tensors are read one at a time, so host memory holds one tensor at once.
`save_pretrained(model, path)` writes the same layout back, so transformers
(or any other HF-format tool) can load what we trained.

Layouts: HF linear weights are [out, in]; ours are [in, ...] with heads split
out (q [D, H, Dh], k/v [D, K, Dh], o [H, Dh, D], gate/up [D, F], down [F, D],
untied lm_head [D, V]); embed [V, D] and norm scales are the same.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Optional

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from safetensors.numpy import save_file

from mtrl_jax import sharding
from mtrl_jax.models import state_shardings
from mtrl_jax.models.config import _DTYPES, ModelConfig
from mtrl_jax.models.transformer import Transformer

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_RE = re.compile(r"model-\d+-of-\d+\.safetensors")
# Buffers some checkpoints carry that are not parameters (recomputed from config).
_IGNORED_RE = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")

# safetensors dtype codes -> numpy dtypes (ml_dtypes supplies the ones numpy lacks).
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One parameter: our state path, its HF name and HF shape.

  `transpose`: the HF tensor is stored [out, in] while ours is [in, ...]; the
  conversion is then `w_hf.T.reshape(ours)` and back `x.reshape(hf[::-1]).T`.
  """

  path: tuple
  hf_name: str
  hf_shape: tuple
  transpose: bool


def _entries(cfg: ModelConfig) -> list[_Entry]:
  """The parameter table of a model with config `cfg`, in HF order."""
  d, h, k, dh, f, v = (
      cfg.d_model,
      cfg.num_heads,
      cfg.num_kv_heads,
      cfg.head_dim,
      cfg.mlp_dim,
      cfg.vocab_size,
  )
  out = [_Entry(("embed",), "model.embed_tokens.weight", (v, d), False)]
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", ("blocks", i)
    attn, mlp = ours + ("attn",), ours + ("mlp",)
    out += [
        _Entry(attn + ("q",), hf + "self_attn.q_proj.weight", (h * dh, d), True),
        _Entry(attn + ("k",), hf + "self_attn.k_proj.weight", (k * dh, d), True),
        _Entry(attn + ("v",), hf + "self_attn.v_proj.weight", (k * dh, d), True),
        _Entry(attn + ("o",), hf + "self_attn.o_proj.weight", (d, h * dh), True),
    ]
    if cfg.qkv_bias:
      out += [
          _Entry(attn + ("q_bias",), hf + "self_attn.q_proj.bias", (h * dh,), False),
          _Entry(attn + ("k_bias",), hf + "self_attn.k_proj.bias", (k * dh,), False),
          _Entry(attn + ("v_bias",), hf + "self_attn.v_proj.bias", (k * dh,), False),
      ]
    if cfg.o_bias:
      out.append(_Entry(attn + ("o_bias",), hf + "self_attn.o_proj.bias", (d,), False))
    if cfg.qk_norm:
      out += [
          _Entry(attn + ("q_norm", "scale"), hf + "self_attn.q_norm.weight", (dh,), False),
          _Entry(attn + ("k_norm", "scale"), hf + "self_attn.k_norm.weight", (dh,), False),
      ]
    out += [
        _Entry(ours + ("attn_norm", "scale"), hf + "input_layernorm.weight", (d,), False),
        _Entry(ours + ("mlp_norm", "scale"), hf + "post_attention_layernorm.weight", (d,), False),
        _Entry(mlp + ("gate",), hf + "mlp.gate_proj.weight", (f, d), True),
        _Entry(mlp + ("up",), hf + "mlp.up_proj.weight", (f, d), True),
        _Entry(mlp + ("down",), hf + "mlp.down_proj.weight", (d, f), True),
    ]
  out.append(_Entry(("final_norm", "scale"), "model.norm.weight", (d,), False))
  if not cfg.tie_embeddings:
    out.append(_Entry(("lm_head",), "lm_head.weight", (v, d), True))
  return out


def _to_ours(w_hf: np.ndarray, e: _Entry, shape: tuple, dtype) -> np.ndarray:
  w = w_hf.astype(dtype)  # always a copy: nothing aliases the memory-mapped file
  w = w.T.reshape(shape) if e.transpose else w.reshape(shape)
  return np.ascontiguousarray(w)


def _to_hf(x: np.ndarray, e: _Entry) -> np.ndarray:
  x = x.reshape(e.hf_shape[::-1]).T if e.transpose else x.reshape(e.hf_shape)
  return np.ascontiguousarray(x)


# ------------------------------------------------------------------ reading
class _SafetensorsFile:
  """Lazy, memory-mapped reader of one .safetensors file.

  We parse the (documented) header ourselves instead of `safe_open(...,
  framework="numpy")` because numpy has no bfloat16: a memory map viewed with
  ml_dtypes reads every dtype, one tensor at a time, without a device copy.
  """

  def __init__(self, path: str):
    self.path = path
    with open(path, "rb") as f:
      n = int.from_bytes(f.read(8), "little")
      header = json.loads(f.read(n))
    self.data_start = 8 + n
    self.file_size = os.path.getsize(path)
    header.pop("__metadata__", None)
    self.header = header

  def keys(self) -> list[str]:
    return list(self.header)

  def get(self, name: str) -> np.ndarray:
    info = self.header[name]
    if info["dtype"] not in _ST_DTYPES:
      raise ValueError(
          f"{self.path}: tensor {name!r} has dtype {info['dtype']!r}; "
          f"allowed: {sorted(_ST_DTYPES)}"
      )
    dtype = np.dtype(_ST_DTYPES[info["dtype"]])
    shape = tuple(info["shape"])
    begin, end = info["data_offsets"]
    if (
        end - begin != int(np.prod(shape)) * dtype.itemsize
        or self.data_start + end > self.file_size
    ):
      raise ValueError(
          f"{self.path}: tensor {name!r} has inconsistent data_offsets "
          f"{info['data_offsets']} for shape {shape} and dtype {info['dtype']}"
      )
    if not shape or 0 in shape:
      return np.zeros(shape, dtype)
    return np.memmap(self.path, dtype=dtype, mode="r", offset=self.data_start + begin, shape=shape)


def _weight_map(path: str) -> dict[str, str]:
  """HF tensor name -> file path, from the single file or the index."""
  single, index = os.path.join(path, SINGLE_FILE), os.path.join(path, INDEX_FILE)
  if os.path.exists(single):  # same precedence as transformers
    return {name: single for name in _SafetensorsFile(single).keys()}
  if os.path.exists(index):
    with open(index) as f:
      weight_map = json.load(f)["weight_map"]
    return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
  raise FileNotFoundError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE} found")


def _check_names(entries: list[_Entry], available, cfg: ModelConfig):
  expected = {e.hf_name for e in entries}
  missing = sorted(expected - set(available))
  unexpected = sorted(
      n
      for n in set(available) - expected
      if not _IGNORED_RE.fullmatch(n)
      # Some tied checkpoints still store a copy of the embedding as lm_head.
      and not (cfg.tie_embeddings and n == "lm_head.weight")
  )
  if missing or unexpected:
    raise ValueError(
        f"checkpoint tensors do not match the {cfg.family} config "
        f"(tie_embeddings={cfg.tie_embeddings}, qkv_bias={cfg.qkv_bias}, "
        f"o_bias={cfg.o_bias}, qk_norm={cfg.qk_norm}): missing {missing}; "
        f"unexpected {unexpected}"
    )


def _dtype_name(dtype) -> str:
  name = dtype if isinstance(dtype, str) else np.dtype(dtype).name
  if name not in _DTYPES:
    raise ValueError(f"from_pretrained dtype={dtype!r}; allowed: {sorted(_DTYPES)}")
  return name


def from_pretrained(
    path: str,
    *,
    mesh: Optional[jax.sharding.Mesh] = None,
    rules=sharding.TRAIN_RULES,
    dtype=None,
    value_head: bool = False,
) -> Transformer:
  """Loads a local HF-format Llama / Qwen2 / Qwen3 checkpoint.

  Args:
    path: directory with `config.json` and `model.safetensors` or
      `model.safetensors.index.json` plus its shards.
    mesh: a (data, fsdp, tensor) mesh; default: one device.
    rules: logical-axis rules (filtered by `sharding.rules_for`).
    dtype: parameter and compute dtype ('float32' | 'bfloat16' | 'float16' or
      the jnp dtype); default: the checkpoint's own (config.json `dtype`).
    value_head: add a zero value head (`ModelConfig.value_head`: not in HF files).
  Returns:
    The model, each parameter created directly with its NamedSharding.
  Raises:
    FileNotFoundError: no config.json or weights in `path`.
    ValueError: tensor names or shapes that do not match the config.
  """
  overrides = {}
  if dtype is not None:
    overrides = dict(param_dtype=_dtype_name(dtype), dtype=_dtype_name(dtype))
  if not os.path.exists(os.path.join(path, "config.json")):
    raise FileNotFoundError(f"{path}: no config.json found")
  cfg = ModelConfig.from_hf_json(path, **overrides).replace(value_head=value_head)
  mesh = mesh if mesh is not None else sharding.single_device_mesh()

  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh, rules)):
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
  graphdef, abs_state = nnx.split(abstract)
  shardings = dict(nnx.to_flat_state(state_shardings(abs_state, cfg, mesh, rules)))
  abs_flat = dict(nnx.to_flat_state(abs_state))

  entries = _entries(cfg)
  filled = {}
  if value_head:  # a fresh critic: zero, as `Transformer` makes it
    var = abs_flat.pop(("value_head",))
    filled[("value_head",)] = var.replace(
        jax.device_put(
            np.zeros(var.get_value().shape, np.float32), shardings[("value_head",)].get_value()
        )
    )
  if {e.path for e in entries} != set(abs_flat):
    raise AssertionError(  # the table above is out of sync with Transformer
        f"loading table {sorted(e.path for e in entries)} != model state {sorted(abs_flat)}"
    )
  weight_map = _weight_map(path)
  _check_names(entries, weight_map, cfg)

  by_file: dict[str, list[_Entry]] = {}
  for e in entries:
    by_file.setdefault(weight_map[e.hf_name], []).append(e)
  for fpath, file_entries in by_file.items():
    reader = _SafetensorsFile(fpath)
    for e in file_entries:
      w = reader.get(e.hf_name)
      if tuple(w.shape) != e.hf_shape:
        raise ValueError(
            f"{fpath}: tensor {e.hf_name!r} has shape {tuple(w.shape)}; "
            f"the config needs {e.hf_shape}"
        )
      var = abs_flat[e.path]
      spec = var.get_value()
      w = _to_ours(w, e, spec.shape, spec.dtype)
      # Each process transfers only its addressable shards (multi-host safe).
      arr = jax.make_array_from_callback(
          w.shape, shardings[e.path].get_value(), lambda idx, w=w: w[idx]
      )
      filled[e.path] = var.replace(arr)
      del w
  return nnx.merge(graphdef, nnx.from_flat_state(filled))


# ------------------------------------------------------------------ writing
def _host_array(x: jax.Array) -> np.ndarray:
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    x = multihost_utils.process_allgather(x, tiled=True)
  return np.asarray(jax.device_get(x))


def _check_representable(cfg: ModelConfig):
  """Fails when config.json cannot describe `cfg` (e.g. Llama with qkv_bias != o_bias)."""
  back = ModelConfig.from_hf_dict(cfg.to_hf_dict(), dtype=cfg.dtype, remat=cfg.remat)
  lost = {
      f.name: (getattr(cfg, f.name), getattr(back, f.name))
      for f in dataclasses.fields(cfg)
      if getattr(cfg, f.name) != getattr(back, f.name)
  }
  if lost:
    raise ValueError(
        f"save_pretrained: a {cfg.family} config.json cannot express "
        f"{ {k: v[0] for k, v in lost.items()} } (it would read back as "
        f"{ {k: v[1] for k, v in lost.items()} })"
    )


def save_pretrained(
    model: Transformer, path: str, *, max_shard_bytes: int = 4 * 2**30
) -> list[str]:
  """Writes `model` as an HF-format checkpoint directory.

  `config.json` comes from `cfg.to_hf_dict()`; weights keep the parameter
  dtype. When they exceed `max_shard_bytes` they are split into
  `model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`.
  Weight files of an earlier save in `path` are removed first. In a
  multi-process run every process must call this (parameters are gathered
  collectively); only process 0 writes.

  Args:
    model: the model to save.
    path: output directory (created if needed).
    max_shard_bytes: size limit of one weight file (a larger single tensor
      gets a file of its own).
  Returns:
    The names of the weight files written.
  """
  if max_shard_bytes <= 0:
    raise ValueError(f"save_pretrained max_shard_bytes={max_shard_bytes}; must be > 0")
  cfg = model.cfg.replace(value_head=False)  # a critic's value head is not an HF weight
  _check_representable(cfg)
  flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
  flat.pop(("value_head",), None)
  entries = _entries(cfg)
  if {e.path for e in entries} != set(flat):
    raise AssertionError(
        f"saving table {sorted(e.path for e in entries)} != model state {sorted(flat)}"
    )

  # Plan the shards from shapes alone, so only one shard is on the host at once.
  shards: list[list[_Entry]] = [[]]
  shard_bytes, total = 0, 0
  for e in entries:
    nbytes = flat[e.path].get_value().nbytes
    total += nbytes
    if shards[-1] and shard_bytes + nbytes > max_shard_bytes:
      shards.append([])
      shard_bytes = 0
    shards[-1].append(e)
    shard_bytes += nbytes
  n = len(shards)
  names = (
      [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
  )

  write = jax.process_index() == 0
  if write:
    os.makedirs(path, exist_ok=True)
    for old in os.listdir(path):
      if old in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.fullmatch(old):
        os.remove(os.path.join(path, old))
  weight_map = {}
  for fname, shard in zip(names, shards):
    tensors = {e.hf_name: _to_hf(_host_array(flat[e.path].get_value()), e) for e in shard}
    if write:
      save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
    weight_map.update({e.hf_name: fname for e in shard})
    del tensors
  if write:
    if n > 1:
      with open(os.path.join(path, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(path, "config.json"), "w") as f:
      json.dump(cfg.to_hf_dict(), f, indent=2)
  return names
