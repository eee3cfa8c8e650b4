"""From a ConfigDict to one validated, frozen `Experiment`: the run's validation.

Only this module and the entry points read the ConfigDict (docs/design.md,
Conventions). `build` turns each config group into its frozen dataclass and
fails with one line naming the field on any invalid value or unsafe
combination, before any compute (invariant 8): it resolves the model's
architecture, fits a from-scratch model's vocabulary to the tokenizer, groups
the agents by architecture and tokenizer (`exp.agents.team`, `run.groups`), and
builds the environment factory and both task splits once to see that they
work (`run/checks.py`: the first prompt fits the token budget, an
environment forks, micro-batches divide every batch, the success threshold).
`start` joins the run's processes and then validates, once per run. What a
run is built from an `Experiment` lives in `run/components.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import ml_collections

import mtrl_jax.tasks  # noqa: F401  (registers the built-in tasks: config names resolve)
from mtrl_jax import compile_cache, data, distributed, sharding
from mtrl_jax.envs.reward import RewardConfig
from mtrl_jax.losses import CORRECTIONS, LossConfig
from mtrl_jax.models.config import ModelConfig, get_preset
from mtrl_jax.rollout import TreeConfig, plan_tree
from mtrl_jax.run import budget, checks, groups
from mtrl_jax.run.config import (
    AgentsConfig,
    CheckpointConfig,
    EngineGroup,
    EvalConfig,
    RLConfig,
    SFTConfig,
)
from mtrl_jax.run.critic_config import CriticGroup
from mtrl_jax.run.inputs import EnvConfig, ModelGroup, TasksConfig, TokenizerConfig
from mtrl_jax.sampling import SamplingConfig
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import StepConfig


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything a run needs, validated: one field per config group, under the group's
  name (`exp.sft.check_every` is `config.sft.check_every`)."""

  seed: int
  model: ModelGroup  # `model.arch`: the resolved architecture, vocabulary fitted
  tokenizer: TokenizerConfig
  mesh: sharding.MeshConfig
  env: EnvConfig
  tasks: TasksConfig
  tree: TreeConfig
  sampling: SamplingConfig
  engine: EngineGroup
  reward: RewardConfig
  loss: LossConfig
  optim: OptimConfig  # `total_steps`: every RL update of the run
  step: StepConfig
  sft: SFTConfig
  rl: RLConfig
  eval: EvalConfig
  agents: AgentsConfig
  critic: CriticGroup
  curriculum: data.CurriculumConfig
  checkpoint: CheckpointConfig
  distributed: distributed.DistributedConfig


def _fields(cd, cls, **extra):
  kw = dict(cd.items()) if cd is not None else {}
  kw.update(extra)
  names = {f.name for f in dataclasses.fields(cls) if f.init}
  unknown = sorted(set(kw) - names)
  if unknown:
    raise ValueError(f"{cls.__name__}: unknown config keys {unknown}; allowed: {sorted(names)}")
  return cls(**kw)


def _architecture(model: ModelGroup) -> ModelConfig:
  """The model's architecture: its checkpoint's config.json (`model.path`) or its preset
  (cut to `model.num_layers`), with the model group's run settings."""
  if model.path:
    arch = ModelConfig.from_hf_json(model.path)
  else:
    arch = get_preset(model.preset)
    if model.num_layers:
      arch = arch.replace(num_layers=int(model.num_layers))
  overrides = {
      "remat": bool(model.remat),
      "attention": model.attention,
      "embed_init": model.embed_init,  # a checkpoint's weights are loaded, never drawn
  }
  if model.dtype:
    overrides.update(dtype=model.dtype, param_dtype=model.dtype)
  return arch.replace(**overrides)


def _optim(c: ml_collections.ConfigDict, rl: RLConfig) -> OptimConfig:
  """The optimizer group `c`; the schedule spans the run's updates (rl.steps x
  rl.updates_per_step, at least one past the warm-up)."""
  total = max(rl.steps * rl.updates_per_step, 1)
  return OptimConfig(
      learning_rate=c.learning_rate,
      warmup_steps=c.warmup_steps,
      total_steps=max(total, c.warmup_steps + 1),
      schedule=c.schedule,
      weight_decay=c.weight_decay,
      grad_clip_norm=c.grad_clip_norm,
  )


def build(config: ml_collections.ConfigDict) -> Experiment:
  """Validates `config` and returns the frozen experiment description."""
  c = config
  model = _fields(c.model, ModelGroup)
  check_fields(c)
  model = dataclasses.replace(model, arch=_architecture(model))
  tokenizer = _fields(c.tokenizer, TokenizerConfig)
  if tokenizer.kind == "hf" and not model.path:
    raise ValueError("config tokenizer.kind='hf' needs model.path (its tokenizer.json)")
  # The tree mixes each agent's reward by the agents group's team weight.
  tree = _fields(c.tree, TreeConfig, team_weight=c.agents.get("team_weight", 1.0))
  sampling = _fields(c.sampling, SamplingConfig)
  rl = _fields(c.rl, RLConfig)
  sft = _fields(c.sft, SFTConfig)
  buckets = rl.length_buckets
  loss = _fields(c.loss, LossConfig, max_len=int(c.loss.max_len) or rl.max_length)
  optim = _optim(c.optim, rl)
  env = _fields(c.env, EnvConfig)
  limits = env.limits
  if limits.max_tokens and limits.max_tokens + sampling.max_new_tokens > max(buckets):
    raise ValueError(
        f"config env.max_tokens={limits.max_tokens} + sampling.max_new_tokens="
        f"{sampling.max_new_tokens} exceeds the largest rl.length_buckets "
        f"entry {max(buckets)}: rows would not fit"
    )
  reward = _fields(c.reward, RewardConfig)
  exp = Experiment(
      seed=c.seed,
      model=model,
      tokenizer=tokenizer,
      mesh=_fields(c.mesh, sharding.MeshConfig),
      env=env,
      tasks=_fields(c.tasks, TasksConfig),
      tree=tree,
      sampling=sampling,
      engine=_fields(c.get("engine"), EngineGroup),
      reward=reward,
      loss=loss,
      optim=optim,
      step=_fields(c.step, StepConfig),
      sft=sft,
      rl=rl,
      eval=_fields(c.eval, EvalConfig),
      agents=_fields(c.agents, AgentsConfig),
      critic=_fields(c.get("critic"), CriticGroup),
      curriculum=_fields(c.get("curriculum"), data.CurriculumConfig),
      checkpoint=_fields(c.checkpoint, CheckpointConfig),
      distributed=distributed_config(c),
  )
  check_agents(exp)
  checkpoints = groups.read_checkpoints(exp)  # each agents.paths entry's, read once
  check_team(exp, groups.team_groups(exp, checkpoints))
  exp.critic.check(exp)
  if exp.critic.head:  # the critic is a value head on each policy
    exp = dataclasses.replace(
        exp, model=dataclasses.replace(exp.model, arch=exp.model.arch.replace(value_head=True))
    )
  checks.check_lora(exp)  # what adapters cannot be combined with; init_from fits the base
  check_processes(exp)
  # Size the tree before launch: a config that cannot fit fails here.
  plan_tree(
      tree,
      rl.roots_per_step,
      max_prompt_len=limits.max_tokens or max(buckets),
      max_new_tokens=sampling.max_new_tokens,
      max_generations=rl.max_generations,
  )
  checks.check_imports(exp)
  tokenizer = checks.make_tokenizer(exp)
  factory = checks.check_environment(exp, tokenizer)
  exp = dataclasses.replace(
      exp,
      eval=dataclasses.replace(exp.eval, success_threshold=checks.success_threshold(exp, factory)),
  )
  checks.check_microbatches(exp)
  checks.check_curriculum(exp)
  exp = fit_vocab(exp, tokenizer)
  # The agents' groups of the resolved architecture, from the checkpoints read above.
  team = groups.team_groups(exp, checkpoints)
  return dataclasses.replace(exp, agents=dataclasses.replace(exp.agents, team=team))


# ------------------------------------------------------------------ validation
# Modes whose baseline comes from siblings: with one sibling every advantage is 0.
_SIBLING_BASELINES = ("mean", "max", "rloo")


class ConfigError(ValueError):
  """A config that cannot run; the message is one line naming the field, the
  value and what is allowed (entry points print it without a traceback)."""


def validate(config: ml_collections.ConfigDict) -> Experiment:
  """`build`, with every refusal raised as a one-line `ConfigError`.

  Library callers validate with this; a run validates once, through `start`.
  """
  try:
    return build(config)
  except ConfigError:
    raise
  except (ValueError, TypeError, LookupError, OSError) as e:
    raise ConfigError(_one_line(e)) from e


def start(config: ml_collections.ConfigDict) -> Experiment:
  """Joins the run's processes (`config.distributed`; validation counts them), then
  validates: what a run does once, before any device is touched or file written.
  A tree whose KV cache and batch cannot fit the machine's memory is refused
  (`budget.check_memory`); process 0 prints the estimate and what is legal but
  probably not meant (`checks.advisories`, one `warning: ...` line each on stderr).

  Raises:
    ConfigError (one line) for a bad `config.distributed` or any other refusal.
  """
  try:
    distributed.initialize(distributed_config(config))
    compile_cache.setup(config.get("compile_cache", compile_cache.AUTO))  # before any compile
  except ConfigError:
    raise
  except ValueError as e:
    raise ConfigError(_one_line(e)) from e
  exp = validate(config)
  try:  # the tree's KV cache and batch must fit this machine's memory
    tree = budget.check_memory(exp)
  except ValueError as e:
    raise ConfigError(_one_line(e)) from e
  if distributed.is_writer():
    print(budget.describe(tree), flush=True)
    for line in checks.advisories(exp):
      print(f"warning: {line}", file=sys.stderr, flush=True)
  return exp


def _one_line(err: Exception) -> str:
  return " ".join(str(err).split())


def check_fields(c: ml_collections.ConfigDict):
  """Single-field and cross-field checks that need nothing but the config (the model
  group checks its own fields: `run.inputs.ModelGroup`)."""
  if c.loss.is_correction not in CORRECTIONS:
    raise ValueError(
        f"config loss.is_correction={c.loss.is_correction!r}; allowed: {list(CORRECTIONS)}"
    )
  cap = c.loss.is_cap
  if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 1 < cap < float("inf"):
    raise ValueError(
        f"config loss.is_cap={cap!r}; allowed: a finite number > 1 (ratios are "
        "kept in [1/is_cap, is_cap])"
    )
  if c.tree.joint_mode == "marginal" and c.tree.num_agents < 2:
    raise ValueError(
        f"config tree.joint_mode='marginal' with tree.num_agents="
        f"{c.tree.num_agents}: marginal credit averages over partners; allowed: "
        "tree.num_agents >= 2, or joint_mode 'align', 'cross'"
    )
  critic = c.get("critic", {}).get("kind", "none") != "none"  # its value is the baseline
  if c.tree.num_generations == 1 and c.tree.advantage_mode in _SIBLING_BASELINES and not critic:
    raise ValueError(
        f"config tree.num_generations=1 with tree.advantage_mode="
        f"{c.tree.advantage_mode!r}: a sibling baseline of one sample makes every "
        f"advantage 0; allowed: num_generations >= 2, advantage_mode='raw', or a "
        f"critic (critic.kind)"
    )


def distributed_config(c: ml_collections.ConfigDict) -> distributed.DistributedConfig:
  """`config.distributed`, validated (entry points read it before `jax.distributed` starts)."""
  return _fields(c.get("distributed"), distributed.DistributedConfig)


def check_processes(exp: Experiment):
  """Several processes: the shares and the row blocks must split evenly.

  Runs after `distributed.initialize`, so `jax.process_count()` is the run's.
  """
  if exp.distributed.mode == "off":
    return
  import jax

  n = jax.process_count()
  if exp.rl.roots_per_step % n:
    raise ValueError(
        f"config rl.roots_per_step={exp.rl.roots_per_step} with {n} processes; "
        f"allowed: a multiple of {n} (every process takes an equal share)"
    )
  data_shards = exp.mesh.shape(jax.device_count())
  if (data_shards[0] * data_shards[1]) % n:
    raise ValueError(
        f"config mesh data x fsdp={data_shards[0] * data_shards[1]} with {n} "
        f"processes; allowed: a multiple of {n} (each process holds a block of rows)"
    )
  if (exp.sft.steps or exp.sft.mix_every) and exp.sft.batch_size % (
      data_shards[0] * data_shards[1]
  ):
    raise ValueError(
        f"config sft.batch_size={exp.sft.batch_size} with {n} processes; allowed: "
        f"a multiple of data x fsdp={data_shards[0] * data_shards[1]}"
    )
  if not exp.agents.share_policy:
    raise ValueError(
        f"config agents.share_policy=False with {n} processes; allowed: True "
        "(stacked per-agent batches are not assembled across processes yet)"
    )
  if exp.rl.max_staleness:
    raise ValueError(
        f"config rl.max_staleness={exp.rl.max_staleness} with {n} processes; "
        "allowed: 0 (a rollout's collectives must not interleave with the update's)"
    )


def check_agents(exp: Experiment):
  """Separate policies: one entry per agent, each checkpoint and preset there."""
  exp.agents.check(exp.tree.num_agents)
  if exp.tree.num_agents == 1 and not exp.agents.share_policy:
    raise ValueError(
        "config agents.share_policy=False with tree.num_agents=1; allowed: True "
        "(one agent has one policy)"
    )
  if exp.tree.num_agents == 1 and exp.agents.team_weight != 1.0:
    raise ValueError(
        f"config agents.team_weight={exp.agents.team_weight!r} with tree.num_agents"
        "=1; allowed: 1.0 (one agent has no team to weigh its own grade against)"
    )
  if exp.sft.mix_every and not exp.agents.share_policy:
    raise ValueError(
        f"config sft.mix_every={exp.sft.mix_every} with agents.share_policy=False; "
        "allowed: 0 (SFT steps mixed into RL are built for one shared policy)"
    )
  if not all(exp.agents.trainable) and exp.model.lora.enabled and exp.sft.steps:
    raise ValueError(
        f"config agents.trainable={exp.agents.trainable!r} with model.lora.rank="
        f"{exp.model.lora.rank} and sft.steps={exp.sft.steps}: the warm-up trains "
        "the base every agent's adapters share, a frozen agent's too; allowed: "
        "sft.steps=0, every agent trainable, or model.lora.rank=0"
    )
  for a, path in enumerate(exp.agents.paths):
    if path and not os.path.isfile(os.path.join(path, "config.json")):
      raise ValueError(
          f"config agents.paths[{a}]={path!r} has no config.json; allowed: a local "
          "HF-format checkpoint directory, or '' for the top-level model"
      )
  for a, preset in enumerate(exp.agents.presets):
    if preset:
      get_preset(preset)  # an unknown name fails here, naming the presets


def check_team(exp: Experiment, team: tuple):
  """What a team of several architectures (`team`: its groups, `run.groups`) cannot be
  combined with."""
  if not team:
    return
  what = "agents of another architecture or tokenizer than the top-level model's"
  for field, value, why in (
      (
          "critic.kind",
          exp.critic.kind != "none" and exp.critic.kind,
          "a critic of a team of several architectures is not built",
      ),
      (
          "model.lora.init_from",
          exp.model.lora.init_from,
          "adapters to start from are read for agents of the top-level architecture",
      ),
  ):
    if value:
      raise ValueError(
          f"config {field}={value!r} with {what} (agents.presets / agents.paths): {why}; "
          "allowed: 0 / '' / 'none', or agents of the top-level architecture"
      )


def fit_vocab(exp: Experiment, tokenizer) -> Experiment:
  """A from-scratch model gets exactly the tokenizer's vocabulary (the preset's must
  hold it).

  Logits of ids the tokenizer cannot decode would only waste compute and
  could be sampled. A checkpoint keeps its own (padded) vocabulary; its
  tokenizer is checked against it where it is first read (`components.build`).
  """
  if exp.model.path:
    return exp
  arch = exp.model.arch
  vocab = tokenizer.vocab_size
  if vocab > arch.vocab_size:
    raise ValueError(
        f"config model.preset={exp.model.preset!r}: its vocab_size="
        f"{arch.vocab_size} is smaller than the tokenizer's {vocab}; allowed: a "
        "preset whose vocabulary holds the tokenizer's"
    )
  if arch.vocab_size == vocab:
    return exp
  return dataclasses.replace(
      exp, model=dataclasses.replace(exp.model, arch=arch.replace(vocab_size=vocab))
  )


def describe(exp: Experiment) -> str:
  """A one-screen summary printed at start."""
  m = exp.model.arch
  d = {
      "model": f"{m.family} L{m.num_layers} D{m.d_model} "
      f"V{m.vocab_size} ({m.num_params() / 1e6:.2f}M params)",
      "tree": f"T={exp.tree.num_turns} G={exp.tree.num_generations} N={exp.tree.num_agents} "
      f"{exp.tree.joint_mode} branch_on={exp.tree.branch_on}",
      "loss": f"{exp.loss.algorithm} {exp.loss.aggregation} kl={exp.loss.kl_coef}",
      "env": exp.env.factory,
      "tasks": exp.tasks.source,
  }
  return json.dumps(d, indent=1)
