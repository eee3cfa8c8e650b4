"""CPU demo of multi-agent multi-turn RL: two agents build a code from private halves.

  python -m experiments.train --config=configs/coop.py --workdir=runs/coop
  python -m experiments.train --config=configs/coop.py --workdir=runs/coop_blind \
      --config.env.kwargs.show_partner=False     # ablation: no partner answer in turn 2
  python -m experiments.train --config=configs/coop.py:smoke=True --workdir=/tmp/coop_smoke
  python -m experiments.train --config=configs/coop.py:share_policy=True --workdir=runs/coop_shared
      # one policy for both agents (the setting of docs/ablations.md's coop table)

The `coop` task (mtrl_jax/tasks/coop.py): agent 0 sees "A:x", agent 1
"B:y"; both must answer x‖y; turn 2 shows each agent its partner's turn-1
answer. A 2-layer byte-level policy (`small` preset) is warmed up on golden episodes of both
roles, then trained with ENVGRPO on a T=2, G=4 aligned two-agent tree; the
reward (+1 when both answers are the joint code) is scored at every joint
action, so per-turn grades weigh as much as the final one. Episodes are
about 30 byte tokens per agent. As CoMLRL trains them, each agent has its
own policy (`agents.share_policy=False`: both start from the same warmed-up
weights, then each is updated on its own samples only; `train/stacked.py`);
`share_policy=True` gives both agents one policy, which the role letter
tells apart. With `show_partner=False` the joint success
stays at chance (about 1 in 90), which is what makes turn-2 feedback the
measurable ingredient.
"""

from ml_collections import config_dict

from configs import base
from configs.common import apply_smoke, critic_trainer_arms, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, smoke=False, share_policy=False)
  c = base.get_config()
  num_turns = config_dict.FieldReference(2)  # one T for the tree, the turn cap and the env
  c.model.preset = "small"
  c.tokenizer.kind = "byte"
  c.tokenizer.chat_format = "compact"
  c.env.factory = "coop"
  c.env.kwargs = dict(
      num_turns=num_turns,  # the env stops after the T-th joint action
      show_partner=True,  # False: the turn-2 message hides the partner's answer (ablation)
      team_reward="all",  # 'any': one right answer scores the team (room to free-ride)
  )
  c.env.max_turns = num_turns
  c.env.max_tokens = 48  # a whole episode is ~30 tokens per agent
  c.tasks.source = "coop"
  c.tasks.kwargs = dict(digits=2)  # digits of each private half
  c.tree.num_turns = num_turns
  c.tree.num_generations = 4
  c.tree.num_agents = 2
  c.tree.joint_mode = "align"
  c.tree.discount = 0.9
  c.tree.branch_on = "every_turn"
  c.agents.share_policy = a.share_policy  # False: one policy per agent (CoMLRL)
  c.sampling.max_new_tokens = 12  # <answer>3752</answer><|end|> is 7 tokens
  c.reward.outcome_weight = 1.0  # the last turn's grade
  c.reward.shaping_weight = 1.0  # earlier turns' grades: every joint action weighs the same
  c.reward.step_penalty = 0.0
  c.reward.tool_penalty = 0.0
  c.loss.algorithm = "grpo"
  c.optim.learning_rate = 1e-3
  c.critic.learning_rate = 1e-3  # a separate critic (critic.model='separate'): the policy's
  c.sft.steps = 150
  c.sft.batch_size = 32
  c.sft.num_examples = 4000  # golden episodes, agent = task index parity
  c.sft.conversations = "mtrl_jax.tasks.coop:golden_conversation"
  c.sft.learning_rate = 3e-3
  # With --config.model.lora.rank > 0 the warm-up still trains every weight (one policy,
  # before the agents part ways), then each agent's adapters train over that one base
  # (docs/internals.md, LoRA: why the warm-up is not LoRA).
  c.rl.steps = 150
  c.rl.roots_per_step = 16
  c.rl.length_buckets = (32, 64)
  c.eval.every = 10
  c.eval.num_tasks = 200
  c.eval.success_threshold = 0.5  # success: both answered the joint code at the last turn
  c.checkpoint.every = 10
  if a.smoke:  # seconds, for tests: the whole pipeline on a tiny model
    apply_smoke(c)
  return c


def get_sweep(arg=None):
  """Ablation axes x 3 seeds: `experiments/sweep.py --config=configs/coop.py --sweep=<axis>`.

  Axes: turns (T in 1, 2, 3: T = 1 is one joint answer with no partner
  feedback), joint (align vs cross), feedback (the turn-2 message shows the
  partner's answer or not), policy (one shared policy vs one per agent), shape
  (tree vs chain at equal joint actions per root), team (agent 1 of another
  architecture: the `bench` preset, d256, beside agent 0's `small`, d128), trainer (CoMLRL's trainers:
  MAGRPO, the config's sibling baselines; IAC, an independent value-head critic
  per agent, and MAAC, one centralized critic model over the joint history,
  each with a REINFORCE loss and batch-normalised TD(0) advantages, at G = 4
  and G = 1), and 'all' (the config, then one change at a time). docs/ablations.md's coop table ran `cpu` and
  `feedback` with `configs/coop.py:share_policy=True`.
  """
  axes = {
      "turns": [{"tree.num_turns": t} for t in (1, 2, 3)],
      "joint": [{"tree.joint_mode": "align"}, {"tree.joint_mode": "cross"}],
      "feedback": [{"env.kwargs.show_partner": True}, {"env.kwargs.show_partner": False}],
      "policy": [{"agents.share_policy": True}, {"agents.share_policy": False}],
      # Equal joint actions per root (rollout.config.generations_per_root): 4 + 16 = 10 x 2.
      "shape": [{"tree.shape": "tree"}, {"tree.shape": "chain", "tree.num_generations": 10}],
      # A team of two architectures: agent 1 the 2-layer d256 `bench` preset (train.team).
      "team": [{}, {"agents.presets": ("", "bench")}],
      "trainer": [{}] + critic_trainer_arms((4, 1)),
  }
  axes["all"] = [{}, axes["turns"][0], axes["turns"][2]] + axes["joint"][1:] + axes["feedback"][1:]
  # 'cpu': the subset docs/ablations.md ran on 2 CPU cores.
  axes["cpu"] = [{}, axes["turns"][0], axes["joint"][1]]
  if arg not in axes:
    raise ValueError(f"coop get_sweep({arg!r}); allowed: {sorted(axes)}")
  return [{**o, "seed": s} for o in axes[arg] for s in (0, 1, 2)]
