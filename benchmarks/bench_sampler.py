r"""Decode throughput of the rollout engine: generated tokens/s, beside Google's Tunix sampler.

Command (the Tunix column needs a separate venv with google-tunix==0.1.7):
  python3 -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix==0.1.7
  .venv/bin/python -m benchmarks.bench_sampler --tunix_python=/tmp/tunix_venv/bin/python

Model: the `bench` preset (2-layer Qwen3 shape, d_model 256, 4 heads of 64, 2 KV
heads, MLP 768, vocab 8192, tied, float32), random weights; Tunix builds its own
`tunix.models.qwen3` model of the same shape. Cases: batch 8 and 16 of
32-token prompts, 64 new tokens, temperature 1, no filters, EOS disabled (every
row generates 64 tokens); and branching: 4 prompts x G=4 with one prefill per
prompt forked into 4 slots vs the same 16 rows as 16 separate prompts. Ours is
`DecodeEngine` (16 slots, decode calls of 16 rows): submit the requests, step
until every sample is back. Each figure is the median of --repeats timed calls
after one warm-up call (compilation), taken round robin over the cases, wall
clock from submission to the last sample on the host. Runtime: ~1-2 minutes on
2 CPU cores.
"""

import json
import os
import statistics
import subprocess
import sys
import time

from absl import app, flags

_TUNIX = flags.DEFINE_string(
    "tunix_python", None, "python of a venv with google-tunix==0.1.7; adds the Tunix column"
)
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed calls per case (median reported)")
_PRESET = flags.DEFINE_string("preset", "bench", "model preset")
_DTYPE = flags.DEFINE_string("dtype", None, "override param and compute dtype (e.g. bfloat16)")
_CHUNKS = flags.DEFINE_list(
    "decode_chunks",
    ["8"],
    "EngineConfig.chunk values to compare (decode steps per engine "
    "step); adds a decode-step vs memory-floor table",
)

PROMPT_LEN, NEW_TOKENS = 32, 64
# (label, number of distinct prompts, generations per prompt)
CASES = [
    ("batch 8", 8, 1),
    ("batch 16", 16, 1),
    ("4 prompts x G=4 (fork)", 4, 4),
    ("16 separate prompts", 16, 1),
]

# Runs in the Tunix interpreter: same shapes, Tunix's own model and Sampler.
_TUNIX_SCRIPT = r"""
import json, statistics, sys, time
import numpy as np
from flax import nnx
from tunix.generate import sampler as tsampler
from tunix.models.qwen3 import model as qmodel
a = json.loads(sys.argv[1])
cfg = qmodel.ModelConfig(num_layers=a["layers"], vocab_size=a["vocab"], embed_dim=a["d_model"],
                         hidden_dim=a["mlp"], num_heads=a["heads"], head_dim=a["head_dim"],
                         num_kv_heads=a["kv_heads"], rope_theta=int(a["rope_theta"]),
                         norm_eps=a["eps"], use_tied_embedding=True)
model = qmodel.Qwen3(cfg, rngs=nnx.Rngs(0))

class IdTokenizer:  # prompts travel as space-separated ids; 0 = pad (never in a prompt)
  def encode(self, text, **kw): return [int(x) for x in text.split()]
  def decode(self, ids, **kw): return " ".join(map(str, ids))
  def bos_id(self): return 0
  def eos_id(self): return 1
  def pad_id(self): return 0

sampler = tsampler.Sampler(model, IdTokenizer(), tsampler.CacheConfig(
    cache_size=a["prompt_len"] + a["new"], num_layers=a["layers"],
    num_kv_heads=a["kv_heads"], head_dim=a["head_dim"]))
rng = np.random.default_rng(0)
calls = {}
for label, n_prompts, g in a["cases"]:
  base = [" ".join(map(str, rng.integers(2, a["vocab"], a["prompt_len"])))
          for _ in range(n_prompts)]
  prompts = [p for p in base for _ in range(g)]  # Tunix has no fork: repeat prompts
  def call(seed, prompts=prompts):
    res = sampler(prompts, max_generation_steps=a["new"], max_prompt_length=a["prompt_len"],
                  temperature=1.0, top_p=1.0, seed=seed, eos_tokens=[-1], return_logprobs=True)
    assert all(len(t) == a["new"] for t in res.tokens)
  call(0)
  calls[label] = (call, len(prompts))
times = {label: [] for label in calls}
for i in range(a["repeats"]):  # round robin: load changes hit every case alike
  for label, (call, _) in calls.items():
    t0 = time.perf_counter(); call(i + 1); times[label].append(time.perf_counter() - t0)
out = {label: rows * a["new"] / statistics.median(times[label])
       for label, (_, rows) in calls.items()}
print("RESULT " + json.dumps(out))
"""


def measure_bandwidth(n_bytes: int = 1 << 30) -> float:
  """Device memory bandwidth (bytes read + written per second) of a large copy."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  x = jnp.ones((n_bytes // 4,), jnp.float32)
  f = jax.jit(lambda a: a * 1.0001)
  f(x).block_until_ready()
  times = []
  for _ in range(10):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  return 2 * n_bytes / statistics.median(times)


def bench_mtrl(preset: str, repeats: int, chunk: int) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top
  from mtrl_jax import models  # pylint: disable=g-import-not-at-top
  from mtrl_jax.sampling import (
      DecodeEngine,
      EngineConfig,
      Request,  # pylint: disable=g-import-not-at-top
      SamplingConfig,
  )

  cfg = models.get_preset(preset, dtype=_DTYPE.value)
  _, state = nnx.split(models.create_model(cfg, seed=0))
  engine = DecodeEngine(
      cfg,
      EngineConfig(slots=16, capacity=PROMPT_LEN + NEW_TOKENS + 16, chunk=chunk, decode_rows=16),
  )
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=NEW_TOKENS)
  rng = np.random.default_rng(0)
  calls = {}
  for label, n_prompts, g in CASES:
    prompts = [rng.integers(1, cfg.vocab_size, PROMPT_LEN).tolist() for _ in range(n_prompts)]

    def call(seed, prompts=prompts, g=g):
      key = np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)
      engine.start(state, sampling, (), 0, fanout=4)
      for p, prompt in enumerate(prompts):
        engine.submit(Request(p, prompt, key, np.arange(g) + p * g))
      got, busy = 0, True
      while busy:
        samples, busy = engine.step()
        for s in samples:
          assert len(s.ids) == NEW_TOKENS
          engine.release(s.handle)
        got += len(samples)
      assert got == len(prompts) * g

    call(0)  # warm-up: compiles
    calls[label] = (call, n_prompts * g)
  times = {label: [] for label in calls}
  for i in range(repeats):  # round robin: load changes hit every case alike
    for label, (call, _) in calls.items():
      t0 = time.perf_counter()
      call(i + 1)
      times[label].append(time.perf_counter() - t0)
  out = {
      label: rows * NEW_TOKENS / statistics.median(times[label])
      for label, (_, rows) in calls.items()
  }
  out["_compiles"] = engine.num_compiles
  out["_chunk"] = chunk
  # Per decode step of the 16-row batch (the prefill is a small part of the call).
  out["_step_ms"] = 1e3 * statistics.median(times["batch 16"]) / NEW_TOKENS
  return out


def bench_tunix(python: str, preset: str, repeats: int) -> dict:
  from mtrl_jax import models  # pylint: disable=g-import-not-at-top

  cfg = models.get_preset(preset)
  arg = dict(
      layers=cfg.num_layers,
      vocab=cfg.vocab_size,
      d_model=cfg.d_model,
      mlp=cfg.mlp_dim,
      heads=cfg.num_heads,
      head_dim=cfg.head_dim,
      kv_heads=cfg.num_kv_heads,
      rope_theta=cfg.rope_theta,
      eps=cfg.rms_eps,
      prompt_len=PROMPT_LEN,
      new=NEW_TOKENS,
      repeats=repeats,
      cases=CASES,
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  proc = subprocess.run(
      [python, "-c", _TUNIX_SCRIPT, json.dumps(arg)],
      capture_output=True,
      text=True,
      env=env,
      check=False,
  )
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT ") :])
  raise RuntimeError(f"Tunix benchmark failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")


def main(argv):
  del argv
  chunks = [int(c) for c in _CHUNKS.value]
  runs = [bench_mtrl(_PRESET.value, _REPEATS.value, c) for c in chunks]
  ours = runs[0]
  theirs = bench_tunix(_TUNIX.value, _PRESET.value, _REPEATS.value) if _TUNIX.value else {}
  import jax  # pylint: disable=g-import-not-at-top

  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"preset {_PRESET.value}, prompt {PROMPT_LEN}, {NEW_TOKENS} new tokens, EOS disabled, "
      f"temperature 1; median of {_REPEATS.value} after warm-up; "
      f"{jax.devices()[0].platform} x{jax.device_count()}, {os.cpu_count()} cores; "
      f"mtrl_jax compiles: {ours['_compiles']}"
  )
  print(
      f"| {'case':<24} | {'rows':>4} | {'mtrl_jax tok/s':>14} | {'Tunix 0.1.7 tok/s':>17} "
      f"| {'ratio':>5} |"
  )
  print(f"|{'-' * 26}|{'-' * 6}|{'-' * 16}|{'-' * 19}|{'-' * 7}|")
  for label, n_prompts, g in CASES:
    t = theirs.get(label)
    print(
        f"| {label:<24} | {n_prompts * g:>4} | {ours[label]:>14.0f} | "
        f"{(f'{t:.0f}' if t else 'n/a'):>17} | {(f'{ours[label] / t:.2f}' if t else 'n/a'):>5} |"
    )
  if theirs:
    print("Tunix has no prefix fork: its '4 prompts x G=4' row decodes 16 repeated prompts.")
  from mtrl_jax import models  # pylint: disable=g-import-not-at-top

  cfg = models.get_preset(_PRESET.value, dtype=_DTYPE.value)
  bw = measure_bandwidth()
  itemsize = 2 if cfg.dtype == "bfloat16" else 4
  weights = cfg.num_params() * itemsize
  cache = (
      2
      * cfg.num_layers
      * 16
      * (PROMPT_LEN + NEW_TOKENS)
      * cfg.num_kv_heads
      * cfg.head_dim
      * itemsize
  )
  floor_ms = 1e3 * (weights + cache) / bw
  print(
      f"\ndecode step, batch 16: memory floor = (weights {weights / 2**20:.0f} MiB + KV cache "
      f"{cache / 2**20:.1f} MiB) / measured bandwidth {bw / 1e9:.0f} GB/s = {floor_ms:.3f} ms"
  )
  print("| chunk | step ms (call / new tokens) | x floor | batch 16 tok/s |")
  print("|---|---|---|---|")
  for r in runs:
    print(
        f"| {r['_chunk']} | {r['_step_ms']:.3f} | {r['_step_ms'] / floor_ms:.2f} | "
        f"{r['batch 16']:.0f} |"
    )


if __name__ == "__main__":
  app.run(main)
