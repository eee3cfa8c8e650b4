r"""Train-step throughput and model FLOP utilisation against the measured matmul peak.

  .venv/bin/python -m benchmarks.bench_train

Peak: the median time of a large float32 matmul (--peak_n cubed) in the same
run. Cases: the `bench` preset (2-layer Qwen3 shape, d_model 256, vocab 8192)
and the CPU demo model (`small`, byte vocabulary), GRPO token-mean, batch of
--rows rows x (32 prompt + 64 completion) tokens, with and without the
reference model (kl_coef 0 vs 0.05: one more forward). Model FLOPs per step =
3 x forward FLOPs (forward + backward) + 1 x forward with the reference;
MFU = model FLOP/s / peak FLOP/s. Median of --repeats steps after warm-up.

--packing=tree,rows adds the long-context tree workload (a --system-token system
prompt shared by --roots roots, each with a 32-token task, T = 3, G = 4, 64 new
tokens per turn, 8-token observations; random tokens) trained from both layouts of
`rollout.batching`. There FLOPs are counted on the work the tree needs: every unique
token's matmuls once, attention over its own path only (its depth), and the LM head
at trained tokens only (a row layout computes more; its MFU counts the same useful
FLOPs, so the two MFUs compare directly).
"""

import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from mtrl_jax.losses import LossConfig
from mtrl_jax.models import create_model, get_preset
from mtrl_jax.rollout import Completion, Tree, TreeConfig
from mtrl_jax.rollout.batching import BatchConfig, make_train_batch
from mtrl_jax.rollout.train_batch import TrainBatch, from_rows
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import TrainStep

_ROWS = flags.DEFINE_integer("rows", 16, "rows per train batch")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed steps per case (median reported)")
_PEAK_N = flags.DEFINE_integer("peak_n", 2048, "matmul size for the peak measurement")
_PRESETS = flags.DEFINE_list("presets", ["bench", "small"], "model presets to measure")
_DTYPE = flags.DEFINE_string(
    "dtype",
    None,
    "override the presets' param and compute dtype, "
    "and measure the peak in it (e.g. bfloat16 on a GPU)",
)

_PACKING = flags.DEFINE_list(
    "packing",
    [],
    "also time the long-context tree workload with these train-batch layouts (tree, rows)",
)
_SYSTEM = flags.DEFINE_integer("system", 512, "tree workload: shared system-prompt tokens")
_ROOTS = flags.DEFINE_integer("roots", 2, "tree workload: roots (tasks) per batch")
_ATTENTION = flags.DEFINE_string("attention", "xla", "ModelConfig.attention: xla | cudnn")
_REMAT = flags.DEFINE_bool("remat", False, "rematerialise blocks in the backward pass")
_KLS = flags.DEFINE_list("tree_kl", ["0", "0.05"], "tree workload: kl_coef values")
_TREE_LEN = flags.DEFINE_integer("tree_len", 2048, "tree workload: packed row length")

PROMPT, NEW = 32, 64
TURNS, GENS, OBS = 3, 4, 8


def measure_peak(n: int, repeats: int, dtype: str = "float32") -> float:
  """FLOP/s of an n x n x n matmul in `dtype` (median), on random data."""
  a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), dtype)
  f = jax.jit(lambda x, y: x @ y)
  f(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    f(a, a).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n**3 / statistics.median(times)


def batch(cfg, rows: int) -> TrainBatch:
  rng = np.random.default_rng(0)
  length = PROMPT + NEW
  tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
  mask = np.zeros((rows, length), bool)
  mask[:, PROMPT:] = True
  return from_rows(
      tokens,
      mask,
      old_logp_BxL=np.full((rows, length), -5.0, np.float32),
      adv=rng.standard_normal(rows).astype(np.float32),
  )


def _median_step(cfg, kl_coef: float, b: dict, repeats: int):
  """Median seconds of a train step on batch `b` after one warm-up step, and compiles."""
  model = create_model(cfg)
  step = TrainStep(model, LossConfig(kl_coef=kl_coef), OptimConfig(learning_rate=1e-5))
  state = step.init_state(model)
  ref = step.copy_params(state.params) if kl_coef > 0 else None
  state, m = step(state, ref, b)
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, m = step(state, ref, b)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times)
  return seconds, step.num_compiles


def time_case(preset: str, kl_coef: float, rows: int, repeats: int):
  cfg = get_preset(preset, dtype=_DTYPE.value, attention=_ATTENTION.value, remat=_REMAT.value)
  seconds, compiles = _median_step(cfg, kl_coef, batch(cfg, rows), repeats)
  tokens = rows * (PROMPT + NEW)
  fwd = cfg.flops_per_token(PROMPT + NEW) * tokens
  flops = (3 + (1 if kl_coef > 0 else 0)) * fwd
  return seconds, tokens / seconds, flops / seconds, compiles


def tree_batches(cfg, roots: int, system: int, length: int) -> dict:
  """The long-context tree workload as a 'tree' and a 'rows' batch, and its useful FLOPs."""
  rng = np.random.default_rng(0)
  tok = lambda n: rng.integers(3, cfg.vocab_size, n).tolist()
  tree = Tree(TreeConfig(num_turns=TURNS, num_generations=GENS))
  sys_prompt = tok(system)
  frontier = [tree.add_root([sys_prompt + tok(PROMPT)]) for _ in range(roots)]
  while frontier:
    nxt = []
    for node in frontier:
      comps = [
          Completion(np.asarray(tok(NEW), np.int32), np.full(NEW, -5.0, np.float32))
          for _ in range(GENS)
      ]
      tree.set_completions(node, [comps])
      if tree.record(node, rng.standard_normal(GENS)):
        for g in range(GENS):
          nxt.append(tree.add_child(node, g, [node.prompts[0] + list(comps[g].ids) + tok(OBS)]))
    frontier = nxt
  tree.finalize()
  out = {}
  longest = max(len(n.prompts[0]) + NEW for n in tree.nodes)
  for packing, lengths in (("tree", (length,)), ("rows", (longest,))):
    out[packing], m = make_train_batch(
        tree, BatchConfig(packing=packing, length_buckets=lengths, zero_variance_filter=False)
    )
    out[packing + "_tokens"] = m["batch/tokens_trained"]
  # Useful forward FLOPs: each unique token's matmuls once, attention over its own
  # path (depth + 1 keys), the LM head at trained tokens only.
  b = out["tree"]
  d, h, k, dh, f = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim
  matmul = 2 * (d * h * dh + 2 * d * k * dh + h * dh * d + 3 * d * f)
  real = b.tokens_BxL != 0
  keys = float((b.positions_BxL[real] + 1).sum())
  unique, trained = float(real.sum()), float(b.loss_mask_BxK.sum())
  out["useful_fwd_flops"] = (
      cfg.num_layers * (matmul * unique + 4 * h * dh * keys) + 2 * d * cfg.vocab_size * trained
  )
  out["trained"] = trained
  return out


def time_tree_case(preset: str, packing: str, kl_coef: float, work: dict, repeats: int):
  cfg = get_preset(preset, dtype=_DTYPE.value, attention=_ATTENTION.value, remat=_REMAT.value)
  seconds, compiles = _median_step(cfg, kl_coef, work[packing], repeats)
  flops = (3 + (1 if kl_coef > 0 else 0)) * work["useful_fwd_flops"]
  return seconds, flops / seconds, compiles


def main(argv):
  del argv
  dtype = _DTYPE.value or "float32"
  peak = measure_peak(_PEAK_N.value, _REPEATS.value, dtype)
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; "
      f"measured {dtype} matmul peak ({_PEAK_N.value}^3): {peak / 1e9:.1f} GFLOP/s"
  )
  print("| model | reference | rows x len | step ms | tokens/s | model GFLOP/s | MFU | compiles |")
  print("|---|---|---|---|---|---|---|---|")
  for preset in _PRESETS.value:
    for kl in (0.0, 0.05):
      s, tps, fps, compiles = time_case(preset, kl, _ROWS.value, _REPEATS.value)
      print(
          f"| {preset} | {'on' if kl else 'off'} | {_ROWS.value} x {PROMPT + NEW} | "
          f"{s * 1e3:.1f} | {tps:.0f} | {fps / 1e9:.2f} | {fps / peak:.1%} | {compiles} |"
      )
  if not _PACKING.value:
    return
  print(
      f"\ntree workload: {_ROOTS.value} roots x (system {_SYSTEM.value} + task {PROMPT}), "
      f"T={TURNS} G={GENS}, {NEW} new tokens per turn; FLOPs counted on useful work "
      "(unique tokens, path attention, LM head at trained tokens)"
  )
  print(
      "| model | packing | reference | batch B x L | tokens in batch | trained tokens | "
      "step ms | useful GFLOP/s | MFU | compiles |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|")
  for preset in _PRESETS.value:
    work = tree_batches(
        get_preset(preset, dtype=_DTYPE.value), _ROOTS.value, _SYSTEM.value, _TREE_LEN.value
    )
    for packing in _PACKING.value:
      for kl in map(float, _KLS.value):
        s, fps, compiles = time_tree_case(preset, packing, kl, work, _REPEATS.value)
        shape = "x".join(map(str, work[packing].tokens_BxL.shape))
        print(
            f"| {preset} | {packing} | {'on' if kl else 'off'} | {shape} | "
            f"{work[packing + '_tokens']:.0f} | {work['trained']:.0f} | {s * 1e3:.1f} | "
            f"{fps / 1e9:.2f} | {fps / peak:.1%} | {compiles} |"
        )


if __name__ == "__main__":
  app.run(main)
