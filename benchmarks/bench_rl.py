r"""One full RL step (rollout + rewards + reference logprobs + update), beside Tunix.

  .venv/bin/python -m benchmarks.bench_rl --tunix_python=/tmp/tunix_venv/bin/python
  (Tunix venv: python3 -m venv /tmp/tunix_venv && /tmp/tunix_venv/bin/pip install google-tunix==0.1.7)
  GPU, no Tunix:  python -m benchmarks.bench_rl --preset=qwen2-0.5b --dtype=bfloat16

Workloads (same model shape on both sides: the `bench` preset, a 2-layer Qwen3 shape,
random weights; 4 prompts of 32 random ids, G = 4, 64 new tokens per turn with EOS
disabled so every completion is 64 tokens, temperature 1, KL to a frozen reference
with beta = 0.05, Adam lr 1e-5, one update per step on every sampled sequence):

  grpo     one turn: 16 sequences of 32 + 64 tokens. Ours: `expand_tree` with T = 1
           (the rollout engine: each prompt prefilled once and forked G ways), rewards
           from `mtrl_jax.testing.TokenTransition` (parity of the first token),
           `make_train_batch`, one jitted `TrainStep` (reference logprobs inside). Tunix:
           its GRPOLearner (`benchmarks/tunix_rl_worker.py`).
  longctx  (ours only, rows vs tree) a 512-token system prompt shared by 2 roots, each
           with a 32-token task prompt, T = 3, G = 4, 64 new tokens per turn: 2 x 21
           nodes, 168 completions. One row per action repeats the system prompt and
           every earlier turn 168 times; the packed tree holds each token once.
  agentic  two turns with an 8-token observation between them. Ours: the tree with
           T = 2, G = 4: each of the 16 turn-1 samples branches into G = 4 turn-2
           samples from its shared prefix (4 + 16 nodes, 80 completions of 64 tokens,
           each child continuing its parent sample's cache, 80 training rows). Tunix: its agentic GRPO
           learner, 16 independent 2-turn episodes (32 completions), one generate call
           per turn per episode, every turn re-tokenised and prefilled from scratch.
           The trees differ by design, so the comparison is generated tokens per
           second of whole training steps (Tunix's structure is what the issue's 3x
           target is about).

Rollout: `--rollout=engine,level-sync` runs our side with the engine (continuous
schedule, children extending their parents' caches) and with the level-synchronous
baseline (barrier schedule, every node's prompt prefilled whole, as the sampler the
engine replaced did).

Packing: `--packing=tree,rows` runs our side with both layouts of the train batch
(`rollout.batching`, every sampled sequence trained: no zero-variance filter); the
table gives trained tokens (non-padding tokens in the batch) and XLA's memory for the
train step (arguments + temporaries of the compiled program; on a GPU also the
process's peak bytes in use so far, which grows down the table).

Time split of our step (median over the timed steps): generation (engine steps),
environment (rewards, tree bookkeeping), packing (host), train (one jitted call:
reference forward + policy forward/backward + Adam). Compile census: the engine and
train-step compile counts after the --warmup steps and after all steps; docs/design.md
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
from mtrl_jax.rollout import EnginePolicy, TreeConfig, expand_tree, plan_tree
from mtrl_jax.rollout.batching import BatchConfig, make_train_batch
from mtrl_jax.testing import TokenTransition
from mtrl_jax.sampling import DecodeEngine, EngineConfig, SamplingConfig
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import TrainStep

_PRESET = flags.DEFINE_string("preset", "bench", "model preset")
_DTYPE = flags.DEFINE_string("dtype", None, "override param and compute dtype (e.g. bfloat16)")
_TUNIX = flags.DEFINE_string(
    "tunix_python", None, "python of a venv with google-tunix==0.1.7; adds the Tunix rows"
)
_WORKLOADS = flags.DEFINE_list(
    "workloads", ["grpo", "agentic", "longctx"], "grpo, agentic and/or longctx"
)
_PACKING = flags.DEFINE_list("packing", ["tree", "rows"], "our train-batch layouts: tree, rows")
_ROLLOUT = flags.DEFINE_list("rollout", ["engine"], "our rollouts: engine, level-sync")
_ATTENTION = flags.DEFINE_string("attention", "xla", "ModelConfig.attention: xla | cudnn")
_REMAT = flags.DEFINE_bool("remat", False, "rematerialise blocks in the backward pass")
_LONG_STEPS = flags.DEFINE_integer("long_steps", 3, "timed steps of the longctx workload")
_STEPS = flags.DEFINE_integer("steps", 20, "our timed steps (also the compile-census run)")
_WARMUP = flags.DEFINE_integer("warmup", 1, "untimed first steps (compilation)")
_TUNIX_STEPS = flags.DEFINE_integer("tunix_steps", 3, "Tunix timed steps")

PROMPTS, GENERATIONS, PROMPT_LEN, NEW, OBS, BETA = 4, 4, 32, 64, 8, 0.05
SYSTEM_LEN, LONG_ROOTS = 512, 2
# workload: (turns, roots, system prompt tokens, packed row length of 'tree'). A
# packed row holds whole trees (grpo: two 288-token trees; agentic: half a
# 1344-token tree, the split copying the 104-token path above it; longctx: a
# tree is 5.9k tokens, split under its root into rows of 2048).
WORKLOADS = {
    "grpo": (1, PROMPTS, 0, 576),
    "agentic": (2, PROMPTS, 0, 768),
    "longctx": (3, LONG_ROOTS, SYSTEM_LEN, 2048),
}


def _memory(train_step, state, ref, batch) -> dict:
  """XLA's memory of the compiled train step for this batch (bytes)."""
  sel = train_step._select(batch)
  fn = train_step._fn_for(sel, False)
  sds = lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype)
  with jax.set_mesh(train_step.mesh):
    ma = (
        fn.lower(state, ref, jax.tree.map(sds, sel), train_step.schedule_args)
        .compile()
        .memory_analysis()
    )
  out = {"xla_bytes": None, "peak_bytes": None}
  if ma is not None:
    out["xla_bytes"] = ma.argument_size_in_bytes + ma.temp_size_in_bytes
  return out


def bench_ours(cfg, workload: str, steps: int, warmup: int, packing: str, rollout: str) -> dict:
  turns, roots, system, tree_len = WORKLOADS[workload]
  level_sync = rollout == "level-sync"
  tree_cfg = TreeConfig(
      num_turns=turns,
      num_generations=GENERATIONS,
      schedule="barrier" if level_sync else "continuous",
  )
  plan = plan_tree(tree_cfg, roots, system + PROMPT_LEN + (turns - 1) * (NEW + OBS), NEW)
  model = create_model(cfg, seed=0)
  train_step = TrainStep(model, LossConfig(kl_coef=BETA), OptimConfig(learning_rate=1e-5))
  state = train_step.init_state(model)
  ref = train_step.copy_params(state.params)
  del model
  length = system + PROMPT_LEN + turns * NEW + (turns - 1) * OBS
  engine = DecodeEngine(
      cfg,
      EngineConfig(slots=plan.max_level_generations, capacity=length + 16, reuse=not level_sync),
  )
  policy = EnginePolicy(
      engine,
      None,
      SamplingConfig(temperature=1.0, max_new_tokens=NEW),
      stop_ids=(),
      pad_id=0,
      fanout=GENERATIONS,
  )
  transition = TokenTransition(cfg.vocab_size, obs_len=OBS)
  batch_cfg = BatchConfig(
      packing=packing,
      length_buckets=(tree_len,) if packing == "tree" else (length,),
      row_buckets=None if packing == "tree" else (plan.rows,),
      zero_variance_filter=False,
  )
  census = CompileCensus()
  census.register("engine", engine)
  census.register("train_step", train_step)
  rows, warm = [], None
  for step in range(warmup + steps):
    if step == warmup:
      warm = census.counts()
    key = jax.random.key(step)
    policy.set_states(state.params)
    t0 = time.perf_counter()
    tree = expand_tree(
        tree_cfg,
        policy,
        transition,
        transition.roots(roots, 1, PROMPT_LEN, seed=step, system_len=system),
        key,
    )
    t1 = time.perf_counter()
    batch, batch_m = make_train_batch(tree, batch_cfg)
    t2 = time.perf_counter()
    if step == 0:
      memory = _memory(train_step, state, ref, batch)
    state, m = train_step(state, ref, batch)
    jax.block_until_ready(m)
    t3 = time.perf_counter()
    tokens = sum(len(c.ids) for n in tree.nodes for a in n.completions for c in a)
    assert tokens == plan.generations * NEW, (tokens, plan.generations)
    generation = tree.times.generation
    rows.append(
        {
            "step": t3 - t0,
            "generation": generation,
            "prefill": tree.engine["prefill_tokens"],
            "environment": t1 - t0 - generation,
            "packing": t2 - t1,
            "train": t3 - t2,
            "tokens": tokens,
            "trained": batch_m["batch/tokens_trained"],
            "shape": "x".join(map(str, batch.tokens_BxL.shape)),
        }
    )
  timed = rows[warmup:]
  out = {k: statistics.median(r[k] for r in timed) for k in timed[0] if k != "shape"}
  out["shape"] = timed[-1]["shape"]
  out.update(memory)
  # The process's peak so far (GPU): workloads run in table order, so a row's
  # figure also bounds the rows above it.
  out["peak_bytes"] = (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use")
  out["tok_s"] = out["tokens"] / out["step"]
  out["completions"] = plan.generations
  out["census"] = (warm, census.counts())
  return out


def bench_tunix(python: str, cfg, steps: int, workloads) -> dict:
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
      new_tokens=NEW,
      num_prompts=PROMPTS,
      generations=GENERATIONS,
      beta=BETA,
      steps=steps,
      warmup=1,
      obs_len=OBS,
      workloads=list(workloads),
  )
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tunix_rl_worker.py")
  proc = subprocess.run(
      [python, worker, json.dumps(arg)], capture_output=True, text=True, env=env, check=False
  )
  lines = proc.stdout.strip().splitlines()
  if proc.returncode or not lines:
    raise RuntimeError(f"Tunix worker failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1])["workloads"]


def _fmt(x, spec):
  return "n/a" if x is None else format(x, spec)


def main(argv):
  del argv
  cfg = get_preset(
      _PRESET.value, dtype=_DTYPE.value, attention=_ATTENTION.value, remat=_REMAT.value
  )
  ours = {}
  arms = [(p, r) for p in _PACKING.value for r in _ROLLOUT.value]
  for w in _WORKLOADS.value:
    steps = _LONG_STEPS.value if w == "longctx" else _STEPS.value
    for packing, rollout in arms:
      try:
        ours[(w, packing, rollout)] = o = bench_ours(cfg, w, steps, _WARMUP.value, packing, rollout)
      except Exception as e:  # pylint: disable=broad-except
        # e.g. out of memory: the row layout's full logits of a long-context batch
        print(f"{w} ({packing}, {rollout}): failed: {str(e).splitlines()[0][:200]}", flush=True)
        continue
      # As it finishes, so a run cut short keeps what it measured.
      print(
          f"{w} ({packing}, {rollout}): step {o['step']:.3f} s, generation "
          f"{o['generation']:.3f} s, train {o['train']:.3f} s, batch {o['shape']}, trained "
          f"tokens {o['trained']:.0f}, gen tok/s {o['tok_s']:.0f}",
          flush=True,
      )
  tunix_workloads = [w for w in _WORKLOADS.value if w != "longctx"]
  theirs = (
      bench_tunix(_TUNIX.value, cfg, _TUNIX_STEPS.value, tunix_workloads)
      if _TUNIX.value and tunix_workloads
      else {}
  )
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"device: {jax.devices()[0].device_kind} ({jax.devices()[0].platform}), "
      f"{os.cpu_count()} cores; preset {_PRESET.value} ({cfg.dtype}); {PROMPTS} prompts x "
      f"G={GENERATIONS}, {PROMPT_LEN}-token prompts, {NEW} new tokens per turn, "
      f"beta={BETA}; ours: median of {_STEPS.value} steps after {_WARMUP.value} warm-up"
      + (f"; Tunix 0.1.7: median of {_TUNIX_STEPS.value} after 1" if theirs else "")
  )
  mib = lambda b: "n/a" if b is None else f"{b / 2**20:.0f}"
  print(
      "| workload | system | completions | step s | generation s | prefilled tokens | "
      "environment s | packing s | train s (ref + update) | batch B x L | trained tokens | "
      "train-step memory MiB (XLA / peak) | gen tokens/step | gen tok/s |"
  )
  print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
  for w in _WORKLOADS.value:
    for packing, rollout in arms:
      if (w, packing, rollout) not in ours:
        print(f"| {w} | mtrl_jax ({packing}, {rollout}) | failed (see above) |")
        continue
      o = ours[(w, packing, rollout)]
      print(
          f"| {w} | mtrl_jax ({packing}, {rollout}) | {o['completions']} | {o['step']:.3f} | "
          f"{o['generation']:.3f} | {o['prefill']:.0f} | {o['environment']:.3f} | "
          f"{o['packing']:.3f} | {o['train']:.3f} | {o['shape']} | {o['trained']:.0f} | "
          f"{mib(o['xla_bytes'])} / {mib(o['peak_bytes'])} | {o['tokens']:.0f} | "
          f"{o['tok_s']:.0f} |"
      )
    t = theirs.get(w)
    if t and "error" not in t:
      ph = t.get("phases", {})
      gen = ph.get("rollout", {}).get("median_span_s")
      train = sum(
          ph.get(k, {}).get("median_span_s", 0.0)
          for k in ("ref_logps", "actor_logps", "policy_update")
      )
      print(
          f"| {w} | Tunix 0.1.7 | {t['generated_tokens_per_step'] // NEW} | "
          f"{t['step_s_median']:.3f} | {_fmt(gen, '.3f')} | | | {train:.3f} | | | | "
          f"{t['generated_tokens_per_step']} | {t['tokens_per_s']:.0f} |"
      )
    elif t:
      print(f"| {w} | Tunix 0.1.7 | error: {t['error']} |")
  for (w, packing, rollout), o in ours.items():
    t = theirs.get(w)
    if t and "error" not in t:
      print(
          f"{w} ({packing}, {rollout}): step time ours/Tunix = "
          f"{o['step'] / t['step_s_median']:.2f}; generated tok/s ours/Tunix = "
          f"{o['tok_s'] / t['tokens_per_s']:.2f}"
      )
  for w in _WORKLOADS.value:
    for r in _ROLLOUT.value:
      if (w, "tree", r) in ours and (w, "rows", r) in ours:
        tr, ro = ours[(w, "tree", r)], ours[(w, "rows", r)]
        print(
            f"{w} ({r}): rows/tree trained tokens = {ro['trained'] / tr['trained']:.2f}x; "
            f"train step rows/tree = {ro['train'] / tr['train']:.2f}x"
        )
    for p in _PACKING.value:
      if (w, p, "engine") in ours and (w, p, "level-sync") in ours:
        e, l = ours[(w, p, "engine")], ours[(w, p, "level-sync")]
        print(
            f"{w} ({p}): generation level-sync/engine = {l['generation'] / e['generation']:.2f}x;"
            f" prefilled tokens {l['prefill'] / max(e['prefill'], 1):.1f}x fewer"
        )
  for (w, packing, rollout), o in ours.items():
    warm, end = o["census"]
    grew = {k: end[k] - warm[k] for k in end if end[k] != warm[k]}
    print(
        f"compile census {w} ({packing}, {rollout}): after warm-up {warm}; after the timed "
        f"steps {'unchanged' if not grew else grew}"
    )


if __name__ == "__main__":
  app.run(main)
