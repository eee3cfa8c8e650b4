"""Graders: Grade, programmatic and LLM-judge graders, combination, reward composition.

`LocalLLM` (the judge / user-simulator model on our sampler) lives in
`mtrl_jax.graders.local_llm` and is imported on first use, so that importing
the environment API does not import JAX.
"""

from mtrl_jax.graders.base import (SCOPES, CombinedGrader, FunctionGrader, Grade, Grader,
                                   ScriptedGenerator, TextGenerator, as_grade, normalize_grades,
                                   register_grader, resolve_grader)
from mtrl_jax.graders.judges import BinaryJudgeGrader, RangeJudgeGrader, render_transcript
from mtrl_jax.graders.reward import (RewardBreakdown, RewardConfig, RewardDominanceWarning,
                                     check_reward_dominance, compose_reward, mean_score)

__all__ = [
    "SCOPES", "CombinedGrader", "FunctionGrader", "Grade", "Grader", "ScriptedGenerator",
    "TextGenerator", "as_grade", "normalize_grades", "register_grader", "resolve_grader",
    "BinaryJudgeGrader", "RangeJudgeGrader", "render_transcript",
    "RewardBreakdown", "RewardConfig", "RewardDominanceWarning", "check_reward_dominance",
    "compose_reward", "mean_score", "LocalLLM",
]


def __getattr__(name):
  if name == "LocalLLM":
    from mtrl_jax.graders.local_llm import LocalLLM
    return LocalLLM
  raise AttributeError(f"module 'mtrl_jax.graders' has no attribute {name!r}")
