"""`.safetensors`: weights only. The header (8-byte length + JSON) is all that inspect reads.

The header is parsed here rather than with `safe_open`, so inspection needs neither torch nor a
framework that knows bfloat16, and every lie a header can tell is named precisely. Tensor bytes are
read lazily through the same `TensorInfo` path as every other format.
"""

from __future__ import annotations

import json
import math
import os
import struct
from functools import partial

from ckptfix.checkpoint import ByteRange, Checkpoint, TensorInfo
from ckptfix.dtypes import DTYPE_SIZES, SAFETENSORS_TO_TORCH, TORCH_TO_SAFETENSORS
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.formats.common import find_tied
from ckptfix.untrusted import MAX_DIM

MAX_HEADER = 100 << 20  # the safetensors library's own limit

_REFUSES = "the safetensors library refuses the file too"
DTYPES = SAFETENSORS_TO_TORCH  # safetensors code -> torch name
SAFETENSORS_DTYPES = TORCH_TO_SAFETENSORS


# What safetensors 0.8 (safe_open, load_file, and so transformers' from_pretrained) does with a file cut short or
# emptied: measured in tests/test_resume_hf_model.py
CUT = ("(safetensors' load_file and transformers' from_pretrained die on it with SafetensorError 'Error while "
       "deserializing header: ...', naming no file)")

def sniff(head: bytes) -> bool:
    if len(head) < 9:
        return False
    (n,) = struct.unpack("<Q", head[:8])
    return 2 <= n <= MAX_HEADER and head[8:9] == b"{"


def read_header(path: str) -> tuple[dict, dict, int]:
    """(tensors, __metadata__, data start) with every offset checked against the file."""
    from ckptfix.formats import open_regular

    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            raw_len = f.read(8)
            if len(raw_len) < 8:
                raise UnreadableCheckpoint(f"{path}: safetensors file shorter than its 8-byte header length {CUT}")
            (n,) = struct.unpack("<Q", raw_len)
            if n > MAX_HEADER or 8 + n > size:
                raise UnreadableCheckpoint(f"{path}: safetensors header length {n} exceeds the file ({size} bytes) "
                                           f"{CUT}")
            raw = f.read(n)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot read ({exc.strerror})") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise UnreadableCheckpoint(f"{path}: safetensors header is not UTF-8") from None
    except json.JSONDecodeError as exc:
        raise UnreadableCheckpoint(f"{path}: safetensors header is not valid JSON ({exc.msg})") from None
    except (ValueError, RecursionError) as exc:  # a number too long to convert, nesting too deep
        raise UnreadableCheckpoint(f"{path}: safetensors header is not valid JSON ({type(exc).__name__})") from None
    if not isinstance(header, dict):
        raise UnreadableCheckpoint(f"{path}: safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise UnreadableCheckpoint(f"{path}: safetensors __metadata__ is not an object of strings; {_REFUSES}")
    data_start, data_len = 8 + n, size - 8 - n
    _check_layout(path, header, data_len)
    return header, metadata, data_start


def _check_layout(path: str, header: dict, data_len: int) -> None:
    """Every entry's dtype, shape and offsets, and the entries tiling the data section. One pass of plain type
    tests per entry (`type(x) is int`: JSON makes no int subclass but bool): a header of 300,000 tensors costs
    ~1 s in all with its parse, not the 6 s the generator checks cost."""
    spans = []
    sizes = {code: DTYPE_SIZES[name] for code, name in DTYPES.items()}
    for name, entry in header.items():
        if type(entry) is not dict or "dtype" not in entry or "shape" not in entry or "data_offsets" not in entry:
            raise UnreadableCheckpoint(f"{path}: safetensors entry {name!r:.80} lacks dtype/shape/data_offsets")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        itemsize = sizes.get(dtype) if type(dtype) is str else None
        if itemsize is None:
            raise UnreadableCheckpoint(f"{path}: tensor {name!r:.80} has unknown dtype {dtype!r:.40}")
        if type(shape) is not list or len(shape) > 64 or not _dims_ok(shape):
            raise UnreadableCheckpoint(f"{path}: tensor {name!r:.80} has an invalid shape {shape!r:.80}")
        if type(offsets) is not list or len(offsets) != 2 or type(offsets[0]) is not int or type(offsets[1]) is not int:
            raise UnreadableCheckpoint(f"{path}: tensor {name!r:.80} has invalid data_offsets {offsets!r:.80}")
        begin, end = offsets
        if not 0 <= begin <= end <= data_len:
            raise UnreadableCheckpoint(f"{path}: tensor {name!r:.80} data_offsets {offsets} lie outside the data "
                                       f"({data_len} bytes) {CUT}")
        if end - begin != math.prod(shape) * itemsize:
            raise UnreadableCheckpoint(f"{path}: tensor {name!r:.80} has {end - begin} bytes for shape {shape} {dtype}")
        spans.append((begin, end, name))
    spans.sort()
    for (_b1, e1, n1), (b2, _e2, n2) in zip(spans, spans[1:]):
        if b2 < e1:
            raise UnreadableCheckpoint(f"{path}: tensors {n1!r:.80} and {n2!r:.80} overlap in the data section")
    # The library (safetensors' `validate`) wants the tensors to tile the data section exactly: a gap could hide
    # bytes no reader shows (a pickle), trailing bytes likewise. It refuses both, so does ckptfix.
    end = 0
    for begin, stop, name in spans:
        if begin != end:
            raise UnreadableCheckpoint(f"{path}: tensor {name!r:.80} starts at data byte {begin:,}, not where the tensor "
                                       f"before it ends ({end:,}): a gap in the data section; {_REFUSES}")
        end = stop
    if end != data_len:
        raise UnreadableCheckpoint(f"{path}: {data_len - end:,} bytes after the last tensor's data; {_REFUSES}")


def _dims_ok(shape: list) -> bool:
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_DIM:  # bool, float, str, None, list: refused
            return False
    return True


def tensors(path: str, prefix_id: str = "") -> tuple[dict[str, TensorInfo], dict]:
    """The lazily readable tensors of one safetensors file, in header order, and its metadata."""
    header, metadata, start = read_header(path)
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        # a ByteRange made when asked (partial): a frozen dataclass per tensor up front cost ~1 s for 300,000
        out[name] = TensorInfo(name, tuple(entry["shape"]), DTYPES[entry["dtype"]],
                               partial(ByteRange, path, start + begin, end - begin), f"{prefix_id}{path}:{begin}")
    return out, metadata


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    """A `.safetensors` file (no pickles in it: `trust_pickle` has nothing to do)."""
    model, metadata = tensors(path)
    ckpt = Checkpoint(path=path, format="safetensors", model=model, tied=find_tied(model), ordered=False)
    ckpt.sections["model"] = os.path.basename(path)
    if metadata:
        ckpt.extras["__metadata__"] = metadata
    ckpt.files["model"] = path
    return ckpt
