"""A minimal streaming zip writer for torch's archive layout (stored records, 64-byte aligned data).

Why not `zipfile`: unchanged tensor records are copied from the source file with
`os.copy_file_range` (kernel side, no user-space buffer) and keep their known CRC-32, so writing
a repaired checkpoint costs about one file copy. Records are aligned like `torch.save` aligns them
(a padding extra field), so `torch.load(mmap=True)` maps them directly. Zip64 is used when needed.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

from ckptfix.io import copy_range

ALIGNMENT = 64
PAGE = 4096
_PAGE_MATCH_MIN = 1 << 20  # copies at least this large get page-congruent offsets (<= 4 KiB padding each)
_ZIP64_LIMIT = 0xFFFFFFFF


@dataclass
class _Entry:
    name: bytes
    offset: int
    size: int
    crc: int


class ZipWriter:
    """Write members one after another; call `close()` to write the central directory."""

    def __init__(self, fileobj: BinaryIO):
        self.f = fileobj
        self.entries: list[_Entry] = []

    def _local_header(self, name: bytes, size: int, crc: int, page_offset: int | None = None) -> None:
        offset = self.f.tell()
        zip64 = size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT
        extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
        base = 30 + len(name) + len(extra)
        pad = (-(offset + base + 4)) % ALIGNMENT  # 4: the padding field's own header
        if page_offset is not None and page_offset % ALIGNMENT == 0:
            # Data at the same offset within a page as in the source: the kernel's copy then moves whole
            # pages (about 1.5x faster than a copy shifted within pages), and stays 64-byte aligned.
            pad = (page_offset - (offset + base + 4)) % PAGE
        extra += struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # "FB": the field torch uses for padding
        stored = _ZIP64_LIMIT if zip64 else size
        self.f.write(struct.pack("<4sHHHHHLLLHH", b"PK\x03\x04", 45 if zip64 else 20, 0, 0, 0, 0x21,
                                 crc, stored, stored, len(name), len(extra)))
        self.f.write(name)
        self.f.write(extra)
        self.entries.append(_Entry(name, offset, size, crc))

    def write_bytes(self, name: str, data: bytes | memoryview) -> None:
        data = memoryview(data).cast("B")
        self._local_header(name.encode(), len(data), zlib.crc32(data))
        self.f.write(data)

    def copy_range(self, name: str, src: BinaryIO, start: int, size: int, crc: int,
                   tail: bytes | memoryview = b"") -> None:
        """Copy `size` bytes of an open source file from `start`, then write `tail` (e.g. rows added to a
        copied tensor), as one member whose CRC-32 (of all its bytes) is already known."""
        self._local_header(name.encode(), size + len(tail), crc,
                           page_offset=start % PAGE if size >= _PAGE_MATCH_MIN else None)
        self.f.flush()
        pos = self.f.tell()
        copy_range(src.fileno(), self.f.fileno(), start, pos, size)
        self.f.seek(pos + size)
        if len(tail):
            self.f.write(tail)

    def close(self) -> None:
        cd_start = self.f.tell()
        for e in self.entries:
            zip64 = e.size >= _ZIP64_LIMIT or e.offset >= _ZIP64_LIMIT
            extra = struct.pack("<HHQQQ", 0x0001, 24, e.size, e.size, e.offset) if zip64 else b""
            size = _ZIP64_LIMIT if zip64 else e.size
            offset = _ZIP64_LIMIT if zip64 else e.offset
            self.f.write(struct.pack("<4sHHHHHHLLLHHHHHLL", b"PK\x01\x02", 45 if zip64 else 20,
                                     45 if zip64 else 20, 0, 0, 0, 0x21, e.crc, size, size, len(e.name),
                                     len(extra), 0, 0, 0, 0, offset))
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

