r"""One full RL step (rollout + rewards + reference logprobs + update), beside Tunix.

  .venv/bin/python -m benchmarks.bench_rl --tunix_python=/tmp/tunix_venv/bin/python
  (Tunix venv: python3 -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix==0.1.7)
  GPU, no Tunix:  python -m benchmarks.bench_rl --preset=qwen2-0.5b --dtype=bfloat16

Workloads (same model shape on both sides: the `bench` preset, a 2-layer Qwen3 shape,
random weights; 4 prompts of 32 random ids, G = 4, 64 new tokens per turn with EOS
disabled so every completion is 64 tokens, temperature 1, KL to a frozen reference
with beta = 0.05, Adam lr 1e-5, one update per step on every sampled sequence):

  grpo     one turn: 16 sequences of 32 + 64 tokens. Ours: `expand_tree` with T = 1
           (one sampler call, each prompt prefilled once and forked G ways), rewards
           from `mtrl_jax.testing.TokenTransition` (parity of the first token),
           `pack_tree`, one jitted `TrainStep` (reference logprobs inside). Tunix:
           its GRPOLearner (`benchmarks/tunix_rl_worker.py`).
  agentic  two turns with an 8-token observation between them. Ours: the tree with
           T = 2, G = 4: each of the 16 turn-1 samples branches into G = 4 turn-2
           samples from its shared prefix (4 + 16 nodes, 80 completions of 64 tokens,
           two sampler calls per step, 80 training rows). Tunix: its agentic GRPO
           learner, 16 independent 2-turn episodes (32 completions), one generate call
           per turn per episode, every turn re-tokenised and prefilled from scratch.
           The trees differ by design, so the comparison is generated tokens per
           second of whole training steps (Tunix's structure is what the issue's 3x
           target is about).

Time split of our step (median over the timed steps): generation (sampler calls),
environment (rewards, tree bookkeeping), packing (host), train (one jitted call:
reference forward + policy forward/backward + Adam). Compile census: the sampler and
train-step compile counts after the --warmup steps and after all steps; DESIGN.md
invariant 5 wants them equal. Runtime on 2 CPU cores: ~2 min ours + ~1 min Tunix.
"""

import json
import os
import statistics
import subprocess
import sys
import time

import jax
from absl import app, flags

from mtrl_jax.losses import LossConfig
from mtrl_jax.metrics import CompileCensus
from mtrl_jax.models import create_model, get_preset
from mtrl_jax.rollout import TreeConfig, expand_tree, pack_tree, plan_tree
from mtrl_jax.rollout.policy import TimedPolicy
from mtrl_jax.testing import TokenTransition
from mtrl_jax.sampling import Sampler, SamplingConfig
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import TrainStep

_PRESET = flags.DEFINE_string("preset", "bench", "model preset")
_DTYPE = flags.DEFINE_string("dtype", None, "override param and compute dtype (e.g. bfloat16)")
_TUNIX = flags.DEFINE_string("tunix_python", None,
                             "python of a venv with google-tunix==0.1.7; adds the Tunix rows")
_WORKLOADS = flags.DEFINE_list("workloads", ["grpo", "agentic"], "grpo and/or agentic")
_STEPS = flags.DEFINE_integer("steps", 20, "our timed steps (also the compile-census run)")
_WARMUP = flags.DEFINE_integer("warmup", 1, "untimed first steps (compilation)")
_TUNIX_STEPS = flags.DEFINE_integer("tunix_steps", 3, "Tunix timed steps")

PROMPTS, GENERATIONS, PROMPT_LEN, NEW, OBS, BETA = 4, 4, 32, 64, 8, 0.05


def bench_ours(cfg, workload: str, steps: int, warmup: int) -> dict:
  turns = {"grpo": 1, "agentic": 2}[workload]
  tree_cfg = TreeConfig(num_turns=turns, num_generations=GENERATIONS)
  plan = plan_tree(tree_cfg, PROMPTS, PROMPT_LEN + (turns - 1) * (NEW + OBS), NEW)
  model = create_model(cfg, seed=0)
  train_step = TrainStep(model, LossConfig(kl_coef=BETA), OptimConfig(learning_rate=1e-5))
  state = train_step.init_state(model)
  ref = train_step.copy_params(state.params)
  del model
  sampler = Sampler(cfg)
  policy = TimedPolicy(sampler, None, SamplingConfig(temperature=1.0, max_new_tokens=NEW),
                        stop_ids=(), pad_id=0)
  transition = TokenTransition(cfg.vocab_size, obs_len=OBS)
  length = PROMPT_LEN + turns * NEW + (turns - 1) * OBS
  census = CompileCensus()
  census.register("sampler", sampler)
  census.register("train_step", train_step)
  rows, warm = [], None
  for step in range(warmup + steps):
    if step == warmup:
      warm = census.counts()
    key = jax.random.key(step)
    policy.set_states(state.params)
    t0 = time.perf_counter()
    tree = expand_tree(tree_cfg, policy, transition,
                       transition.roots(PROMPTS, 1, PROMPT_LEN, seed=step), key)
    t1 = time.perf_counter()
    batch = pack_tree(tree, length_buckets=(length,), row_buckets=(plan.rows,))
    t2 = time.perf_counter()
    state, m = train_step(state, ref, batch)
    jax.block_until_ready(m)
    t3 = time.perf_counter()
    tokens = sum(len(c.ids) for n in tree.nodes for a in n.completions for c in a)
    assert tokens == plan.generations * NEW, (tokens, plan.generations)
    generation = policy.pop_seconds()
    rows.append({"step": t3 - t0, "generation": generation,
                 "environment": t1 - t0 - generation, "packing": t2 - t1,
                 "train": t3 - t2, "tokens": tokens})
  timed = rows[warmup:]
  out = {k: statistics.median(r[k] for r in timed) for k in timed[0]}
  out["tok_s"] = out["tokens"] / out["step"]
  out["completions"] = plan.generations
  out["census"] = (warm, census.counts())
  return out


def bench_tunix(python: str, cfg, steps: int) -> dict:
  arg = dict(layers=cfg.num_layers, vocab=cfg.vocab_size, d_model=cfg.d_model,
             mlp=cfg.mlp_dim, heads=cfg.num_heads, head_dim=cfg.head_dim,
             kv_heads=cfg.num_kv_heads, rope_theta=cfg.rope_theta, eps=cfg.rms_eps,
             prompt_len=PROMPT_LEN, new_tokens=NEW, num_prompts=PROMPTS,
             generations=GENERATIONS, beta=BETA, steps=steps, warmup=1, obs_len=OBS,
             workloads=list(_WORKLOADS.value))
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_rl_worker.py")
  proc = subprocess.run([python, worker, json.dumps(arg)], capture_output=True, text=True,
                        env=env, check=False)
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    raise RuntimeError(f"Tunix worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1])["workloads"]


def _fmt(x, spec):
  return "n/a" if x is None else format(x, spec)


def main(argv):
  del argv
  cfg = get_preset(_PRESET.value, dtype=_DTYPE.value)
  ours = {w: bench_ours(cfg, w, _STEPS.value, _WARMUP.value) for w in _WORKLOADS.value}
  theirs = bench_tunix(_TUNIX.value, cfg, _TUNIX_STEPS.value) if _TUNIX.value else {}
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), "
        f"{os.cpu_count()} cores; preset {_PRESET.value} ({cfg.dtype}); {PROMPTS} prompts x "
        f"G={GENERATIONS}, {PROMPT_LEN}-token prompts, {NEW} new tokens per turn, "
        f"beta={BETA}; ours: median of {_STEPS.value} steps after {_WARMUP.value} warm-up"
        + (f"; Tunix 0.1.7: median of {_TUNIX_STEPS.value} after 1" if theirs else ""))
  print("| workload | system | completions | step s | generation s | environment s | "
        "packing s | train s (ref + update) | gen tokens/step | gen tok/s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for w, o in ours.items():
    print(f"| {w} | mtrl_jax | {o['completions']} | {o['step']:.3f} | {o['generation']:.3f} | "
          f"{o['environment']:.3f} | {o['packing']:.3f} | {o['train']:.3f} | "
          f"{o['tokens']:.0f} | {o['tok_s']:.0f} |")
    t = theirs.get(w)
    if t and "error" not in t:
      ph = t.get("phases", {})
      gen = ph.get("rollout", {}).get("median_span_s")
      train = sum(ph.get(k, {}).get("median_span_s", 0.0)
                  for k in ("ref_logps", "actor_logps", "policy_update"))
      print(f"| {w} | Tunix 0.1.7 | {t['generated_tokens_per_step'] // NEW} | "
            f"{t['step_s_median']:.3f} | {_fmt(gen, '.3f')} | | | {train:.3f} | "
            f"{t['generated_tokens_per_step']} | {t['tokens_per_s']:.0f} |")
    elif t:
      print(f"| {w} | Tunix 0.1.7 | error: {t['error']} |")
  for w, o in ours.items():
    t = theirs.get(w)
    if t and "error" not in t:
      print(f"{w}: step time ours/Tunix = {o['step'] / t['step_s_median']:.2f}; "
            f"generated tok/s ours/Tunix = {o['tok_s'] / t['tokens_per_s']:.2f}")
  for w, o in ours.items():
    warm, end = o["census"]
    grew = {k: end[k] - warm[k] for k in end if end[k] != warm[k]}
    print(f"compile census {w}: after warm-up {warm}; after {_STEPS.value} more steps "
          f"{'unchanged' if not grew else grew}")


if __name__ == "__main__":
  app.run(main)
