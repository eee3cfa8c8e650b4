"""Jitted prefill + decode with a KV cache: one prefill per prompt, G branches.

`Sampler.generate(state, prompts, G, SamplingConfig(...), key, stop_ids, pad_id)`
returns tokens, behaviour log-probs, lengths and finish reasons as numpy.

`mtrl_jax.sampling.generation` (not imported here) holds the text-generation
services judges and user simulators share: `TextGenerator`, `LocalLLM` (a
local model on this sampler), `BatchingGenerator`, `ScriptedGenerator`.
"""

from mtrl_jax.sampling.filters import choose_tokens, filtered_logits, inverse_cdf
from mtrl_jax.sampling.sampler import SampleResult, Sampler, SamplingConfig

__all__ = ["SamplingConfig", "Sampler", "SampleResult", "choose_tokens", "filtered_logits",
           "inverse_cdf"]
