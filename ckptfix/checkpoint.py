"""The one in-memory model of a checkpoint, whatever format it came from.

Tensors are `TensorInfo` records: name, shape, dtype and where their bytes live. Nothing is read
until `read()` (numpy, no torch) or `to_torch()` is called, so building a `Checkpoint` costs time
in the number of tensors, not in their bytes.
"""

from __future__ import annotations

import math
import mmap
import os
import re
import stat
import struct
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.dtypes import DTYPE_SIZES, FLOAT_DTYPES, NUMPY_DTYPES, QUANTIZED_DTYPES, contiguous_stride
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.untrusted import check_inside


@dataclass(frozen=True)
class ByteRange:
    """Where a storage's bytes are: `length` bytes of `file` from `start`."""

    file: str
    start: int
    length: int
    # a zip whose `byteorder` record says "big" (written on a big-endian machine): values are read
    # byte-swapped, as torch.load reads them; writers that copy bytes raw refuse such a range
    big_endian: bool = False


@dataclass
class TensorInfo:
    """A lazily readable tensor: metadata now, bytes on request."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    locate: Callable[[], ByteRange]  # resolves the storage's bytes; may read a zip local header
    storage_id: str  # equal for tensors sharing storage (tied weights)
    offset: int = 0  # in elements, into the storage
    stride: tuple[int, ...] | None = None
    is_parameter: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES.get(self.dtype, 1)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def contiguous_stride(self) -> tuple[int, ...]:
        return contiguous_stride(self.shape)

    def repeats_storage(self) -> bool:
        """Whether the view has more elements than the distinct storage elements it addresses (stride 0,
        as `expand()` makes, or overlapping strides): its element count is not backed by bytes."""
        if self.stride is None or self.numel == 0:
            return False
        return self.numel > sum((d - 1) * s for d, s in zip(self.shape, self.stride)) + 1

    def read(self) -> np.ndarray:
        """The values as a numpy array (bfloat16 widened to float32; float8 as raw uint8)."""
        return widen_stored(self.read_stored(), self.dtype)

    def read_stored(self) -> np.ndarray:
        """The values as stored, a read-only view of the mapped file: numpy has no bfloat16 or float8,
        so those come as their raw bits (uint16 / uint8). No copy for any dtype."""
        return _read_numpy(self)

    def read_dtype(self) -> Any:
        """The numpy dtype `read_stored` returns (bfloat16/float8 as their bits)."""
        return NUMPY_DTYPES[self.dtype]

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        """(file, start, length) of the bytes `read_stored` reads (for prefetching); [] if unknown."""
        try:
            where = self.locate()
        except Exception:  # noqa: BLE001 - a tensor that cannot be located reports it when read
            return []
        return [(where.file, where.start, where.length)]

    def files(self) -> list[str]:
        """The files holding its bytes (a writer rewrites those)."""
        return [self.locate().file]

    def read_rows_into(self, dst: np.ndarray) -> None:
        """Copy rows 0..len(dst)-1, as stored, into `dst` (one copy, no temporary)."""
        dst[...] = self.read_stored()[:dst.shape[0]]

    def to_torch(self):
        """The values as a torch tensor backed by a private copy-on-write map of the file."""
        if self.dtype in QUANTIZED_DTYPES:  # the integers alone would load as wrong values
            raise UnreadableCheckpoint(f"{self.name}: a quantized tensor ({self.dtype}); ckptfix reads its integers "
                                       "only, not its scales: load it with torch.load")
        stride = self.stride if self.stride is not None else self.contiguous_stride()
        storage = _mapped_storage(self, writable=True)
        if not storage.dtype.isnative:  # a big-endian archive: torch takes native bytes only (a copy)
            storage = storage.astype(storage.dtype.newbyteorder("="))
        return stored_to_torch(storage, self.dtype).as_strided(self.shape, stride, self.offset)


_MAPS: dict[tuple, mmap.mmap] = {}
_SMALL_READ = 1 << 16


class _ReadMap(mmap.mmap):
    """A read-only map whose small slices are read with pread().

    A page fault on an uncached page makes the kernel read around it, up to the device's read-ahead
    (8 MB on a virtio disk with read_ahead_kb=8192) per fault: reading a zip local header or an
    optimizer `step` through the map cost megabytes each on a cold cache (inspect of a 2 GB checkpoint:
    ~200 ms instead of ~25 ms). pread() reads just those bytes; large slices (CRCs, --scan) and
    np.frombuffer still go through the map, with read-ahead, as bulk reads should.
    """

    _fd: int | None = None

    def __getitem__(self, key):
        if self._fd is not None and isinstance(key, slice) and key.step in (None, 1):
            start, stop, _ = key.indices(len(self))
            if 0 < stop - start <= _SMALL_READ:
                data = os.pread(self._fd, stop - start, start)
                if len(data) == stop - start:
                    return data
        return super().__getitem__(key)

    def close(self) -> None:
        super().close()
        self._release_fd()

    def _release_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:
        try:
            self._release_fd()
        except Exception:  # interpreter shutdown
            pass


class _MirrorMap(_ReadMap):
    """A `_ReadMap` of a mirror file (an object in object storage, `ckptfix.remote`): each slice or byte
    read through it fetches its range first. Buffer-protocol readers (numpy, struct) call `remote.ensure`
    themselves: `_mapped_storage`, `read_scalar`, `read_last_row`."""

    _path: str = ""

    def __getitem__(self, key):
        remote = sys.modules["ckptfix.remote"]  # loaded: this map exists only for a mirror file

        if isinstance(key, slice):
            start, stop, _ = key.indices(len(self))
            remote.ensure(self._path, start, stop - start)
        elif isinstance(key, int):
            remote.ensure(self._path, key % len(self), 1)
        return super().__getitem__(key)


def _ensure(path: str, start: int, length: int) -> None:
    """`remote.ensure` where a URL was named in this process; nothing (no import) otherwise."""
    remote = sys.modules.get("ckptfix.remote")
    if remote is not None:
        remote.ensure(path, start, length)


def file_map(path: str, writable: bool = False) -> mmap.mmap:
    """One shared map per file: reading many small records costs no open() each.

    Keyed by inode, size and mtime too, so a file replaced under the same name is mapped afresh.
    The writable map is copy-on-write (ACCESS_COPY): writes stay private, the file never changes.
    """
    st = os.stat(path)
    # The inode (device + number) names the file whatever path or link reached it; no realpath()
    # per call: a step tensor's read maps its file twice, and checkpoints hold hundreds of steps.
    key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, writable)
    mapped = _MAPS.get(key)
    if mapped is None or mapped.closed:
        if not stat.S_ISREG(st.st_mode):  # a folder or device named as a data file: mmap says only EINVAL
            raise UnreadableCheckpoint(f"{path}: not a regular file")
        if st.st_size == 0:
            raise UnreadableCheckpoint(f"{path}: empty file (0 bytes)")
        check_inside(path)  # a data file below an input folder must live in it (never through a link out)
        if writable:  # private writes must stay visible through the map: no pread() shortcut
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        else:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
            remote = sys.modules.get("ckptfix.remote")
            mirrored = remote is not None and remote.is_mirrored(path)
            try:
                if mirrored:
                    mapped = _MirrorMap(fd, 0, access=mmap.ACCESS_READ)
                    mapped._path = os.path.abspath(path)
                else:
                    mapped = _ReadMap(fd, 0, access=mmap.ACCESS_READ)
            except BaseException:
                os.close(fd)
                raise
            mapped._fd = fd  # kept open for pread() (the map holds its own duplicate)
        _MAPS[key] = mapped
    return mapped


def release_maps() -> None:
    """Forget cached maps (arrays handed out keep their own reference to the mapping)."""
    _MAPS.clear()


def _mapped_storage(tensor: TensorInfo, writable: bool = False) -> np.ndarray:
    where = tensor.locate()
    np_dtype = NUMPY_DTYPES.get(tensor.dtype)
    if np_dtype is None:
        raise UnreadableCheckpoint(f"{tensor.name}: cannot read dtype {tensor.dtype}")
    itemsize = np.dtype(np_dtype).itemsize
    count = where.length // itemsize
    if where.big_endian:
        np_dtype = np.dtype(np_dtype).newbyteorder(">")
    if count == 0:
        return np.zeros(0, dtype=np_dtype)
    try:
        mapped = file_map(where.file, writable)
        if where.start + count * itemsize > len(mapped):
            raise UnreadableCheckpoint(f"{tensor.name}: data runs past the end of {where.file} (truncated?)")
        _ensure(where.file, where.start, count * itemsize)
        return np.frombuffer(mapped, dtype=np_dtype, count=count, offset=where.start)
    except (OSError, ValueError) as exc:
        raise UnreadableCheckpoint(f"{tensor.name}: cannot map data in {where.file}: {exc}") from None


def _read_numpy(tensor: TensorInfo) -> np.ndarray:
    if tensor.numel == 0:  # no bytes to map; numpy refuses some empty shapes torch allows ((0, 2**62): "too big")
        try:
            return np.empty(tensor.shape, dtype=tensor.read_dtype())
        except ValueError:
            return np.empty(0, dtype=tensor.read_dtype())  # the same zero values; the shape stays in TensorInfo
    storage = _mapped_storage(tensor)
    stride = tensor.stride if tensor.stride is not None else tensor.contiguous_stride()
    last = tensor.offset + sum((d - 1) * s for d, s in zip(tensor.shape, stride)) if tensor.numel else 0
    if tensor.numel and (tensor.offset < 0 or last >= storage.size):
        raise UnreadableCheckpoint(f"{tensor.name}: view lies outside its storage record (corrupt or short record)")
    itemsize = storage.itemsize
    view = np.lib.stride_tricks.as_strided(
        storage[tensor.offset:] if tensor.numel else storage, shape=tensor.shape,
        strides=tuple(s * itemsize for s in stride), writeable=False)
    return view


def collapse_repeats(array: np.ndarray, keep: tuple[int, ...] | None = None) -> tuple[np.ndarray, int]:
    """`array` with its stride-0 dimensions (an `expand()`ed view: every value repeats along them) cut
    to length 1, and how many elements of `array` each remaining element stands for. Dimensions in
    `keep` are never cut. A 4M x 64 view of one 64-value row is read as 64 values, never materialised."""
    index, weight = [], 1
    for dim, (size, stride) in enumerate(zip(array.shape, array.strides)):
        if stride == 0 and size > 1 and (keep is None or dim not in keep):
            index.append(slice(0, 1))
            weight *= size
        else:
            index.append(slice(None))
    return (array[tuple(index)], weight) if weight > 1 else (array, 1)


def distinct_stored(array: np.ndarray) -> tuple[np.ndarray, int]:
    """The storage elements a view addresses, each once, and how many view elements each stands for (exact for
    stride-0 dimensions; for an overlapping view, the span it covers with weight 1). A 4M x 64 view of one
    64-value row costs 64 values: a walk of its elements would be a tree walk of a DAG."""
    values, weight = collapse_repeats(array)
    if overlaps_itself(values):
        span = sum((d - 1) * s for d, s in zip(values.shape, values.strides)) // values.itemsize + 1
        values, weight = np.lib.stride_tricks.as_strided(values, (span,), (values.itemsize,), writeable=False), 1
    return values, weight


def overlaps_itself(array: np.ndarray) -> bool:
    """Whether a (non-negative-stride) view addresses fewer distinct bytes than it has elements: reading
    it element by element would cost more than the bytes present (an overlapping `as_strided` view)."""
    if array.size == 0:
        return False
    span = sum((d - 1) * s for d, s in zip(array.shape, array.strides)) // max(array.itemsize, 1) + 1
    return array.size > span


def widen_stored(array: np.ndarray, dtype: str) -> np.ndarray:
    """Stored values as numpy floats: bfloat16 bits widened (exactly) to float32, other dtypes as they are."""
    return (array.astype(np.uint32) << 16).view(np.float32) if dtype == "bfloat16" else array


def stored_to_torch(array: np.ndarray, dtype: str):
    """A torch tensor sharing `array`'s memory, with the dtype numpy could not represent restored."""
    import torch

    tensor = torch.from_numpy(array)
    if dtype == "bfloat16" or dtype.startswith("float8"):
        tensor = tensor.view(getattr(torch, dtype))
    return tensor


def read_scalar(tensor: TensorInfo, maps: dict[str, mmap.mmap] | None = None) -> float | None:
    """A 0-d/1-element tensor's value (optimizer `step` is one); None if unreadable. `maps`: the files this
    caller has mapped, by path (many steps of one file: `file_map` stats the file on every call)."""
    if tensor.numel != 1:
        return None
    code = _SCALAR_CODES.get(tensor.dtype)
    try:  # the one element directly, with struct: this runs for every optimizer `step`, and importing
        # numpy for it would cost inspect more than the rest of its work
        if code is None:
            return _read_scalar_numpy(tensor)
        where = tensor.locate()
        size = DTYPE_SIZES[tensor.dtype]
        if not 0 <= tensor.offset < where.length // size:
            return None  # the view lies outside its storage record
        start = where.start + tensor.offset * size
        mapped = maps.get(where.file) if maps is not None else None
        if mapped is None or mapped.closed:
            mapped = file_map(where.file, False)
            if maps is not None:
                maps[where.file] = mapped
        if start + size > len(mapped):
            return None  # data runs past the end of the file (truncated)
        _ensure(where.file, start, size)
        (value,) = struct.unpack_from(code, mapped, start)
        if tensor.dtype == "bfloat16":
            (value,) = struct.unpack("<f", struct.pack("<I", value << 16))
        return float(value)
    except (UnreadableCheckpoint, OSError, ValueError, TypeError, IndexError, struct.error):
        return None


# torch writes storages little-endian; bfloat16 is read as its bits and widened
_SCALAR_CODES = {"float64": "<d", "float32": "<f", "float16": "<e", "bfloat16": "<H", "int64": "<q", "int32": "<i",
                 "int16": "<h", "int8": "<b", "uint8": "<B", "bool": "<?", "uint16": "<H", "uint32": "<I",
                 "uint64": "<Q"}


def read_last_row(tensor: TensorInfo) -> tuple[float, ...] | None:
    """The last row of a plain, contiguous 2-D tensor as numbers (bfloat16 as its bits), read with struct;
    None when it cannot be read this way (another layout, dtype or kind of tensor). Lets a check that
    usually needs one row decide without importing numpy (`checks/reserved.py`)."""
    code = _SCALAR_CODES.get(tensor.dtype)
    if type(tensor) is not TensorInfo or code is None or len(tensor.shape) != 2 or 0 in tensor.shape:
        return None
    if tensor.stride is not None and tensor.stride != tensor.contiguous_stride():
        return None
    try:
        where = tensor.locate()
        size = DTYPE_SIZES[tensor.dtype]
        rows, width = tensor.shape
        first = tensor.offset + (rows - 1) * width
        if tensor.offset < 0 or (first + width) * size > where.length:
            return None
        mapped = file_map(where.file, False)
        start = where.start + first * size
        if start + width * size > len(mapped):
            return None
        _ensure(where.file, start, width * size)
        return struct.unpack_from(f"<{width}{code[1]}", mapped, start)
    except (UnreadableCheckpoint, OSError, ValueError, struct.error):
        return None


def _read_scalar_numpy(tensor: TensorInfo) -> float | None:
    """The other dtypes (a complex or float8 `step` is not a number ckptfix can use): as numpy reads them."""
    storage = _mapped_storage(tensor)
    if not 0 <= tensor.offset < storage.size:
        return None
    return float(storage[tensor.offset])


@dataclass
class JoinedTensor(TensorInfo):
    """One table saved as tensors that its loader concatenates along rows (Molmo2's `wte.embedding` +
    `wte.new_embedding`: transformers 5 joins them into `embed_tokens`, vocab_size + additional_vocab_size
    rows, and splits them again on save). Read as the table the model holds; named `first+second`; the
    writers save it as its parts again (`part_rows`). No single byte range: `locate()` refuses."""

    parts: tuple[TensorInfo, ...] = ()

    def read_stored(self) -> np.ndarray:
        out: np.ndarray = np.empty(self.shape, dtype=self.read_dtype())
        self.read_rows_into(out)
        out.flags.writeable = False
        return out

    def read_rows_into(self, dst: np.ndarray) -> None:
        start = 0
        for part in self.parts:
            take = min(part.shape[0], dst.shape[0] - start)
            if take <= 0:
                return
            dst[start:start + take] = part.read_stored()[:take]
            start += take

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        return [r for part in self.parts for r in part.byte_ranges()]

    def files(self) -> list[str]:
        return [f for part in self.parts for f in part.files()]

    def to_torch(self):
        return stored_to_torch(self.read_stored().copy(), self.dtype)

    def part_rows(self, rows: int) -> list[int]:
        """How many of `rows` each part holds when the table is saved again: the parts but the last keep
        their rows while the last still gets one (their bytes stay as they were when their rows do), else
        `torch.chunk`'s split, which transformers' own save makes."""
        kept = [p.shape[0] for p in self.parts[:-1]]
        if sum(kept) < rows:
            return [*kept, rows - sum(kept)]
        size = -(-rows // len(self.parts))
        return [min(size, max(rows - i * size, 0)) for i in range(len(self.parts))]


# A table the loader concatenates from two saved tensors: `<module>.embedding` then `<module>.new_embedding`
# (transformers' conversion mapping for Molmo2TextModel: Concatenate(dim=0) into `embed_tokens.weight`).
_SPLIT_SUFFIXES = ("embedding", "new_embedding")


def split_tables(model: dict[str, TensorInfo]) -> list[tuple[TensorInfo, TensorInfo]]:
    """The (first, second) parts of every table saved in two parts: same width, each 2-D."""
    out = []
    for name, first in model.items():
        if name.endswith("." + _SPLIT_SUFFIXES[0]) and len(first.shape) == 2:
            second = model.get(name[:-len(_SPLIT_SUFFIXES[0])] + _SPLIT_SUFFIXES[1])
            if second is not None and len(second.shape) == 2 and second.shape[1] == first.shape[1]:
                out.append((first, second))
    return out


def join_split_tables(model: dict[str, TensorInfo], tied: dict[str, str]) -> dict[str, TensorInfo]:
    """`model` with each table saved in two parts as one `JoinedTensor`, in the first part's place, where the
    parts can be joined as they are (one float dtype, contiguous, distinct storages, neither tied to another
    name, the joined name not a tensor's own); else left as read."""
    joined: dict[str, JoinedTensor] = {}
    aliased = set(tied) | set(tied.values())
    for first, second in split_tables(model):
        if first.dtype != second.dtype or not first.is_float or first.storage_id == second.storage_id or any(
                p.stride not in (None, p.contiguous_stride()) or type(p) is not TensorInfo or p.name in aliased
                for p in (first, second)) or f"{first.name}+{second.name}" in model:  # the name taken: as read
            continue
        table = JoinedTensor(name=f"{first.name}+{second.name}", shape=(first.shape[0] + second.shape[0],
                             first.shape[1]), dtype=first.dtype, locate=_in_parts(first.name, second.name),
                             storage_id=f"joined:{first.storage_id}+{second.storage_id}",
                             is_parameter=first.is_parameter, parts=(first, second))
        joined[first.name] = table
    if not joined:
        return model
    seconds = {t.parts[1].name for t in joined.values()}
    return {(joined[n].name if n in joined else n): joined.get(n, t) for n, t in model.items() if n not in seconds}


def _in_parts(*names: str) -> Callable[[], ByteRange]:
    def locate() -> ByteRange:
        raise UnreadableCheckpoint(f"{' + '.join(names)}: one table saved in parts, no single byte range")
    return locate


@dataclass
class ParamState:
    """Optimizer state of one parameter: its tensors (exp_avg, ...), `step`, and the rest verbatim."""

    tensors: dict[str, TensorInfo] = field(default_factory=dict)
    step: float | None = None
    other: dict[str, Any] = field(default_factory=dict)
    step_kind: str = "tensor"  # how `step` was saved: tensor (torch.optim), int (transformers' Adafactor, bitsandbytes), float


@dataclass
class ParamGroup:
    params: list[Any]  # optimizer indices (ints) or, for DCP, parameter FQNs
    options: dict[str, Any]  # lr, betas, eps, weight_decay, ... verbatim

    @property
    def lr(self) -> float | None:
        lr = self.options.get("lr")
        if isinstance(lr, TensorInfo):
            return read_scalar(lr)
        return float(lr) if isinstance(lr, (int, float)) else None


@dataclass
class OptimizerPart:
    """One of several optimizers saved in one checkpoint (Muon for the matrices, AdamW for the rest):
    where it is saved, its kind, and its entries in the merged `OptimizerState` (indices `(part, index)`)."""

    section: str  # e.g. "optimizers[1]", "optimizer_states[0]", "state/optimizers/AdamW"
    kind: str
    groups: int  # how many of the merged groups are its own (they follow the previous part's)
    indices: frozenset[Any]


@dataclass
class OptimizerState:
    kind: str  # as `ckptfix.optim_state.kind_name` names it: "AdamW", "SGD (momentum)", "unknown (states: ...)"
    groups: list[ParamGroup]
    state: dict[Any, ParamState]
    param_names: list[str] | None = None  # optimizer index -> model name, when the checkpoint records it
    parts: list[OptimizerPart] = field(default_factory=list)  # several optimizers: each one's part (else empty)
    # (state entry, its step tensor) left unread in object storage: a request each (`common.read_steps`)
    unread_steps: list[tuple[ParamState, TensorInfo]] = field(default_factory=list)

    def kind_of(self, index: Any) -> str:
        """The kind of the optimizer that holds entry `index`."""
        return next((p.kind for p in self.parts if index in p.indices), self.kind)

    def indices(self) -> list[Any]:
        """Every parameter id, in param-group order (the order `optimizer.param_groups` holds them)."""
        return [p for g in self.groups for p in g.params]

    def tensors(self) -> Iterator[tuple[Any, str, TensorInfo]]:
        for index, ps in self.state.items():
            for key, t in ps.tensors.items():
                yield index, key, t


@dataclass
class Checkpoint:
    """A checkpoint in one shape for every format. `sections` says where each part came from."""

    path: str
    format: str
    model: dict[str, TensorInfo] = field(default_factory=dict)
    optimizer: OptimizerState | None = None
    scheduler: dict[str, Any] | None = None
    scaler: dict[str, Any] | None = None
    extras: dict[str, Any] = field(default_factory=dict)  # epoch, step, anything else, verbatim
    tied: dict[str, str] = field(default_factory=dict)  # alias name -> the name it shares storage with
    record: Any = None  # ckptfix.record.Record: a previous repair's (or guard.record()'s) record, if present
    notes: list[str] = field(default_factory=list)
    unopened_records: int = 0  # in object storage: tensor records opened only when read (`dcp_folder`)
    sections: dict[str, str] = field(default_factory=dict)  # "model" -> "model" key or file name
    raw: Any = None  # the format's own tree (the unpickled dict for torch files), for writers
    # a folder's other pickled files as read (optimizer.pt, a .bin shard...), by name: what CKF704/706 walk too
    pickles: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # component -> file, for folder formats
    handle: Any = None  # the format's open source (e.g. the zip member table), for verify and writers
    # why torch.load(weights_only=True) refuses the pickle beyond the objects in `raw` (globals a rebuild
    # consumed, opcodes of another pickle protocol): CKF704 names them with the objects
    weights_only_refusals: list[str] = field(default_factory=list)
    # `data_globals.raw_uses`: the objects in `raw` torch's weights-only loader refuses, walked once (the CKF704 checks
    # and the report's weights_only section ask for the same walk: on a 150,000-entry state it costs ~0.5 s)
    raw_uses: list | None = None
    # False when `model` is not in the model's registration order (safetensors stores tensors sorted by
    # name), so optimizer indices cannot be matched to parameters by position.
    ordered: bool = True

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.model.values())

    def parameters(self) -> list[str]:
        """Model tensors that are plausibly trainable parameters, in order (aliases and buffers out)."""
        return [n for n, t in self.model.items() if n not in self.tied and t.is_float and not _is_buffer(n)]


# Registered buffers that state_dicts carry but optimizers never see. "attn.bias" is GPT-2's causal
# mask buffer; it must not match a parameter such as "attn.c_attn.bias".
_BUFFER = re.compile(r"(^|\.)(running_mean|running_var|num_batches_tracked|position_ids|inv_freq|masked_bias|"
                     r"attn\.bias|token_type_ids)$")


def _is_buffer(name: str) -> bool:
    return _BUFFER.search(name) is not None

