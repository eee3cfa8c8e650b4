"""RL from scratch on the one-turn `charclass` task: the suite's learning test.

  python -m experiments.train --config=configs/charclass.py --workdir=/tmp/charclass

The `tiny` byte-level policy gets a short format-only SFT (a random printable
character as reply, whatever the class; mtrl_jax/tasks/charclass.py says why),
which leaves it at chance: about 25% sampled held-out success. GRPO then
raises it above 80% within the configured steps, in well under a minute of
CPU (tests/train/test_learning.py asserts it). Held-out success is measured
with sampled (temperature 1) replies: a greedy reply of an untrained model
is one fixed byte per prompt, so greedy success starts at 0, 50 or 100%.
"""

from configs import base


def get_config(arg=None):
  del arg
  c = base.get_config()
  c.model.preset = "tiny"
  c.env.factory = "charclass"
  c.env.max_turns = 1
  c.env.max_tokens = 12  # "<user>symbol<end><assistant>" is 9 ids
  c.tasks.source = "charclass"
  c.tree.num_turns = 1
  c.tree.num_generations = 16
  c.tree.branch_on = "every_turn"
  # Standardised group advantages: a group with one right reply of 16 pushes it 4x
  # harder than the plain mean baseline, so a class no sample has sharpened on yet is
  # not lost (without it 2 of 5 seeds stalled at 75%: one class never found).
  c.tree.advantage_std_norm = True
  c.sampling.max_new_tokens = 1  # the graded first character
  c.reward.step_penalty = 0.0
  c.reward.tool_penalty = 0.0
  c.sft.steps = 30
  c.sft.batch_size = 32
  c.sft.num_examples = 2000
  c.sft.conversations = "mtrl_jax.tasks.charclass:warmup_conversation"
  c.sft.learning_rate = 3e-3
  c.optim.learning_rate = 1e-3
  c.rl.steps = 50
  c.rl.roots_per_step = 8
  c.rl.length_buckets = (16,)
  c.rl.prompt_buckets = (16,)
  c.rl.precompile = False  # a handful of shapes, compiled on first use
  c.rl.dump_every = 0
  c.rl.zero_variance_filter = False  # one batch shape: a second train-step compile costs ~20 s
  c.eval.every = 50
  c.eval.num_tasks = 200
  c.eval.greedy = False
  c.eval.sampled = True
  c.checkpoint.every = 50
  return c
