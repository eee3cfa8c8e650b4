"""The aux/main code-generation task (HumanEval; docs/comlrl.md sections 2.2, 3.1).

Modules: `prompts` (turn-1 prompts), `analysis` (code clean-up and static
checks), `rewards` (the gated level reward, run in the sandbox), `data`
(HumanEval splits: a TFDS builder and a plain loader; imports
tensorflow_datasets, so it is not imported here). `feedback` (the feedback
transitions of turns >= 2) and `expert` (its expert-edit requests) are not imported
here either.
"""

from mtrl_jax.tasks.code.prompts import (
    EXTRACTION_ERROR,
    agent_prompts,
    aux_prompt,
    extract_function_params,
    main_prompt,
    single_agent_prompt,
)
from mtrl_jax.tasks.code.rewards import (
    GRPO_SHIFT,
    MAGRPO_SHIFT,
    MAX_REWARD,
    MAX_SINGLE_AGENT_REWARD,
    execution_reward_aux,
    process_reward,
    single_agent_reward,
)

__all__ = [
    "EXTRACTION_ERROR",
    "agent_prompts",
    "aux_prompt",
    "extract_function_params",
    "main_prompt",
    "single_agent_prompt",
    "GRPO_SHIFT",
    "MAGRPO_SHIFT",
    "MAX_REWARD",
    "MAX_SINGLE_AGENT_REWARD",
    "execution_reward_aux",
    "process_reward",
    "single_agent_reward",
]
