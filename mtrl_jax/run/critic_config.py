"""The `critic` config group: a learned value critic instead of (or beside) sibling baselines.

`critic.kind='independent'` is CoMLRL's IAC: each agent's critic reads its own
history. `critic.kind='centralized'` is CoMLRL's MAAC: one critic over the
joint history (`rollout.joint_rows`), its value shared by every agent.

Where the critic lives (`critic.model`):
  * 'head': a value head on the policy's backbone (`ModelConfig.value_head`,
    `Transformer.values_at`), trained with the policy by one update
    (`PolicyObjective.value_coef`): with `agents.share_policy=False` every
    agent has its own head (stacked with its policy), with a shared policy the
    agents share one head over their own histories;
  * 'separate': its own model (`critic.preset` / `critic.path`, default the
    policy's starting model) with a value head, its own AdamW at
    `critic.learning_rate` (`train.separate_critic`). An independent critic
    is then one model shared by the agents, each read over its own history.

After each rollout one value pass gives every action's value (`TrainStep.values`:
one forward of the packed tree, or of the joint rows);
`rollout.critic.critic_advantages` turns them and the tree's rewards into
advantages (TD(0) as CoMLRL, or GAE over a path's turns) and value targets,
which replace the sibling baselines.
"""

from __future__ import annotations

import dataclasses

from mtrl_jax.rollout.critic import ESTIMATORS, TARGETS, CriticConfig

KINDS = ("none", "independent", "centralized")
MODELS = ("head", "separate")


@dataclasses.dataclass(frozen=True)
class CriticGroup:
  """A value critic (`config.critic`).

  Attributes:
    kind: 'none' (sibling baselines only), 'independent' (IAC: a critic over
      each agent's own history) or 'centralized' (MAAC: one critic over the
      joint history; needs model='separate').
    target: 'v' (value of the history before the agent's turn) or 'q' (the
      history plus the agent's action).
    estimator: 'td0' (r + gamma V(next) - V, CoMLRL's) or 'gae' (GAE over a
      path's turns, `gae_lambda`).
    gae_lambda: GAE's lambda in [0, 1] (1: Monte-Carlo returns minus V).
    normalize: advantages standardised over the step's trained samples.
    value_coef: weight of the value loss beside the policy loss (> 0).
    value_clip: |v - v_old| bound of the clipped value loss; 0: unclipped.
    model: 'head' (a value head on the policy, trained with it) or 'separate'
      (its own model and optimizer).
    preset: with model='separate', the critic's architecture from a preset
      (fresh weights, the policy's vocabulary); '' with path '': the policy's
      starting model.
    path: with model='separate', a local checkpoint the critic starts from.
    learning_rate: with model='separate', the critic's peak learning rate (the
      policy's schedule and warm-up; CoMLRL's default 5e-6).
  """

  kind: str = "none"
  target: str = "v"
  estimator: str = "td0"
  gae_lambda: float = 0.95
  normalize: bool = True
  value_coef: float = 0.5
  value_clip: float = 0.2
  model: str = "head"
  preset: str = ""
  path: str = ""
  learning_rate: float = 5e-6

  def __post_init__(self):
    if self.kind not in KINDS:
      raise ValueError(f"config critic.kind={self.kind!r}; allowed: {list(KINDS)}")
    if self.target not in TARGETS:
      raise ValueError(f"config critic.target={self.target!r}; allowed: {list(TARGETS)}")
    if self.estimator not in ESTIMATORS:
      raise ValueError(f"config critic.estimator={self.estimator!r}; allowed: {list(ESTIMATORS)}")
    for name, low in (("value_coef", 0.0), ("value_clip", 0.0)):
      v = getattr(self, name)
      if (
          isinstance(v, bool)
          or not isinstance(v, (int, float))
          or not (v > low if name == "value_coef" else v >= low)
      ):
        raise ValueError(
            f"config critic.{name}={v!r}; allowed: a number "
            f"{'>' if name == 'value_coef' else '>='} {low:g}"
        )
    if not 0.0 <= self.gae_lambda <= 1.0:
      raise ValueError(f"config critic.gae_lambda={self.gae_lambda!r}; allowed: [0, 1]")
    if self.model not in MODELS:
      raise ValueError(f"config critic.model={self.model!r}; allowed: {list(MODELS)}")
    lr = self.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0:
      raise ValueError(f"config critic.learning_rate={lr!r}; allowed: a number > 0")
    if self.preset and self.path:
      raise ValueError(
          f"config critic.preset={self.preset!r} and critic.path={self.path!r}; "
          "allowed: at most one of them"
      )
    if (self.preset or self.path) and self.model != "separate":
      raise ValueError(
          f"config critic.preset / critic.path with critic.model={self.model!r}: "
          "a head critic is the policy's; allowed: critic.model='separate'"
      )
    if self.kind == "centralized" and self.model != "separate":
      raise ValueError(
          "config critic.kind='centralized' with critic.model='head': one critic "
          "over the joint history is its own model; allowed: "
          "critic.model='separate'"
      )
    if self.preset:
      from mtrl_jax.models import PRESETS

      if self.preset not in PRESETS:
        raise ValueError(f"config critic.preset={self.preset!r}; allowed: {sorted(PRESETS)}")

  @property
  def enabled(self) -> bool:
    return self.kind != "none"

  @property
  def head(self) -> bool:
    """A value head on the policy (trained by the policy's update)."""
    return self.enabled and self.model == "head"

  @property
  def separate(self) -> bool:
    """A critic model of its own (`train.separate_critic`)."""
    return self.enabled and self.model == "separate"

  def advantage_config(self) -> CriticConfig:
    """What `rollout.critic.critic_advantages` reads."""
    return CriticConfig(
        target=self.target,
        estimator=self.estimator,
        gae_lambda=self.gae_lambda,
        normalize=self.normalize,
    )

  def check(self, exp) -> None:
    """Refuses what the critic cannot run with, in one line each (before compute)."""
    if not self.enabled:
      return
    refuse = [
        (
            self.head and exp.model.lora.enabled,
            "model.lora.rank > 0 (the value head is not an adapter)",
        ),
        (
            exp.rl.max_staleness > 0,
            "rl.max_staleness > 0 (the value pass reads the "
            "parameters the rollout sampled with)",
        ),
        (exp.distributed.mode != "off", "several processes (distributed.mode)"),
        (
            self.head and not all(exp.agents.trainable),
            "a head on frozen agents (agents.trainable; a separate critic trains beside them)",
        ),
    ]
    for bad, what in refuse:
      if bad:
        raise ValueError(
            f"config critic.kind={self.kind!r} with {what}: not supported; "
            "allowed: critic.kind='none' there"
        )
    if self.kind != "centralized":
      return
    tree = exp.tree
    for bad, field, value, allowed in (
        (
            tree.num_agents < 2,
            "tree.num_agents",
            tree.num_agents,
            "2 or more (with one agent: critic.kind='independent')",
        ),
        (
            self.target == "q" and tree.joint_mode != "align",
            "tree.joint_mode",
            tree.joint_mode,
            "'align' for a centralized Q critic (one value per joint action), "
            "or critic.target='v'",
        ),
        (
            exp.agents.team_weight != 1.0,
            "agents.team_weight",
            exp.agents.team_weight,
            "1.0 (a centralized critic values the team's reward)",
        ),
    ):
      if bad:
        raise ValueError(
            f"config {field}={value!r} with critic.kind='centralized'; allowed: {allowed}"
        )
