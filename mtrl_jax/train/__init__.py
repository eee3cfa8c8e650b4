"""Training: the sharded train step, its objectives and optimizer, the SFT step.

A run that uses them (config, composition, the loop) is `mtrl_jax.run`, one layer up.
"""

from mtrl_jax.train.optim import OptimConfig, make_optimizer, make_schedule
from mtrl_jax.train.sft import SFTBatcher, SFTObjective, make_sft_step, pack_sft_rows
from mtrl_jax.train.objectives import Objective, PolicyObjective, train_mask
from mtrl_jax.train.step import NonFiniteError, StepConfig, TrainState, TrainStep

__all__ = [
    "NonFiniteError",
    "Objective",
    "OptimConfig",
    "PolicyObjective",
    "SFTBatcher",
    "SFTObjective",
    "StepConfig",
    "TrainState",
    "TrainStep",
    "make_optimizer",
    "make_schedule",
    "make_sft_step",
    "pack_sft_rows",
    "train_mask",
]
