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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from mtrl_jax import sharding
from mtrl_jax.models import lora
from mtrl_jax.models.config import LORA_TARGETS, LoraConfig, ModelConfig, get_preset
from mtrl_jax.models.transformer import Transformer
from mtrl_jax.train.optim import OptimConfig, make_optimizer

_RANK = flags.DEFINE_integer("rank", 16, "adapter rank")
_AGENTS = flags.DEFINE_list("agents", ["1", "2", "4"], "agent counts N")

LLAMA_7B = ModelConfig(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32,
                       num_kv_heads=32, head_dim=128, mlp_dim=11008, family="llama",
                       rms_eps=1e-5, tie_embeddings=False, max_seq_len=4096,
                       param_dtype="bfloat16", dtype="bfloat16")


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def _abstract(cfg: ModelConfig):
  mesh = sharding.single_device_mesh()
  with jax.set_mesh(mesh), nnx.logical_axis_rules(sharding.rules_for(cfg, mesh,
                                                                     sharding.TRAIN_RULES)):
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _optim_bytes(params) -> int:
  tx = make_optimizer(OptimConfig())
  f32 = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32), params)
  return _bytes(jax.eval_shape(tx.init, f32))


def sizes(cfg: ModelConfig, rank: int) -> dict:
  """Bytes of one policy's weights, AdamW state, adapters and adapters' AdamW state."""
  _, base = nnx.split(_abstract(cfg), nnx.Param)
  _, adapters, _ = lora.split(_abstract(cfg.replace(
      lora=LoraConfig(rank=rank, alpha=2.0 * rank, targets=LORA_TARGETS))))
  return {"base": _bytes(base), "base_optim": _optim_bytes(base),
          "adapters": _bytes(adapters), "adapters_optim": _optim_bytes(adapters)}


def rows(s: dict, n: int) -> list[tuple]:
  full = (n * s["base"], n * s["base_optim"], n * s["base"])
  low = (s["base"] + n * s["adapters"], n * s["adapters_optim"], 0)
  return [("full", n, *full, sum(full)), ("lora", n, *low, sum(low))]


def main(argv):
  del argv
  gib = lambda b: f"{b / 2**30:9.2f}"
  for name, cfg in (("qwen2-0.5b", get_preset("qwen2-0.5b")), ("llama-7b shape", LLAMA_7B)):
    s = sizes(cfg, _RANK.value)
    print(f"\n{name}: base {gib(s['base'])} GiB, rank-{_RANK.value} adapters "
          f"{s['adapters'] / 2**20:.1f} MiB")
    print(f"{'arm':>5} {'N':>2} {'params GiB':>10} {'optim GiB':>10} {'ref GiB':>10} "
          f"{'total GiB':>10} {'vs full':>8}")
    for n in map(int, _AGENTS.value):
      (_, _, *full), (_, _, *low) = rows(s, n)
      for arm, vals in (("full", full), ("lora", low)):
        print(f"{arm:>5} {n:>2} {gib(vals[0]):>10} {gib(vals[1]):>10} {gib(vals[2]):>10} "
              f"{gib(vals[3]):>10} {vals[3] / full[3]:8.3f}")
    one = rows(s, 1)[1][-1]
    four, four_full = rows(s, 4)[1][-1], rows(s, 4)[0][-1]
    print(f"targets: 4 LoRA / 4 full = {four / four_full:.3f} (<= 0.1); "
          f"1 LoRA / base = {one / s['base']:.3f} (<= 1.2)")


if __name__ == "__main__":
  app.run(main)
