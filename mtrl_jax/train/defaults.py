"""The base config of an ENVGRPO / ENVGSPO run: every field, documented.

`configs/base.py` (and through it every task config) and the recipe API
(`mtrl_jax.train.recipes`) start from `base_config()`; it lives in the package
so that a notebook or an installed copy has it without the repository's
`configs/` folder.
"""

import ml_collections
from ml_collections import config_dict


def base_config() -> ml_collections.ConfigDict:
  """The base ConfigDict of a run (every field documented); task configs override it."""
  c = ml_collections.ConfigDict()
  c.seed = 0  # parameter init, sampling and data order all derive from it

  c.model = dict(
      preset="small",  # a mtrl_jax.models.config.PRESETS name (ignored when path is set)
      num_layers=0,  # > 0: the preset's depth replaced by this many blocks (0: the preset's)
      path="",  # local HF-format checkpoint directory (config.json + safetensors)
      dtype="",  # '' keeps the preset's / checkpoint's dtype; 'float32' | 'bfloat16'
      remat=False,  # rematerialise blocks in the backward pass
      attention="xla",  # training attention: 'xla' (any device) | 'cudnn' (GPU fused flash, bf16)
  )
  c.tokenizer = dict(
      kind="byte",  # 'byte' (tiny from-scratch models) | 'hf' (tokenizer.json of model.path)
      extra_specials="",  # import path to a tuple of extra byte-tokenizer specials
      chat_format="compact",  # 'compact' (byte models) | 'chatml' (Qwen-style)
      strip_thinking=False,  # Qwen3-style: earlier assistant turns lose their <think> blocks
  )
  c.mesh = dict(data=-1, fsdp=1, tensor=1)  # device mesh; -1 takes the remaining devices

  c.env = dict(
      factory="calculator",  # registry name or 'pkg.module:Factory'
      kwargs={},  # keyword arguments of the factory
      max_turns=8,  # policy messages per trajectory (framework cap -> truncation)
      max_tokens=256,  # ledger tokens per trajectory (framework cap -> truncation)
      react_timeout_s=30.0,  # wall-clock limit of one react_to call
      max_retries=2,  # retries of infrastructure faults before masking
      tool_timeout="mask",  # timed-out tool call: 'mask' the step | 'tell' the policy, go on
  )
  c.tasks = dict(
      source="calculator",  # task source: registry name or 'pkg.module:fn(split, **kw)'
      train_split="train",
      eval_split="eval",
      kwargs={},  # keyword arguments of the task source
  )
  c.tree = dict(
      num_turns=2,  # T: tree depth (user turns with branch_on='user_turn')
      num_generations=4,  # G: samples per agent per node
      num_agents=1,  # N
      joint_mode="align",  # 'align' (G joint actions per node) | 'cross' (G^N)
      termination_threshold=config_dict.placeholder(float),  # tau; None: never
      discount=0.9,  # gamma of R = r + gamma * mean(child returns)
      advantage_mode="mean",  # 'mean' | 'raw' | 'max' | 'rloo'
      advantage_std_norm=False,  # divide sibling advantages by their std
      cross_return="sum",  # cross mode per-agent return: 'sum' (CoMLRL) | 'mean'
      branch_on="user_turn",  # 'every_turn' (CoMLRL) | 'user_turn' (tool calls don't branch)
      max_substeps=4,  # tool round trips inside one turn
      # 'tree' | 'chain' (G independent trajectories per root, branching only at the root;
      # equal sampled segments per root: G_chain = (G + ... + G^T) / T, see TreeConfig)
      shape="tree",
      # 'continuous' (no level barrier: a step starts when its own samples are done, a
      # child's requests when the step returns) | 'barrier' (level by level). Same trees.
      schedule="continuous",
  )
  c.sampling = dict(
      temperature=1.0,
      top_p=1.0,
      top_k=0,  # 0 disables
      max_new_tokens=48,  # per policy message
  )
  c.engine = dict(
      slots=0,  # KV slots per agent per batch shard (0: the widest level's samples)
      capacity=0,  # cache columns per slot (0: largest prompt bucket + max_new_tokens + 1)
      chunk=8,  # decode steps between admissions of new requests
      decode_rows=0,  # rows per decode call, fixed (0: min(slots, 64) on CPU, 256 on GPU)
      admit_rows=8,  # requests per prefill call, fixed
      reuse=True,  # continue requests from their parent's KV (False: prefill whole prompts)
  )
  c.reward = dict(
      outcome_weight=1.0,  # multiplies final grades (the outcome must dominate)
      step_penalty=-0.05,  # per environment step (<= 0)
      tool_penalty=-0.2,  # per invalid tool call / format error (<= 0)
      shaping_weight=0.0,  # multiplies per-turn grades (>= 0)
  )
  c.loss = dict(
      algorithm="grpo",  # 'grpo' | 'gspo' | 'reinforce'
      clip_eps_low=0.2,
      clip_eps_high=0.28,
      kl_coef=0.0,  # KL to the frozen reference; > 0 adds a reference forward
      kl_estimator="k3",  # 'k1' | 'k2' | 'k3'
      aggregation="token-mean",  # token-mean | seq-mean-token-mean | seq-mean-token-sum | seq-mean-token-sum-norm
      max_len=0,  # the fixed length of seq-mean-token-sum-norm (0: the largest length bucket)
      # Sampler/trainer gap (docs/internals.md "Off-policy corrections"): 'none' | 'tis'
      # (truncated IS) | 'mis_token' | 'mis_action' (masked IS, per token / per action)
      is_correction="none",
      is_cap=2.0,  # C > 1: TIS weights min(ratio, C); MIS keeps ratios in [1/C, C]
  )
  c.optim = dict(
      learning_rate=1e-4,
      warmup_steps=0,
      schedule="constant",  # 'constant' | 'cosine' (over rl.steps)
      weight_decay=0.0,
      grad_clip_norm=1.0,
  )
  c.step = dict(
      num_microbatches=1,  # exact gradient accumulation
      nonfinite="skip",  # 'skip' | 'halt' on a non-finite loss / gradient
  )
  c.sft = dict(
      steps=0,  # SFT warm-up updates before RL (0: none)
      batch_size=32,
      num_examples=2000,  # golden conversations rendered from train tasks
      conversations="",  # 'pkg.module:fn(task) -> [(role, content), ...]'
      learning_rate=3e-3,
      # Stop SFT early once greedy success on `check_tasks` train tasks held out
      # from the SFT data reaches this (0: run all steps). Keeps RL's starting
      # point in a band instead of at a seed-dependent spot on a steep curve.
      until_success=0.0,
      check_every=25,  # SFT steps between those checks
      check_tasks=100,
      # One NLL step on the golden conversations after every k-th RL update
      # (0: none), with its own AdamW moments at this constant rate (train.sft.SFTMix).
      mix_every=0,
      mix_learning_rate=5e-4,
  )
  c.rl = dict(
      steps=100,  # RL updates
      roots_per_step=8,  # tasks (tree roots) per RL step
      # Optimizer steps on each rollout batch (>1: off-policy ratios; 0: no RL
      # update, a control that still rolls out, evaluates and mixes in SFT).
      updates_per_step=1,
      zero_variance_filter=True,  # drop sibling groups whose advantages are all 0 (KL off)
      packing="tree",  # 'tree' (every token once, ancestor-only attention) | 'rows' (row per action)
      ref_reset_every=0,  # copy the policy into the reference every k steps (0: never)
      length_buckets=(64, 128, 256, 512),  # packed row lengths
      prompt_buckets=(),  # sampler prompt lengths (empty: length_buckets)
      precompile=True,  # compile every shape bucket before step 1 (none after)
      max_generations=200_000,  # planning budget: generations per step
      dump_every=10,  # rollout dump every k steps (0: never)
      # 0: on-policy. 1: step t+1's rollout runs during update t, sampling with the
      # parameters update t started from (one update stale; pair with loss.is_correction).
      max_staleness=0,
  )
  c.eval = dict(
      every=10,  # held-out evaluation every k RL steps (and at 0 and the end)
      num_tasks=100,
      greedy=True,  # greedy single-path evaluation
      sampled=False,  # also a sampled (temperature 1) evaluation
      success_threshold=0.0,  # a trajectory succeeds when its outcome is above this
  )
  c.agents = dict(
      share_policy=True,  # True: one policy for every agent; False: one policy per agent
      learning_rates=(),  # per-agent RL learning rates (empty: optim.learning_rate for all)
      paths=(),  # per-agent local HF checkpoints, same architecture ('' / empty: model)
      presets=(),  # per-agent model presets, same architecture ('' / empty: model)
  )
  c.curriculum = dict(
      # Move tasks.kwargs[level_key] by rolling rollout success (mtrl_jax.data.CurriculumStream);
      # held-out evaluation keeps tasks.kwargs as they are. Logged as curriculum/level.
      enabled=False,
      level_key="level",  # the task source keyword that selects a level (calculator: 'level')
      num_levels=5,  # levels 0 .. num_levels - 1 (the calculator has 5)
      # Level of the first RL step. After SFT, start where SFT trained: on the calculator
      # a start below it (level 0) cost every seed (docs/ablations.md, "Curriculum").
      start_level=0,
      window=10,  # k: RL steps whose rollout success is averaged
      raise_above=0.8,  # one level up when the mean over a full window is above this
      lower_below=0.3,  # one level down when it is below this
  )
  c.checkpoint = dict(
      every=10,  # save every k RL steps (and at the end)
      keep=3,  # latest checkpoints kept (besides workdir/best)
  )
  c.distributed = dict(
      # One process per host on jax.distributed (docs/multihost.md): 'off' | 'auto'
      # (jax.distributed.initialize() detects TPU pod slices and SLURM) | 'explicit'.
      mode="off",
      coordinator_address="",  # 'explicit': 'host:port' of process 0
      num_processes=0,  # 'explicit': how many processes
      process_id=-1,  # 'explicit': this process, in [0, num_processes)
      heartbeat_timeout_s=100,  # a silent process is declared dead; the others stop
      initialization_timeout_s=300,  # waiting for every process to join
      gather_timeout_s=600,  # a host all-gather waiting for the other processes
  )
  return c
