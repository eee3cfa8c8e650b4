r"""Memory of N policies: full fine-tuning vs LoRA over one frozen base (bytes, no compute).

  python -m benchmarks.bench_lora                    # the table, from jax.eval_shape
  python -m benchmarks.bench_lora --rank=16 --agents=1,2,4

Shapes only: every byte count comes from `jax.eval_shape` of the model, its
adapters and AdamW's state (`train.optim.make_optimizer`), so a 7B shape costs
nothing to measure. Models: the `qwen2-0.5b` preset and a 7B Llama-2 shape
(32 layers, D 4096, MLP 11008, 32 heads, vocab 32000), bfloat16 weights.

Per N agents:
  full   params   N copies of the weights;
         optim    N x AdamW's two float32 moments of every weight;
         ref      N frozen references (a KL term keeps one per policy);
  LoRA   params   the base once, plus N adapter sets (float32, rank r on every
                  linear layer: q, k, v, o, gate, up, down);
         optim    N x the adapters' two moments;
         ref      0: the reference is the base with the adapters off.
Targets (the LoRA work item): 4 LoRA agents at most 1/10 of 4 full policies;
1 LoRA agent at most 1.2x the frozen base alone.

  python -m benchmarks.bench_lora --timing           # seconds on this machine, full vs LoRA

`--timing` measures on the default device (CPU here) with the `bench` preset
(qwen3 shape, 2 layers, D 256, vocab 8192), full fine-tuning against LoRA rank
--rank (alpha 2 x rank, every linear layer), side by side in one process:
  train step   `TrainStep` on --rows random rows x 96 tokens (GRPO token-mean,
               kl_coef --kl_coef: full keeps a reference copy, LoRA's reference is
               the base with the adapters off); median of --repeats after warm-up;
  RL step      the real loop (`run.rl.run`, configs/calculator.py smoke run with
               the bench preset, no SFT, --rl_steps steps): median time/rollout and
               time/train of the steps after the first (which compiles); the byte
               tokenizer fits the vocabulary to its own ~300 tokens;
  decode step  one token for --rows rows against a 256-slot KV cache: the plain
               program with merged weights (what the engine runs) vs the adapted
               model's own program (adapters applied unmerged), plus one merge
               (`lora.merge`, once per rollout when merged);
  allocator    `jax.devices()[0].memory_stats()` bytes in use / peak, where the
               backend reports them (the CPU client reports nothing).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from flax import nnx

from mtrl_jax import sharding
from mtrl_jax.losses import LossConfig
from mtrl_jax.models import create_model, lora
from mtrl_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig, get_preset
from mtrl_jax.models.cache import init_cache
from mtrl_jax.models.transformer import Transformer
from mtrl_jax.rollout.train_batch import from_rows
from mtrl_jax.train.optim import OptimConfig, make_optimizer
from mtrl_jax.train.step import TrainStep

_RANK = flags.DEFINE_integer("rank", 16, "adapter rank")
_AGENTS = flags.DEFINE_list("agents", ["1", "2", "4"], "agent counts N")
_TIMING = flags.DEFINE_bool(
    "timing",
    False,
    "time train, RL and decode steps on this machine "
    "(bench preset), full vs LoRA, instead of the memory table",
)
_ROWS = flags.DEFINE_integer("rows", 16, "--timing: rows of the train batch and decode step")
_REPEATS = flags.DEFINE_integer("repeats", 5, "--timing: timed calls per case (median)")
_RL_STEPS = flags.DEFINE_integer(
    "rl_steps", 4, "--timing: RL steps per run (the first compiles and is not counted)"
)
_KL = flags.DEFINE_float("kl_coef", 0.05, "--timing: the loss's KL coefficient")

LLAMA_7B = ModelConfig(
    vocab_size=32000,
    d_model=4096,
    num_layers=32,
    num_heads=32,
    num_kv_heads=32,
    head_dim=128,
    mlp_dim=11008,
    family="llama",
    rms_eps=1e-5,
    tie_embeddings=False,
    max_seq_len=4096,
    param_dtype="bfloat16",
    dtype="bfloat16",
)


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _abstract(cfg: ModelConfig):
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(
      sharding.rules_for(cfg, mesh, sharding.TRAIN_RULES)
  ):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _optim_bytes(params) -> int:
  tx = make_optimizer(OptimConfig())
  f32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
  return _bytes(jax.eval_shape(tx.init, f32))


def sizes(cfg: ModelConfig, rank: int) -> dict:
  """Bytes of one policy's weights, AdamW state, adapters and adapters' AdamW state."""
  _, base = nnx.split(_abstract(cfg), nnx.Param)
  _, adapters, _ = lora.split(
      _abstract(cfg.replace(lora=LoraConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)))
  )
  return {
      "base": _bytes(base),
      "base_optim": _optim_bytes(base),
      "adapters": _bytes(adapters),
      "adapters_optim": _optim_bytes(adapters),
  }


def rows(s: dict, n: int) -> list[tuple]:
  full = (n * s["base"], n * s["base_optim"], n * s["base"])
  low = (s["base"] + n * s["adapters"], n * s["adapters_optim"], 0)
  return [("full", n, *full, sum(full)), ("lora", n, *low, sum(low))]


def _median(fn, repeats: int) -> float:
  """Median seconds of `fn()` (which blocks on its result) after one warm-up call."""
  fn()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def _lora(rank: int) -> LoraConfig:
  return LoraConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS)


def time_train_step(cfg: ModelConfig, rank: int, rows: int, kl_coef: float, repeats: int) -> float:
  """Median seconds of one train step, full (rank 0) or LoRA over the same base."""
  model = create_model(cfg)
  trained = lora.attach(model, _lora(rank)) if rank else model
  step = TrainStep(trained, LossConfig(kl_coef=kl_coef), OptimConfig(learning_rate=1e-5))
  box = [step.init_state(trained)]
  ref = step.copy_params(box[0].params) if kl_coef > 0 and not rank else None
  r = np.random.default_rng(0)
  mask = np.zeros((rows, 96), bool)
  mask[:, 32:] = True
  batch = from_rows(
      r.integers(0, cfg.vocab_size, (rows, 96)).astype(np.int32),
      mask,
      old_logp_BxL=np.full((rows, 96), -5.0, np.float32),
      adv=r.standard_normal(rows).astype(np.float32),
  )

  def one():
    box[0], m = step(box[0], ref, batch)
    jax.block_until_ready(m)

  return _median(one, repeats)


def time_rl_steps(rank: int, steps: int, kl_coef: float) -> dict:
  """Median time/rollout and time/train of a short calculator run on the bench preset
  (steps after the first)."""
  from configs import calculator
  from mtrl_jax.run import rl

  c = calculator.get_config("smoke=True")
  c.model.preset, c.sft.steps, c.loss.kl_coef = "bench", 0, kl_coef
  c.model.lora.rank, c.model.lora.alpha = rank, 2.0 * max(rank, 1)
  c.rl.steps, c.rl.dump_every, c.checkpoint.every, c.eval.every = steps, 0, steps, steps
  with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
    rl.run(c, os.path.join(d, "run"), progress=False)
    with open(os.path.join(d, "run", "metrics.jsonl")) as f:
      rows = [json.loads(line) for line in f][1:]
  return {k: statistics.median(r[k] for r in rows) for k in ("time/rollout", "time/train")}


def time_decode(cfg: ModelConfig, rank: int, rows: int, repeats: int) -> dict:
  """Median seconds of one decode step: merged weights in the plain program vs the
  adapted model's program (unmerged); and of one merge."""
  model = create_model(cfg)
  graphdef, params = nnx.split(model, nnx.Param)
  adapted_graphdef, adapters, base = lora.split(lora.attach(model, _lora(rank)))
  size = 256
  cache = init_cache(cfg, rows, size)
  tokens = jnp.zeros((rows, 1), jnp.int32)
  pos = jnp.full((rows, 1), size // 2, jnp.int32)
  mask = jnp.broadcast_to(jnp.arange(size) <= size // 2, (rows, 1, size))

  def decode(g, *state):
    return nnx.merge(g, *state).forward_cached(tokens, pos, mask, cache, pos, head="last")[0]

  plain = jax.jit(lambda p: decode(graphdef, p))
  unmerged = jax.jit(lambda a, b: decode(adapted_graphdef, a, b))
  merge = jax.jit(lambda b, a: lora.merge(b, a, _lora(rank)))
  return {
      "merged": _median(lambda: plain(params).block_until_ready(), repeats),
      "unmerged": _median(lambda: unmerged(adapters, base).block_until_ready(), repeats),
      "merge": _median(lambda: jax.block_until_ready(merge(base, adapters)), repeats),
  }


def allocator_bytes() -> str:
  stats = jax.devices()[0].memory_stats()
  if not stats:
    return (
        f"jax.devices()[0].memory_stats() is {stats!r} on {jax.devices()[0].platform}: "
        "no allocator figures here (the byte table, without --timing, is jax.eval_shape's)"
    )
  return (
      f"{stats.get('bytes_in_use', 0) / 2**20:.1f} MiB in use, "
      f"{stats.get('peak_bytes_in_use', 0) / 2**20:.1f} MiB peak (the whole process)"
  )


def timing():
  cfg, rank, rows, reps = get_preset("bench"), _RANK.value, _ROWS.value, _REPEATS.value
  print(
      f"python -m benchmarks.bench_lora --timing --rank={rank} --rows={rows} "
      f"--repeats={reps} --rl_steps={_RL_STEPS.value} --kl_coef={_KL.value}"
  )
  print(
      f"bench preset on {jax.devices()[0].platform} ({os.cpu_count()} cores as loaded), "
      f"full vs LoRA rank {rank}; seconds"
  )
  out = [("train step", *(time_train_step(cfg, r, rows, _KL.value, reps) for r in (0, rank)))]
  full, low = (time_rl_steps(r, _RL_STEPS.value, _KL.value) for r in (0, rank))
  out += [(f"RL step: {k[5:]}", full[k], low[k]) for k in full]
  out.append(("RL step: both", sum(full.values()), sum(low.values())))
  print(f"{'':22} {'full':>9} {'lora':>9} {'lora/full':>9}")
  for name, a, b in out:
    print(f"{name:22} {a:9.4f} {b:9.4f} {b / a:9.3f}")
  d = time_decode(cfg, rank, rows, reps)
  print(
      f"decode step ({rows} rows, 256 slots): merged {d['merged'] * 1e3:.2f} ms, unmerged "
      f"{d['unmerged'] * 1e3:.2f} ms ({d['unmerged'] / d['merged']:.2f}x); one merge "
      f"{d['merge'] * 1e3:.2f} ms = {d['merge'] / d['merged']:.1f} merged decode steps"
  )
  print("allocator:", allocator_bytes())


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)  # start-up and Orbax's saves log at INFO
  if _TIMING.value:
    timing()
    return
  gib = lambda b: f"{b / 2**30:9.2f}"
  for name, cfg in (("qwen2-0.5b", get_preset("qwen2-0.5b")), ("llama-7b shape", LLAMA_7B)):
    s = sizes(cfg, _RANK.value)
    print(
        f"\n{name}: base {gib(s['base'])} GiB, rank-{_RANK.value} adapters "
        f"{s['adapters'] / 2**20:.1f} MiB"
    )
    print(
        f"{'arm':>5} {'N':>2} {'params GiB':>10} {'optim GiB':>10} {'ref GiB':>10} "
        f"{'total GiB':>10} {'vs full':>8}"
    )
    for n in map(int, _AGENTS.value):
      (_, _, *full), (_, _, *low) = rows(s, n)
      for arm, vals in (("full", full), ("lora", low)):
        print(
            f"{arm:>5} {n:>2} {gib(vals[0]):>10} {gib(vals[1]):>10} {gib(vals[2]):>10} "
            f"{gib(vals[3]):>10} {vals[3] / full[3]:8.3f}"
        )
    one = rows(s, 1)[1][-1]
    four, four_full = rows(s, 4)[1][-1], rows(s, 4)[0][-1]
    print(
        f"targets: 4 LoRA / 4 full = {four / four_full:.3f} (<= 0.1); "
        f"1 LoRA / base = {one / s['base']:.3f} (<= 1.2)"
    )


if __name__ == "__main__":
  app.run(main)
