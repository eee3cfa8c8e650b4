"""MAGRPO on HumanEval: two agents (aux helper + main function), T=2 turns of code refinement.

  python -m experiments.train --config=configs/humaneval.py --workdir=runs/he \
      --config.model.path=/path/to/Qwen2.5-Coder-3B
  python -m experiments.train --config=configs/humaneval.py:agents=1 --workdir=runs/he_grpo \
      --config.model.path=/path/to/Qwen2.5-Coder-3B          # the single-agent GRPO baseline
  python -m experiments.train --config=configs/humaneval.py:smoke=True --workdir=/tmp/he_smoke

Reproduces the published multi-turn HumanEval setting (HE-MAGRPO-MT, V2 tree;
docs/comlrl.md 1 and 2.2 @ e9f0098): Qwen2.5-Coder-3B in bfloat16 with its
own tokenizer and ChatML, train test[33:163] (130 problems, one task per
step, 6 epochs = 780 steps), eval test[:32] (4 tasks every 4 steps); T=2,
G=4, aligned joint actions, gamma 0.9, tau -0.2 (single agent -0.1) on the
shifted reward, lr 2e-5 AdamW without weight decay, schedule or clipping;
temperature 0.7, top_p 0.9, top_k 50 (single agent: 0.8 / 0.95), 256 new
tokens; REINFORCE with a sequence-sum of token log-probs averaged over
samples, no KL (the MAGRPO loss); every policy message is a tree turn.
Each agent has its own policy (`agents.share_policy=False`: aux and main
start from the same checkpoint and are updated separately, stacked on an
agent axis; `agents.paths` / `agents.learning_rates` set them per agent).
Reward: the gated level reward (max 4.0; 2.1 single agent) shifted by -4
(-2.1), scored at every joint action: the env grades continuing turns
(shaping) and stops after the last (outcome), so both weights are 1 and the
penalties 0; `num_turns` is one FieldReference shared by the tree, the turn
cap and the env. Feedback: level_feedback on the first assert
(`--config.env.kwargs.external_mode=plain|passed|level_passed|expert_edits|
bandit`, `--config.env.kwargs.sandbox_slice=all`). The chat-native prompt
style appends only the feedback block to each agent's thread;
`--config.env.kwargs.prompt_style=comlrl` feeds the reference's full
transition string. Differences from the reference: one batched update per
task (V3-like) instead of one optimizer step per tree node, padding after the
stop token is not trained, zero-variance sibling groups are dropped.

Runtime: the real run needs a GPU (two 3B policies' worth of samples per
node); the smoke variant (`tiny` byte-level model, 2 RL steps on the
HumanEval problems with the shortest prompts, ~1.5k-byte contexts) ran in
about 40 s on a shared 2-core CPU, most of it compilation.
"""

from ml_collections import config_dict

from configs import base
from configs.common import apply_smoke, parse_arg

MAGRPO = dict(shift=-4.0, tau=-0.2, temperature=0.7, top_p=0.9)
GRPO = dict(shift=-2.1, tau=-0.1, temperature=0.8, top_p=0.95)


def get_config(arg=None):
  a = parse_arg(arg, smoke=False, agents=2)
  if a.agents not in (1, 2):
    raise ValueError(f"configs/humaneval.py agents={a.agents}; allowed: 1, 2")
  ref = MAGRPO if a.agents == 2 else GRPO
  c = base.get_config()
  c.seed = 0
  num_turns = config_dict.FieldReference(2)  # one T for the tree, the turn cap and the env

  c.model.path = ""  # --config.model.path=/path/to/Qwen2.5-Coder-3B (HF-format directory)
  c.model.dtype = "bfloat16"
  c.tokenizer.kind = "hf"
  c.tokenizer.chat_format = "chatml"

  c.env.factory = "humaneval"
  c.env.kwargs = dict(
      num_agents=a.agents,  # 2: agent 0 aux, agent 1 main; 1: the GRPO baseline
      num_turns=num_turns,  # the env stops after the T-th joint action
      external_mode="level_feedback",  # | level_passed | passed | plain | expert_edits | bandit
      sandbox_slice="1",  # asserts the feedback runs: '1' first, '-1' last, 'all'
      prompt_style="chat",  # 'chat' (feedback block only) | 'comlrl' | 'comlrl_v2'
      reward_shift=ref["shift"],  # processed reward = raw * scale + shift (<= 0)
      reward_scale=1.0,
      expert="",  # expert_edits: import path of a callable prompt -> str or a TextGenerator
      timeout_per_assert_s=10.0,  # sandbox alarm per assert (3 timeouts skip the rest)
      max_timeouts=3,
  )
  c.env.max_turns = num_turns
  c.env.max_tokens = 3072  # ledger tokens per agent thread (turn-2 context is ~1-1.5k)
  c.env.react_timeout_s = 120.0  # reward + feedback may each take 3 x 10 s of timeouts

  c.tasks.source = "humaneval"
  c.tasks.train_split = "train"  # test[33:163]
  c.tasks.eval_split = "eval"  # test[:32]
  c.tasks.kwargs = dict(limit=0, max_prompt_chars=0)  # 0: every problem of the split

  c.tree.num_turns = num_turns
  c.tree.num_generations = 4
  c.tree.num_agents = a.agents
  c.agents.share_policy = a.agents == 1  # 2 agents: one policy each (aux, main), as CoMLRL
  c.tree.joint_mode = "align"
  c.tree.termination_threshold = ref["tau"]
  c.tree.discount = 0.9
  c.tree.advantage_mode = "mean"
  c.tree.advantage_std_norm = False
  c.tree.branch_on = "every_turn"

  c.sampling.temperature = ref["temperature"]
  c.sampling.top_p = ref["top_p"]
  c.sampling.top_k = 50
  c.sampling.max_new_tokens = 256

  c.reward.outcome_weight = 1.0  # the last turn's grade
  c.reward.shaping_weight = 1.0  # earlier turns' grades: every joint action weighs the same
  c.reward.step_penalty = 0.0
  c.reward.tool_penalty = 0.0

  c.loss.algorithm = "reinforce"
  c.loss.aggregation = "seq-mean-token-sum"
  c.loss.kl_coef = 0.0

  c.optim.learning_rate = 2e-5
  c.optim.warmup_steps = 0
  c.optim.schedule = "constant"
  c.optim.weight_decay = 0.0
  c.optim.grad_clip_norm = 0.0  # the reference does not clip

  c.sft.steps = 0
  # No warm-up: with --config.model.lora.rank=16 the adapters train over the pretrained
  # base of model.path, which checkpoints name by sha256 and never copy.
  c.rl.steps = 780  # 6 epochs x 130 problems
  c.rl.roots_per_step = 1  # one task per step, as the reference
  c.rl.length_buckets = (512, 1024, 2048, 4096)
  c.rl.dump_every = 10
  c.eval.every = 4
  c.eval.num_tasks = 4
  c.eval.greedy = True
  c.eval.success_threshold = ref["tau"]  # a path succeeds when its last reward beats tau
  c.checkpoint.every = 200
  c.checkpoint.keep = 3

  if a.smoke:  # seconds on a CPU: the whole pipeline on a tiny byte-level model
    apply_smoke(c, sft_steps=0, roots_per_step=1, eval_tasks=1)
    c.model.path = ""
    c.model.dtype = ""
    c.tokenizer.kind = "byte"
    c.tokenizer.chat_format = "compact"
    c.tasks.kwargs.max_prompt_chars = 150  # train: 4 problems, eval: 1
    c.env.max_tokens = 1536
    c.env.kwargs.timeout_per_assert_s = 2.0
    c.sampling.max_new_tokens = 16
    c.rl.length_buckets = (1024, 2048)
    c.optim.learning_rate = 1e-3
  return c
