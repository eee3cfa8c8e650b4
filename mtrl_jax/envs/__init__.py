"""Environments: turns and threads, the react_to API, tools, user simulators, faults.

The researcher-facing API (docs/design.md section 4). An environment subclasses
`Environment` and implements `react_to(thread)`; a factory makes one per
trajectory and is named in the config by registry name or import path
(`resolve_factory`). The framework runs each step through
`step_environment`, which enforces limits, classifies faults and composes the
reward from the `Grade`s the environment returns (`mtrl_jax.envs.reward`). See
`mtrl_jax/tasks/weather.py` for a complete example; concrete tasks live in
`mtrl_jax.tasks`, above this package.

Submodules not imported here: `sandbox` (code execution).
"""

from mtrl_jax.envs.core import (
    ROLES,
    Environment,
    EnvironmentFactory,
    Thread,
    Turn,
    fork_error_message,
)
from mtrl_jax.envs.grades import Grade, as_grade, normalize_grades
from mtrl_jax.envs.reward import (
    RewardBreakdown,
    RewardConfig,
    RewardDominanceWarning,
    check_reward_dominance,
    compose_reward,
    mean_score,
)
from mtrl_jax.envs.registry import (register_env_factory, registered_env_factories, resolve_factory)
from mtrl_jax.envs.faults import (
    MODEL_CAUSED,
    ContractError,
    EnvFault,
    Fault,
    FaultCounter,
    FaultKind,
    FaultPolicy,
    FaultTimeoutError,
    InfrastructureError,
    ModelFormatError,
    ToolError,
    call_with_timeout,
    classify,
)
from mtrl_jax.envs.fault_report import fault_source, show_fault_once
from mtrl_jax.envs.tools import (
    Tool,
    ToolCache,
    ToolCallRecord,
    ToolResults,
    ToolSet,
    canonical_arguments,
    tool,
)
from mtrl_jax.envs.runner import (
    StepLimits,
    StepOutcome,
    render_thread,
    rollout_scripted,
    step_environment,
)
from mtrl_jax.envs.user_sim import LLMUserSimulator, ScriptedUserSimulator, UserReply
from mtrl_jax.resources import SharedResource

__all__ = [
    "ROLES",
    "Environment",
    "EnvironmentFactory",
    "SharedResource",
    "Thread",
    "Turn",
    "fork_error_message",
    "Grade",
    "as_grade",
    "normalize_grades",
    "RewardBreakdown",
    "RewardConfig",
    "RewardDominanceWarning",
    "check_reward_dominance",
    "compose_reward",
    "mean_score",
    "register_env_factory",
    "registered_env_factories",
    "resolve_factory",
    "MODEL_CAUSED",
    "ContractError",
    "EnvFault",
    "Fault",
    "FaultCounter",
    "FaultKind",
    "FaultPolicy",
    "FaultTimeoutError",
    "InfrastructureError",
    "ModelFormatError",
    "ToolError",
    "call_with_timeout",
    "classify",
    "fault_source",
    "show_fault_once",
    "Tool",
    "ToolCache",
    "ToolCallRecord",
    "ToolResults",
    "ToolSet",
    "canonical_arguments",
    "tool",
    "StepLimits",
    "StepOutcome",
    "render_thread",
    "rollout_scripted",
    "step_environment",
    "LLMUserSimulator",
    "ScriptedUserSimulator",
    "UserReply",
]
