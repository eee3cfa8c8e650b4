r"""Separate policies, N = 2: one stacked program vs one program per agent, per RL step.

  python -m benchmarks.bench_agents                      # CPU, ~3 min on 2 cores
  python -m benchmarks.bench_agents --preset=qwen2-0.5b --dtype=bfloat16 --new=128   # GPU

Workload: two agents with their own weights (the `bench` preset, a 2-layer
Qwen3 shape, random init with seeds 0 and 1), 4 roots of 32 random ids per
agent, T = 2, G = 4, aligned joint actions (4 + 16 nodes, 160 completions of
--new tokens, EOS disabled), `mtrl_jax.testing.TokenTransition` rewards, the
tree packed per agent (`rollout.batching.make_agent_batches`, no zero-variance
filter), GRPO with KL to each agent's frozen reference (beta 0.05), AdamW.

Arms, run side by side (each timed step runs every arm once, in turn, on the
same tree key, so machine load drifts over all arms alike):
  stacked (map)    one `DecodeEngine` with a KV pool per agent, agent_map='map'
                   (both agents' rows in one program per engine call) +
                   `StackedTrainStep` (one vmapped update of both agents);
  stacked (vmap)   the same with agent_map='vmap' (agents batched into each op);
  per agent        one engine per agent (each call one agent's program) + one
                   `TrainStep` per agent (two programs), the fallback that
                   agents of different architectures would need.
Columns: medians over the timed steps of the rollout (generation, tree
bookkeeping and per-agent packing), the train step(s), and their sum; ratio = arm / per agent.
"""

import statistics
import sys
import time

import jax
from absl import app, flags

from mtrl_jax.losses import LossConfig
from mtrl_jax.models import create_model, get_preset
from mtrl_jax.rollout import EnginePolicy, StackedStates, TreeConfig, expand_tree
from mtrl_jax.rollout.batching import BatchConfig, make_agent_batches
from mtrl_jax.sampling import DecodeEngine, EngineConfig, SamplingConfig
from mtrl_jax.testing import TokenTransition
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.stacked import StackedTrainStep
from mtrl_jax.train.step import TrainStep

_PRESET = flags.DEFINE_string("preset", "bench", "model preset")
_DTYPE = flags.DEFINE_string("dtype", None, "override param and compute dtype")
_NEW = flags.DEFINE_integer("new", 32, "new tokens per completion")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps per arm")
_WARMUP = flags.DEFINE_integer("warmup", 1, "untimed first steps per arm (compilation)")

AGENTS, ROOTS, G, PROMPT_LEN, BETA, LR = 2, 4, 4, 32, 0.05, 1e-5


def _engine_cfg(new: int) -> EngineConfig:
  return EngineConfig(slots=ROOTS * G * G, capacity=PROMPT_LEN + 2 * new + 8 + 16)


class PerAgentPolicy:
  """A `RolloutPolicy` over one single-agent engine per agent (agent a's requests to engine a)."""

  separate = True

  def __init__(self, engines):
    self.engines = engines
    self.owner = {}
    self.engine_calls = 0

  def start(self, fanout):
    for e in self.engines:
      e.start(fanout)

  def submit(self, req):
    self.engines[req.agent].submit(req)

  def step(self, expect_more=False):
    out, more = [], False
    for e in self.engines:
      if e.busy:
        samples, _ = e.step()
        self.engine_calls += 1
        for s in samples:
          self.owner[id(s.handle)] = e
        out += samples
      more = more or e.busy
    return out, more or expect_more

  def release(self, handle):
    self.owner.pop(id(handle)).release(handle)

  @property
  def busy(self):
    return any(e.busy for e in self.engines)

  def finish(self):
    return {}


class Stacked:
  """Both agents in one engine (a pool per agent, one program per call) and one train program."""

  def __init__(self, cfg, models, sampling, agent_map):
    self.train = StackedTrainStep(
        models[0], LossConfig(kl_coef=BETA), OptimConfig(learning_rate=LR), (LR,) * AGENTS
    )
    self.state = self.train.init_state(models)
    self.ref = self.train.copy_params(self.state.params)
    engine = DecodeEngine(
        cfg,
        EngineConfig(**{**vars(_engine_cfg(sampling.max_new_tokens)), "agent_map": agent_map}),
        num_agents=AGENTS,
    )
    self.policy = EnginePolicy(
        engine, StackedStates(self.state.params, AGENTS), sampling, stop_ids=(), pad_id=0, fanout=G
    )

  def set_policy(self):
    self.policy.set_states(StackedStates(self.state.params, AGENTS))

  def update(self, batch):
    self.state, m = self.train(self.state, self.ref, batch)
    return m


class PerAgent:
  """One engine and one train program per agent."""

  def __init__(self, cfg, models, sampling):
    self.train = [
        TrainStep(m, LossConfig(kl_coef=BETA), OptimConfig(learning_rate=LR)) for m in models
    ]
    self.states = [t.init_state(m) for t, m in zip(self.train, models)]
    self.refs = [t.copy_params(s.params) for t, s in zip(self.train, self.states)]
    self.engines = [
        EnginePolicy(
            DecodeEngine(cfg, _engine_cfg(sampling.max_new_tokens)),
            s.params,
            sampling,
            stop_ids=(),
            pad_id=0,
            fanout=G,
        )
        for s in self.states
    ]
    self.policy = PerAgentPolicy(self.engines)

  def set_policy(self):
    for e, s in zip(self.engines, self.states):
      e.set_states(s.params)

  def update(self, batch):
    out = []
    for a, (t, ref) in enumerate(zip(self.train, self.refs)):
      self.states[a], m = t(self.states[a], ref, {k: v[a] for k, v in batch.items()})
      out.append(m)
    return out


def step(arm, tree_cfg, transition, batch_cfg, seed: int) -> dict:
  arm.set_policy()
  t0 = time.perf_counter()
  roots = transition.roots(ROOTS, AGENTS, PROMPT_LEN, seed=seed)
  tree = expand_tree(tree_cfg, arm.policy, transition, roots, jax.random.key(seed))
  batch, _ = make_agent_batches(tree, batch_cfg)
  t1 = time.perf_counter()
  jax.block_until_ready(arm.update(batch))
  t2 = time.perf_counter()
  return {
      "rollout": t1 - t0,
      "train": t2 - t1,
      "step": t2 - t0,
      "shape": "x".join(map(str, batch.tokens_BxL.shape)),
  }


def main(argv):
  del argv
  cfg = get_preset(_PRESET.value, dtype=_DTYPE.value)
  models = [create_model(cfg, seed=s) for s in range(AGENTS)]
  sampling = SamplingConfig(temperature=1.0, max_new_tokens=_NEW.value)
  tree_cfg = TreeConfig(num_turns=2, num_generations=G, num_agents=AGENTS)
  transition = TokenTransition(cfg.vocab_size, obs_len=8)
  length = 2 * (PROMPT_LEN + 2 * _NEW.value + 8)
  batch_cfg = BatchConfig(
      packing="tree",
      length_buckets=(1 << (length - 1).bit_length(),),
      zero_variance_filter=False,
      keep_kl=True,
  )
  arms = {
      "stacked (map)": Stacked(cfg, models, sampling, "map"),
      "stacked (vmap)": Stacked(cfg, models, sampling, "vmap"),
      "per agent": PerAgent(cfg, models, sampling),
  }
  rows = {name: [] for name in arms}
  for s in range(_WARMUP.value + _STEPS.value):
    for name, arm in arms.items():
      r = step(arm, tree_cfg, transition, batch_cfg, seed=s)
      if s >= _WARMUP.value:
        rows[name].append(r)
    print(
        f"step {s}: "
        + ", ".join(f"{n} {rows[n][-1]['step']:.2f} s" if rows[n] else n for n in arms),
        flush=True,
    )
  med = {
      n: {k: statistics.median(r[k] for r in rs) for k in ("rollout", "train", "step")}
      for n, rs in rows.items()
  }
  base = med["per agent"]
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), "
      f"{jax.device_count()} device(s); preset {_PRESET.value} ({cfg.dtype}); N = {AGENTS}, "
      f"{ROOTS} roots, T = 2, G = {G}, {_NEW.value} new tokens; medians of {_STEPS.value} "
      f"steps after {_WARMUP.value} warm-up, arms interleaved"
  )
  print(
      "| arm | programs per shape (engine + train) | rollout s | train s | "
      "rollout + train s | ratio to per agent |"
  )
  print("|---|---|---|---|---|---|")
  for n, m in med.items():
    programs = "1 + 1" if n.startswith("stacked") else f"{AGENTS} engines + {AGENTS}"
    print(
        f"| {n} | {programs} | {m['rollout']:.3f} | {m['train']:.3f} | "
        f"{m['step']:.3f} | {m['step'] / base['step']:.2f} (rollout "
        f"{m['rollout'] / base['rollout']:.2f}, train {m['train'] / base['train']:.2f}) |"
    )
  print(f"train batch [A, B, L]: {rows['per agent'][-1]['shape']}")


if __name__ == "__main__":
  app.run(main)
