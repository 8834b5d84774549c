"""A minimal streaming zip writer that lays records out exactly as `torch.save` (miniz) does.

Why not `zipfile`: unchanged tensor records are copied from the source file with
`os.copy_file_range` (kernel side, no user-space buffer) and keep their known CRC-32, so writing
a repaired checkpoint costs about one file copy. Why byte-for-byte miniz's layout: `torch.load`
with `map_location="meta"` (how `transformers` reads `.bin` weights) does not look records up: it
computes each one's offset from the previous one, assuming miniz's headers (no sizes, a "FB"
padding field to the next 64-byte boundary, a zip64 field only where a value overflows) and the
data descriptor miniz writes after every record. Any other padding makes it read the wrong bytes.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from ckptfix.io import copy_range

ALIGNMENT = 64
_ZIP64_LIMIT = 0xFFFFFFFF
_FLAGS = 0x0808  # bit 3: sizes and CRC in a data descriptor after the data; bit 11: UTF-8 names


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int
    data_start: int = 0


class ZipWriter:
    """Write members one after another; call `close()` to write the central directory."""

    def __init__(self, fileobj: BinaryIO):
        self.f = fileobj
        self.entries: list[_Entry] = []

    def _local_header(self, name: bytes, size: int, crc: int) -> _Entry:
        offset = self.f.tell()
        big, far = size >= _ZIP64_LIMIT, offset >= _ZIP64_LIMIT
        extra = _zip64_extra(size if big else None, offset if far else None)
        # torch's getPadding(): the padding field's own 4 bytes, then up to the next 64-byte boundary
        pad = (-(offset + 30 + len(name) + len(extra) + 4)) % ALIGNMENT
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": the field torch uses for padding
        self.f.write(struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 0, _FLAGS, 0, 0, 0, 0, 0, 0,
                                 len(name), len(extra)))
        self.f.write(name)
        self.f.write(extra)
        entry = _Entry(name, offset, size, crc, offset + 30 + len(name) + len(extra))
        self.entries.append(entry)
        return entry

    def _descriptor(self, entry: _Entry) -> None:
        if entry.size >= _ZIP64_LIMIT or entry.offset >= _ZIP64_LIMIT:
            self.f.write(struct.pack("<4sLQQ", b"PK\x07\x08", entry.crc, entry.size, entry.size))
        else:
            self.f.write(struct.pack("<4sLLL", b"PK\x07\x08", entry.crc, entry.size, entry.size))

    def write_bytes(self, name: str, data: bytes | memoryview) -> _Entry:
        data = memoryview(data).cast("B")
        entry = self._local_header(name.encode(), len(data), zlib.crc32(data))
        self.f.write(data)
        self._descriptor(entry)
        return entry

    def rewrite(self, entry: _Entry, data: bytes | memoryview) -> None:
        """Replace a member's bytes by as many other bytes (e.g. a value known only at the end)."""
        data = memoryview(data).cast("B")
        if len(data) != entry.size:
            raise ValueError("a rewritten zip member must keep its size")
        end = self.f.tell()
        entry.crc = zlib.crc32(data)
        self.f.seek(entry.data_start)
        self.f.write(data)
        self._descriptor(entry)
        self.f.seek(end)

    def copy_range(self, name: str, src: BinaryIO, start: int, size: int, crc: int,
                   tail: bytes | memoryview = b"") -> None:
        """Copy `size` bytes of an open source file from `start`, then write `tail` (e.g. rows added to a
        copied tensor), as one member whose CRC-32 (of all its bytes) is already known."""
        entry = self._local_header(name.encode(), size + len(tail), crc)
        self.f.flush()
        pos = self.f.tell()
        copy_range(src.fileno(), self.f.fileno(), start, pos, size)
        self.f.seek(pos + size)
        if len(tail):
            self.f.write(tail)
        self._descriptor(entry)

    def close(self) -> None:
        cd_start = self.f.tell()
        for e in self.entries:
            big, far = e.size >= _ZIP64_LIMIT, e.offset >= _ZIP64_LIMIT
            extra = _zip64_extra(e.size if big else None, e.offset if far else None)
            size = _ZIP64_LIMIT if big else e.size
            offset = _ZIP64_LIMIT if far else e.offset
            self.f.write(struct.pack("<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 0, 0, _FLAGS, 0, 0, 0,
                                     e.crc, size, size, len(e.name), len(extra), 0, 0, 0, 0, offset))
            self.f.write(e.name)
            self.f.write(extra)
        cd_size = self.f.tell() - cd_start
        count = len(self.entries)
        if cd_start >= _ZIP64_LIMIT or count >= 0xFFFF:
            eocd64 = self.f.tell()
            self.f.write(struct.pack("<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, count, count,
                                     cd_size, cd_start))
            self.f.write(struct.pack("<4sLQL", b"PK\x06\x07", 0, eocd64, 1))
            self.f.write(struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF,
                                     _ZIP64_LIMIT, _ZIP64_LIMIT, 0))
        else:
            self.f.write(struct.pack("<4sHHHHLLH", b"PK\x05\x06", 0, 0, count, count, cd_size, cd_start, 0))


def _zip64_extra(size: int | None, offset: int | None) -> bytes:
    """miniz's zip64 field: only the values that overflow (sizes as uncompressed, compressed; then offset)."""
    fields = ([size, size] if size is not None else []) + ([offset] if offset is not None else [])
    if not fields:
        return b""
    return struct.pack(f"<HH{len(fields)}Q", 0x0001, 8 * len(fields), *fields)
