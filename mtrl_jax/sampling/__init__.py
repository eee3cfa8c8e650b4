"""The rollout engine (decode slots whose KV cache persists) and how tokens are chosen.

`DecodeEngine(model_cfg, EngineConfig(...))` samples requests (a prompt, G
samples, per-sample keys, optionally the cache of a finished sample the
prompt extends) in jitted admit / decode programs over a pool of KV slots;
`SamplingConfig` says how tokens are chosen (`filters`).

`mtrl_jax.sampling.generation` (not imported here) holds the text-generation
services judges and user simulators share: `TextGenerator`, `LocalLLM` (a
local model on its own engine), `ScriptedGenerator`; `mtrl_jax.sampling.batching`
holds `BatchingGenerator`.
"""

from mtrl_jax.sampling.config import SamplingConfig
from mtrl_jax.sampling.engine import DecodeEngine
from mtrl_jax.sampling.filters import choose_tokens, filtered_logits, inverse_cdf
from mtrl_jax.sampling.slots import EngineConfig, Handle, Request, Sample

__all__ = [
    "SamplingConfig",
    "DecodeEngine",
    "EngineConfig",
    "Request",
    "Sample",
    "Handle",
    "choose_tokens",
    "filtered_logits",
    "inverse_cdf",
]
