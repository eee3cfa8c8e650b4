r"""The RL train step with a value critic beside the critic-free step: time and memory.

  .venv/bin/python -m benchmarks.bench_critic

One packed tree (two agents sharing one policy, align, T = 2, G = --gens,
--roots roots, a --system-token system prompt, 32-token tasks, 48 new tokens
per turn, 8-token observations; random tokens and rewards) is trained by:

  none         the policy's update alone (sibling baselines);
  head         a value head on the policy (`critic.model=head`): the value pass
               (one forward of the packed tree) and the policy's update with
               the value loss;
  separate     a critic model of its own (`critic.model=separate`, IAC): the
               critic's value pass over the same packed tree, the policy's
               update, and the critic's value-only update;
  centralized  MAAC: the critic's value pass over the joint rows
               (`rollout.joint_rows`, target V), the policy's update, and the
               critic's update on those rows.

Each case: the median milliseconds of its train-side work per RL step (after
a warm-up call of every program: host packing included, sampling excluded),
and its memory: the bytes of the train states it keeps (parameters and AdamW
moments, a separate critic's included). The policy and a separate critic are
the same preset.
"""

import statistics
import sys
import time

import jax
import numpy as np
from absl import app, flags

from mtrl_jax.losses import LossConfig
from mtrl_jax.models import create_model, get_preset
from mtrl_jax.rollout import Completion, Tree, TreeConfig, joint_rows
from mtrl_jax.rollout.batching import BatchConfig, critic_values, make_train_batch
from mtrl_jax.rollout.critic import CriticConfig, critic_advantages
from mtrl_jax.train.objectives import PolicyObjective, ValueObjective
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import TrainStep

_PRESET = flags.DEFINE_string("preset", "bench", "model preset of the policy and the critic")
_ROOTS = flags.DEFINE_integer("roots", 2, "roots (tasks) per batch")
_GENS = flags.DEFINE_integer("gens", 4, "G: samples per agent and node")
_SYSTEM = flags.DEFINE_integer("system", 128, "shared system-prompt tokens")
_REPEATS = flags.DEFINE_integer("repeats", 5, "timed RL steps per case (median reported)")
_LENGTH = flags.DEFINE_integer("length", 2048, "packed row length")

PROMPT, NEW, OBS, AGENTS, TURNS = 32, 48, 8, 2, 2
OPT = OptimConfig(learning_rate=1e-5)


def make_tree(vocab: int) -> Tree:
  """The workload's finalized tree (random tokens and rewards)."""
  rng = np.random.default_rng(0)
  tok = lambda n: rng.integers(3, vocab, n).tolist()
  g = _GENS.value
  tree = Tree(TreeConfig(num_turns=TURNS, num_generations=g, num_agents=AGENTS))
  system = tok(_SYSTEM.value)
  frontier = [
      tree.add_root([system + tok(PROMPT) for _ in range(AGENTS)]) for _ in range(_ROOTS.value)
  ]
  while frontier:
    nxt = []
    for node in frontier:
      comps = [
          [
              Completion(np.asarray(tok(NEW), np.int32), np.full(NEW, -5.0, np.float32))
              for _ in range(g)
          ]
          for _ in range(AGENTS)
      ]
      tree.set_completions(node, comps)
      if tree.record(node, rng.standard_normal(g)):
        for j in range(g):
          nxt.append(
              tree.add_child(
                  node,
                  j,
                  [node.prompts[i] + list(comps[i][j].ids) + tok(OBS) for i in range(AGENTS)],
              )
          )
    frontier = nxt
  return tree.finalize()


def _bytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def run_case(case: str, cfg, tree: Tree) -> dict:
  """Median ms per RL step of the case's train-side work, and its memory."""
  policy_model = create_model(cfg.replace(value_head=case == "head"))
  objective = PolicyObjective(
      LossConfig(algorithm="reinforce"), value_coef=0.5 if case == "head" else None, value_clip=0.2
  )
  policy = TrainStep(policy_model, objective, OPT)
  p_state = policy.init_state(policy_model)
  critic = c_state = None
  if case in ("separate", "centralized"):
    critic_model = create_model(cfg.replace(value_head=True), seed=1)
    critic = TrainStep(critic_model, ValueObjective(value_coef=0.5, value_clip=0.2), OPT)
    c_state = critic.init_state(critic_model)
  bcfg = BatchConfig(length_buckets=(_LENGTH.value,), zero_variance_filter=False)
  values_cfg = BatchConfig(length_buckets=(_LENGTH.value,), zero_variance_filter=False, values="v")
  ccfg = CriticConfig(target="v")

  def one_step():
    nonlocal p_state, c_state
    if case == "none":
      batch, _ = make_train_batch(tree, bcfg)
      p_state, m = policy(p_state, None, batch)
      return m
    if case == "head":
      values = critic_values(
          tree, values_cfg, lambda b: jax.device_get(policy.values(p_state.params, b)), False
      )
      _, targets = critic_advantages(tree, values, ccfg)
      batch, _ = make_train_batch(tree, values_cfg, (values, targets))
      p_state, m = policy(p_state, None, batch)
      return m
    fn = lambda b: jax.device_get(critic.values(c_state.params, b))
    if case == "separate":
      values = critic_values(tree, values_cfg, fn, False)
      _, targets = critic_advantages(tree, values, ccfg)
      c_batch, _ = make_train_batch(tree, values_cfg, (values, targets))
    else:
      values, rows = joint_rows.joint_values(tree, "v", fn)
      _, targets = critic_advantages(tree, values, ccfg)
      c_batch = joint_rows.rows_batch(
          rows,
          targets_R=joint_rows.row_targets(tree, rows, targets),
          old_values_R=joint_rows.row_targets(tree, rows, values),
      )
    batch, _ = make_train_batch(tree, bcfg)
    p_state, m = policy(p_state, None, batch)
    c_state, cm = critic(c_state, None, c_batch)
    return (m, cm)

  jax.block_until_ready(one_step())  # compiles every program
  times = []
  for _ in range(_REPEATS.value):
    t0 = time.perf_counter()
    jax.block_until_ready(one_step())
    times.append(time.perf_counter() - t0)
  state_bytes = _bytes(p_state) + (_bytes(c_state) if c_state is not None else 0)
  return {
      "ms": statistics.median(times) * 1e3,
      "state_mib": state_bytes / 2**20,
      "compiles": policy.num_compiles + (critic.num_compiles if critic else 0),
  }


def main(argv):
  del argv
  cfg = get_preset(_PRESET.value)
  tree = make_tree(cfg.vocab_size)
  print(f"command: {' '.join([sys.executable] + sys.argv)}")
  print(
      f"device: {jax.devices()[0].device_kind} x{jax.device_count()}; preset {_PRESET.value}; "
      f"tree: {_ROOTS.value} roots, N={AGENTS} align, T={TURNS}, G={_GENS.value}, "
      f"{len(tree.nodes)} nodes"
  )
  print("| critic | ms per RL step (train side) | vs none | train states MiB | programs |")
  print("|---|---|---|---|---|")
  base = None
  for case in ("none", "head", "separate", "centralized"):
    r = run_case(case, cfg, tree)
    base = base or r["ms"]
    print(
        f"| {case} | {r['ms']:.1f} | {r['ms'] / base:.2f}x | {r['state_mib']:.1f} | "
        f"{r['compiles']} |",
        flush=True,
    )


if __name__ == "__main__":
  app.run(main)
