"""Losses: pure array functions for GRPO, GSPO and REINFORCE with a KL penalty.

Arrays in, arrays out; the model call lives in the train step. Per-token arrays
follow the alignment of `docs/internals.md` ("Shapes and alignment"), which
`token_logprobs` produces from a forward pass.
"""

from mtrl_jax.losses.aggregation import (
    AGGREGATIONS,
    aggregate,
    finalize_metrics,
    merge_metric_sums,
    safe_divide,
)
from mtrl_jax.losses.logprobs import (
    chunked_target_logprobs,
    chunked_token_logprobs,
    target_entropy,
    target_logprobs,
    token_entropy,
    token_logprobs,
)
from mtrl_jax.losses.offpolicy import CORRECTIONS, importance_weights
from mtrl_jax.losses.policy import (
    ALGORITHMS,
    KL_ESTIMATORS,
    LossConfig,
    policy_loss,
    policy_loss_terms,
)

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "CORRECTIONS",
    "KL_ESTIMATORS",
    "importance_weights",
    "LossConfig",
    "aggregate",
    "chunked_target_logprobs",
    "chunked_token_logprobs",
    "finalize_metrics",
    "merge_metric_sums",
    "policy_loss",
    "policy_loss_terms",
    "safe_divide",
    "target_entropy",
    "target_logprobs",
    "token_entropy",
    "token_logprobs",
]
