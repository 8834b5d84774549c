"""An allowlist unpickler for `torch.save` pickles that never imports torch and never runs code.

Every GLOBAL the pickle names is answered by `find_class` from a fixed table of inert stand-ins:
tensors become `TensorRef` records (storage key, dtype, shape, stride, offset), dtypes become
`TorchDtype`, devices `TorchDevice`. Anything else is refused (strict mode, the default) or, for
pickles we only want to look at (HF `training_args.bin`), turned into an inert `OpaqueObject`
that records its class name and arguments. No class outside the table is ever imported.
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
from dataclasses import dataclass, field
from typing import Any

from ckptfix.errors import UnreadableCheckpoint, UnsafePickle

# torch storage class names -> dtype name and element size in bytes.
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    "DoubleStorage": ("float64", 8),
    "FloatStorage": ("float32", 4),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("bfloat16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
    "ComplexFloatStorage": ("complex64", 8),
    "ComplexDoubleStorage": ("complex128", 16),
    "UntypedStorage": ("uint8", 1),
}

# dtype name -> element size in bytes (torch names; `_rebuild_tensor_v3` passes the dtype itself).
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "uint16": 2, "uint32": 4, "uint64": 8,
    "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}
_DTYPE_ALIASES = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128",
}

# Bound on pickle size: a state-dict pickle is ~100 bytes per tensor; 1 GiB would be ~10M tensors.
MAX_PICKLE_BYTES = 1 << 30


@dataclass(frozen=True)
class TorchDtype:
    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class TorchDevice:
    spec: str

    def __repr__(self) -> str:
        return f"device({self.spec!r})"


@dataclass(frozen=True)
class StorageRef:
    """A `('storage', type, key, location, numel)` persistent id: one record in the archive."""

    key: str
    dtype: str
    location: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass
class TensorRef:
    """A tensor as the pickle describes it; the bytes stay in the archive until someone asks."""

    storage: StorageRef
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def is_contiguous(self) -> bool:
        expected, stride = 1, []
        for d in reversed(self.shape):
            stride.append(expected)
            expected *= d
        return all(d == 1 or s == e for d, s, e in zip(self.shape, self.stride, reversed(stride)))

    def fits_storage(self) -> bool:
        """Whether every element the view addresses lies inside its storage."""
        if self.numel == 0:
            return self.offset >= 0
        last = self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.stride))
        return self.offset >= 0 and min(self.stride, default=0) >= 0 and last < self.storage.numel


@dataclass
class OpaqueObject:
    """An instance of a class we refused to import, kept as data (only in `opaque` mode)."""

    cls: str
    args: tuple = ()
    state: Any = None
    items: dict = field(default_factory=dict)

    def __setstate__(self, state: Any) -> None:  # BUILD opcode
        object.__setattr__(self, "state", state)

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) on dict subclasses
        self.items[key] = value

    def append(self, value: Any) -> None:  # APPEND(S) on list subclasses
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)


def _opaque_class(qualname: str) -> type:
    # NEWOBJ needs a real class; this one records the call instead of running anything.
    def new(cls, *args, **kwargs):
        obj = object.__new__(cls)
        OpaqueObject.__init__(obj, qualname, args)
        return obj

    return type("Opaque", (OpaqueObject,), {"__new__": new, "__init__": lambda self, *a, **k: None})


def _dtype_name(value: Any) -> str:
    if isinstance(value, TorchDtype):
        return value.name
    raise pickle.UnpicklingError(f"expected a torch dtype, got {type(value).__name__}")


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without a storage record")
    return TensorRef(storage, int(offset), tuple(map(int, size)), tuple(map(int, stride)),
                     storage.dtype, bool(requires_grad))


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    tensor = _rebuild_tensor(storage, offset, size, stride, requires_grad)
    tensor.dtype = _dtype_name(dtype)
    if tensor.dtype not in DTYPE_SIZES:
        raise pickle.UnpicklingError(f"unknown tensor dtype {tensor.dtype}")
    return tensor


def _rebuild_parameter(data, requires_grad=True, hooks=None, state=None):
    if isinstance(data, TensorRef):
        data.is_parameter, data.requires_grad = True, bool(requires_grad)
    return data


def _rebuild_from_type(func, new_type, args, state):
    return func(*args)


class _StorageType:
    def __init__(self, name: str):
        self.dtype = STORAGE_DTYPES[name][0]


def _device(spec, index=None):
    return TorchDevice(f"{spec}:{index}" if index is not None else str(spec))


def _size(dims=()):
    return tuple(dims)


def _allowlist() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex,
        ("builtins", "slice"): slice,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
        ("torch._utils", "_rebuild_tensor_v3"): _rebuild_tensor_v3,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
        ("torch", "Tensor"): object,  # only ever an argument of _rebuild_from_type_v2
        ("torch.nn.parameter", "Parameter"): object,
        ("torch", "device"): _device,
        ("torch", "Size"): _size,
    }
    for name in STORAGE_DTYPES:
        table[("torch", name)] = _StorageType(name)
    for name in list(DTYPE_SIZES) + list(_DTYPE_ALIASES):
        table[("torch", name)] = TorchDtype(_DTYPE_ALIASES.get(name, name))
    return table


ALLOWED_GLOBALS = _allowlist()


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, opaque: bool):
        super().__init__(io.BytesIO(data))
        self.opaque = opaque
        self.refused: list[str] = []

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED_GLOBALS.get((module, name))
        if found is not None:
            return found
        self.refused.append(f"{module}.{name}")
        if self.opaque:
            return _opaque_class(f"{module}.{name}")
        raise UnsafePickle("", [f"{module}.{name}"])

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) >= 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id {pid!r:.60}")
        storage_type, key, location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError("storage of an unknown type")
        if not isinstance(numel, int) or numel < 0:
            raise pickle.UnpicklingError("storage with a negative size")
        return StorageRef(str(key), storage_type.dtype, str(location), numel)


def globals_in_pickle(data: bytes) -> list[str]:
    """List every global a pickle would import, by reading its opcodes (nothing is executed)."""
    found, strings, memo = [], [], {}
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                found.append(arg.replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(strings) >= 2:
                found.append(f"{strings[-2]}.{strings[-1]}")
            elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
                          "BINSTRING", "STRING"):
                strings.append(str(arg))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT") and strings:
                memo[arg] = strings[-1]
            elif name == "MEMOIZE" and strings:
                memo[len(memo)] = strings[-1]
            elif name in ("BINGET", "LONG_BINGET", "GET") and arg in memo:
                strings.append(memo[arg])
            if opcode.name == "STOP":
                break
    except Exception:  # a truncated pickle: report what we saw before the damage
        pass
    return sorted(set(found))


def load_pickle(data: bytes, origin: str, *, opaque: bool = False) -> Any:
    """Unpickle `data` with the allowlist. Raises UnsafePickle naming every global outside it."""
    if len(data) > MAX_PICKLE_BYTES:
        raise UnreadableCheckpoint(f"{origin}: pickle of {len(data)} bytes is implausibly large")
    unpickler = _SafeUnpickler(data, opaque)
    try:
        return unpickler.load()
    except UnsafePickle:
        outside = [g for g in globals_in_pickle(data) if tuple(g.rsplit(".", 1)) not in ALLOWED_GLOBALS]
        raise UnsafePickle(origin, outside or unpickler.refused) from None
    except RecursionError:
        raise UnreadableCheckpoint(f"{origin}: pickle is nested too deeply to read") from None
    except MemoryError:
        raise UnreadableCheckpoint(f"{origin}: pickle needs more memory than is available") from None
    except Exception as exc:  # any damage to the opcode stream
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UnreadableCheckpoint(f"{origin}: corrupt pickle ({detail})") from None
