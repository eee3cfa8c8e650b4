"""What tests build on: the byte tokenizer and renderer, the tiny model and its logits
as one program, train batches from plain rows, local HF checkpoints, directories built
once per `pytest` run, stopped copies of runs and subprocess environments (the index:
`mtrl_jax/testing/__init__.py`)."""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
from typing import Callable, Sequence

import jax.numpy as jnp
import numpy as np
from flax import nnx

from mtrl_jax import checkpoint, models
from mtrl_jax.text import ByteTokenizer, ChatRenderer, compact


@functools.cache
def byte_tokenizer(extra_specials: Sequence[str] = ()) -> ByteTokenizer:
  """The byte tokenizer (with `extra_specials`), built once per process."""
  return ByteTokenizer(extra_specials=tuple(extra_specials))


def byte_renderer(extra_specials: Sequence[str] = ()) -> ChatRenderer:
  """A fresh renderer (its mismatch counters start at 0) in the compact chat format."""
  tok = byte_tokenizer(tuple(extra_specials))
  return ChatRenderer(tok, compact(tok))


@functools.cache
def tiny_model():
  """The seed-0 model of the `tiny` preset, built once per process (do not mutate it)."""
  return models.create_model(models.get_preset("tiny"), seed=0)


@nnx.jit
def _call(model, tokens_BxL):
  return model(tokens_BxL)


def logits(model, tokens_BxL) -> np.ndarray:
  """`model(tokens_BxL)` (int32 token ids) as one program, compiled once per architecture
  and shape. Called outside `jit`, the forward runs op by op and each of its ops compiles
  for every new shape: ~1 s of compiling per call on 2 cores."""
  return np.asarray(_call(model, jnp.asarray(tokens_BxL, jnp.int32)))


def rows_batch(rows: dict):
  """A `TrainBatch` of plain row arrays as tests write them: tokens_BxL, loss_mask_BxL
  and optionally old_logp_BxL, adv_B (or adv_BxL), row_weight_B
  (`rollout.train_batch.from_rows`: each row one causal path)."""
  from mtrl_jax.rollout.train_batch import from_rows

  return from_rows(
      rows["tokens_BxL"],
      rows["loss_mask_BxL"],
      old_logp_BxL=rows.get("old_logp_BxL"),
      adv=rows.get("adv_BxL", rows.get("adv_B")),
      row_weight_B=rows.get("row_weight_B"),
  )


def dense_rows(batch, x_BxK, fill=0.0) -> np.ndarray:
  """Per-token values `[B, K]` of a `rows_batch` back at their row positions `[B, L]`
  (token t's slot is where prev = t - 1; `fill` elsewhere)."""
  x_BxK, mask_BxK = np.asarray(x_BxK), np.asarray(batch.loss_mask_BxK)
  out = np.full(np.shape(batch.tokens_BxL), fill, x_BxK.dtype)
  rows, slots = np.nonzero(mask_BxK)
  out[rows, np.asarray(batch.prev_BxK)[rows, slots] + 1] = x_BxK[rows, slots]
  return out


def rows_of(tree, length_buckets):
  """A finalized tree's trained samples as the rows layout (`rl.packing='rows'`): one row
  per action, agent-major then in node and sample order, no zero-variance filter."""
  from mtrl_jax.rollout.batching import BatchConfig, make_train_batch

  batch, _ = make_train_batch(
      tree,
      BatchConfig(packing="rows", length_buckets=tuple(length_buckets), zero_variance_filter=False),
  )
  return batch


def hf_checkpoint(
    out_dir: str,
    *,
    preset: str = "tiny",
    tokenizer_vocab: int = 300,
    model_vocab: int = 320,
    seed: int = 0,
    embed_scale: float = 1.0,
) -> str:
  """Writes a local HF checkpoint to `out_dir` and returns it: `preset`'s random weights
  (seed `seed`, vocabulary `model_vocab`, the embedding times `embed_scale`: a fresh
  preset's unit-variance tied embedding saturates its logits) with a byte-level BPE
  tokenizer of `tokenizer_vocab` ids trained on a few sentences, the chatml specials
  added (eos '<|im_end|>', pad '<|endoftext|>')."""
  import json

  from tokenizers import AddedToken, Tokenizer, decoders, models as tok_models
  from tokenizers import pre_tokenizers, trainers

  from mtrl_jax.models import loading

  os.makedirs(out_dir, exist_ok=True)
  raw = Tokenizer(tok_models.BPE())
  raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  raw.decoder = decoders.ByteLevel()
  raw.train_from_iterator(
      ["what is 12 + 30? call the calculator tool", "the answer is 42"] * 4,
      trainer=trainers.BpeTrainer(
          vocab_size=tokenizer_vocab,
          special_tokens=["<|endoftext|>"],
          initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
          show_progress=False,
      ),
  )
  raw.add_special_tokens(
      [AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>", "<|im_end|>")]
  )
  raw.save(os.path.join(out_dir, "tokenizer.json"))
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump(
        {
            "eos_token": "<|im_end|>",
            "pad_token": "<|endoftext|>",
            "tokenizer_class": "PreTrainedTokenizerFast",
        },
        f,
    )
  model = models.create_model(models.get_preset(preset, vocab_size=model_vocab), seed=seed)
  if embed_scale != 1.0:
    model.embed[...] = model.embed[...] * embed_scale
  loading.save_pretrained(model, out_dir)
  return out_dir


def built_once(tmp_path_factory, name: str, build: Callable[[str], None]) -> str:
  """The directory `name`, built by `build(dir)` once per `pytest` run.

  A module-scoped fixture runs once per pytest-xdist worker that runs one of the
  module's tests; an expensive one (a training run) would run again on each. Here the
  first worker to ask builds it in the directory the workers share
  (`tmp_path_factory`'s base directory's parent under xdist) while the others wait on a
  file lock, then every worker reads the same directory (read only). A failed build
  raises RuntimeError with its message in every worker that asks.
  """
  base = tmp_path_factory.getbasetemp()
  shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
  out, done = os.path.join(shared, name), os.path.join(shared, name + ".done")
  with open(os.path.join(shared, name + ".lock"), "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
      if not os.path.exists(done):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        failure = ""
        try:
          build(out)
        except Exception as e:  # noqa: BLE001  (reported to every worker below)
          failure = f"{type(e).__name__}: {e}"
        with open(done, "w") as f:
          f.write(failure)
      with open(done) as f:
        failure = f.read()
    finally:
      fcntl.flock(lock, fcntl.LOCK_UN)
  if failure:
    raise RuntimeError(f"building {name} failed: {failure}")
  return out


def stopped_copy(run: str, workdir: str, step: int) -> str:
  """Copies the run directory `run` to `workdir` without its checkpoints after `step`
  (`workdir/ckpt/<n>`, n > step): the run as it stood after `step`, what a run stopped
  there leaves (its metrics rows past `step` are dropped when it resumes; the best
  checkpoint, which no row reads, is kept). Returns `workdir`."""
  shutil.copytree(run, workdir)
  ckpt = os.path.join(workdir, checkpoint.CKPT_DIR)
  for name in os.listdir(ckpt):
    if name.isdigit() and int(name) > step:
      shutil.rmtree(os.path.join(ckpt, name))
  return workdir


def cpu_env(devices: int, **extra: str) -> dict:
  """This process's environment with `devices` CPU devices instead of its own count, plus
  `extra`: the other XLA flags (tests/conftest.py's compile-time flags) and the
  compilation cache variables go to the subprocess unchanged."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", **extra)
  flags = [
      f
      for f in env.get("XLA_FLAGS", "").split()
      if not f.startswith("--xla_force_host_platform_device_count")
  ]
  env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
  return env
