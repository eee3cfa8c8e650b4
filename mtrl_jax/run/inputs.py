"""The config groups of what a run is made from: the model, its tokenizer, the
environment and the tasks (docs/design.md section 1: what a researcher brings).

Like the groups of `run/config.py`, each frozen dataclass mirrors its
ConfigDict group field for field, carries the base config's defaults and
refuses a bad value in one line naming the field. A group may hold what its
fields resolve to (`ModelGroup.arch`, `EnvConfig.limits`); those are not
config fields.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

from mtrl_jax.envs import FaultPolicy, StepLimits
from mtrl_jax.models.config import LoraConfig, ModelConfig
from mtrl_jax.rollout.workers import check_workers

_MODEL_DTYPES = ("", "float32", "bfloat16")


def kwargs_pairs(value) -> tuple:
  """A keyword-argument group ({} in the config) as sorted (name, value) pairs."""
  return tuple(sorted(dict(value).items()))


@dataclasses.dataclass(frozen=True)
class ModelGroup:
  """The policy model (`config.model`) and the architecture it resolves to.

  Attributes:
    preset: a `mtrl_jax.models.config.PRESETS` name (ignored when `path` is set).
    num_layers: > 0: the preset's depth replaced by this many blocks (0: the
      preset's or checkpoint's own).
    path: a local HF-format checkpoint directory (config.json + safetensors);
      '' builds `preset` from scratch.
    dtype: '' keeps the preset's / checkpoint's dtype; 'float32' or 'bfloat16'.
    remat: rematerialise blocks in the backward pass.
    attention: training attention, 'xla' (any device) or 'cudnn' (GPU fused
      flash attention, bfloat16).
    embed_init: a model built from scratch draws its embedding with standard
      deviation 1 ('unit') or 1/sqrt(d_model) ('scaled': unit-scale logits at
      init, a warm-up that moves a fresh model; docs/internals.md,
      "Initialisation"); every agent's preset too. A checkpoint's is loaded.
    lora: low-rank adapters over the frozen model (`models.config.LoraConfig`:
      rank, alpha, targets, init_from; rank 0, the default, trains every
      weight); a group in the config, its `LoraConfig` here.
    arch: the architecture the fields above give (set by validation, not a
      config field); a from-scratch model's vocabulary is the tokenizer's.
  """

  preset: str = "small"
  num_layers: int = 0
  path: str = ""
  dtype: str = ""
  remat: bool = ModelConfig.remat
  attention: str = ModelConfig.attention
  embed_init: str = ModelConfig.embed_init
  lora: LoraConfig = dataclasses.field(default_factory=lambda: dataclasses.asdict(LoraConfig()))
  arch: Optional[ModelConfig] = None

  def __post_init__(self):
    if not isinstance(self.lora, LoraConfig):  # the config's group (a ConfigDict or dict)
      names = [f.name for f in dataclasses.fields(LoraConfig)]
      given = dict(self.lora.items()) if hasattr(self.lora, "items") else None
      if given is None or set(given) - set(names):
        raise ValueError(
            f"config model.lora has keys {sorted(given or ())}; allowed: a group of {names}"
        )
      object.__setattr__(self, "lora", LoraConfig(**given))
    if self.dtype not in _MODEL_DTYPES:
      raise ValueError(
          f"config model.dtype={self.dtype!r}; allowed: {list(_MODEL_DTYPES)} "
          "('' keeps the preset's / checkpoint's dtype)"
      )
    if (
        not isinstance(self.num_layers, int)
        or self.num_layers < 0
        or (self.num_layers and self.path)
    ):
      raise ValueError(
          f"config model.num_layers={self.num_layers!r}; allowed: 0 (the preset's "
          "or checkpoint's depth) or a positive int with model.path=''"
      )
    if self.path and not os.path.isfile(os.path.join(self.path, "config.json")):
      raise ValueError(
          f"config model.path={self.path!r} has no config.json; allowed: a local "
          "HF-format checkpoint directory, or '' for model.preset"
      )


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
  """The policy's tokenizer and chat format (`config.tokenizer`).

  Attributes:
    kind: 'byte' (tiny from-scratch models) or 'hf' (the tokenizer.json of
      `model.path`).
    extra_specials: import path of a tuple of extra byte-tokenizer specials
      ('pkg.module:NAME'; '' for none).
    chat_format: 'compact' (byte models: one special token per role) or
      'chatml' (Qwen-style).
    strip_thinking: Qwen3-style: earlier assistant turns lose their <think>
      blocks once a user turn follows.
  """

  kind: str = "byte"
  extra_specials: str = ""
  chat_format: str = "compact"
  strip_thinking: bool = False

  def __post_init__(self):
    if self.kind not in ("byte", "hf"):
      raise ValueError(f"config tokenizer.kind={self.kind!r}; allowed: ['byte', 'hf']")
    if self.chat_format not in ("compact", "chatml"):
      raise ValueError(
          f"config tokenizer.chat_format={self.chat_format!r}; allowed: ['compact', 'chatml']"
      )
    if not isinstance(self.strip_thinking, bool):
      raise ValueError(
          f"config tokenizer.strip_thinking={self.strip_thinking!r}; allowed: True or False"
      )


@dataclasses.dataclass(frozen=True)
class EnvConfig:
  """The environment factory and the framework's limits on a trajectory (`config.env`).

  Attributes:
    factory: a registered factory name or 'pkg.module:Factory'.
    kwargs: keyword arguments of the factory ({} in the config; kept as
      sorted (name, value) pairs).
    max_turns: policy messages per trajectory (past it: a truncation).
    max_tokens: ledger tokens per trajectory (past it: a truncation).
    react_timeout_s: wall-clock limit of one react_to call.
    max_retries: retries of an infrastructure fault before the step is masked.
    tool_timeout: a timed-out tool call 'mask's its step, or 'tell's the
      policy and goes on.
    max_tool_output_chars: characters of one tool turn; longer output is cut,
      with a note, before it is tokenised (None: 16 x max_tokens).
    workers: where environment steps run: 'threads' (a thread pool in the
      engine's process) or 'processes' (a pool of worker processes, for
      environments whose Python would hold the engine's interpreter lock; the
      environment must pickle and must not sample on the engine, checked at
      start; a dead worker masks its steps as infrastructure faults).
      docs/running.md, "Environment workers".
    max_concurrency: most environment steps (joint actions, all agents
      together) in flight at once in a rollout (training and evaluation
      alike); also the pool's size (0: unbounded, with 32 threads or one
      process per CPU).
    limits: the `envs.StepLimits` of the fields above (not a config field).
  """

  factory: str = "calculator"
  kwargs: tuple = dataclasses.field(default_factory=dict)
  max_turns: int = 8
  max_tokens: int = 256
  react_timeout_s: float = 30.0
  max_retries: int = FaultPolicy.max_retries
  tool_timeout: str = FaultPolicy.tool_timeout
  max_tool_output_chars: Optional[int] = None
  workers: str = "threads"
  max_concurrency: int = 0
  limits: StepLimits = dataclasses.field(init=False, repr=False)

  def __post_init__(self):
    object.__setattr__(self, "kwargs", kwargs_pairs(self.kwargs))
    check_workers(self.workers, self.max_concurrency)
    object.__setattr__(
        self,
        "limits",
        StepLimits(
            max_turns=self.max_turns,
            max_tokens=self.max_tokens,
            react_timeout_s=self.react_timeout_s,
            faults=FaultPolicy(max_retries=self.max_retries, tool_timeout=self.tool_timeout),
            max_tool_output_chars=self.max_tool_output_chars,
        ),
    )


@dataclasses.dataclass(frozen=True)
class TasksConfig:
  """Where tasks come from (`config.tasks`).

  Attributes:
    source: a registered task source or 'pkg.module:fn(split, **kwargs)'.
    train_split: the split RL (and the SFT warm-up) draws from.
    eval_split: the held-out split.
    kwargs: keyword arguments of the source ({} in the config; kept as sorted
      (name, value) pairs).
  """

  source: str = "calculator"
  train_split: str = "train"
  eval_split: str = "eval"
  kwargs: tuple = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "kwargs", kwargs_pairs(self.kwargs))
