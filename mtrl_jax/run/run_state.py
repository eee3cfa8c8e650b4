"""What an RL run carries from step to step, and its latest-N checkpoints.

A `RunState` holds the train state, the frozen reference parameters (kept when
the loss has a KL term), the parameters the next rollout samples with
(`rl.max_staleness=1`), the task stream and, with `sft.mix_every`, the SFT
mix (`run.warmup.SFTMix`: its own moments and batch position). A checkpoint
holds exactly these, so a resumed run continues as if never stopped
(docs/design.md invariant 6):

  tree  {"train": state, "ref": params, "behaviour": params, "sft_mix": opt_state,
         "critic": state}
  meta  {"stream": stream position, "sft_mix": batch position}

("ref", "behaviour", "sft_mix" and "critic" only where kept), each state and
parameter tree in its `Policies`' saved layout (one subtree per agent when
stacked); "critic" is a separate critic's train state (`train.separate_critic`).

With low-rank adapters (`model.lora`) the train state holds the adapters and
their optimizer state; the frozen base is named in meta by its path and the
sha256 of its weights (`models.lora.fingerprint`), {"lora_base": {"path",
"sha256"}}, and saved in the tree ("base") only when the run's SFT warm-up
trained it. A resume whose base has another hash is refused in one line.
"""

from __future__ import annotations

from typing import Any, Optional

import jax

from mtrl_jax.models import lora as lora_lib
from mtrl_jax.run.experiment import ConfigError


class RunState:
  """The train state, reference, behaviour parameters, task stream and SFT mix of a run.

  Args:
    policies: the run's `train.policies.Policies` (layout, parameter copies).
    stream: the RL task stream (`data.TaskStream` or `data.CurriculumStream`).
    mix: the `SFTMix`, or None without `sft.mix_every`.
    keep_ref: keep frozen reference parameters (the loss has a KL term).
    keep_behaviour: keep the next rollout's parameters (`rl.max_staleness=1`).
    base_path: with adapters, where the base came from (`model.path`; '' a preset).
    keep_base: with adapters, save the base in the tree (the warm-up trained it).
    critic_model: a `train.separate_critic.SeparateCritic`, or None.
  """

  def __init__(
      self,
      policies,
      stream,
      mix=None,
      *,
      keep_ref: bool,
      keep_behaviour: bool,
      base_path: str = "",
      keep_base: bool = False,
      critic_model=None,
  ):
    self.policies, self.stream, self.mix = policies, stream, mix
    self.critic_model = critic_model
    self.critic: Any = None  # the separate critic's train state
    self.keep_ref, self.keep_behaviour = keep_ref, keep_behaviour
    self.lora = policies.train_step.lora is not None
    self.base_path, self.keep_base = base_path, keep_base and self.lora
    self.base_sha = ""  # with adapters: the fingerprint of the frozen base
    self.state: Any = None
    self.ref: Any = None
    self.behaviour: Any = None  # max_staleness 1: the parameters the next rollout samples with
    self.stream_mark: Optional[dict] = None  # the stream before an in-flight rollout took tasks

  @classmethod
  def of(cls, exp, policies, stream=None, mix=None, critic_model=None) -> RunState:
    """The state `exp`'s run keeps: a reference when the loss has a KL term (none with
    adapters: the frozen base is the reference), behaviour parameters with
    `rl.max_staleness=1`, a separate critic's state (no stream: a restore target only)."""
    return cls(
        policies,
        stream,
        mix,
        keep_ref=exp.loss.kl_coef > 0 and not exp.model.lora.enabled,
        keep_behaviour=exp.rl.max_staleness > 0,
        base_path=exp.model.path,
        keep_base=exp.sft.steps > 0,
        critic_model=critic_model,
    )

  @property
  def _param_trees(self) -> list[str]:
    return ["ref"] * self.keep_ref + ["behaviour"] * self.keep_behaviour

  def start(self, state) -> None:
    """Begins from a fresh (or warmed-up) `state`: the reference and the first rollouts'
    parameters are copies of its parameters, the mix gets fresh moments."""
    copy = self.policies.train_step.copy_params
    self.state = state
    self.ref = copy(state.params) if self.keep_ref else None
    self.behaviour = copy(state.params) if self.keep_behaviour else None
    if self.mix is not None:
      self.mix.init(state.params)
    if self.critic_model is not None:
      self.critic = self.critic_model.init_state()
    self.stream_mark = self.stream.state()
    if self.lora:
      self.base_sha = lora_lib.fingerprint(self.policies.train_step.base)

  def next_rollout_ahead(self) -> None:
    """The next step's rollout starts now, during the update, with the current
    parameters: they become the behaviour parameters, and the stream is marked
    before that rollout takes its tasks."""
    self.stream_mark = self.stream.state()
    self.behaviour = self.policies.train_step.copy_params(self.state.params)

  def reset_ref(self) -> None:
    """The reference becomes a copy of the current parameters (`rl.ref_reset_every`)."""
    self.ref = self.policies.train_step.copy_params(self.state.params)

  def target(self) -> dict:
    """The abstract checkpoint tree (Orbax's restore target)."""
    target = {"train": self.policies.saved_state_target()}
    params = self.policies.saved_params_target()
    target.update({name: params for name in self._param_trees})
    if self.mix is not None:
      target["sft_mix"] = self.mix.abstract_opt_state()
    if self.critic_model is not None:
      target["critic"] = self.critic_model.abstract_state()
    if self.keep_base:
      step = self.policies.train_step
      target["base"] = jax.tree.map(
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
          step.base,
          step.base_shardings,
      )
    return target

  def checkpoint_tree(self, in_flight: bool) -> tuple[dict, dict]:
    """(tree, meta) of a checkpoint now; `in_flight`: a rollout submitted ahead has
    taken its tasks, so the stream is saved with that draw undone (`stream_mark`)."""
    tree = {"train": self.policies.to_saved(self.state)}
    for name in self._param_trees:
      tree[name] = self.policies.to_saved(getattr(self, name))
    meta = {"stream": (self.stream.rewound(self.stream_mark) if in_flight else self.stream.state())}
    if self.mix is not None:
      tree["sft_mix"], meta["sft_mix"] = self.mix.opt_state, self.mix.stream_state()
    if self.critic_model is not None:
      tree["critic"] = self.critic
    if self.lora:
      meta["lora_base"] = {"path": self.base_path, "sha256": self.base_sha}
    if self.keep_base:
      tree["base"] = self.policies.train_step.base
    return tree, meta

  def restore(self, restored: dict, meta: dict) -> None:
    """Puts back a checkpoint restored onto `target()` and its meta.

    Raises:
      ConfigError (one line) when the checkpoint's adapters were trained over
        another base than this run's.
    """
    p = self.policies
    if self.lora:
      if self.keep_base:
        p.train_step.set_base(restored["base"])
      self.base_sha = lora_lib.fingerprint(p.train_step.base)
      saved = meta.get("lora_base", {})
      if saved.get("sha256") != self.base_sha:
        raise ConfigError(
            f"checkpoint adapters were trained over the base {saved.get('path') or 'preset'!r} "
            f"with sha256 {str(saved.get('sha256'))[:12]}; model.path={self.base_path!r} gives "
            f"{self.base_sha[:12]}; allowed: the base the adapters were trained over"
        )
    self.state = p.state_from_saved(restored["train"])
    self.ref = p.params_from_saved(restored["ref"]) if self.keep_ref else None
    self.behaviour = p.params_from_saved(restored["behaviour"]) if self.keep_behaviour else None
    self.stream.restore(meta["stream"])
    if self.mix is not None:
      self.mix.restore(restored["sft_mix"], meta["sft_mix"])
    if self.critic_model is not None:
      self.critic = restored["critic"]
    self.stream_mark = self.stream.state()
