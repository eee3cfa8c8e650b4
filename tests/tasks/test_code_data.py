"""HumanEval splits: the plain loader and the TFDS builder (no TensorFlow)."""

import os
import subprocess
import sys

import pytest
import tensorflow_datasets as tfds

from mtrl_jax.tasks.code import data


def test_plain_loader_splits_follow_the_reference_configs():
  everything = data.load_humaneval("test")
  assert len(everything) == 164 and everything[0]["task_id"] == "HumanEval/0"
  assert set(everything[0]) == set(data.FIELDS) | {"index"}
  for split, (first, count) in {"train": (33, 130), "eval": (0, 32), "train_v1": (33, 100)}.items():
    rows = data.load_humaneval(split)
    assert [r["index"] for r in rows] == list(range(first, first + count))
    assert all(r["task_id"] == f"HumanEval/{r['index']}" for r in rows)
  with pytest.raises(ValueError, match="split 'validation' is not one of"):
    data.load_humaneval("validation")


def test_plain_loader_does_not_import_tfds():
  code = (
      "import sys\nfrom mtrl_jax.tasks.code import data\n"
      "assert len(data.load_humaneval('eval')) == 32\n"
      "assert 'tensorflow_datasets' not in sys.modules"
  )
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
  subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


def test_tfds_builder_matches_the_plain_loader_without_tensorflow(tmp_path):
  assert issubclass(data.HumanEvalBuilder, tfds.core.GeneratorBasedBuilder)
  for split in ("train", "eval"):
    source = data.humaneval_data_source(split, data_dir=str(tmp_path))
    expected = data.load_humaneval(split)
    assert len(source) == len(expected)
    for i in (0, len(expected) // 2, len(expected) - 1):  # dataset order is kept
      row = source[i]
      assert int(row["index"]) == expected[i]["index"]
      for field in data.FIELDS:
        assert row[field].decode("utf-8") == expected[i][field]
  assert "tensorflow" not in sys.modules
