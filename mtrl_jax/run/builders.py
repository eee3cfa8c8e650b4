"""The small builders of a run's inputs from their config groups: the tokenizer, its chat
renderer and the task sources (a split, or a curriculum level of the train split).

Both sides of a run use them: validation (`run.checks`) builds each once to see that
it works, and the composition root (`run.components.build`) builds the run's parts
with them, so an input is built one way only. They sit below both: nothing here
imports validation or the composition root.
"""

from __future__ import annotations

from mtrl_jax import data
from mtrl_jax.registry import import_object
from mtrl_jax.run.inputs import TasksConfig, TokenizerConfig


def make_tokenizer(cfg: TokenizerConfig, model_path: str = ""):
  """The policy's tokenizer: `model_path`'s tokenizer.json ('hf') or the byte tokenizer
  with `cfg.extra_specials`."""
  from mtrl_jax import text

  if cfg.kind == "hf":
    return text.HFTokenizer.from_dir(model_path)
  extra = tuple(import_object(cfg.extra_specials)) if cfg.extra_specials else ()
  return text.ByteTokenizer(extra_specials=extra)


def make_renderer(cfg: TokenizerConfig, tokenizer):
  """The chat renderer of `tokenizer` in `cfg.chat_format`."""
  from mtrl_jax import text

  fmt = text.chatml(tokenizer) if cfg.chat_format == "chatml" else text.compact(tokenizer)
  return text.ChatRenderer(tokenizer, fmt, strip_thinking=cfg.strip_thinking)


def make_task_source(tasks: TasksConfig, split: str):
  return data.resolve_task_source(tasks.source, split, **dict(tasks.kwargs))


def make_level_source(tasks: TasksConfig, curriculum: data.CurriculumConfig, level: int):
  """The train split's task source at curriculum level `level`."""
  kwargs = {**dict(tasks.kwargs), curriculum.level_key: level}
  return data.resolve_task_source(tasks.source, tasks.train_split, **kwargs)
