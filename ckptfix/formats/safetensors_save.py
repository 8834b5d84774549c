"""Write a `.safetensors` file tensor by tensor: unchanged tensors are copied as raw byte ranges."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from ckptfix.checkpoint import ByteRange
from ckptfix.dtypes import DTYPE_SIZES
from ckptfix.errors import RepairError
from ckptfix.formats.safetensors_file import SAFETENSORS_DTYPES
from ckptfix.formats.torch_save import tensor_bytes
from ckptfix.io import copy_range
from ckptfix.progress import Progress


@dataclass
class Entry:
    name: str
    dtype: str  # torch name, e.g. "bfloat16"
    shape: tuple[int, ...]
    copy_from: ByteRange | None = None
    produce: Callable[[], Any] | None = None  # a numpy array or torch tensor (as torch_save writes it)

    @property
    def nbytes(self) -> int:
        return DTYPE_SIZES[self.dtype] * math.prod(self.shape)


def write(out: BinaryIO, entries: list[Entry], metadata: dict[str, str] | None = None,
          progress: Progress | None = None) -> None:
    """Header first (offsets are known from shapes), then each tensor's bytes in order (counted by `progress`)."""
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for e in entries:
        header[e.name] = {"dtype": SAFETENSORS_DTYPES[e.dtype], "shape": list(e.shape),
                          "data_offsets": [offset, offset + e.nbytes]}
        offset += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data section starts 8-byte aligned, as the safetensors library writes it
    out.write(len(raw).to_bytes(8, "little"))
    out.write(raw)
    for e in progress(entries, offset, "repair") if progress else entries:
        if e.produce is not None:
            data = tensor_bytes(e.produce())
            if len(data) != e.nbytes:
                raise RepairError(f"{e.name}: produced {len(data)} bytes, expected {e.nbytes}")
            out.write(data)
        else:
            assert e.copy_from is not None  # an Entry has a producer or a source range
            _copy_range(out, e.copy_from, e.nbytes)


def _copy_range(out: BinaryIO, where: ByteRange, n: int) -> None:
    out.flush()
    pos = out.tell()
    with open(where.file, "rb") as src:
        copy_range(src.fileno(), out.fileno(), where.start, pos, n)
    out.seek(pos + n)
