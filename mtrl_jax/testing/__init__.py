"""Fakes shared by tests and benchmarks: scripted environments, transitions and builders.

The top layer of the package (it may import anything; nothing in the package
imports it). `fakes.py` holds the scripted stand-ins, `builders.py` what tests build
on; `tests/conftest.py` hands the builders to tests as fixtures.

  TokenTransition     token-level environment for benchmarks: no text, no tools,
                      fixed shapes (the workloads of benchmarks/bench_engine.py and
                      benchmarks/bench_rl.py)
  ScriptedTransition  text-free transition on token lists for the engine tests
  DuoEnv, SoloEnv, ToolThenUserEnv
                      small text environments with scripted rules
  FakePolicy          deterministic stand-in for the decode engine: each sample a pure
                      function of its request, finishing after a random number of steps
  byte_tokenizer(), byte_renderer(), tiny_model()
                      the byte tokenizer with the compact chat format, and the
                      seed-0 `tiny` model, built once per process
  logits(model, tokens)
                      a model's logits as one compiled program (what reference checks
                      against transformers and exports compare)
  rows_batch(rows), dense_rows(batch, x), rows_of(tree, buckets)
                      a train batch of plain row arrays, per-token values back at their
                      row positions, and a finalized tree as the rows layout
  hf_checkpoint(dir, ...)
                      a local HF checkpoint: a preset's random weights and a
                      byte-level BPE tokenizer trained on a few sentences
  built_once(tmp_path_factory, name, build)
                      a directory built once per `pytest` run, whichever
                      pytest-xdist worker asks first (the others wait and reuse it)
  stopped_copy(run, workdir, step)
                      a copy of the run directory `run` as it stood after `step`: what
                      a run stopped there leaves, for resume-equals-uninterrupted tests
  cpu_env(devices, **extra)
                      this process's environment for a subprocess that sees
                      `devices` CPU devices (the test XLA flags and compilation cache kept)
"""

from mtrl_jax.testing.builders import (
    built_once,
    byte_renderer,
    byte_tokenizer,
    cpu_env,
    dense_rows,
    hf_checkpoint,
    logits,
    rows_batch,
    rows_of,
    stopped_copy,
    tiny_model,
)
from mtrl_jax.testing.fakes import (
    CLOSED,
    FEEDBACK,
    TOOL,
    DuoEnv,
    FakePolicy,
    ScriptedTransition,
    SoloEnv,
    TokenState,
    TokenTransition,
    TokState,
    ToolThenUserEnv,
    total_ids,
)

__all__ = [
    "TokenState",
    "TokenTransition",
    "FEEDBACK",
    "TOOL",
    "TokState",
    "ScriptedTransition",
    "total_ids",
    "CLOSED",
    "DuoEnv",
    "SoloEnv",
    "ToolThenUserEnv",
    "FakePolicy",
    "byte_tokenizer",
    "byte_renderer",
    "tiny_model",
    "logits",
    "rows_batch",
    "dense_rows",
    "rows_of",
    "hf_checkpoint",
    "built_once",
    "stopped_copy",
    "cpu_env",
]
