"""Checks `rollout.critic` against CoMLRL 1.4.3's own IAC target and advantage code.

CoMLRL's IAC computes its TD targets inside `IACTrainer._collect_rollouts_multi_turn`
(r_t + discount * old_value_{t+1}; r_T at the end) or `_collect_rollouts`
(one turn, G samples: target r), and its advantages in
`ActorCriticTrainerBase._prepare_advantages` (target - old_value, then
normalised), called per agent and per turn by `_process_buffer` / `_update`. This
script runs those methods unmodified on a trainer object built without models:
the model-facing hooks (`_generate_rollout`, prompts, the reward function) are
replaced by stubs that return hand-made rewards and critic values, and
`_ac_step` (the gradient step) records nothing. The same rewards and values go
into an mtrl_jax chain tree (G = 1 below the root, or one turn with G samples)
and through `critic_advantages`; the script prints the largest differences.

Runs in a separate virtual environment with torch (CPU) and comlrl==1.4.3, the
repository on PYTHONPATH; never imported by tests:

  python3 -m venv /tmp/comlrl_venv
  /tmp/comlrl_venv/bin/pip install torch==2.13.0 comlrl==1.4.3
  PYTHONPATH=. /tmp/comlrl_venv/bin/python benchmarks/compare_comlrl_critic.py
"""

from __future__ import annotations

import random

import numpy as np
import torch
from comlrl.trainers.actor_critic.iac import IACConfig, IACTrainer

from mtrl_jax.rollout.config import TreeConfig
from mtrl_jax.rollout.critic import CriticConfig, critic_advantages
from mtrl_jax.rollout.records import ActionRecord, StepRecord
from mtrl_jax.rollout.tree import Tree


class _Tokenizer:
  pad_token_id = 0

  def decode(self, ids, skip_special_tokens=True):
    return "c"


def _trainer(args: IACConfig, rewards, values):
  """An IACTrainer without models whose turn t of a rollout returns rewards[t] ([N]) and
  values[t] ([N][G]) from the stubbed generation and reward hooks."""
  trainer = object.__new__(IACTrainer)
  trainer.args = args
  trainer.critic_type = args.critic_type
  trainer.agents = [None] * args.num_agents
  trainer.tokenizers = [_Tokenizer()] * args.num_agents
  trainer.external_transition = lambda **kw: ["next"] * args.num_agents
  trainer._resolve_turn_prompt = lambda item, agent_idx, external_prompt=None: "prompt"
  trainer.reward_processor = lambda r: r
  trainer._reward_signature = None
  trainer._ac_step = lambda agent_idx, batch: None  # no gradient step
  calls = {"gen": [0] * args.num_agents, "reward": 0}

  def generate(agent_model, prompt, agent_idx, num_ret):
    t = calls["gen"][agent_idx]
    calls["gen"][agent_idx] += 1
    return {
        "prompt": prompt,
        "prompt_len": 1,
        "sequences": torch.ones((num_ret, 3), dtype=torch.long),
        "attention_mask": torch.ones((num_ret, 3), dtype=torch.long),
        "response_lens": [2] * num_ret,
        "logprobs": [torch.zeros(1)] * num_ret,
        "reference_kls": [],
        "completions": ["c"] * num_ret,
        "values": torch.tensor(values[t][agent_idx], dtype=torch.float32),
    }

  def reward_func(*completions, batch_items=None):
    t = calls["reward"]
    calls["reward"] += 1
    return list(rewards[t])

  trainer._generate_rollout = generate
  trainer.reward_func = reward_func
  return trainer


def _comlrl(args: IACConfig, chains):
  """CoMLRL's value targets, raw and normalised advantages: {(chain, turn, agent, g): ...}."""
  buffers = [[] for _ in range(args.num_agents)]
  for k, (rewards, values) in enumerate(chains):
    trainer = _trainer(args, rewards, values)
    if args.num_turns > 1:
      rollouts = trainer._collect_rollouts_multi_turn({"prompt": "x"}, args.num_turns)
    else:
      rollouts = trainer._collect_rollouts({"prompt": "x"})
    for sample in rollouts:
      sample.metadata["chain"] = k
      buffers[sample.agent_idx].append(sample)
  out = {}
  for a in range(args.num_agents):
    samples = list(buffers[a])
    trainer._process_buffer(a, buffers[a])  # groups by turn, _update -> _prepare_advantages
    for s in samples:
      key = (s.metadata["chain"], s.metadata["turn_idx"], a, s.metadata["generation_idx"])
      out[key] = (
          float(s.metadata["value_target"].view(-1)[0]),
          float(s.advantage.view(-1)[0]),
          float(s.normalized_advantage.view(-1)[0]),
      )
  return out


def _ours(args: IACConfig, chains, target: str):
  """The same chains as one mtrl_jax tree (one root each), through critic_advantages."""
  n, g = args.num_agents, args.num_generations
  cfg = TreeConfig(
      num_turns=args.num_turns,
      num_generations=g,
      num_agents=n,
      discount=args.discount,
      team_weight=0.0,
      termination_threshold=args.early_termination_threshold,
  )
  tree, where = Tree(cfg), {}
  for k, (rewards, values) in enumerate(chains):
    node, t = tree.add_root([[1]] * n), 0
    while True:
      where[id(node)] = (k, t)
      r_N = [float(x) for x in rewards[t]]
      # Team reward = the mean of the agents' (CoMLRL's termination test); agents get their own.
      acts = [
          ActionRecord((StepRecord(float(np.mean(r_N)), local_rewards=tuple(r_N)),))
          for _ in range(g)
      ]
      if not tree.record(node, [a.reward for a in acts], None, acts):
        break
      node, t = tree.add_child(node, 0, [[2]] * n), t + 1
  tree.finalize()
  vals = [
      np.asarray(chains[where[id(nd)][0]][1][where[id(nd)][1]], np.float64) for nd in tree.nodes
  ]
  out = {}
  for normalize in (False, True):
    adv, tgt = critic_advantages(tree, vals, CriticConfig(target=target, normalize=normalize))
    for node in tree.nodes:
      k, t = where[id(node)]
      for a in range(n):
        for j in range(g):
          prev = out.get((k, t, a, j), (0.0, 0.0, 0.0))
          out[(k, t, a, j)] = (
              (tgt[node.node_id][a, j], adv[node.node_id][a, j], prev[2])
              if not normalize
              else (prev[0], prev[1], adv[node.node_id][a, j])
          )
  return out


def _case(name, args, chains, target):
  theirs, ours = _comlrl(args, chains), _ours(args, chains, target)
  assert sorted(theirs) == sorted(ours), (name, sorted(theirs), sorted(ours))
  diff = np.abs(
      np.asarray([theirs[k] for k in sorted(theirs)]) - np.asarray([ours[k] for k in sorted(ours)])
  )
  print(
      f"{name:44s} samples={len(theirs):3d}  max|diff| target={diff[:, 0].max():.2e} "
      f"adv={diff[:, 1].max():.2e} adv_norm={diff[:, 2].max():.2e}"
  )
  return float(diff.max())


def main():
  rng = np.random.default_rng(0)
  random.seed(0)
  worst = 0.0
  n = 2
  for target in ("v", "q"):
    # Multi-turn chains (G = 1), no termination; then with early termination.
    for turns, tau, label in ((3, None, "T=3 chains"), (4, 0.5, "T=4 chains, early stop 0.5")):
      args = IACConfig(
          num_agents=n,
          num_turns=turns,
          discount=0.9,
          num_generations=1,
          critic_type=target,
          early_termination_threshold=tau,
          rollout_buffer_size=1000,
      )
      chains = [
          (
              np.round(rng.uniform(-1, 1, size=(turns, n)), 3).tolist(),
              np.round(rng.normal(size=(turns, n, 1)), 3).tolist(),
          )
          for _ in range(5)
      ]
      worst = max(worst, _case(f"critic={target} {label} x5", args, chains, target))
    # One turn, G = 3 samples per agent (CoMLRL's single-turn path: target r).
    args = IACConfig(
        num_agents=n,
        num_turns=1,
        discount=0.9,
        num_generations=3,
        critic_type=target,
        early_termination_threshold=None,
        rollout_buffer_size=1000,
    )
    chains = [
        (
            np.round(rng.uniform(-1, 1, size=(1, n)), 3).tolist(),
            np.round(rng.normal(size=(1, n, 3)), 3).tolist(),
        )
        for _ in range(4)
    ]
    if target == "v":  # one history's value for all G samples
      chains = [(r, [[[v[0][i][0]] * 3 for i in range(n)]]) for r, v in chains]
    worst = max(worst, _case(f"critic={target} T=1 G=3 x4", args, chains, target))
  print(f"worst |diff| over all cases: {worst:.2e} (CoMLRL computes in float32)")
  assert worst < 1e-5


if __name__ == "__main__":
  main()
