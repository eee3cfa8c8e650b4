"""Reward composition and the start-up dominance check."""

import warnings

import pytest

from mtrl_jax.envs import (
    RewardBreakdown,
    RewardConfig,
    RewardDominanceWarning,
    check_reward_dominance,
    compose_reward,
)


def test_compose_reward_components():
  cfg = RewardConfig(outcome_weight=2.0, step_penalty=-0.01, tool_penalty=-0.2, shaping_weight=0.1)
  r = compose_reward(cfg, outcome=0.75, steps=3, invalid_calls=2, shaping=0.5)
  # 2 * 0.75 - 0.01 * 3 - 0.2 * 2 + 0.1 * 0.5 = 1.5 - 0.03 - 0.4 + 0.05 = 1.12
  assert (r.outcome, r.step, r.tool, r.shaping) == pytest.approx((1.5, -0.03, -0.4, 0.05))
  assert r.total == pytest.approx(1.12)
  assert r.metrics() == pytest.approx(
      {
          "reward/outcome": 1.5,
          "reward/step_penalty": -0.03,
          "reward/tool_penalty": -0.4,
          "reward/shaping": 0.05,
          "reward/total": 1.12,
      }
  )
  assert RewardBreakdown.zero().total == 0.0
  with pytest.raises(ValueError, match="steps=-1"):
    compose_reward(cfg, steps=-1)


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("outcome_weight", 0.0, "must be > 0"),
        ("step_penalty", 0.1, "must be <= 0"),
        ("tool_penalty", 0.5, "must be <= 0"),
        ("shaping_weight", -1.0, "must be >= 0"),
        ("outcome_weight", float("inf"), "finite number"),
    ],
)
def test_reward_config_validation(field, value, needle):
  with pytest.raises(ValueError, match=f"RewardConfig.{field}=.*{needle}"):
    RewardConfig(**{field: value})


def test_dominance_check():
  safe = RewardConfig(1.0, step_penalty=-0.01, tool_penalty=-0.1, shaping_weight=0.05)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    # shaping 0.05 * 10 = 0.5 < 1; penalties 0.1 + 0.3 = 0.4 < 1.
    assert check_reward_dominance(safe, max_steps=10, max_invalid=3) == []
  farm = RewardConfig(1.0, shaping_weight=0.2)
  with pytest.warns(RewardDominanceWarning, match="shaping can outweigh the outcome"):
    msgs = check_reward_dominance(farm, max_steps=5, max_invalid=0)  # 0.2 * 5 = 1.0 >= 1
  assert len(msgs) == 1 and "1 >= outcome_weight * (max - min outcome) = 1" in msgs[0]
  # An environment that grades at most 3 steps (a factory's max_graded_turns) cannot
  # be farmed past 0.2 * 3 = 0.6; a bound above the turn cap changes nothing.
  assert check_reward_dominance(farm, max_steps=5, max_invalid=0, max_graded=3) == []
  with pytest.warns(RewardDominanceWarning, match=r"graded steps \(5\) = 1 >= "):
    check_reward_dominance(farm, max_steps=5, max_invalid=0, max_graded=50)
  for bad in (-1, 2.0, True):
    with pytest.raises(ValueError, match="max_graded="):
      check_reward_dominance(farm, max_steps=5, max_invalid=0, max_graded=bad)
  harsh = RewardConfig(1.0, step_penalty=-0.05, tool_penalty=-0.3)
  with pytest.warns(RewardDominanceWarning, match="penalties can outweigh"):
    msgs = check_reward_dominance(harsh, max_steps=11, max_invalid=2)  # 0.5 + 0.6 = 1.1
  assert len(msgs) == 1 and "= 1.1 >=" in msgs[0]
  # The gap counts, not the top score: outcomes in [-1, 1] (the calculator's)
  # open a gap of 2, and a shift (the code task's [-4, 0]) changes nothing.
  assert check_reward_dominance(harsh, max_steps=11, max_invalid=2, outcome_range=(-1.0, 1.0)) == []
  calc = RewardConfig(1.0, step_penalty=-0.05, tool_penalty=-0.2)
  # A success after 8 steps and 8 invalid calls (-1.95 in penalties) still
  # beats a failure after one step: +1 - 0.4 - 1.6 = -1.0 > -1 - 0.05.
  assert check_reward_dominance(calc, max_steps=8, max_invalid=8, outcome_range=(-1, 1)) == []
  with pytest.warns(RewardDominanceWarning, match="penalties can outweigh"):
    check_reward_dominance(calc, max_steps=8, max_invalid=9, outcome_range=(-1, 1))  # 2.15
  assert (
      check_reward_dominance(
          RewardConfig(1.0, step_penalty=0.0, tool_penalty=0.0),
          max_steps=4,
          max_invalid=4,
          outcome_range=(-4.0, 0.0),
      )
      == []
  )
  with pytest.raises(ValueError, match="outcome_range"):
    check_reward_dominance(calc, max_steps=2, max_invalid=2, outcome_range=(1.0, 1.0))
