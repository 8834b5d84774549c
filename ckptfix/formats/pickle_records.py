"""The records the allowlist unpickler (`pickle_safe`) builds instead of torch's objects: inert data.

Tensors are `TensorRef`s (storage key, dtype, shape, stride, offset), dtypes `TorchDtype`, devices `TorchDevice`,
sparse/nested/meta tensors `RebuiltTensor`s, and any global outside the allowlist an inert stand-in type whose
uses are kept as `OpaqueObject`s. Their own module so that the unpickler, the data-class rules
(`data_globals.py`, which the unpickler consults) and the readers share them without importing each other.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
from dataclasses import dataclass, field
from typing import Any

from ckptfix.dtypes import DTYPE_SIZES


class _Record:
    """Base of the records the unpickler builds. A pickle's BUILD opcode (`__setstate__`) cannot
    rewrite them (it could otherwise replace a tensor's shape with anything, or retarget an
    allowlisted stand-in shared by every later load); copy and pickle still work, through `__reduce__`."""

    __slots__ = ()

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"pickle tries to BUILD (set the state of) a {type(self).__name__}")

    def __reduce__(self):
        return (type(self), tuple(getattr(self, f.name) for f in dataclasses.fields(self)))


@dataclass(frozen=True)
class TorchDtype(_Record):
    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class TorchQScheme(_Record):
    """A quantization scheme (`torch.per_tensor_affine`, `torch.per_channel_affine`, ...), by name."""

    name: str

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class TorchDevice(_Record):
    spec: str

    def __repr__(self) -> str:
        return f"device({self.spec!r})"


@dataclass(frozen=True)
class StorageRef(_Record):
    """A `('storage', type, key, location, numel)` persistent id: one record in the archive."""

    key: str
    dtype: str
    location: str
    numel: int
    # a legacy (pre-zip) stream's storage view: the view starts this many elements into storage `key`;
    # tensors on it are read with their offset moved by as much (torch.load slices the storage alike)
    view_start: int = 0

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass
class TensorRef(_Record):
    """A tensor as the pickle describes it; the bytes stay in the archive until someone asks."""

    storage: StorageRef
    offset: int  # in elements of `dtype`
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    requires_grad: bool = False
    is_parameter: bool = False
    # a quantized tensor's parameters as `_rebuild_qtensor` received them, kept verbatim to be written
    # back: (per_tensor_affine, scale, zero_point) or (per_channel_affine, scales, zero_points, axis)
    quantizer: tuple | None = None
    # `_rebuild_tensor_v2/v3`'s metadata: torch's lazy conjugate / negative bits ({"conj": True}); the stored
    # values are before them. Kept for the writer; readers see the stored values.
    metadata: dict | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]

    def fits_storage(self) -> bool:
        """Whether every byte the view addresses lies inside its storage (offset and strides count elements
        of the tensor's dtype; an `UntypedStorage`, as `_rebuild_tensor_v3` gets, counts bytes)."""
        if self.numel == 0:
            return self.offset >= 0
        last = self.offset + sum((d - 1) * s for d, s in zip(self.shape, self.stride))
        return self.offset >= 0 and min(self.stride, default=0) >= 0 and \
            (last + 1) * DTYPE_SIZES.get(self.dtype, 1) <= self.storage.nbytes


def _check_fits(tensor: TensorRef) -> TensorRef:
    """torch.load refuses a view that reaches past its storage (`set_`: "out of bounds for storage"); so
    does the unpickler, before any reader sizes a row plan or a buffer from the view's shape."""
    if not tensor.fits_storage():
        raise pickle.UnpicklingError(
            f"tensor of shape {list(tensor.shape)[:8]} (offset {tensor.offset}, strides {list(tensor.stride)[:8]}) "
            f"reaches past its storage of {tensor.storage.nbytes:,} bytes; torch.load refuses it too")
    return tensor


@dataclass(frozen=True)
class TorchLayout(_Record):
    """A tensor layout (`torch.sparse_coo`, ...), by name, as `torch.serialization._get_layout` returns it."""

    name: str

    def __repr__(self) -> str:
        return self.name


@dataclass
class RebuiltTensor(_Record):
    """A tensor torch assembles from other tensors or from metadata alone: sparse (COO, CSR, CSC, BSR, BSC),
    nested, or a meta tensor (shape and dtype, no storage). `rebuild` names the `torch._utils` function and
    `args` are its arguments as read (the component `TensorRef`s inside), so a writer can emit the same call.
    ckptfix reads its shape and dtype; its values are not a row-indexed matrix, so no reader edits one."""

    kind: str  # the layout (sparse_coo, sparse_csr, ...), "nested" or "meta"
    shape: tuple[int, ...] | None  # None for a nested tensor (its components have their own shapes)
    dtype: str
    rebuild: str
    args: tuple
    requires_grad: bool = False
    is_parameter: bool = False

    @property
    def parts(self) -> list[TensorRef]:
        """The component tensors (indices, values, nested sizes...), each with its own storage record."""
        flat = [a for a in self.args if isinstance(a, TensorRef)]
        for a in self.args:
            if isinstance(a, tuple):
                flat.extend(x for x in a if isinstance(x, TensorRef))
        return flat


@dataclass
class OpaqueObject:
    """A use of a global outside the allowlist, kept as data: `cls` names the global, `args` what it was
    constructed or called with, `state` what BUILD set, `items` what SETITEM/APPEND added; `called` says
    whether the pickle called it (REDUCE, `cls(*args)`) rather than constructed it (NEWOBJ)."""

    cls: str
    args: tuple = ()
    state: Any = None
    items: dict = field(default_factory=dict)
    called: bool = False
    kwargs: dict = field(default_factory=dict)

    def __setstate__(self, state: Any) -> None:  # BUILD opcode
        object.__setattr__(self, "state", state)

    def __repr__(self) -> str:  # never the arguments: they may be a memo-shared DAG
        return f"<{printable(self.cls)} object>"

    def __setitem__(self, key: Any, value: Any) -> None:  # SETITEM(S) on dict subclasses
        self.items[key] = value

    def append(self, value: Any) -> None:  # APPEND(S) on list subclasses
        self.items[len(self.items)] = value

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)


class _InertType(type):
    """The type of a stand-in for a global outside the allowlist. Calling it (REDUCE, INST with
    arguments) records a call; NEWOBJ (`X.__new__(X, *args)`) records a construction."""

    qualname: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        new: Any = cls.__new__  # the stand-in's recorder (see `_opaque_class`), never the real class
        obj = new(cls, *args, **kwargs)
        obj.called = True
        return obj

    def __repr__(cls) -> str:
        return f"<global {printable(cls.qualname)}>"


def _opaque_class(qualname: str, made: list | None = None) -> type:
    # NEWOBJ needs a real class; this one records the construction instead of running anything.
    def new(cls, *args, **kwargs):
        obj = object.__new__(cls)
        OpaqueObject.__init__(obj, qualname, args, kwargs=kwargs)
        if made is not None:
            made.append(obj)
        return obj

    # Hashable by identity: pickles use such objects as dict keys (DCP's MetadataIndex).
    return _InertType("Opaque", (OpaqueObject,), {"__new__": new, "__init__": lambda self, *a, **k: None,
                                                  "__hash__": object.__hash__, "qualname": qualname})


def global_name(value: Any) -> str | None:
    """The qualified name of a global the pickle refers to without calling it (`typing.Any`, a class)."""
    return value.qualname if isinstance(value, _InertType) else None

def printable(name: str, limit: int = 120) -> str:
    """A pickle-supplied name made safe for one terminal line (no escape sequences), and short."""
    text = "".join(c if c.isprintable() and c != "\\" else ascii(c)[1:-1] for c in name[:limit])
    return text + ("..." if len(name) > limit else "")
