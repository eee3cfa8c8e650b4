"""TensorBoard event files (`mtrl_jax.event_file`) against tensorboardX, the reference.

tensorboardX (a test dependency only) parses the records' Event protos and
computes the CRCs; the writer itself never imports it, nor torch.
"""

import glob
import os
import subprocess
import sys

import numpy as np
import pytest

from mtrl_jax import event_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_events(path):
  """Every Event of a file, each record's CRCs checked with tensorboardX's masked CRC-32C."""
  from tensorboardX.proto import event_pb2
  from tensorboardX.record_writer import masked_crc32c

  data, pos, events = open(path, "rb").read(), 0, []
  while pos < len(data):
    header, (header_crc,) = data[pos : pos + 8], np.frombuffer(data[pos + 8 : pos + 12], "<u4")
    length = int(np.frombuffer(header, "<u8")[0])
    payload = data[pos + 12 : pos + 12 + length]
    (payload_crc,) = np.frombuffer(data[pos + 12 + length : pos + 16 + length], "<u4")
    assert header_crc == masked_crc32c(header) and payload_crc == masked_crc32c(payload)
    events.append(event_pb2.Event.FromString(payload))
    pos += 16 + length
  assert pos == len(data)
  return events


def test_crc32c_matches_the_check_value_and_tensorboardx():
  from tensorboardX.crc32c import crc32c

  assert event_file.crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value (RFC 3720)
  assert event_file.crc32c(b"") == 0
  rng = np.random.default_rng(0)
  for n in (1, 7, 64, 1000):
    data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    assert event_file.crc32c(data) == crc32c(data)


def test_scalars_parse_back_as_tensorboardx_reads_them(tmp_path):
  f = event_file.EventFile(str(tmp_path))
  f.add(0, {"loss": 0.25, "reward/answer": -1.5, "eval/greedy/success": float("nan")})
  f.add(2**40, {"loss": 3e38, "a/" + "x" * 200: 1.0})  # a step past 32 bits, a long tag
  f.close()
  assert f.closed
  (path,) = glob.glob(str(tmp_path / "events.out.tfevents.*"))
  first, *steps = read_events(path)
  assert first.file_version == "brain.Event:2" and first.wall_time > 0
  assert [e.step for e in steps] == [0, 2**40]
  values = [{v.tag: v.simple_value for v in e.summary.value} for e in steps]
  assert values[0]["loss"] == 0.25 and values[0]["reward/answer"] == -1.5
  assert np.isnan(values[0]["eval/greedy/success"])
  assert values[1] == {"loss": np.float32(3e38), "a/" + "x" * 200: 1.0}


def test_a_negative_step_is_refused_in_one_line(tmp_path):
  with pytest.raises(ValueError, match=r"^event step=-1; allowed: a step >= 0$"):
    event_file.EventFile(str(tmp_path)).add(-1, {"loss": 1.0})


def test_writing_metrics_imports_neither_tensorboardx_nor_torch(tmp_path):
  code = (
      "import sys; from mtrl_jax.metrics import MetricsWriter\n"
      f"with MetricsWriter({str(tmp_path)!r}) as w: w.write(0, {{'loss': 1.0}})\n"
      "print(sorted(m for m in ('torch', 'tensorboardX') if m in sys.modules))"
  )
  out = subprocess.run(
      [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
  )
  assert out.stdout.strip() == "[]"
  assert glob.glob(str(tmp_path / "tb" / "events.out.tfevents.*"))
