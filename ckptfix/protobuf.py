"""The few protobuf wire-format reads that sentencepiece's ModelProto needs (no protobuf dependency).

Used by the tokenizer reader (sniffing) and token identity (piece types).
Truncated or overlong input raises IndexError / ValueError / struct.error for the caller to turn into
its own error.
"""

from __future__ import annotations

import struct
from typing import Iterator


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """(value, next position) of the base-128 varint at `pos`."""
    value, shift = 0, 0
    while True:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift >= 64:
            raise ValueError("overlong varint")


def fields(data: bytes) -> Iterator[tuple[int, int | float | bytes]]:
    """(field number, value) of a message: int for varints, bytes for length-delimited, float for fixed32/64."""
    pos = 0
    while pos < len(data):
        key, pos = varint(data, pos)
        wire = key & 7
        value: int | float | bytes
        if wire == 0:
            value, pos = varint(data, pos)
        elif wire == 2:
            length, pos = varint(data, pos)
            value, pos = data[pos:pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = struct.unpack_from("<d" if wire == 1 else "<f", data, pos)[0], pos + size
        else:
            raise ValueError("unsupported protobuf wire type")
        yield key >> 3, value
