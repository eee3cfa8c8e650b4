"""Old import path of the text-generation services: they live in `mtrl_jax.sampling.generation`.

Judges and user simulators share them, so they sit below the environment API;
this module re-exports them for code that imports them from here.
"""

from mtrl_jax.sampling.generation import (BatchingGenerator, LocalLLM, ScriptedGenerator,
                                          TextGenerator)

__all__ = ["BatchingGenerator", "LocalLLM", "ScriptedGenerator", "TextGenerator"]
