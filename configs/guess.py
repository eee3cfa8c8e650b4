"""Number guessing (mtrl_jax/tasks/guess.py): user turns, a tool, per-turn and final grades.

  python -m experiments.train --config=configs/guess.py --workdir=runs/guess
  python -m experiments.train --config=configs/guess.py:smoke=True --workdir=/tmp/guess_smoke
  python -m experiments.train --config=configs/guess.py:sft_file=docs/guess_sft.jsonl \
      --workdir=runs/guess_file    # the SFT warm-up on conversations from a file

A tree turn is one guess (`branch_on='user_turn'`: a tool call continues its
turn), so T = 5 user turns cover a binary search of 1..20; `env.max_turns`
counts policy messages (a tool call and a guess per turn at most: 2 T).
docs/recipes.md walks through it.
"""

from configs import base
from configs.common import apply_smoke, parse_arg


def get_config(arg=None):
  a = parse_arg(arg, smoke=False, sft_file="")
  c = base.get_config()
  c.model.preset = "small"
  c.tokenizer.chat_format = "compact"
  c.env.factory = "guess"
  c.env.kwargs = dict(max_guesses=5)  # ceil(log2(20 + 1)): a binary search always finds it
  c.tasks.source = "guess"
  c.tree.num_turns = 5  # T: one guess per tree turn, as many as the episode has
  c.tree.num_generations = 2  # 31 nodes per root at T = 5 (docs/recipes.md, cost per root)
  c.tree.branch_on = "user_turn"
  c.tree.max_substeps = 1  # one tool call per turn, then the guess
  c.env.max_turns = 10  # policy messages: a tool call and a guess per turn
  c.env.max_tokens = 768  # the system prompt with the tool schema is ~530 byte tokens
  c.sampling.max_new_tokens = 48  # the midpoint call is ~40 tokens
  c.reward.shaping_weight = 0.1  # the per-turn `consistent` grades count
  c.rl.length_buckets = (640, 832)  # a row: env.max_tokens + sampling.max_new_tokens
  c.rl.prompt_buckets = (640, 768)
  c.sft.steps = 100
  c.sft.conversations = "mtrl_jax.tasks.guess:golden_conversation"
  if a.sft_file:  # your own conversations, one JSON object a line (docs/recipes.md)
    c.sft.conversations = "mtrl_jax.run.warmup:file_conversation"
    c.sft.conversation_kwargs = dict(path=a.sft_file)
  if a.smoke:  # seconds, for tests: the whole pipeline on a tiny model
    apply_smoke(c, rl_steps=1, sft_steps=1 if a.sft_file else 0, roots_per_step=1, eval_tasks=1)
    if not a.sft_file:
      c.sft.steps = 0  # RL alone; with sft_file one warm-up step on the file's conversations
    c.eval.greedy = False  # no held-out evaluation: one step checks rollout, grades and SFT
    c.rl.zero_variance_filter = False  # a random policy's groups are all equal: train them
    c.tree.num_turns = 2
    c.env.max_turns = 4
  return c
