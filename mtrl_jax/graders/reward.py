"""Old import path of reward composition: it lives in `mtrl_jax.envs.reward`.

The step runner composes the reward, so it is part of the environment API;
this module re-exports it for code that imports it from here.
"""

from mtrl_jax.envs.reward import (RewardBreakdown, RewardConfig, RewardDominanceWarning,
                                  check_reward_dominance, compose_reward, mean_score)

__all__ = ["RewardBreakdown", "RewardConfig", "RewardDominanceWarning",
           "check_reward_dominance", "compose_reward", "mean_score"]
