"""From a ConfigDict to validated frozen configs and the run's components.

Only this module and the entry points read the ConfigDict (docs/design.md, Conventions): `build`
turns it into small frozen dataclasses and fails with a message naming the
field on any invalid value or unsafe combination, before any compute. The
`make_*` functions then build the tokenizer, model, environment factory and
task sources from an `Experiment`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import ml_collections

from mtrl_jax import data, distributed, sharding
from mtrl_jax.registry import import_object
from mtrl_jax.envs import FaultPolicy, StepLimits, resolve_factory
import mtrl_jax.tasks  # noqa: F401  (registers the built-in tasks: config names resolve)
from mtrl_jax.envs.reward import RewardConfig, check_reward_dominance
from mtrl_jax.losses import CORRECTIONS, LossConfig
from mtrl_jax.models.config import ModelConfig, get_preset
from mtrl_jax.rollout import TreeConfig, plan_tree
from mtrl_jax.sampling import SamplingConfig
from mtrl_jax.train.config import (AgentsConfig, CheckpointConfig, EngineGroup, EvalConfig,
                                   RLConfig, SFTConfig)
from mtrl_jax.train.optim import OptimConfig
from mtrl_jax.train.step import StepConfig


@dataclasses.dataclass(frozen=True)
class Experiment:
  """Everything a run needs, validated."""

  model: ModelConfig
  model_path: str
  tokenizer_kind: str
  extra_specials: str
  chat_format: str
  mesh: sharding.MeshConfig
  env_factory: str
  env_kwargs: tuple
  limits: StepLimits
  task_source: str
  train_split: str
  eval_split: str
  task_kwargs: tuple
  tree: TreeConfig
  sampling: SamplingConfig
  reward: RewardConfig
  loss: LossConfig
  optim: OptimConfig
  sft_optim: OptimConfig
  step: StepConfig
  seed: int
  rl: RLConfig
  sft: SFTConfig
  eval: EvalConfig
  checkpoint: CheckpointConfig
  agents: AgentsConfig
  engine: EngineGroup = EngineGroup()
  strip_thinking: bool = False
  curriculum: data.CurriculumConfig = data.CurriculumConfig()
  distributed: distributed.DistributedConfig = distributed.DistributedConfig()


def _fields(cd, cls, **extra):
  kw = dict(cd.items()) if cd is not None else {}
  kw.update(extra)
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(kw) - names)
  if unknown:
    raise ValueError(f"{cls.__name__}: unknown config keys {unknown}; allowed: {sorted(names)}")
  return cls(**kw)


def build(config: ml_collections.ConfigDict) -> Experiment:
  """Validates `config` and returns the frozen experiment description."""
  c = config
  check_fields(c)
  if c.model.path:
    model = ModelConfig.from_hf_json(c.model.path)
  else:
    model = get_preset(c.model.preset)
    if c.model.num_layers:
      model = model.replace(num_layers=int(c.model.num_layers))
  overrides = {"remat": bool(c.model.remat), "attention": c.model.attention}
  if c.model.dtype:
    overrides.update(dtype=c.model.dtype, param_dtype=c.model.dtype)
  model = model.replace(**overrides)
  if c.tokenizer.kind not in ("byte", "hf"):
    raise ValueError(f"config tokenizer.kind={c.tokenizer.kind!r}; allowed: ['byte', 'hf']")
  if c.tokenizer.kind == "hf" and not c.model.path:
    raise ValueError("config tokenizer.kind='hf' needs model.path (its tokenizer.json)")
  if c.tokenizer.chat_format not in ("compact", "chatml"):
    raise ValueError(f"config tokenizer.chat_format={c.tokenizer.chat_format!r}; "
                     "allowed: ['compact', 'chatml']")
  if not isinstance(c.tokenizer.strip_thinking, bool):
    raise ValueError(f"config tokenizer.strip_thinking={c.tokenizer.strip_thinking!r}; "
                     "allowed: True or False")
  tree = _fields(c.tree, TreeConfig)
  sampling = _fields(c.sampling, SamplingConfig)
  rl = _fields(c.rl, RLConfig)
  sft = _fields(c.sft, SFTConfig)
  buckets = rl.length_buckets
  loss = _fields(c.loss, LossConfig, max_len=int(c.loss.max_len) or rl.max_length)
  total = max(rl.steps * rl.updates_per_step, 1)
  optim = OptimConfig(learning_rate=c.optim.learning_rate, warmup_steps=c.optim.warmup_steps,
                      total_steps=max(total, c.optim.warmup_steps + 1),
                      schedule=c.optim.schedule, weight_decay=c.optim.weight_decay,
                      grad_clip_norm=c.optim.grad_clip_norm)
  sft_optim = OptimConfig(learning_rate=sft.learning_rate, total_steps=max(sft.steps, 1),
                          grad_clip_norm=c.optim.grad_clip_norm)
  limits = StepLimits(max_turns=c.env.max_turns, max_tokens=c.env.max_tokens,
                      react_timeout_s=c.env.react_timeout_s,
                      faults=FaultPolicy(max_retries=c.env.max_retries,
                                         tool_timeout=c.env.tool_timeout))
  if limits.max_tokens and limits.max_tokens + sampling.max_new_tokens > max(buckets):
    raise ValueError(f"config env.max_tokens={limits.max_tokens} + sampling.max_new_tokens="
                     f"{sampling.max_new_tokens} exceeds the largest rl.length_buckets "
                     f"entry {max(buckets)}: rows would not fit")
  reward = _fields(c.reward, RewardConfig)
  exp = Experiment(
      model=model, model_path=c.model.path, tokenizer_kind=c.tokenizer.kind,
      extra_specials=c.tokenizer.extra_specials, chat_format=c.tokenizer.chat_format,
      mesh=_fields(c.mesh, sharding.MeshConfig), env_factory=c.env.factory,
      env_kwargs=tuple(sorted(dict(c.env.kwargs).items())), limits=limits,
      task_source=c.tasks.source, train_split=c.tasks.train_split,
      eval_split=c.tasks.eval_split, task_kwargs=tuple(sorted(dict(c.tasks.kwargs).items())),
      tree=tree, sampling=sampling, reward=reward, loss=loss, optim=optim, sft_optim=sft_optim,
      step=_fields(c.step, StepConfig), seed=c.seed, rl=rl, sft=sft,
      eval=_fields(c.eval, EvalConfig), checkpoint=_fields(c.checkpoint, CheckpointConfig),
      agents=_fields(c.agents, AgentsConfig), engine=_fields(c.get("engine"), EngineGroup),
      strip_thinking=c.tokenizer.strip_thinking,
      curriculum=_fields(c.get("curriculum"), data.CurriculumConfig),
      distributed=distributed_config(c))
  check_agents(exp)
  check_processes(exp)
  # Size the tree before launch: a config that cannot fit fails here.
  plan_tree(tree, rl.roots_per_step, max_prompt_len=limits.max_tokens or max(buckets),
            max_new_tokens=sampling.max_new_tokens, max_generations=rl.max_generations)
  check_imports(exp)
  check_environment(exp)
  check_curriculum(exp)
  return exp


# ------------------------------------------------------------------ validation
# Modes whose baseline comes from siblings: with one sibling every advantage is 0.
_SIBLING_BASELINES = ("mean", "max", "rloo")
_MODEL_DTYPES = ("", "float32", "bfloat16")


class ConfigError(ValueError):
  """A config that cannot run; the message is one line naming the field, the
  value and what is allowed (entry points print it without a traceback)."""


def validate(config: ml_collections.ConfigDict) -> Experiment:
  """`build`, with every refusal raised as a one-line `ConfigError`.

  Entry points call this before building a model or writing a file.
  """
  try:
    return build(config)
  except ConfigError:
    raise
  except (ValueError, TypeError, LookupError, OSError) as e:
    raise ConfigError(" ".join(str(e).split())) from e


def check_fields(c: ml_collections.ConfigDict):
  """Single-field and cross-field checks that need nothing but the config."""
  if c.model.dtype not in _MODEL_DTYPES:
    raise ValueError(f"config model.dtype={c.model.dtype!r}; allowed: {list(_MODEL_DTYPES)} "
                     "('' keeps the preset's / checkpoint's dtype)")
  if not isinstance(c.model.num_layers, int) or c.model.num_layers < 0 or (
      c.model.num_layers and c.model.path):
    raise ValueError(f"config model.num_layers={c.model.num_layers!r}; allowed: 0 (the preset's "
                     "or checkpoint's depth) or a positive int with model.path=''")
  if c.model.path and not os.path.isfile(os.path.join(c.model.path, "config.json")):
    raise ValueError(f"config model.path={c.model.path!r} has no config.json; allowed: a local "
                     "HF-format checkpoint directory, or '' for model.preset")
  if c.loss.is_correction not in CORRECTIONS:
    raise ValueError(f"config loss.is_correction={c.loss.is_correction!r}; allowed: "
                     f"{list(CORRECTIONS)}")
  cap = c.loss.is_cap
  if isinstance(cap, bool) or not isinstance(cap, (int, float)) or not 1 < cap < float("inf"):
    raise ValueError(f"config loss.is_cap={cap!r}; allowed: a finite number > 1 (ratios are "
                     "kept in [1/is_cap, is_cap])")
  if c.tree.num_generations == 1 and c.tree.advantage_mode in _SIBLING_BASELINES:
    raise ValueError(f"config tree.num_generations=1 with tree.advantage_mode="
                     f"{c.tree.advantage_mode!r}: a sibling baseline of one sample makes every "
                     f"advantage 0; allowed: num_generations >= 2, or advantage_mode='raw'")


class _Resolving:
  """Turns an error while resolving user code into one `ValueError` naming the field.

  `what` is the field and its value ("env.factory='x'"); `allowed` is added
  unless the underlying message already lists what is allowed.
  """

  def __init__(self, what: str, allowed: str):
    self.what, self.allowed = what, allowed

  def __enter__(self):
    return self

  def __exit__(self, kind, err, tb):
    if kind is None or not issubclass(kind, (ValueError, TypeError, ImportError,
                                              AttributeError, LookupError, OSError)):
      return False
    msg = str(err) if kind is ValueError else f"{kind.__name__}: {err}"
    if "allowed" not in msg and "registered" not in msg:
      msg += f"; allowed: {self.allowed}"
    raise ValueError(f"config {self.what}: {msg}") from err


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
    raise ValueError(f"config rl.roots_per_step={exp.rl.roots_per_step} with {n} processes; "
                     f"allowed: a multiple of {n} (every process takes an equal share)")
  data_shards = exp.mesh.shape(jax.device_count())
  if (data_shards[0] * data_shards[1]) % n:
    raise ValueError(f"config mesh data x fsdp={data_shards[0] * data_shards[1]} with {n} "
                     f"processes; allowed: a multiple of {n} (each process holds a block of rows)")
  if ((exp.sft.steps or exp.sft.mix_every)
      and exp.sft.batch_size % (data_shards[0] * data_shards[1])):
    raise ValueError(f"config sft.batch_size={exp.sft.batch_size} with {n} processes; allowed: "
                     f"a multiple of data x fsdp={data_shards[0] * data_shards[1]}")
  if not exp.agents.share_policy:
    raise ValueError(f"config agents.share_policy=False with {n} processes; allowed: True "
                     "(stacked per-agent batches are not assembled across processes yet)")
  if exp.rl.max_staleness:
    raise ValueError(f"config rl.max_staleness={exp.rl.max_staleness} with {n} processes; "
                     "allowed: 0 (a rollout's collectives must not interleave with the update's)")


def check_agents(exp: Experiment):
  """Separate policies: one entry per agent, every agent of the top-level architecture."""
  exp.agents.check(exp.tree.num_agents)
  if exp.sft.mix_every and not exp.agents.share_policy:
    raise ValueError(f"config sft.mix_every={exp.sft.mix_every} with agents.share_policy=False; "
                     "allowed: 0 (SFT steps mixed into RL are built for one shared policy)")
  m = exp.model
  same = dict(remat=m.remat, attention=m.attention, dtype=m.dtype, param_dtype=m.param_dtype)
  for a, preset in enumerate(exp.agents.presets):
    if not preset:
      continue
    cfg = get_preset(preset).replace(**same)
    if not exp.model_path:  # a from-scratch model's vocabulary is fitted to the tokenizer
      cfg = cfg.replace(vocab_size=m.vocab_size)
    if cfg != m:
      raise ValueError(f"config agents.presets[{a}]={preset!r}: its architecture differs from "
                       "the top-level model's; allowed: '' or a preset of the same architecture "
                       "(agents are stacked in one program; one program per agent for "
                       "different architectures is not built)")
  for a, path in enumerate(exp.agents.paths):
    if not path:
      continue
    if not os.path.isfile(os.path.join(path, "config.json")):
      raise ValueError(f"config agents.paths[{a}]={path!r} has no config.json; allowed: a local "
                       "HF-format checkpoint directory, or '' for the top-level model")
    cfg = ModelConfig.from_hf_json(path).replace(**same)
    if cfg != exp.model:
      raise ValueError(f"config agents.paths[{a}]={path!r}: its architecture differs from the "
                       "top-level model's; allowed: the same architecture for every agent (agents "
                       "are stacked in one program; one program per agent for different "
                       "architectures is not built)")


def check_imports(exp: Experiment):
  """Resolves the import paths the run will call later (SFT data, tokenizer specials)."""
  if exp.sft.conversations:
    with _Resolving(f"sft.conversations={exp.sft.conversations!r}",
                    "'pkg.module:fn' with fn(task) -> [(role, content), ...]"):
      fn = import_object(exp.sft.conversations, "sft.conversations")
      if not callable(fn):
        raise TypeError(f"{fn!r} is not callable")
  if exp.tokenizer_kind == "byte" and exp.extra_specials:
    with _Resolving(f"tokenizer.extra_specials={exp.extra_specials!r}",
                    "'pkg.module:NAME' naming a tuple of strings"):
      specials = import_object(exp.extra_specials, "tokenizer.extra_specials")
      if isinstance(specials, str) or not all(isinstance(x, str) for x in specials):
        raise TypeError(f"{specials!r} is not a tuple of strings")


def check_environment(exp: Experiment):
  """Builds the factory (and the graders or experts its kwargs name), both task
  splits and one environment from the first train task; its agent count must
  equal `tree.num_agents`.

  Runs before any model is built, so a wrong factory, task source or agent
  count fails in one line instead of at the first rollout after SFT.
  """
  with _Resolving(f"env.factory={exp.env_factory!r} (env.kwargs={dict(exp.env_kwargs)})",
                  "a registered name or 'pkg.module:Factory' taking env.kwargs"):
    factory = resolve_factory(exp.env_factory, **dict(exp.env_kwargs))
  sources = {}
  for field, split in (("tasks.train_split", exp.train_split),
                       ("tasks.eval_split", exp.eval_split)):
    with _Resolving(f"tasks.source={exp.task_source!r} with {field}={split!r}",
                    "a registered name or 'pkg.module:fn(split, **tasks.kwargs)' "
                    "serving that split"):
      sources[field] = make_task_source(exp, split)
      if len(sources[field]) == 0:
        raise ValueError("the split has no tasks")
  task = dict(sources["tasks.train_split"][0], task_index=0)
  with _Resolving(f"env.factory={exp.env_factory!r} on the first task of tasks.source="
                  f"{exp.task_source!r}", "a factory whose environments take these tasks"):
    env = factory.create_environment(task)
  n = getattr(env, "num_agents", 1)
  if hasattr(env, "close"):
    env.close()
  declared = getattr(factory, "num_agents", None)
  if declared is not None and declared != n:
    raise ValueError(f"config env.factory={exp.env_factory!r}: the factory declares "
                     f"num_agents={declared} but its environments have {n}; allowed: equal "
                     "counts (fix the factory)")
  if n != exp.tree.num_agents:
    raise ValueError(f"config tree.num_agents={exp.tree.num_agents}; the environments of "
                     f"env.factory={exp.env_factory!r} have {n} agent(s); allowed: {n}")


def check_curriculum(exp: Experiment):
  """With a curriculum, the task source must serve every level of the train split."""
  cur = exp.curriculum
  if not cur.enabled:
    return
  if cur.level_key in dict(exp.task_kwargs):
    raise ValueError(f"config curriculum.level_key={cur.level_key!r} is also set in "
                     "tasks.kwargs; allowed: the curriculum alone sets it")
  for level in range(cur.num_levels):
    with _Resolving(f"curriculum.num_levels={cur.num_levels}: tasks.source="
                    f"{exp.task_source!r} with {cur.level_key}={level}",
                    f"a task source taking {cur.level_key}=0 .. num_levels - 1"):
      if len(make_level_source(exp, level)) == 0:
        raise ValueError("the level has no tasks")


def make_level_source(exp: Experiment, level: int):
  """The train split's task source at curriculum level `level`."""
  kwargs = {**dict(exp.task_kwargs), exp.curriculum.level_key: level}
  return data.resolve_task_source(exp.task_source, exp.train_split, **kwargs)


def make_train_stream(exp: Experiment, train_tasks):
  """The RL loop's task stream: a `data.CurriculumStream` when `curriculum.enabled`,
  else a `data.TaskStream` over `train_tasks`. Both checkpoint via state()/restore()."""
  if exp.curriculum.enabled:
    return data.CurriculumStream(lambda level: make_level_source(exp, level), exp.curriculum,
                                 seed=exp.seed)
  return data.TaskStream(train_tasks, seed=exp.seed)


def save_config(config: ml_collections.ConfigDict, workdir: str) -> str:
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, "config.json")
  with open(path, "w") as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))
  return path


# ------------------------------------------------------------------ components
def make_tokenizer(exp: Experiment):
  from mtrl_jax import text
  if exp.tokenizer_kind == "hf":
    tok = text.HFTokenizer.from_dir(exp.model_path)
  else:
    extra = tuple(import_object(exp.extra_specials)) if exp.extra_specials else ()
    tok = text.ByteTokenizer(extra_specials=extra)
  if tok.vocab_size > exp.model.vocab_size:
    raise ValueError(f"tokenizer vocab_size={tok.vocab_size} exceeds the model's "
                     f"vocab_size={exp.model.vocab_size}")
  fmt = text.chatml(tok) if exp.chat_format == "chatml" else text.compact(tok)
  return tok, text.ChatRenderer(tok, fmt, strip_thinking=exp.strip_thinking)


def fit_vocab(exp: Experiment, tokenizer) -> Experiment:
  """A from-scratch model gets exactly the tokenizer's vocabulary.

  Logits of ids the tokenizer cannot decode would only waste compute and
  could be sampled; checkpoints keep their own (padded) vocabulary.
  """
  if exp.model_path or exp.model.vocab_size == tokenizer.vocab_size:
    return exp
  return dataclasses.replace(exp, model=exp.model.replace(vocab_size=tokenizer.vocab_size))


def make_model(exp: Experiment, mesh, path: str = ""):
  """The policy model: from `path` (an agent's checkpoint), `model.path`, or the preset."""
  from mtrl_jax import models
  if path or exp.model_path:
    from mtrl_jax.models import loading
    return loading.from_pretrained(path or exp.model_path, mesh=mesh)
  return models.create_model(exp.model, seed=exp.seed, mesh=mesh)


def make_factory(exp: Experiment):
  """The environment factory; warns when the reward weights let penalties or
  shaping outweigh the outcome range the factory declares."""
  factory = resolve_factory(exp.env_factory, **dict(exp.env_kwargs))
  steps = exp.limits.max_turns or 1
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    check_reward_dominance(exp.reward, max_steps=steps, max_invalid=steps,
                           outcome_range=factory.outcome_range,
                           max_graded=factory.max_graded_turns(dict(exp.task_kwargs)))
  return factory


def make_task_source(exp: Experiment, split: str):
  return data.resolve_task_source(exp.task_source, split, **dict(exp.task_kwargs))


def describe(exp: Experiment) -> str:
  """A one-screen summary printed at start."""
  d = {"model": f"{exp.model.family} L{exp.model.num_layers} D{exp.model.d_model} "
                f"V{exp.model.vocab_size} ({exp.model.num_params() / 1e6:.2f}M params)",
       "tree": f"T={exp.tree.num_turns} G={exp.tree.num_generations} N={exp.tree.num_agents} "
               f"{exp.tree.joint_mode} branch_on={exp.tree.branch_on}",
       "loss": f"{exp.loss.algorithm} {exp.loss.aggregation} kl={exp.loss.kl_coef}",
       "env": exp.env_factory, "tasks": exp.task_source}
  return json.dumps(d, indent=1)
