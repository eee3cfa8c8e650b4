"""Cooperative refinement on CPU: two agents, complementary hints, graded feedback.

  python -m experiments.train --config=configs/refine.py --workdir=runs/refine
  python -m experiments.train --config=configs/refine.py --workdir=runs/refine_plain \
      --config.env.kwargs.feedback=plain       # the joint verdict only
  python -m experiments.train --config=configs/refine.py:smoke=True --workdir=/tmp/refine_smoke
  python -m experiments.sweep --config=configs/refine.py --sweep=feedback \
      --workdir=runs/ablations/refine --parallel=2   # one axis x 3 seeds (get_sweep below)

The `refine` task (mtrl_jax/tasks/refine.py): agent 0 sees "A:x B?c1|c2"
(its half of the code x‖y and two candidates for its partner's), agent 1
"B:y A?c1|c2"; both must answer x‖y. A turn-1 guess holds for the pair with
chance 1/4; the feedback between joint actions ('level_feedback' names the
wrong half of each agent's own answer) is what a second turn can use. The
`small` byte-level policy at depth 4 is warmed up on one epoch of episodes
that guess at random at turn 1 and follow the mode's refiner at later turns
in half of them (`warmup_conversation`), then trained with ENVGRPO for 100
steps on a T = 2, G = 4 aligned tree, one policy per agent as CoMLRL trains
them. Every joint action is graded (+1 when both answers are the code), and
per-turn grades weigh as much as the final one. Held-out success: the last
turn's joint success. The grid and what it shows: docs/refine.md.

Knobs shared by the tree, the environment and the warm-up data (one
FieldReference each, so one flag sets all of them): `tree.num_turns` (T) and
`tree.num_agents` (1: the single-agent arm, role A alone; env and warm-up
follow). `env.kwargs.feedback` sets the mode of the environment and of the
warm-up episodes.
"""

from ml_collections import config_dict

from configs import base
from configs.common import apply_smoke, critic_trainer_arms, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, smoke=False, share_policy=False)
  c = base.get_config()
  num_turns = config_dict.FieldReference(2)
  num_agents = config_dict.FieldReference(2)
  feedback = config_dict.FieldReference("level_feedback")
  c.model.preset = "small"
  c.model.num_layers = 4  # as the calculator demo: the 2-layer model copies digits unreliably
  c.tokenizer.kind = "byte"
  c.tokenizer.chat_format = "compact"
  c.env.factory = "refine"
  c.env.kwargs = dict(num_turns=num_turns, feedback=feedback, agents=num_agents)
  c.env.max_turns = num_turns
  c.env.max_tokens = 84  # T = 3 with K = 3 candidates is 69 byte tokens per agent
  c.tasks.source = "refine"
  c.tasks.kwargs = dict(digits=2, hint_size=2)  # K = 2: turn-1 joint chance 1/4
  c.tree.num_turns = num_turns
  c.tree.num_generations = 4
  c.tree.num_agents = num_agents
  c.tree.joint_mode = "align"
  c.tree.discount = 0.9
  c.tree.branch_on = "every_turn"
  c.agents.share_policy = a.share_policy  # False: one policy per agent (CoMLRL)
  c.sampling.max_new_tokens = 12  # <answer>3752</answer><|end|>
  c.reward.outcome_weight = 1.0  # the last turn's grade
  c.reward.shaping_weight = 1.0  # earlier turns' grades: every joint action weighs the same
  c.reward.step_penalty = 0.0
  c.reward.tool_penalty = 0.0
  c.loss.algorithm = "grpo"
  c.optim.learning_rate = 5e-4  # the calculator demo's: its 4-layer policy collapsed at 1e-3
  c.optim.warmup_steps = 5
  c.optim.schedule = "cosine"  # to 0 at rl.steps
  c.sft.steps = 600
  c.sft.batch_size = 32
  c.sft.num_examples = 19200  # warm-up episodes, agent = task index parity; one epoch
  c.sft.conversations = "mtrl_jax.tasks.refine:warmup_conversation"
  c.sft.conversation_kwargs = dict(
      num_turns=num_turns, feedback=feedback, agents=num_agents, follow=0.5
  )  # half the warm-up episodes refine, half guess
  c.sft.learning_rate = 3e-3
  c.rl.steps = 100
  c.rl.roots_per_step = 16
  c.rl.length_buckets = (48, 96)  # T <= 2: 47 tokens at most; T = 3: 69
  c.eval.every = 10
  c.eval.num_tasks = 200
  c.eval.success_threshold = 0.5  # success: the pair's joint code held at the last turn
  c.checkpoint.every = 10
  if a.smoke:  # seconds, for tests: the whole pipeline on a tiny model
    apply_smoke(c)
  return c


SEEDS = (0, 1, 2)


def get_sweep(arg=None):
  """Ablation axes x 3 seeds: `experiments/sweep.py --config=configs/refine.py --sweep=<axis>`.

  Each axis lists the base setting (T = 2, G = 4, align, level_feedback,
  separate policies, tree, discount 0.9, two agents) first, then its other
  arms, so every axis's table has its own baseline; a repeated command skips
  finished runs (the base runs are shared by name across axes).
  """
  axes = {  # in the order `all` runs them: the axes the task was built to separate first
      "turns": [{"tree.num_turns": t} for t in (2, 1, 3)],
      "feedback": [{"env.kwargs.feedback": f} for f in ("level_feedback", "plain", "bandit")],
      "agents": [
          {"tree.num_agents": 2},
          {"tree.num_agents": 1, "agents.share_policy": True},
      ],  # one agent, one policy
      "discount": [{"tree.discount": d} for d in (0.9, 1.0)],
      "policy": [{"agents.share_policy": False}, {"agents.share_policy": True}],
      "generations": [{"tree.num_generations": g} for g in (4, 2, 8)],
      # Equal joint actions per root (rollout.config.generations_per_root): 4 + 16 = 10 x 2.
      "shape": [{"tree.shape": "tree"}, {"tree.shape": "chain", "tree.num_generations": 10}],
      "joint": [{"tree.joint_mode": "align"}, {"tree.joint_mode": "cross"}],
      # CoMLRL's IAC and MAAC beside MAGRPO (the base) on chains (G = 1), at a fifth of the
      # base's rate: coop's critic trainers collapsed at its full rate (docs/ablations.md).
      "trainer": [{}] + critic_trainer_arms((1,), **{"optim.learning_rate": 1e-4}),
  }
  if arg == "all":
    runs = [{}] + [arm for arms in axes.values() for arm in arms[1:]]
  elif arg in axes:
    runs = [{}] + axes[arg][1:]  # the base arm under one name, shared by every axis
  else:
    raise ValueError(f"refine get_sweep({arg!r}); allowed: {sorted(axes) + ['all']}")
  return [{**o, "seed": s} for o in runs for s in SEEDS]
