"""Graders: programmatic and LLM-judge graders and their combination, on the env API.

Re-exported from lower layers, so the names users know keep working: `Grade`
(and `as_grade`, `normalize_grades`) and reward composition from
`mtrl_jax.envs`, the text generators judges call (`TextGenerator`,
`ScriptedGenerator`, `LocalLLM`) from `mtrl_jax.sampling.generation` and
`BatchingGenerator` from `mtrl_jax.sampling.batching`.
"""

from mtrl_jax.envs.grades import Grade, as_grade, normalize_grades
from mtrl_jax.envs.reward import (
    RewardBreakdown,
    RewardConfig,
    RewardDominanceWarning,
    check_reward_dominance,
    compose_reward,
    mean_score,
)
from mtrl_jax.graders.base import (
    GRADERS,
    SCOPES,
    CombinedGrader,
    FunctionGrader,
    Grader,
    register_grader,
    resolve_grader,
)
from mtrl_jax.graders.judges import BinaryJudgeGrader, RangeJudgeGrader, render_transcript
from mtrl_jax.sampling.batching import BatchingGenerator
from mtrl_jax.sampling.generation import LocalLLM, ScriptedGenerator, TextGenerator

__all__ = [
    "GRADERS",
    "SCOPES",
    "CombinedGrader",
    "FunctionGrader",
    "Grade",
    "Grader",
    "ScriptedGenerator",
    "TextGenerator",
    "as_grade",
    "normalize_grades",
    "register_grader",
    "resolve_grader",
    "BinaryJudgeGrader",
    "RangeJudgeGrader",
    "render_transcript",
    "RewardBreakdown",
    "RewardConfig",
    "RewardDominanceWarning",
    "check_reward_dominance",
    "compose_reward",
    "mean_score",
    "LocalLLM",
    "BatchingGenerator",
]
