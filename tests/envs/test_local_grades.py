"""Local grades: a grade scored per agent (`Grade.agent_scores`), composed per agent."""

import math

import pytest

from mtrl_jax.envs import Environment, RewardConfig, Thread, Turn, rollout_scripted
from mtrl_jax.envs.faults import FaultKind
from mtrl_jax.envs.grades import Grade
from mtrl_jax.envs.reward import compose_local
from mtrl_jax.rollout.records import ActionRecord, StepRecord
from mtrl_jax.tasks import coop

PER_TURN = RewardConfig(outcome_weight=1.0, shaping_weight=1.0)


def test_grade_agent_scores_are_checked_and_recorded():
  g = Grade(0.0, "joint failed", agent_scores={0: True, 1: 0})
  assert g.agent_scores == {0: 1.0, 1: 0.0}
  assert g.to_dict()["agent_scores"] == {"0": 1.0, "1": 0.0}
  assert "agent_scores" not in Grade(1.0).to_dict()  # joint-only grades record as before
  with pytest.raises(TypeError, match="agent_scores key 'a'"):
    Grade(1.0, agent_scores={"a": 1.0})
  with pytest.raises(ValueError, match=r"agent_scores\[1\]=nan"):
    Grade(1.0, agent_scores={1: math.nan})


def test_compose_local_uses_each_grades_agent_score_or_its_joint_score():
  cfg = RewardConfig(outcome_weight=2.0, step_penalty=-0.1, shaping_weight=0.5)
  outcome = {"a": Grade(0.0, agent_scores={0: 1.0}), "b": Grade(1.0)}
  shaping = {"s": Grade(0.4, agent_scores={1: 0.8})}
  local = compose_local(cfg, 3, outcome_grades=outcome, shaping_grades=shaping, steps=1)
  # agent 0: outcome mean(1, 1) = 1, shaping 0.4 (joint); agent 1: outcome mean(0, 1),
  # shaping 0.8; agent 2: no grade scores it alone -> None (its local reward is the team's).
  assert local[0].total == pytest.approx(2.0 - 0.1 + 0.2)
  assert local[1].total == pytest.approx(1.0 - 0.1 + 0.4)
  assert local[2] is None


def test_coop_grades_each_agents_own_answer():
  task = coop.make_task("eval", 5)
  x, y = task["parts"]
  env = coop.CoopEnv(task)
  own = [f"<answer>{x}</answer>", f"<answer>{y}</answer>"]
  half = [f"<answer>{x}{y}</answer>", f"<answer>{y}</answer>"]
  outs, _ = rollout_scripted(env, [own, half], reward_cfg=PER_TURN)
  assert [o.reward.total for o in outs] == [0.0, 0.0]  # the team reward: nobody succeeded
  assert [b.total for b in outs[1].local] == [1.0, 0.0]  # agent 0 alone answered x||y
  assert outs[1].grades["joint"].agent_scores == {0: 1.0, 1: 0.0}


def test_step_record_local_reward_falls_back_to_the_team_reward():
  steps = (StepRecord(0.5, local_rewards=(1.0, None)), StepRecord(0.25))
  action = ActionRecord(steps)
  assert action.local_rewards(2) == [1.25, 0.75]
  assert action.local_rewards(2)[1] == action.reward
  assert action.local_graded(2) == [True, False]
  assert steps[0].to_json()["local_rewards"] == [1.0, None]
  assert "local_rewards" not in steps[1].to_json()


class _BadAgentEnv(Environment):
  num_agents = 2

  def initial_threads(self):
    return [Thread((Turn("user", "hi"),)) for _ in range(2)]

  def react_to_joint(self, threads):
    return None, {"g": Grade(1.0, agent_scores={2: 1.0})}


def test_agent_scores_for_an_agent_that_does_not_exist_is_a_contract_fault():
  outs, _ = rollout_scripted(_BadAgentEnv({}), [["a", "b"]])
  assert outs[0].masked and outs[0].local == ()
  assert [f.kind for f in outs[0].faults] == [FaultKind.CONTRACT]
  assert "agent_scores for agents [2]" in outs[0].faults[0].message
