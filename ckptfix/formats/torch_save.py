"""Write a `torch.save`-compatible zip from a tree read by `torch_file`, streaming tensor records.

Unchanged storages are copied byte for byte from the source archive (with their CRC); storages
the repair replaced are produced one at a time while their record is written, so peak memory is
one resized tensor, not the checkpoint; a storage whose first bytes are the source's (rows added at
the end, or trailing rows dropped) is a `Spliced` record: those bytes are copied raw, only the new
rows are produced. The pickle names torch's own rebuild functions as globals, exactly the ones
`torch.load(weights_only=True)` accepts, but is written without importing torch (byte for byte
what pickling the real torch objects gives): a repair that produces no tensor with torch never
pays torch's import time or its ~150 MB of memory.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import threading
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable, NamedTuple

import numpy as np

from ckptfix.checkpoint import ByteRange, file_map
from ckptfix.dtypes import DTYPE_SIZES, STORAGE_CLASS
from ckptfix.errors import RepairError
from ckptfix.formats.pickle_records import (
    OpaqueObject,
    RebuiltTensor,
    StorageRef,
    TensorRef,
    TorchDevice,
    TorchDtype,
    TorchLayout,
    global_name,
)
from ckptfix.formats.zipwriter import ZipWriter
from ckptfix.progress import Progress

_STORAGE_CLASS = STORAGE_CLASS


@dataclass
class StorageSource:
    """Where an output storage's bytes come from: a source byte range (+ CRC if known) or a producer."""

    copy_from: Callable[[], ByteRange] | None = None
    crc: int | None = None
    # returns a contiguous CPU torch tensor, a numpy array (raw element bits), or a `Spliced` record
    produce: Callable[[], Any] | None = None


@dataclass
class Spliced:
    """A produced storage that starts with `prefix` bytes of the source, copied raw, then `tail`."""

    prefix: ByteRange
    tail: Any  # bytes-like or numpy array: the bytes after the prefix (e.g. the new rows)
    prefix_crc: int | None = None  # CRC-32 of the prefix, when known (the whole source record's)


class _Global:
    """A module-level name (torch._utils._rebuild_tensor_v2, torch.FloatStorage, torch.float32): written
    as a GLOBAL opcode by name, so writing a checkpoint never imports torch."""

    __slots__ = ("module", "name")

    def __init__(self, module: str, name: str):
        self.module, self.name = module, name

    def __call__(self, *args: Any, **kwargs: Any) -> Any:  # the pickler insists a reduce function be callable
        raise TypeError(f"{self.module}.{self.name} is only a name to pickle")


_GLOBALS: dict[tuple[str, str], _Global] = {}


def _named(qualname: str) -> _Global:
    """A data class's global by its dotted name (every name in `data_globals.DATA_CLASSES` is module.name)."""
    module, _, name = qualname.rpartition(".")
    return _global(module, name)


def _writable_data(obj: OpaqueObject) -> bool:
    """Whether an inert record is a call of a known data class (numpy's `_reconstruct`/`scalar`/`dtype`, a
    path, a datetime...) that the writer re-emits as read: the same global called with the same arguments,
    then BUILD with the same state. Records with SETITEM/APPEND items or keyword arguments stay refused."""
    from ckptfix.formats.data_globals import is_data_call

    return obj.called and is_data_call(obj) and not obj.items and not obj.kwargs


# Constructions with arguments the data list accepts (`data_globals.NEW_WITH_ARGUMENTS`: Composer's TorchVersion,
# NEWOBJ from one string, no BUILD) are re-emitted as read; anything else constructed stays refused.
# Plain classes constructed empty whose BUILD sets their __dict__ (Megatron-LM's `args` in common.pt): re-emitted
# as read, NEWOBJ then BUILD with the (possibly edited) fields.
_DICT_CONSTRUCTIONS = frozenset({"argparse.Namespace"})


def _writable_construction(obj: OpaqueObject) -> bool:
    if obj.called or obj.items or obj.kwargs:
        return False
    if obj.cls in _DICT_CONSTRUCTIONS:
        return obj.args == () and isinstance(obj.state, dict) and all(isinstance(k, str) for k in obj.state)
    from ckptfix.formats.data_globals import NEW_WITH_ARGUMENTS, is_data_call

    return obj.cls in NEW_WITH_ARGUMENTS and is_data_call(obj) and obj.state is None


def _as_written(value: Any) -> Any:
    """Arguments/state of a data record as the pickler writes them: tuples rebuilt with our stand-ins for
    torch values and classes named by their global; records and tensors are handled by `reducer_override`."""
    if isinstance(value, tuple):
        return tuple(_as_written(v) for v in value)
    if isinstance(value, TorchDtype):
        return _global("torch", value.name)
    name = global_name(value)
    if name is not None:  # a class named as an argument (numpy.ndarray, for `_reconstruct`)
        from ckptfix.formats.data_globals import DATA_CLASSES

        if name not in DATA_CLASSES:
            raise RepairError(f"the checkpoint names the global {name}, which ckptfix cannot write back")
        return _named(name)
    return value


def _global(module: str, name: str) -> _Global:
    # One object per name, like the real ones: the pickler memoizes it and refers back (BINGET).
    found = _GLOBALS.get((module, name))
    if found is None:
        found = _GLOBALS[(module, name)] = _Global(module, name)
    return found


class _Reduce:
    """An object pickled as `func(*args)` (a torch.device: `torch.device('cuda', 0)`)."""

    __slots__ = ("func", "args")

    def __init__(self, func: _Global, args: tuple):
        self.func, self.args = func, args


class _Pickler(pickle._Pickler):
    """The pure-Python pickler (it lets us write GLOBALs by name); protocol 2, like torch.save.

    Storages are renumbered "0", "1", ... in the order they are pickled, as torch.save numbers them:
    `torch.load(map_location="meta")` expects the records in that order, starting at "0"."""

    dispatch = pickle._Pickler.dispatch.copy()

    def save_bytes(self, obj: bytes) -> None:
        # Protocol 2 spells b"" as `bytes()`, a global torch's weights-only loader refuses; `_codecs.encode('',
        # 'latin1')`, its spelling of every other bytes value, it accepts: one spelling for all.
        self.save_reduce(_global("_codecs", "encode"), (obj.decode("latin-1"), "latin1"),  # type: ignore[attr-defined]
                         obj=obj)

    dispatch[bytes] = save_bytes  # type: ignore[assignment]

    def __init__(self, buf: BinaryIO):
        super().__init__(buf, protocol=2)
        self.storages: dict[str, StorageRef] = {}  # output key -> the storage it writes, in pickling order
        self.keys: dict[str, str] = {}  # source key -> output key

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, _StorageAs):
            key = self.keys.get(obj.ref.key)
            if key is None:
                key = self.keys[obj.ref.key] = str(len(self.keys))
                self.storages[key] = obj.ref
            nbytes = obj.ref.nbytes
            if obj.dtype in _STORAGE_CLASS:  # a typed storage counts elements of its dtype
                return ("storage", _global("torch", _STORAGE_CLASS[obj.dtype]), key, obj.ref.location,
                        nbytes // DTYPE_SIZES[obj.dtype])
            return ("storage", _global("torch.storage", "UntypedStorage"), key, obj.ref.location, nbytes)
        return None

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, TensorRef) and obj.is_parameter:
            return (_global("torch._utils", "_rebuild_parameter"),
                    (_Plain(obj), obj.requires_grad, collections.OrderedDict()))
        if isinstance(obj, (TensorRef, _Plain)):
            t = obj.ref if isinstance(obj, _Plain) else obj
            storage = _StorageAs(t.storage, t.dtype)
            if t.quantizer is not None:  # the parameters as torch wrote them: the scheme by name, the rest as read
                params = (_global("torch", t.quantizer[0].name), *t.quantizer[1:])
                return _global("torch._utils", "_rebuild_qtensor"), (
                    storage, t.offset, tuple(t.shape), tuple(t.stride), params, t.requires_grad,
                    collections.OrderedDict())
            args: tuple[Any, ...] = (storage, t.offset, tuple(t.shape), tuple(t.stride), t.requires_grad, collections.OrderedDict())
            extra = (t.metadata,) if t.metadata else ()  # the conj/neg bits, as read
            if t.dtype in _STORAGE_CLASS:
                return _global("torch._utils", "_rebuild_tensor_v2"), (*args, *extra)
            # what torch.save does for dtypes without a typed storage class (float8, uint16/32/64, ...)
            return _global("torch._utils", "_rebuild_tensor_v3"), (*args, _global("torch", t.dtype), *extra)
        if isinstance(obj, _Reduce):
            return obj.func, obj.args
        if isinstance(obj, RebuiltTensor):  # sparse, nested, meta: the same torch._utils call, as read
            call = (_global("torch._utils", obj.rebuild), _with_torch_values(obj.args, {}))
            if obj.is_parameter:
                return (_global("torch._utils", "_rebuild_parameter"),
                        (_Reduce(*call), obj.requires_grad, collections.OrderedDict()))
            return call
        if isinstance(obj, TorchLayout):
            return _global("torch.serialization", "_get_layout"), (obj.name,)
        if isinstance(obj, OpaqueObject):
            if _writable_data(obj):  # a numpy array/scalar/dtype, a path, a date: the same call, the same state
                return (_named(obj.cls), _as_written(obj.args), _as_written(obj.state))
            raise RepairError(f"the checkpoint holds an object of class {obj.cls} that ckptfix read as an inert "
                              "record; it cannot be written back")
        return NotImplemented

    def _save_named_global(self, obj: _Global) -> None:
        self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("utf-8"))  # type: ignore[attr-defined]
        self.memoize(obj)  # type: ignore[attr-defined]

    dispatch[_Global] = _save_named_global  # type: ignore[assignment]

    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        if isinstance(obj, OpaqueObject) and _writable_construction(obj):  # the NEWOBJ it was read from
            memo = self.memo.get(id(obj))  # type: ignore[attr-defined]
            if memo is not None:
                self.write(self.get(memo[0]))  # type: ignore[attr-defined]
                return
            super().save(_named(obj.cls))  # type: ignore[misc]
            super().save(obj.args)  # type: ignore[misc]
            self.write(pickle.NEWOBJ)  # type: ignore[attr-defined]
            self.memoize(obj)  # type: ignore[attr-defined]
            if obj.state is not None:
                super().save(_with_torch_values(obj.state, {}))  # type: ignore[misc]
                self.write(pickle.BUILD)  # type: ignore[attr-defined]
            return
        super().save(obj, save_persistent_id)  # type: ignore[misc]


@dataclass
class _Plain:
    ref: TensorRef


@dataclass(frozen=True)
class _StorageAs:
    """A storage as one tensor pickles it: typed by that tensor's dtype, or untyped (bytes)."""

    ref: StorageRef
    dtype: str


# Two no-op opcode pairs (push, pop) of 2 and 3 bytes: padding that keeps a re-pickled data.pkl its size.
_NOOP2, _NOOP3 = pickle.NONE + pickle.POP, pickle.BININT1 + b"\x00" + pickle.POP


def write(out: BinaryIO, tree: Any, source_for: Callable[[StorageRef], StorageSource], *,
          prefix: str = "archive", version: bytes | None = None,
          finish: Callable[[Any, bool], Any] | None = None, progress: Progress | None = None) -> None:
    """Write `tree` as a torch zip archive; `source_for` says where each storage's bytes come from.

    The records are those torch.save writes, in its order: `data.pkl`, `.format_version`,
    `.storage_alignment`, `byteorder`, the storages `data/0`, `data/1`, ... (numbered in pickling
    order), `version`, `.data/serialization_id`. `finish(tree, final)` may add values known only after
    the bytes are copied (e.g. the source's sha256, hashed on another thread meanwhile): `data.pkl` is
    first written from `finish(tree, False)` (placeholders) and rewritten in place from
    `finish(tree, True)`, which must pickle to no more bytes. It must not add tensors. `progress`
    counts the storages' bytes as they are written.
    """
    data, storages = _pickle(finish(tree, False) if finish else tree)
    zw = ZipWriter(out)
    pkl = zw.write_bytes(f"{prefix}/data.pkl", data)
    zw.write_bytes(f"{prefix}/.format_version", b"1")
    zw.write_bytes(f"{prefix}/.storage_alignment", b"64")
    zw.write_bytes(f"{prefix}/byteorder", b"little")
    records = [_Record(key, storage, storage.nbytes) for key, storage in storages.items()]
    for record in progress(records, sum(r.nbytes for r in records), "repair") if progress else records:
        _write_storage(zw, f"{prefix}/data/{record.key}", record.storage, source_for(record.storage))
    zw.write_bytes(f"{prefix}/version", version or b"3\n")
    zw.write_bytes(f"{prefix}/.data/serialization_id", _serialization_id(zw))
    if finish is not None:
        flush = _Flush(out)  # the records go to disk while `finish` waits (e.g. for the source's hash)
        try:
            final, final_storages = _pickle(finish(tree, True))
        except BaseException:
            flush.wait(report=False)  # the error in flight is the one to see
            raise
        flush.wait()
        if final_storages.keys() != storages.keys() or len(final) > len(data):
            raise RepairError("internal: finishing the checkpoint changed its tensors or grew its pickle")
        zw.rewrite(pkl, _padded(final, len(data)))
    zw.close()


class _Record(NamedTuple):
    key: str
    storage: StorageRef
    nbytes: int


def _padded(data: memoryview, size: int) -> bytes:
    """`data` (a pickle) made exactly `size` bytes long with no-op opcodes before its STOP."""
    missing = size - len(data)
    if missing == 1:
        raise RepairError("internal: a re-pickled data.pkl is one byte short")
    threes = (missing % 2) if missing >= 3 else 0
    body = bytes(data[:-1]) + _NOOP3 * threes + _NOOP2 * ((missing - 3 * threes) // 2)
    return body + bytes(data[-1:])


def _serialization_id(zw: ZipWriter) -> bytes:
    """40 digits like torch's (20 from the records' CRCs, 20 from their names): an id for this archive."""
    crcs = zlib.crc32(b"".join(e.crc.to_bytes(4, "little") for e in zw.entries))
    names = zlib.crc32(b"\0".join(e.name for e in zw.entries))
    return f"{crcs * 2654435761 % 10**20:020d}{names * 2246822519 % 10**20:020d}".encode()


class _Flush:
    """fdatasync() of what is written so far, on a thread: the caller's final fsync then has only the
    last few kilobytes left to write. An I/O error is raised by `wait()` (the kernel reports a writeback
    error to each file descriptor once, so it must not be lost here)."""

    def __init__(self, out: BinaryIO):
        self.error: BaseException | None = None
        self.thread = None
        try:
            out.flush()
            fd = out.fileno()
        except (AttributeError, OSError, ValueError, io.UnsupportedOperation):
            return  # not a file (e.g. BytesIO): nothing to flush
        self.thread = threading.Thread(target=self._run, args=(fd,), daemon=True)
        self.thread.start()

    def _run(self, fd: int) -> None:
        try:
            os.fdatasync(fd)
        except OSError as exc:
            if exc.errno not in (22, 95):  # EINVAL/EOPNOTSUPP: a pipe or a special file, not an error
                self.error = exc

    def wait(self, report: bool = True) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None and report:
            raise self.error


def _pickle(tree: Any) -> tuple[memoryview, dict[str, StorageRef]]:
    """data.pkl's bytes and the storages it names (output key -> storage, in pickling order)."""
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    try:
        pickler.dump(_with_torch_values(tree, {}))
    except RecursionError:  # both recurse per level of nesting; torch.load reads such a file, we cannot write it
        raise RepairError("cannot write this checkpoint: a value in it is nested more than a few hundred levels "
                          "deep (real checkpoints nest a few); nothing was written") from None
    return buf.getbuffer(), pickler.storages


def _device_args(spec: str) -> tuple:
    """`torch.device(spec).__reduce__()`'s arguments: ('cpu',), ('cuda', 0)."""
    kind, sep, index = spec.partition(":")
    if not sep:
        return (kind,)
    if not index.isdigit():
        raise RepairError(f"cannot write the device {spec!r}")
    return (kind, int(index))


def _with_torch_values(node: Any, memo: dict[int, Any]) -> Any:
    """Swap our dtype/device stand-ins for what torch's own objects pickle as (a GLOBAL `torch.float32`,
    `torch.device(*args)`); containers keep their sharing."""
    if isinstance(node, TorchDtype):
        return _global("torch", node.name)
    if isinstance(node, TorchDevice):
        return _Reduce(_global("torch", "device"), _device_args(node.spec))
    if not isinstance(node, (dict, list, tuple, set, frozenset)):
        return node
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, dict):
        mapping = type(node)() if type(node) in (dict, collections.OrderedDict) else dict()
        memo[id(node)] = mapping
        for k, v in node.items():
            mapping[k] = _with_torch_values(v, memo)
        return mapping
    if isinstance(node, list):  # a list may contain itself: register it before filling it
        seq: list[Any] = []
        memo[id(node)] = seq
        seq.extend(_with_torch_values(v, memo) for v in node)
        return seq
    items = [_with_torch_values(v, memo) for v in node]
    out = type(node)(items)
    memo[id(node)] = out
    return out


def _write_storage(zw: ZipWriter, name: str, storage: StorageRef, source: StorageSource | None) -> None:
    if source is None:
        raise RepairError(f"no data for storage {storage.key}")
    if source.produce is not None:
        produced = source.produce()
        if isinstance(produced, Spliced):
            _write_spliced(zw, name, storage, produced)
            return
        data = tensor_bytes(produced)
        if len(data) != storage.nbytes:
            raise RepairError(f"storage {storage.key}: produced {len(data)} bytes, expected {storage.nbytes}")
        zw.write_bytes(name, data)
        return
    assert source.copy_from is not None  # a StorageSource has a producer or a source range
    where = _little_endian(source.copy_from())
    if where.length < storage.nbytes:
        raise RepairError(f"source record for storage {storage.key} is shorter than the storage")
    crc = source.crc
    if crc is None or where.length != storage.nbytes:
        crc = _crc_of(where, storage.nbytes)
    with open(where.file, "rb") as src:
        zw.copy_range(name, src, where.start, storage.nbytes, crc)


def _write_spliced(zw: ZipWriter, name: str, storage: StorageRef, spliced: Spliced) -> None:
    """The source's bytes copied raw (kernel side), then the produced tail; the CRC-32 continues from
    the prefix's (known for a whole source record, else computed from the mapped file)."""
    where, tail = _little_endian(spliced.prefix), tensor_bytes(spliced.tail)
    if where.length + len(tail) != storage.nbytes:
        raise RepairError(f"storage {storage.key}: produced {where.length + len(tail)} bytes, "
                          f"expected {storage.nbytes}")
    crc = spliced.prefix_crc if spliced.prefix_crc is not None else _crc_of(where, where.length)
    with open(where.file, "rb") as src:
        zw.copy_range(name, src, where.start, where.length, zlib.crc32(tail, crc), tail=tail)


def _little_endian(where: ByteRange) -> ByteRange:
    # The output says byteorder "little": copying a big-endian archive's bytes raw would change every value.
    if where.big_endian:
        raise RepairError(f"{where.file}: a big-endian archive (its byteorder record says 'big'); ckptfix writes "
                          "little-endian archives only. Re-save it on this machine first: "
                          "torch.save(torch.load(path, weights_only=True), new_path)")
    return where


def _crc_of(where: ByteRange, length: int) -> int:
    mapped = file_map(where.file)
    crc = 0
    for pos in range(where.start, where.start + length, 1 << 24):
        crc = zlib.crc32(mapped[pos:min(pos + (1 << 24), where.start + length)], crc)
    return crc


def tensor_bytes(tensor: Any) -> memoryview:
    """The raw bytes of a torch tensor (made contiguous), a numpy array or a bytes-like object."""
    if isinstance(tensor, np.ndarray):
        return memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8))  # type: ignore[arg-type]
    if isinstance(tensor, (bytes, bytearray, memoryview)):
        return memoryview(tensor).cast("B")
    import torch

    flat = tensor.contiguous().reshape(-1)
    if flat.dtype in (torch.bfloat16,) or str(flat.dtype).startswith("torch.float8"):
        flat = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    return memoryview(flat.numpy()).cast("B")
