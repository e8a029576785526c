"""Editing protobuf messages in their wire format, without a protobuf runtime.

Enough of the format (varints; the wire types 0, 1, 2 and 5 that proto3 writes) to walk a message's
fields and drop sub-fields of its length-delimited ones: data/vocab.py clears the
temporary rule-file paths from a trained sentencepiece model this way, so that no
protobuf runtime of a particular version is needed (sentencepiece's generated module
pins one).
"""

from __future__ import annotations


def read_varint(data: bytes, at: int) -> tuple[int, int]:
  """(the varint at data[at], the index after it)."""
  value, shift = 0, 0
  while True:
    byte = data[at]
    at += 1
    value |= (byte & 0x7F) << shift
    if byte < 0x80:
      return value, at
    shift += 7


def encode_varint(value: int) -> bytes:
  """A non-negative int as a protobuf varint: 7 bits a byte, low first."""
  out = bytearray()
  while True:
    byte = value & 0x7F
    value >>= 7
    if value:
      out.append(byte | 0x80)
    else:
      out.append(byte)
      return bytes(out)


def fields(message: bytes):
  """(key, start, payload start, end) of each field of a protobuf wire-format message."""
  at = 0
  while at < len(message):
    start = at
    key, at = read_varint(message, at)
    body, wire = at, key & 7
    if wire == 0:
      _, at = read_varint(message, at)
    elif wire in (1, 5):
      at += 8 if wire == 1 else 4
    elif wire == 2:
      size, body = read_varint(message, at)
      at = body + size
    else:
      raise ValueError(f"protobuf message: unexpected wire type {wire} at byte {start}")
    yield key, start, body, at


def drop_subfields(message: bytes, edits: dict) -> bytes:
  """`message` (protobuf wire format) with, inside each length-delimited field k of
  `edits`, the sub-field edits[k] removed."""
  out = bytearray()
  for key, start, body, end in fields(message):
    if key & 7 == 2 and key >> 3 in edits:
      inner = b"".join(message[body:end][s:e] for k, s, _, e in fields(message[body:end])
                       if k >> 3 != edits[key >> 3])
      out += encode_varint(key) + encode_varint(len(inner)) + inner
    else:
      out += message[start:end]
  return bytes(out)
