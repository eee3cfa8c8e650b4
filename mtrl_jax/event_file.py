"""TensorBoard event files of scalars, written without TensorFlow, tensorboardX or torch.

An event file is a sequence of TFRecords (a little-endian uint64 length, its
masked CRC-32C, the payload, the payload's masked CRC-32C), each payload one
`Event` protocol buffer (tensorflow/core/util/event.proto). The first event
names the file version; every later one carries a step's scalars as one
`Summary` of `(tag, simple_value)` values, which TensorBoard's scalar
dashboard reads. The few proto fields used are encoded here by hand:

  Event:          1 wall_time (double), 2 step (int64), 3 file_version (string),
                  5 summary (Summary)
  Summary:        1 value (repeated Summary.Value)
  Summary.Value:  1 tag (string), 2 simple_value (float)

(tensorboardX, the library this replaces, imports torch whenever torch is
installed: seconds and about 180 MB of resident memory at the start of every
run; docs/performance.md.)
"""

from __future__ import annotations

import os
import socket
import struct
import time
from typing import Mapping

_FILE_VERSION = b"brain.Event:2"


def _crc32c_table() -> tuple[int, ...]:
  table = []
  for n in range(256):
    c = n
    for _ in range(8):
      c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli polynomial, reflected
    table.append(c)
  return tuple(table)


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
  """CRC-32C (Castagnoli) of `data`, the checksum TFRecord framing uses."""
  crc = 0xFFFFFFFF
  for b in data:
    crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
  return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
  """TFRecord's masked CRC: rotated right by 15 bits plus a constant (mod 2**32)."""
  crc = crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
  out = bytearray()
  while True:
    byte, n = n & 0x7F, n >> 7
    if n:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
  """A length-delimited field (wire type 2): string, bytes or a sub-message."""
  return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _event(wall_time: float, step: int, tail: bytes) -> bytes:
  if step < 0:
    raise ValueError(f"event step={step}; allowed: a step >= 0")
  return b"\x09" + struct.pack("<d", wall_time) + b"\x10" + _varint(step) + tail


def scalars_event(wall_time: float, step: int, values: Mapping[str, float]) -> bytes:
  """An `Event` proto holding one `Summary` with a `simple_value` per tag."""
  summary = b"".join(
      _field(1, _field(1, tag.encode()) + b"\x15" + struct.pack("<f", value))
      for tag, value in values.items()
  )
  return _event(wall_time, step, _field(5, summary))


def record(payload: bytes) -> bytes:
  """`payload` framed as one TFRecord."""
  header = struct.pack("<Q", len(payload))
  return (
      header
      + struct.pack("<I", masked_crc32c(header))
      + payload
      + struct.pack("<I", masked_crc32c(payload))
  )


class EventFile:
  """Appends scalars to `logdir/events.out.tfevents.<time>.<host>`, flushed per call,
  in the caller's thread (a full disk raises OSError here, to the caller)."""

  def __init__(self, logdir: str):
    os.makedirs(logdir, exist_ok=True)
    now = time.time()
    name = f"events.out.tfevents.{int(now):010d}.{socket.gethostname()}"
    self._file = open(os.path.join(logdir, name), "ab")
    self._file.write(record(_event(now, 0, _field(3, _FILE_VERSION))))
    self._file.flush()

  @property
  def closed(self) -> bool:
    return self._file.closed

  def add(self, step: int, values: Mapping[str, float]) -> None:
    self._file.write(record(scalars_event(time.time(), step, values)))
    self._file.flush()

  def close(self) -> None:
    self._file.close()
