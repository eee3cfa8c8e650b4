"""TreeConfig validation and the pre-launch size plan."""

import pytest

from mtrl_jax.rollout import TreeConfig, plan_tree


def test_plan_matches_comlrl_counts():
  # CoMLRL spec 1.1 item 6: T=2, G=4, N=2: align 5 nodes, 40 generations,
  # 20 reward calls; cross 17 nodes, 136 generations, 272 reward calls.
  align = plan_tree(TreeConfig(num_turns=2, num_generations=4, num_agents=2), 1, 100, 20)
  assert (align.nodes, align.generations, align.reward_calls) == (5, 40, 20)
  cross = plan_tree(
      TreeConfig(num_turns=2, num_generations=4, num_agents=2, joint_mode="cross"), 1, 100, 20
  )
  assert (cross.nodes, cross.generations, cross.reward_calls) == (17, 136, 272)
  assert cross.rows == 136 and cross.tokens == 136 * 120
  assert cross.level_nodes == (1, 16) and cross.max_level_generations == 16 * 2 * 4


def test_plan_scales_with_roots_and_formula():
  cfg = TreeConfig(num_turns=3, num_generations=3, num_agents=2, joint_mode="cross")
  plan = plan_tree(cfg, 5, 10, 10)
  b = 3**2
  assert plan.nodes == 5 * (1 + b + b * b)
  assert plan.generations == plan.nodes * 2 * 3
  assert plan.reward_calls == plan.nodes * b
  single = plan_tree(TreeConfig(num_turns=2, num_generations=4), 8, 10, 10)
  assert (single.nodes, single.generations) == (8 * 5, 8 * 5 * 4)


def test_budget_violation_is_a_clear_error():
  cfg = TreeConfig(num_turns=2, num_generations=4, num_agents=2, joint_mode="cross")
  with pytest.raises(ValueError, match="136 completions.*max_generations=100"):
    plan_tree(cfg, 1, 100, 20, max_generations=100)
  with pytest.raises(ValueError, match="max_tokens=1000"):
    plan_tree(cfg, 1, 100, 20, max_tokens=1000)
  plan_tree(cfg, 1, 100, 20, max_generations=136, max_tokens=136 * 120)  # exactly at budget


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(num_turns=0), "num_turns"),
        (dict(num_generations=1.5), "num_generations"),
        (dict(num_agents=0), "num_agents"),
        (
            dict(joint_mode="aligned"),
            r"joint_mode='aligned'; allowed: \['align', 'cross', 'marginal'\]",
        ),
        (dict(joint_mode="marginal"), "joint_mode='marginal' needs num_agents >= 2"),
        (
            dict(num_agents=2, team_weight=1.5),
            r"agents.team_weight=1.5; allowed: a number in \[0, 1\]",
        ),
        (dict(num_agents=2, team_weight=-0.1), r"agents.team_weight=-0.1; allowed"),
        (dict(advantage_mode="zscore"), "advantage_mode.*allowed"),
        (dict(cross_return="max"), "cross_return.*allowed"),
        (dict(discount=1.5), "discount"),
        (dict(termination_threshold="high"), "termination_threshold"),
        (dict(advantage_mode="rloo", num_generations=1), "rloo"),
        (dict(advantage_std_norm=1), "advantage_std_norm"),
        (
            dict(advantage_std_norm=True, advantage_mode="raw"),
            "std_norm=True with .*'raw'.*allowed",
        ),
        (
            dict(advantage_std_norm=True, advantage_mode="max"),
            "advantage_std_norm=True with .*'max'",
        ),
        (
            dict(branch_on="tool_turn"),
            r"branch_on='tool_turn'; allowed: \['every_turn', 'user_turn'\]",
        ),
        (dict(max_substeps=0), "max_substeps=0"),
        (dict(max_substeps=True), "max_substeps"),
        (dict(branch_on="user_turn", num_agents=2), "branch_on='user_turn' needs num_agents=1"),
    ],
)
def test_bad_config_names_the_field(kw, match):
  base = dict(num_turns=2, num_generations=4)
  base.update(kw)
  with pytest.raises(ValueError, match=match):
    TreeConfig(**base)


def test_config_is_frozen_and_hashable():
  cfg = TreeConfig(num_turns=2, num_generations=4, num_agents=2, joint_mode="cross")
  assert cfg.branching == 16 and hash(cfg) == hash(cfg.replace())
  with pytest.raises(Exception):
    cfg.num_turns = 3
  with pytest.raises(ValueError, match="num_roots"):
    plan_tree(cfg, 0, 10, 10)


def test_user_turn_plan_counts_worst_case_substeps():
  # T=2, G=4, 3 roots: 15 nodes, 60 rows; with max_substeps=2 every action may
  # take 3 segments / environment steps.
  cfg = TreeConfig(num_turns=2, num_generations=4, branch_on="user_turn", max_substeps=2)
  plan = plan_tree(cfg, 3, 100, 50)
  assert (plan.nodes, plan.rows, plan.generations, plan.reward_calls) == (15, 60, 180, 180)
  assert plan.tokens == 60 * 150 and plan.max_level_generations == 12 * 4
  assert plan_tree(cfg.replace(branch_on="every_turn"), 3, 100, 50).generations == 60
  with pytest.raises(ValueError, match="branch_on='user_turn'.*max_substeps"):
    plan_tree(cfg, 3, 100, 50, max_generations=100)
