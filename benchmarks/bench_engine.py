r"""The rollout engine's workloads, each arm beside its baseline in one run.

  .venv/bin/python -m benchmarks.bench_engine                       # every workload, CPU
  .venv/bin/python -m benchmarks.bench_engine --workloads=latency --steps=3
  python -m benchmarks.bench_engine --preset=qwen2-0.5b --dtype=bfloat16   # on a GPU

Workloads (random weights; token-level environments from `mtrl_jax.testing`):

  longctx  a 512-token system prompt shared by 2 roots, each with a 32-token task,
           T = 3, G = 4, 64 new tokens per turn, an 8-token observation after each
           (2 x 21 nodes, 168 completions; `bench` preset). Arms: level-sync (the
           barrier schedule with `EngineConfig(reuse=False)`: every node's whole
           prompt prefilled at its level, as the level-by-level sampler this engine
           replaced did) and the engine (continuous, every child extending its
           parent sample's cache). Figures: prompt tokens prefilled per step and
           generation seconds per step.
  latency  16 roots, T = 3, G = 4, 16 new tokens; every environment step sleeps a
           lognormal time (median 50 ms, p99 2 s, as a remote tool or sandbox
           does), drawn from a hash of the step so both arms wait the same times
           (`tiny` preset, a pool of 512 environment threads). Arms: barrier,
           continuous, and continuous with `EngineConfig.overlap` (samples come back
           a chunk later). Figure: rollout seconds per step, and its floor: the larger
           of the decode-only time (the same rollout with no sleeps) and the
           slowest trajectory's own chain of sleeps.
  skew     64 requests of G = 1, half with a budget of 8 tokens and half of 128
           (no stop id: each sample runs to its budget), 16 slots (`bench` preset).
           Arms: level-sync (all requests of a level decoded together until the
           longest ends: one decode call per level, `chunk = 128`, 64 slots), the
           same with 16 slots (the engine's memory: 16 requests at a time, each
           wave decoded until its longest ends) and the engine (chunk 8: a finished
           slot takes a queued request at the next chunk), read chunk by chunk and
           with `EngineConfig.overlap` (each chunk read while the next decodes; a
           finished slot is seen, and taken, a chunk later). Figures: sampled tokens
           / decoded slot-steps, and decode steps (summed over calls: the steps a
           device runs one after another, what sets the time where a step costs
           the same at any row count, as on a GPU at this size).

Every arm runs `--warmup` untimed steps (compilation) and reports the median of
`--steps`; the compile counts must not move during the timed steps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import math
import statistics
import threading
import time

import jax
import numpy as np
from absl import app, flags
from flax import nnx

from mtrl_jax.models import create_model, get_preset
from mtrl_jax.rollout import EnginePolicy, TreeConfig, expand_tree
from mtrl_jax.rollout.records import ActionOutcome, StepRecord
from mtrl_jax.sampling import DecodeEngine, EngineConfig, Request, SamplingConfig
from mtrl_jax.testing import TokenState, TokenTransition

_WORKLOADS = flags.DEFINE_list(
    "workloads", ["longctx", "latency", "skew"], "longctx, latency and/or skew"
)
_PRESET = flags.DEFINE_string(
    "preset",
    None,
    "model preset for every workload (default: bench for longctx and skew, tiny for latency)",
)
_DTYPE = flags.DEFINE_string("dtype", None, "override param and compute dtype (e.g. bfloat16)")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps per arm")
_WARMUP = flags.DEFINE_integer("warmup", 1, "untimed first steps per arm (compilation)")
_ROOTS = flags.DEFINE_integer("roots", 16, "roots of the latency workload")

MEDIAN_S, P99_S = 0.05, 2.0
SIGMA = float(np.log(P99_S / MEDIAN_S) / 2.3263478740408408)  # z of the 99th percentile


def _model(preset, dtype):
  cfg = get_preset(preset, dtype=dtype)
  return cfg, nnx.split(create_model(cfg, seed=0))[1]


def _policy(cfg, state, cfg_engine, new_tokens):
  engine = DecodeEngine(cfg, cfg_engine)
  return EnginePolicy(
      engine,
      state,
      SamplingConfig(temperature=1.0, max_new_tokens=new_tokens),
      stop_ids=(),
      pad_id=0,
      fanout=4,
  )


def _timed(arms: dict, run, warmup: int, steps: int) -> dict:
  """Runs every arm's steps interleaved (arm a's step k after arm b's step k)."""
  out = {name: [] for name in arms}
  compiles = {}
  for step in range(warmup + steps):
    if step == warmup:
      compiles = {name: p.engine.num_compiles for name, p in arms.items()}
    for name, policy in arms.items():
      res = run(policy, step)
      if step >= warmup:
        out[name].append(res)
  for name, policy in arms.items():
    if policy.engine.num_compiles != compiles[name]:
      raise RuntimeError(
          f"{name}: the engine compiled during the timed steps "
          f"({compiles[name]} -> {policy.engine.num_compiles})"
      )
  return {
      name: {k: statistics.median(r[k] for r in rows) for k in rows[0]}
      for name, rows in out.items()
  }


# ------------------------------------------------------------------ longctx
def bench_longctx(preset, dtype, warmup, steps):
  cfg, state = _model(preset or "bench", dtype)
  new, obs, system, prompt = 64, 8, 512, 32
  tree_cfg = TreeConfig(num_turns=3, num_generations=4)
  capacity = system + prompt + 3 * new + 2 * obs + 16
  slots = 2 * 16 * 4
  transition = TokenTransition(cfg.vocab_size, obs_len=obs)
  arms = {
      "level-sync": _policy(
          cfg, state, EngineConfig(slots=slots, capacity=capacity, reuse=False), new
      ),
      "engine": _policy(cfg, state, EngineConfig(slots=slots, capacity=capacity), new),
  }
  schedule = {"level-sync": "barrier", "engine": "continuous"}
  names = {id(p): n for n, p in arms.items()}

  def run(policy, step):
    t0 = time.perf_counter()
    tree = expand_tree(
        tree_cfg.replace(schedule=schedule[names[id(policy)]]),
        policy,
        transition,
        transition.roots(2, 1, prompt, seed=step, system_len=system),
        jax.random.key(step),
    )
    return {
        "seconds": time.perf_counter() - t0,
        "generation": tree.times.generation,
        "prefill": tree.engine["prefill_tokens"],
        "reused": tree.engine["reused_tokens"],
        "decoded": tree.engine["decode_tokens"],
        "nodes": len(tree.nodes),
    }

  res = _timed(arms, run, warmup, steps)
  print(
      f"\nlongctx ({preset or 'bench'}): 2 roots, 512-token system prompt, T=3, G=4, "
      f"{new} new tokens, median of {steps}"
  )
  print(
      "| arm | prefilled tokens / step | cached context tokens | generation s / step | "
      "rollout s / step | sampled tokens |"
  )
  print("|---|---|---|---|---|---|")
  for name, r in res.items():
    print(
        f"| {name} | {r['prefill']:,.0f} | {r['reused']:,.0f} | {r['generation']:.3f} | "
        f"{r['seconds']:.3f} | {r['decoded']:,.0f} |"
    )
  a, b = res["level-sync"], res["engine"]
  print(
      f"prefill tokens: {a['prefill'] / b['prefill']:.1f}x fewer; generation "
      f"{a['generation'] / b['generation']:.2f}x faster"
  )


# ------------------------------------------------------------------ latency
@dataclasses.dataclass(frozen=True)
class _Waited:
  histories: tuple
  waited: float = 0.0  # seconds slept along the path from the root


class _Sleepy:
  """`TokenTransition` whose every step first sleeps a lognormal time named by the step."""

  def __init__(self, inner: TokenTransition, sleep: bool = True):
    self.inner, self.sleep = inner, sleep
    self.slowest_chain = 0.0
    self._lock = threading.Lock()

  def roots(self, *a, **k):
    return [_Waited(s.histories) for s in self.inner.roots(*a, **k)]

  def prompts(self, state):
    return [list(h) for h in state.histories]

  def _seconds(self, state, actions) -> float:
    h = hashlib.blake2b(digest_size=8)
    for hist in state.histories:
      h.update(np.asarray(hist, np.int64).tobytes())
    for c in actions:
      h.update(np.asarray(c.ids, np.int64).tobytes())
    u = (int.from_bytes(h.digest(), "little") + 0.5) / 2**64
    z = float(np.sqrt(2.0) * _erfinv(2 * u - 1))
    return MEDIAN_S * float(np.exp(SIGMA * z))

  def step(self, state, actions):
    s = self._seconds(state, actions)
    if self.sleep:
      time.sleep(s)
    with self._lock:
      self.slowest_chain = max(self.slowest_chain, state.waited + s)
    out = self.inner.step(TokenState(state.histories), actions)
    return ActionOutcome(
        _Waited(out.next_state.histories, state.waited + s), StepRecord(out.step.reward)
    )


def _erfinv(y: float) -> float:
  """Inverse error function (Winitzki's approximation refined by two Newton steps)."""
  a = 0.147
  ln = math.log(1 - y * y)
  x = math.copysign(
      math.sqrt(
          math.sqrt((2 / (math.pi * a) + ln / 2) ** 2 - ln / a) - (2 / (math.pi * a) + ln / 2)
      ),
      y,
  )
  for _ in range(2):
    x -= (math.erf(x) - y) / (2 / math.sqrt(math.pi) * math.exp(-x * x))
  return x


def bench_latency(preset, dtype, warmup, steps, roots):
  cfg, state = _model(preset or "tiny", dtype)
  new, prompt = 16, 32
  tree_cfg = TreeConfig(num_turns=3, num_generations=4)
  slots = roots * 16 * 4
  capacity = prompt + 3 * new + 2 * 8 + 16
  arms = {
      name: _policy(
          cfg,
          state,
          EngineConfig(slots=slots, capacity=capacity, overlap=name == "continuous, overlap"),
          new,
      )
      for name in ("barrier", "continuous", "continuous, overlap", "decode only")
  }
  names = {id(p): n for n, p in arms.items()}
  pool = concurrent.futures.ThreadPoolExecutor(512)

  def run(policy, step):
    name = names[id(policy)]
    transition = _Sleepy(TokenTransition(cfg.vocab_size), sleep=name != "decode only")
    schedule = "barrier" if name == "barrier" else "continuous"
    t0 = time.perf_counter()
    tree = expand_tree(
        tree_cfg.replace(schedule=schedule),
        policy,
        transition,
        transition.roots(roots, 1, prompt, seed=step),
        jax.random.key(step),
        executor=pool,
    )
    t = tree.times
    return {
        "seconds": time.perf_counter() - t0,
        "generation": t.generation,
        "device_idle": t.device_idle,
        "env_waiting": t.env_waiting,
        "chain": transition.slowest_chain,
        "nodes": len(tree.nodes),
    }

  res = _timed(arms, run, warmup, steps)
  pool.shutdown()
  floor = max(res["decode only"]["seconds"], res["continuous"]["chain"])
  print(
      f"\nlatency ({preset or 'tiny'}): {roots} roots, T=3, G=4, {new} new tokens, steps "
      f"sleep lognormal (median {MEDIAN_S * 1000:.0f} ms, p99 {P99_S:.0f} s), median of {steps}"
  )
  print(
      "| arm | rollout s / step | generation s | device idle s | engine busy, no env "
      "step in flight s | slowest chain of sleeps s |"
  )
  print("|---|---|---|---|---|---|")
  for name, r in res.items():
    print(
        f"| {name} | {r['seconds']:.3f} | {r['generation']:.3f} | {r['device_idle']:.3f} | "
        f"{r['env_waiting']:.3f} | {r['chain']:.3f} |"
    )
  b, c = res["barrier"]["seconds"], res["continuous"]["seconds"]
  print(
      f"continuous vs barrier: {b / c:.2f}x faster; continuous / floor ({floor:.3f} s) = "
      f"{c / floor:.2f}"
  )


# ------------------------------------------------------------------ skew
def bench_skew(preset, dtype, warmup, steps):
  cfg, state = _model(preset or "bench", dtype)
  num, prompt, short, long = 64, 32, 8, 128
  capacity = prompt + long + 16
  slots = 16
  arms = {
      "level-sync": DecodeEngine(cfg, EngineConfig(slots=num, capacity=capacity, chunk=long)),
      f"level-sync, {slots} slots": DecodeEngine(
          cfg, EngineConfig(slots=slots, capacity=capacity, chunk=long)
      ),
      "engine": DecodeEngine(
          cfg, EngineConfig(slots=slots, capacity=capacity, chunk=8, overlap=False)
      ),
      "engine, overlap": DecodeEngine(
          cfg, EngineConfig(slots=slots, capacity=capacity, chunk=8, overlap=True)
      ),
  }
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=long)
  rng = np.random.default_rng(0)
  prompts = rng.integers(12, cfg.vocab_size, (num, prompt))
  key = np.asarray(jax.random.key_data(jax.random.key(0)), np.uint32)

  class _Arm:  # the `_timed` interface: .engine

    def __init__(self, engine):
      self.engine = engine

  def run(arm, step):
    engine = arm.engine
    engine.start(state, sampling, (), 0, fanout=1)
    for i in range(num):
      engine.submit(Request(i, prompts[i], key, [step * num + i], max_new=short if i % 2 else long))
    t0, busy = time.perf_counter(), True
    while busy:
      samples, busy = engine.step()
      for s in samples:
        engine.release(s.handle)
    st = engine.stats
    return {
        "seconds": time.perf_counter() - t0,
        "useful": st["decode_tokens"],
        "slot_steps": st["slot_steps"],
        "ratio": st["decode_tokens"] / st["slot_steps"],
        "steps": st["decode_steps"],
    }

  res = _timed({k: _Arm(v) for k, v in arms.items()}, run, warmup, steps)
  print(
      f"\nskew ({preset or 'bench'}): {num} requests, half of {short} and half of {long} "
      f"tokens, median of {steps}"
  )
  print(
      "| arm | sampled tokens | decoded slot-steps | sampled / slot-steps | decode steps "
      "| seconds |"
  )
  print("|---|---|---|---|---|---|")
  for name, r in res.items():
    print(
        f"| {name} | {r['useful']:,.0f} | {r['slot_steps']:,.0f} | {r['ratio']:.2f} | "
        f"{r['steps']:,.0f} | {r['seconds']:.3f} |"
    )


def main(argv):
  del argv
  dev = jax.devices()[0]
  print(f"device: {dev.platform} ({dev.device_kind}); jax {jax.__version__}")
  for w in _WORKLOADS.value:
    if w == "longctx":
      bench_longctx(_PRESET.value, _DTYPE.value, _WARMUP.value, _STEPS.value)
    elif w == "latency":
      bench_latency(_PRESET.value, _DTYPE.value, _WARMUP.value, _STEPS.value, _ROOTS.value)
    elif w == "skew":
      bench_skew(_PRESET.value, _DTYPE.value, _WARMUP.value, _STEPS.value)
    else:
      raise SystemExit(f"--workloads: {w!r}; allowed: longctx, latency, skew")


if __name__ == "__main__":
  app.run(main)
