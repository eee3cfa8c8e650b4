"""The run's own config groups as frozen, validated dataclasses: engine, sft, rl, eval,
agents, checkpoint.

Each dataclass mirrors one group of the ConfigDict field for field and under the
same names, so `config.sft.check_every` is `exp.sft.check_every`, and its
defaults are the base config's (`run/defaults.py` builds the groups from
them). A bad value fails at construction with one line naming the field
(`config rl.steps=-1; allowed: an integer >= 0`). The model, tokenizer, env and
tasks groups are in `run/inputs.py`; the tree, sampling, reward, loss,
optimizer, step, mesh, curriculum and distributed groups have their own
dataclasses beside the code that uses them.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

from mtrl_jax.rollout.batching import PACKINGS
from mtrl_jax.run.inputs import kwargs_pairs


def _int_at_least(group: str, obj, names, low: int):
  for name in names:
    v = getattr(obj, name)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
      raise ValueError(f"config {group}.{name}={v!r}; allowed: an integer >= {low}")


def _buckets(group: str, name: str, value, allow_empty: bool) -> tuple:
  b = tuple(value)
  if (
      not all(isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in b)
      or list(b) != sorted(set(b))
      or (not b and not allow_empty)
  ):
    raise ValueError(
        f"config {group}.{name}={b!r}; allowed: increasing positive integers"
        + ("" if allow_empty else ", at least one")
    )
  return b


@dataclasses.dataclass(frozen=True)
class RLConfig:
  """The RL loop (`config.rl`).

  Attributes:
    steps: RL updates.
    roots_per_step: tasks (tree roots) per RL step.
    updates_per_step: optimizer steps on each rollout batch (> 1: off-policy
      ratios; 0: no RL update, a control that still rolls out, evaluates and
      mixes in SFT).
    zero_variance_filter: drop sibling groups whose advantages are all 0 (KL off).
    packing: 'tree' (every token once, ancestor-only attention) or 'rows' (a
      row per action).
    ref_reset_every: copy the policy into the reference every k steps (0: never).
    length_buckets: packed row lengths.
    prompt_buckets: sampler prompt lengths (empty: `length_buckets`).
    precompile: compile every shape bucket before step 1 (none after).
    max_generations: planning budget, generations per step.
    dump_every: a rollout dump every k steps (0: never).
    max_staleness: 0: on-policy; 1: step t + 1's rollout runs during update t,
      sampling with the parameters update t started from (pair it with
      `loss.is_correction`).
    halt_if_idle_steps: stop the run, with the reason, after this many
      consecutive steps that trained no sample (every group zero-variance,
      every trajectory truncated or every sample masked; each such step also
      warns on the console; a step on which every sample succeeded does not
      count); 0: never stop (the warnings stay).
    max_masked_fraction: stop the run, with the first fault's message, when
      more than this fraction of the joint actions of the last
      `masked_window` steps were masked (infrastructure faults: nothing to
      learn from); 1.0: never.
    masked_window: steps the masked fraction is taken over (checked once
      the window is full, and at the last step).
  """

  steps: int = 100
  roots_per_step: int = 8
  updates_per_step: int = 1
  zero_variance_filter: bool = True
  packing: str = "tree"
  ref_reset_every: int = 0
  length_buckets: tuple = (64, 128, 256, 512)
  prompt_buckets: tuple = ()
  precompile: bool = True
  max_generations: int = 200_000
  dump_every: int = 10
  max_staleness: int = 0
  halt_if_idle_steps: int = 10
  max_masked_fraction: float = 0.5
  masked_window: int = 5

  def __post_init__(self):
    _int_at_least("rl", self, ("steps", "ref_reset_every", "dump_every", "halt_if_idle_steps"), 0)
    _int_at_least("rl", self, ("masked_window",), 1)
    f = self.max_masked_fraction
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0.0 <= f <= 1.0:
      raise ValueError(
          f"config rl.max_masked_fraction={f!r}; allowed: a number in [0, 1] (1.0: never halt)"
      )
    if self.max_staleness not in (0, 1) or isinstance(self.max_staleness, bool):
      raise ValueError(
          f"config rl.max_staleness={self.max_staleness!r}; allowed: 0 (on-policy) "
          "or 1 (the next rollout samples during the update)"
      )
    _int_at_least("rl", self, ("roots_per_step", "max_generations"), 1)
    _int_at_least("rl", self, ("updates_per_step",), 0)  # 0: a control without RL updates
    object.__setattr__(
        self, "length_buckets", _buckets("rl", "length_buckets", self.length_buckets, False)
    )
    object.__setattr__(
        self, "prompt_buckets", _buckets("rl", "prompt_buckets", self.prompt_buckets, True)
    )
    if self.packing not in PACKINGS:
      raise ValueError(f"config rl.packing={self.packing!r}; allowed: {list(PACKINGS)}")

  @property
  def max_length(self) -> int:
    return max(self.length_buckets)


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  """The optional SFT warm-up, and SFT steps mixed into RL (`config.sft`).

  Attributes:
    steps: SFT warm-up updates before RL (0: none).
    batch_size: rows per SFT batch.
    num_examples: golden conversations rendered from the first train tasks.
    conversations: 'pkg.module:fn' with fn(task, **conversation_kwargs) ->
      [(role, content), ...].
    conversation_kwargs: keyword arguments of that function ({} in the
      config; kept as sorted (name, value) pairs), e.g. the turns and
      feedback mode its episodes show.
    learning_rate: the warm-up's constant AdamW rate.
    until_success: stop the warm-up once greedy success on `check_tasks` train
      tasks held out from the SFT data reaches this (0: run every step); keeps
      RL's starting point in a band instead of at a seed-dependent spot on a
      steep curve.
    check_every: SFT steps between those checks.
    check_tasks: train tasks of each check.
    mix_every: one NLL step on the golden conversations after every k-th RL
      update (0: none; `run.warmup.SFTMix`).
    mix_learning_rate: the constant rate of those steps (their own AdamW moments).
  """

  steps: int = 0
  batch_size: int = 32
  num_examples: int = 2000
  conversations: str = ""
  conversation_kwargs: tuple = dataclasses.field(default_factory=dict)
  learning_rate: float = 3e-3
  until_success: float = 0.0
  check_every: int = 25
  check_tasks: int = 100
  mix_every: int = 0
  mix_learning_rate: float = 5e-4

  def __post_init__(self):
    object.__setattr__(self, "conversation_kwargs", kwargs_pairs(self.conversation_kwargs))
    _int_at_least("sft", self, ("steps", "num_examples", "mix_every"), 0)
    _int_at_least("sft", self, ("batch_size", "check_every", "check_tasks"), 1)
    for name in ("learning_rate", "mix_learning_rate"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 and math.isfinite(v)):
        raise ValueError(f"config sft.{name}={v!r}; allowed: a finite number > 0")
    if not 0.0 <= self.until_success <= 1.0:
      raise ValueError(
          f"config sft.until_success={self.until_success!r}; allowed: a number in "
          "[0, 1] (0: run every step)"
      )
    kwargs = dict(self.conversation_kwargs)
    for name, value in (
        ("steps", self.steps),
        ("mix_every", self.mix_every),
        ("conversation_kwargs", kwargs),
    ):
      if value and not self.conversations:
        raise ValueError(
            f"config sft.{name}={value!r} needs sft.conversations; allowed: "
            "'pkg.module:fn' with fn(task) -> [(role, content), ...]"
        )


@dataclasses.dataclass(frozen=True)
class EvalConfig:
  """Held-out evaluation (`config.eval`).

  Attributes:
    every: evaluate every k RL steps (and at step 0 and the last).
    num_tasks: the first k tasks of the eval split.
    greedy: a greedy single-path evaluation.
    sampled: also a sampled (temperature 1) evaluation.
    success_threshold: a trajectory succeeds when the outcome of its last
      action (`reward.outcome_weight` x the final grades' mean score) is above
      this, in training rollouts and evaluations alike. None: the top of the
      environment factory's `outcome_range` (`success_threshold_for`):
      success is a full score, never a share of it. Set it explicitly where
      partial credit should count (a combined grader, graded test levels);
      validation refuses a threshold no outcome can pass, or one every
      outcome passes.
  """

  every: int = 10
  num_tasks: int = 100
  greedy: bool = True
  sampled: bool = False
  success_threshold: Optional[float] = None

  def __post_init__(self):
    _int_at_least("eval", self, ("every", "num_tasks"), 1)
    t = self.success_threshold
    if t is not None and (
        isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)
    ):
      raise ValueError(
          f"config eval.success_threshold={t!r}; allowed: a finite number, or "
          "None (the top of env.factory's outcome_range)"
      )

  @property
  def modes(self) -> tuple[tuple[str, bool], ...]:
    """(name, greedy) of each evaluation pass."""
    return (("greedy", True),) * self.greedy + (("sampled", False),) * self.sampled


# Of the outcome range: a full score summed from weighted grades (0.9 + 0.1) still counts.
SUCCESS_TOLERANCE = 1e-3


def success_threshold_for(outcome_range, outcome_weight: float) -> float:
  """The default `EvalConfig.success_threshold`: the top of `outcome_range` (lo, hi)
  within `SUCCESS_TOLERANCE`, weighted as the reward composes it."""
  lo, hi = (float(x) for x in outcome_range)
  return float(outcome_weight) * (hi - SUCCESS_TOLERANCE * (hi - lo))


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """Checkpoints of the run (`config.checkpoint`).

  Attributes:
    every: save every k RL steps (and at the last).
    keep: latest checkpoints kept (besides workdir/best).
  """

  every: int = 10
  keep: int = 3

  def __post_init__(self):
    _int_at_least("checkpoint", self, ("every", "keep"), 1)


@dataclasses.dataclass(frozen=True)
class AgentsConfig:
  """Shared or separate policies (`config.agents`).

  Attributes:
    share_policy: True: one policy acts for every agent (role prompts tell
      them apart); False: one policy per agent, stacked on an agent axis and
      updated by one program (`train.stacked`).
    learning_rates: per-agent RL learning rates on `optim`'s schedule (empty:
      `optim.learning_rate` for every agent).
    paths: per-agent local HF checkpoint directories ('' or empty: the
      top-level `model`); with `tokenizer.kind='hf'` a directory holding a
      tokenizer.json gives its agent that tokenizer.
    presets: per-agent model presets built from scratch ('' or empty: the
      top-level `model`). Agents of another architecture or tokenizer than the
      top-level model's make a team: agents of one architecture and tokenizer
      are stacked in one program, each such group has its own engine and
      update program (`run.groups`, `train.team`).
    trainable: per-agent bools (empty: every agent trains); a False agent is
      frozen: it acts with its own weights but never updates, and has no
      optimizer state (`train.frozen_agents`). At least one True; a shared
      policy allows only all True.
    team_weight: lambda in [0, 1]: agent i's reward is lambda * team +
      (1 - lambda) * local_i, local_i its own grade (`Grade.agent_scores`;
      the team reward where the environment grades only jointly). 1: the
      team reward only. Validation hands it to `TreeConfig.team_weight`.
    team: the groups of a team of several architectures or tokenizers
      (`run.groups.AgentGroup`, set by validation, not a config field);
      empty when every agent has the top-level model's.
  """

  share_policy: bool = True
  learning_rates: tuple = ()
  paths: tuple = ()
  presets: tuple = ()
  trainable: tuple = ()
  team_weight: float = 1.0
  team: tuple = ()

  def __post_init__(self):
    w = self.team_weight
    if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0.0 <= w <= 1.0:
      raise ValueError(
          f"config agents.team_weight={w!r}; allowed: a number in [0, 1] "
          "(1: the team reward only)"
      )
    if not isinstance(self.trainable, (tuple, list)):
      raise ValueError(
          f"config agents.trainable={self.trainable!r}; allowed: a tuple of True "
          "or False, one per agent (or empty)"
      )
    object.__setattr__(self, "trainable", tuple(self.trainable))
    if not all(isinstance(t, bool) for t in self.trainable):
      raise ValueError(
          f"config agents.trainable={self.trainable!r}; allowed: True or False, "
          "one per agent (or empty)"
      )
    if self.trainable and not any(self.trainable):
      raise ValueError(
          f"config agents.trainable={self.trainable!r} freezes every agent: a run "
          "that trains nothing; allowed: at least one True"
      )
    if self.share_policy and not all(self.trainable):
      raise ValueError(
          f"config agents.trainable={self.trainable!r} with agents.share_policy="
          "True: the one policy acts for every agent; allowed: all True or empty, "
          "or agents.share_policy=False"
      )
    object.__setattr__(self, "learning_rates", tuple(self.learning_rates))
    object.__setattr__(self, "paths", tuple(self.paths))
    object.__setattr__(self, "presets", tuple(self.presets))
    object.__setattr__(self, "team", tuple(self.team))
    if any(
        isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 0
        for r in self.learning_rates
    ):
      raise ValueError(
          f"config agents.learning_rates={self.learning_rates!r}; allowed: "
          "positive numbers, one per agent (or empty); agents.trainable "
          "freezes an agent"
      )
    for name in ("paths", "presets"):
      if not all(isinstance(p, str) for p in getattr(self, name)):
        raise ValueError(
            f"config agents.{name}={getattr(self, name)!r}; allowed: strings, one "
            "per agent (or empty)"
        )
    if self.share_policy and (self.learning_rates or any(self.paths) or any(self.presets)):
      raise ValueError(
          "config agents.learning_rates / agents.paths / agents.presets need "
          "agents.share_policy=False; allowed: empty with a shared policy"
      )
    for a, (path, preset) in enumerate(zip(self.paths, self.presets)):
      if path and preset:
        raise ValueError(
            f"config agents.paths[{a}]={path!r} and agents.presets[{a}]="
            f"{preset!r}; allowed: at most one of them per agent"
        )

  def check(self, num_agents: int):
    for name in ("learning_rates", "paths", "presets", "trainable"):
      v = getattr(self, name)
      if v and len(v) != num_agents:
        raise ValueError(
            f"config agents.{name}={v!r} has {len(v)} entries; allowed: "
            f"{num_agents} (tree.num_agents) or none"
        )


@dataclasses.dataclass(frozen=True)
class EngineGroup:
  """The rollout engine's KV budget and decode chunk (`config.engine`).

  Attributes:
    slots: KV slots per agent per batch shard; 0: the widest tree level's
      samples (or the evaluation's roots, if more), so a level never waits
      for slots.
    capacity: cache columns per slot; 0: the largest prompt bucket plus
      `sampling.max_new_tokens` plus one.
    chunk: decode steps between admissions of new requests.
    decode_rows: rows of one decode call (fixed, so rounding never depends on
      which requests share a call; 0: min(slots, 64) on CPU, 256 elsewhere).
    admit_rows: requests prefilled by one admit call (fixed likewise).
    reuse: continue each request from its parent's cache (False: prefill
      every prompt whole, the level-synchronous baseline).
    overlap: read each decode chunk's tokens while the next chunk decodes
      (the same samples, each back a chunk later; docs/performance.md,
      "Reading a chunk while the next decodes").
  """

  slots: int = 0
  capacity: int = 0
  chunk: int = 8
  decode_rows: int = 0
  admit_rows: int = 8
  reuse: bool = True
  overlap: bool = False

  def __post_init__(self):
    _int_at_least("engine", self, ("slots", "capacity", "decode_rows"), 0)
    _int_at_least("engine", self, ("chunk", "admit_rows"), 1)
    if not isinstance(self.reuse, bool):
      raise ValueError(f"config engine.reuse={self.reuse!r}; allowed: True or False")
    if not isinstance(self.overlap, bool):
      raise ValueError(f"config engine.overlap={self.overlap!r}; allowed: True or False")
