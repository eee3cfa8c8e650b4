"""The `critic` config group: a learned value critic instead of (or beside) sibling baselines.

`critic.kind='independent'` is CoMLRL's IAC: each agent's critic reads its own
history. The critic is a value head on the policy's backbone
(`ModelConfig.value_head`, `Transformer.values_at`), trained with the policy
by one update (`PolicyObjective.value_coef`): with `agents.share_policy=False`
every agent has its own head (stacked with its policy), with a shared policy
the agents share one head over their own histories. After each rollout one
forward of the packed tree gives every action's value (`TrainStep.values`,
`rollout.batching.critic_values`); `rollout.critic.critic_advantages` turns
them and the tree's rewards into advantages (TD(0) as CoMLRL, or GAE over a
path's turns) and value targets, which replace the sibling baselines.
"""

from __future__ import annotations

import dataclasses

from mtrl_jax.rollout.critic import ESTIMATORS, TARGETS, CriticConfig

KINDS = ("none", "independent")


@dataclasses.dataclass(frozen=True)
class CriticGroup:
  """A value critic (`config.critic`).

  Attributes:
    kind: 'none' (sibling baselines only) or 'independent' (IAC: a value head
      on each policy over its agent's own history).
    target: 'v' (value of the history before the agent's turn) or 'q' (the
      history plus the agent's action).
    estimator: 'td0' (r + gamma V(next) - V, CoMLRL's) or 'gae' (GAE over a
      path's turns, `gae_lambda`).
    gae_lambda: GAE's lambda in [0, 1] (1: Monte-Carlo returns minus V).
    normalize: advantages standardised over the step's trained samples.
    value_coef: weight of the value loss beside the policy loss (> 0).
    value_clip: |v - v_old| bound of the clipped value loss; 0: unclipped.
  """

  kind: str = "none"
  target: str = "v"
  estimator: str = "td0"
  gae_lambda: float = 0.95
  normalize: bool = True
  value_coef: float = 0.5
  value_clip: float = 0.2

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"config critic.kind={self.kind!r}; allowed: {list(KINDS)}")
    if self.target not in TARGETS:
      raise ValueError(f"config critic.target={self.target!r}; allowed: {list(TARGETS)}")
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"config critic.estimator={self.estimator!r}; allowed: "
                       f"{list(ESTIMATORS)}")
    for name, low in (("value_coef", 0.0), ("value_clip", 0.0)):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
          v > low if name == "value_coef" else v >= low):
        raise ValueError(f"config critic.{name}={v!r}; allowed: a number "
                         f"{'>' if name == 'value_coef' else '>='} {low:g}")
    if not 0.0 <= self.gae_lambda <= 1.0:
      raise ValueError(f"config critic.gae_lambda={self.gae_lambda!r}; allowed: [0, 1]")

  @property
  def enabled(self) -> bool:
    return self.kind != "none"

  def advantage_config(self) -> CriticConfig:
    """What `rollout.critic.critic_advantages` reads."""
    return CriticConfig(target=self.target, estimator=self.estimator,
                        gae_lambda=self.gae_lambda, normalize=self.normalize)

  def check(self, exp) -> None:
    """Refuses what the critic cannot run with, in one line each (before compute)."""
    if not self.enabled:
      return
    refuse = [
        (exp.model.lora.enabled, "model.lora.rank > 0 (the value head is not an adapter)"),
        (exp.rl.max_staleness > 0, "rl.max_staleness > 0 (the value pass reads the "
         "parameters the rollout sampled with)"),
        (exp.distributed.mode != "off", "several processes (distributed.mode)"),
        (not all(exp.agents.trainable), "frozen agents (agents.trainable)"),
    ]
    for bad, what in refuse:
      if bad:
        raise ValueError(f"config critic.kind={self.kind!r} with {what}: not supported; "
                         "allowed: critic.kind='none' there")
