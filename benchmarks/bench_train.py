r"""Train-step throughput and model FLOP utilisation against the measured matmul peak.

  .venv/bin/python -m benchmarks.bench_train

Peak: the median time of a large float32 matmul (--peak_n cubed) in the same
run. Cases: the `bench` preset (2-layer Qwen3 shape, d_model 256, vocab 8192)
and the CPU demo model (`small`, byte vocabulary), GRPO token-mean, batch of
--rows rows x (32 prompt + 64 completion) tokens, with and without the
reference model (kl_coef 0 vs 0.05: one more forward). Model FLOPs per step =
3 x forward FLOPs (forward + backward) + 1 x forward with the reference;
MFU = model FLOP/s / peak FLOP/s. Median of --repeats steps after warm-up.
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
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import TrainStep

_ROWS = flags.DEFINE_integer("rows", 16, "rows per train batch")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed steps per case (median reported)")
_PEAK_N = flags.DEFINE_integer("peak_n", 2048, "matmul size for the peak measurement")
_PRESETS = flags.DEFINE_list("presets", ["bench", "small"], "model presets to measure")
_DTYPE = flags.DEFINE_string("dtype", None, "override the presets' param and compute dtype, "
                             "and measure the peak in it (e.g. bfloat16 on a GPU)")

PROMPT, NEW = 32, 64


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
  return 2 * n ** 3 / statistics.median(times)


def batch(cfg, rows: int) -> dict:
  rng = np.random.default_rng(0)
  length = PROMPT + NEW
  tokens = rng.integers(0, cfg.vocab_size, (rows, length)).astype(np.int32)
  mask = np.zeros((rows, length), bool)
  mask[:, PROMPT:] = True
  return {"tokens_BxL": tokens, "loss_mask_BxL": mask,
          "old_logp_BxL": np.full((rows, length), -5.0, np.float32),
          "adv_B": rng.standard_normal(rows).astype(np.float32),
          "row_weight_B": np.ones(rows, np.float32)}


def time_case(preset: str, kl_coef: float, rows: int, repeats: int):
  cfg = get_preset(preset, dtype=_DTYPE.value)
  model = create_model(cfg)
  step = TrainStep(model, LossConfig(kl_coef=kl_coef), OptimConfig(learning_rate=1e-5))
  state = step.init_state(model)
  ref = step.copy_params(state.params) if kl_coef > 0 else None
  b = batch(cfg, rows)
  state, m = step(state, ref, b)
  jax.block_until_ready(m)
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    state, m = step(state, ref, b)
    jax.block_until_ready(m)
    times.append(time.perf_counter() - t0)
  seconds = statistics.median(times)
  tokens = rows * (PROMPT + NEW)
  fwd = cfg.flops_per_token(PROMPT + NEW) * tokens
  flops = (3 + (1 if kl_coef > 0 else 0)) * fwd
  return seconds, tokens / seconds, flops / seconds, step.num_compiles


def main(argv):
  del argv
  dtype = _DTYPE.value or "float32"
  peak = measure_peak(_PEAK_N.value, _REPEATS.value, dtype)
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; "
        f"measured {dtype} matmul peak ({_PEAK_N.value}^3): {peak / 1e9:.1f} GFLOP/s")
  print("| model | reference | rows x len | step ms | tokens/s | model GFLOP/s | MFU | compiles |")
  print("|---|---|---|---|---|---|---|---|")
  for preset in _PRESETS.value:
    for kl in (0.0, 0.05):
      s, tps, fps, compiles = time_case(preset, kl, _ROWS.value, _REPEATS.value)
      print(f"| {preset} | {'on' if kl else 'off'} | {_ROWS.value} x {PROMPT + NEW} | "
            f"{s * 1e3:.1f} | {tps:.0f} | {fps / 1e9:.2f} | {fps / peak:.1%} | {compiles} |")


if __name__ == "__main__":
  app.run(main)
