"""Write a `torch.save`-compatible zip from a tree read by `torch_file`, streaming tensor records.

Unchanged storages are copied byte for byte from the source archive (with their CRC); storages
the repair replaced are produced one at a time while their record is written, so peak memory is
one resized tensor, not the checkpoint. The pickle is written with torch's own rebuild functions
as globals, exactly the ones `torch.load(weights_only=True)` accepts.
"""

from __future__ import annotations

import collections
import io
import pickle
import zlib
from dataclasses import dataclass
from typing import Any, BinaryIO, Callable

from ckptfix.checkpoint import ByteRange, file_map
from ckptfix.errors import RepairError
from ckptfix.formats.pickle_safe import OpaqueObject, StorageRef, TensorRef, TorchDevice, TorchDtype
from ckptfix.formats.zipwriter import ZipWriter

_STORAGE_CLASS = {"float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage",
                  "bfloat16": "BFloat16Storage", "int64": "LongStorage", "int32": "IntStorage",
                  "int16": "ShortStorage", "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage",
                  "complex64": "ComplexFloatStorage", "complex128": "ComplexDoubleStorage"}


@dataclass
class StorageSource:
    """Where an output storage's bytes come from: a source byte range (+ CRC if known) or a producer."""

    copy_from: Callable[[], ByteRange] | None = None
    crc: int | None = None
    produce: Callable[[], Any] | None = None  # returns a contiguous CPU torch tensor


class _Pickler(pickle.Pickler):
    def __init__(self, buf: BinaryIO, torch: Any):
        super().__init__(buf, protocol=2)
        self.torch = torch
        self.storages: dict[str, StorageRef] = {}

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, StorageRef):
            self.storages.setdefault(obj.key, obj)
            cls = _STORAGE_CLASS.get(obj.dtype)
            if cls is None:
                raise RepairError(f"cannot write storage {obj.key} of dtype {obj.dtype}")
            return ("storage", getattr(self.torch, cls), obj.key, obj.location, obj.numel)
        return None

    def reducer_override(self, obj: Any) -> Any:
        torch = self.torch
        if isinstance(obj, TensorRef) and obj.is_parameter:
            return torch._utils._rebuild_parameter, (_Plain(obj), obj.requires_grad, collections.OrderedDict())
        if isinstance(obj, (TensorRef, _Plain)):
            t = obj.ref if isinstance(obj, _Plain) else obj
            return (torch._utils._rebuild_tensor_v2,
                    (t.storage, t.offset, tuple(t.shape), tuple(t.stride), t.requires_grad, collections.OrderedDict()))
        if isinstance(obj, OpaqueObject):
            raise RepairError(f"the checkpoint holds an object of class {obj.cls} that ckptfix read as an inert "
                              "record; it cannot be written back")
        return NotImplemented


@dataclass
class _Plain:
    ref: TensorRef


def write(out: BinaryIO, tree: Any, source_for: Callable[[StorageRef], StorageSource], *,
          prefix: str = "archive", extra_members: dict[str, bytes] | None = None,
          finish: Callable[[Any], Any] | None = None) -> None:
    """Write `tree` as a torch zip archive; `source_for` says where each storage's bytes come from.

    Records are written first and `data.pkl` last (readers find members through the central
    directory), so `finish(tree)` can add values known only after the bytes are written (e.g. the
    source's sha256, hashed on another thread meanwhile). It must not add tensors.
    """
    import torch

    storages = _pickle(tree, torch)[1]
    zw = ZipWriter(out)
    members = {".format_version": b"1", ".storage_alignment": b"64", "byteorder": b"little"}
    members.update(extra_members or {})
    for name in (".format_version", ".storage_alignment", "byteorder"):
        zw.write_bytes(f"{prefix}/{name}", members.pop(name))
    for key, storage in storages.items():
        _write_storage(zw, f"{prefix}/data/{key}", storage, source_for(storage))
    data, final_storages = _pickle(finish(tree) if finish else tree, torch)
    if final_storages.keys() != storages.keys():
        raise RepairError("internal: finishing the checkpoint changed its tensors")
    zw.write_bytes(f"{prefix}/data.pkl", data)
    zw.write_bytes(f"{prefix}/version", members.pop("version", b"3\n"))
    for name, value in members.items():
        zw.write_bytes(f"{prefix}/{name}", value)
    zw.close()


def _pickle(tree: Any, torch: Any) -> tuple[memoryview, dict[str, StorageRef]]:
    buf = io.BytesIO()
    pickler = _Pickler(buf, torch)
    pickler.dump(_with_torch_values(tree, torch, {}))
    return buf.getbuffer(), pickler.storages


def _with_torch_values(node: Any, torch: Any, memo: dict[int, Any]) -> Any:
    """Swap our dtype/device stand-ins for torch's own objects; containers keep their sharing."""
    if isinstance(node, TorchDtype):
        return getattr(torch, node.name)
    if isinstance(node, TorchDevice):
        return torch.device(node.spec)
    if not isinstance(node, (dict, list, tuple, set, frozenset)):
        return node
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, dict):
        out = type(node)() if type(node) in (dict, collections.OrderedDict) else dict()
        memo[id(node)] = out
        for k, v in node.items():
            out[k] = _with_torch_values(v, torch, memo)
        return out
    if isinstance(node, list):  # a list may contain itself: register it before filling it
        out = memo[id(node)] = []
        out.extend(_with_torch_values(v, torch, memo) for v in node)
        return out
    items = [_with_torch_values(v, torch, memo) for v in node]
    out = type(node)(items)
    memo[id(node)] = out
    return out


def _write_storage(zw: ZipWriter, name: str, storage: StorageRef, source: StorageSource | None) -> None:
    if source is None:
        raise RepairError(f"no data for storage {storage.key}")
    if source.produce is not None:
        tensor = source.produce().contiguous()
        data = _tensor_bytes(tensor)
        if len(data) != storage.nbytes:
            raise RepairError(f"storage {storage.key}: produced {len(data)} bytes, expected {storage.nbytes}")
        zw.write_bytes(name, data)
        return
    where = source.copy_from()
    if where.length < storage.nbytes:
        raise RepairError(f"source record for storage {storage.key} is shorter than the storage")
    crc = source.crc
    if crc is None or where.length != storage.nbytes:
        crc = _crc_of(where, storage.nbytes)
    with open(where.file, "rb") as src:
        zw.copy_range(name, src, where.start, storage.nbytes, crc)


def _crc_of(where: ByteRange, length: int) -> int:
    mapped = file_map(where.file)
    crc = 0
    for pos in range(where.start, where.start + length, 1 << 24):
        crc = zlib.crc32(mapped[pos:min(pos + (1 << 24), where.start + length)], crc)
    return crc


def _tensor_bytes(tensor: Any) -> memoryview:
    import torch

    flat = tensor.reshape(-1)
    if flat.dtype in (torch.bfloat16,) or str(flat.dtype).startswith("torch.float8"):
        flat = flat.view(torch.uint8 if flat.element_size() == 1 else torch.int16)
    return memoryview(flat.numpy()).cast("B")
