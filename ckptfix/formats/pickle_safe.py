"""An allowlist unpickler for `torch.save` pickles that never imports torch and never runs code.

Every GLOBAL the pickle names is answered by `find_class` from a fixed table of inert stand-ins:
tensors become `TensorRef` records (storage key, dtype, shape, stride, offset), dtypes become
`TorchDtype`, devices `TorchDevice`. Any other global becomes an inert stand-in type that records
how the pickle uses it: constructed (NEWOBJ: an instance whose state is set by BUILD, e.g. an
`argparse.Namespace` or a dataclass) or called (REDUCE: `X(*args)`). Nothing outside the table is
ever imported or run. In strict mode (the default) a call is refused unless it is a known data
class's constructor (`data_globals.DATA_CALLS`: a PosixPath from its parts, a numpy scalar from its
bytes...); the refusal names each call and its arguments. In opaque mode (`--trust-pickle`, HF
`training_args.bin`) every use is kept as an inert `OpaqueObject`.
"""

from __future__ import annotations

import _compat_pickle
import collections
import dataclasses
import io
import pickle
import pickletools
from typing import Any

from ckptfix.dtypes import (  # noqa: F401 (re-exported)
    DTYPE_SIZES,
    QUANTIZED_DTYPES,
    STORAGE_DTYPES,
    TORCH_ALIASES,
    contiguous_stride,
)
from ckptfix.errors import UnreadableCheckpoint, UnsafePickle
from ckptfix.formats.data_globals import DATA_CALLS, call_globals, describe_call, is_data_call, torch_refuses
from ckptfix.formats.pickle_records import (
    OpaqueObject,
    RebuiltTensor,
    StorageRef,
    TensorRef,
    TorchDevice,
    TorchDtype,
    TorchLayout,
    TorchQScheme,
    _check_fits,
    _opaque_class,
    _Record,
    global_name,
    printable,
)
from ckptfix.untrusted import MAX_DIM

_DTYPE_ALIASES = TORCH_ALIASES

# Bound on pickle size: a state-dict pickle is ~100 bytes per tensor; 1 GiB would be ~10M tensors.
MAX_PICKLE_BYTES = 1 << 30
# What no checkpoint holds, refused before or while unpickling (see `_prescan` and `_rebuild_tensor`):
INT64_MAX = (1 << 63) - 1  # torch sizes, strides, offsets and numels are int64
MAX_DIMS = 64  # numpy's limit; torch tensors have far fewer
MAX_INT_BITS = 1023  # a wider int cannot become a float; every checkpoint number fits in 64 bits
MAX_TUPLE_NODES = 1_000_000  # a memo-shared tuple DAG hashes in time exponential in its depth
MAX_TUPLE_DEPTH = 100  # hashing a tuple nested ~100k deep overflows the C stack
MAX_HASH_WORK = 10_000_000  # tuple nodes all dict keys and set members of one pickle may hash (at least)
# Containers and objects one pickle may build: 512Ki plus one per 8 bytes (real state dicts build about one per
# 25 bytes). A 1-byte EMPTY_SET or EMPTY_DICT builds 64-216 bytes: without this a 64 MiB (deflated: 64 KB)
# data.pkl would take gigabytes.
MAX_OBJECTS_BASE = 1 << 19
_BUILDS = frozenset({"EMPTY_DICT", "EMPTY_LIST", "EMPTY_SET", "LIST", "OBJ", "INST", "NEWOBJ", "NEWOBJ_EX",
                     "REDUCE"})


def _dtype_name(value: Any) -> str:
    if isinstance(value, TorchDtype):
        return value.name
    raise pickle.UnpicklingError(f"expected a torch dtype, got {type(value).__name__}")


def _rebuild_tensor(storage, offset, size, stride, requires_grad=False, hooks=None, metadata=None):
    if not isinstance(storage, StorageRef):
        raise pickle.UnpicklingError("tensor without a storage record")
    if not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)):
        raise pickle.UnpicklingError("tensor whose size or stride is not a sequence")
    offset, size, stride = _int64(offset), tuple(map(_int64, size)), tuple(map(_int64, stride))
    if storage.view_start:  # a legacy storage view: the same bytes, addressed from the root storage
        offset, storage = offset + storage.view_start, dataclasses.replace(storage, view_start=0)
    # What torch itself cannot hold: readers index storages with these, so they must be sane.
    if len(size) != len(stride) or len(size) > MAX_DIMS:
        raise pickle.UnpicklingError(f"tensor with {len(size)} sizes but {len(stride)} strides")
    if offset < 0 or min(size, default=0) < 0 or min(stride, default=0) < 0:
        raise pickle.UnpicklingError("tensor with a negative size, stride or offset")
    numel = 1
    for d in size:
        numel *= d
    if numel > INT64_MAX:
        raise pickle.UnpicklingError("tensor with more than 2**63 elements")
    if max(size, default=0) > MAX_DIM:  # (0, 2**62) is empty, but code that walks its rows would not be
        raise pickle.UnpicklingError("tensor with a dimension over 2**48")
    tensor = TensorRef(storage, offset, size, stride, storage.dtype, bool(requires_grad))
    if metadata:
        if not (isinstance(metadata, dict) and all(k in ("conj", "neg") and isinstance(v, bool)
                                                   for k, v in metadata.items())):
            raise pickle.UnpicklingError("tensor metadata other than torch's conj/neg bits")
        tensor.metadata = dict(metadata)
    return _check_fits(tensor)


def _int64(value: Any) -> int:
    if not isinstance(value, int) or not -INT64_MAX <= value <= INT64_MAX:
        raise pickle.UnpicklingError(f"tensor metadata is not an int64 ({type(value).__name__})")
    return int(value)


def _rebuild_tensor_v3(storage, offset, size, stride, requires_grad, hooks, dtype, metadata=None):
    tensor = _rebuild_tensor(storage, offset, size, stride, requires_grad, None, metadata)
    tensor.dtype = _dtype_name(dtype)
    if tensor.dtype not in DTYPE_SIZES:
        raise pickle.UnpicklingError(f"unknown tensor dtype {tensor.dtype}")
    return _check_fits(tensor)


_PER_TENSOR = "per_tensor_affine"
_PER_CHANNEL = ("per_channel_affine", "per_channel_affine_float_qparams")


def _rebuild_qtensor(storage, offset, size, stride, quantizer_params, requires_grad=False, hooks=None):
    """A quantized tensor (what `Tensor._reduce_ex_internal` writes for `is_quantized`): its integer
    representation is the storage; the parameters are checked as data and kept for the writer."""
    if not isinstance(storage, StorageRef) or storage.dtype not in QUANTIZED_DTYPES:
        raise pickle.UnpicklingError("quantized tensor without a quantized storage")
    tensor = _rebuild_tensor(storage, offset, size, stride, requires_grad)
    size = tensor.shape
    params = tuple(quantizer_params) if isinstance(quantizer_params, (tuple, list)) else ()
    scheme = params[0].name if params and isinstance(params[0], TorchQScheme) else None
    if scheme == _PER_TENSOR and len(params) == 3:
        ok = isinstance(params[1], (int, float)) and isinstance(params[2], int)
    elif scheme in _PER_CHANNEL and len(params) == 4:
        axis = params[3]
        ok = (isinstance(axis, int) and 0 <= axis < len(size) and all(
            isinstance(p, TensorRef) and p.quantizer is None and p.shape == (size[axis],)
            or isinstance(p, list) and len(p) == size[axis] and all(isinstance(x, (int, float)) for x in p)
            for p in params[1:3]))
    else:
        ok = False
    if not ok:
        raise pickle.UnpicklingError("quantized tensor with parameters torch does not write")
    tensor.quantizer = params
    return tensor


def _rebuild_parameter(data, requires_grad=True, hooks=None, state=None):
    # Only ever a tensor: passing any other object through would hide it from `_prescan`.
    if not isinstance(data, (TensorRef, RebuiltTensor)):
        raise pickle.UnpicklingError(f"parameter that is not a tensor (a {type(data).__name__})")
    data.is_parameter, data.requires_grad = True, bool(requires_grad)
    return data


def _rebuild_from_type(func, new_type, args, state):
    """`_rebuild_from_type_v2`: a tensor rebuilt by `func`, then given the class `new_type` (torch.Tensor,
    Parameter, or a subclass: a global torch refuses unless allowlisted, which the refusal list names)."""
    tensor = func(*args)
    if isinstance(new_type, _TensorClassType) and new_type.qualname == "torch.nn.parameter.Parameter":
        tensor = _rebuild_parameter(tensor, getattr(tensor, "requires_grad", True))
    return tensor


_LAYOUTS = ("torch.strided", "torch.sparse_coo", "torch.sparse_csr", "torch.sparse_csc", "torch.sparse_bsr",
            "torch.sparse_bsc", "torch._mkldnn", "torch.jagged")
_COMPRESSED = ("sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc")


def _get_layout(name):
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError("torch.serialization._get_layout of something other than a torch layout")
    return TorchLayout(name)


def _shape(size: Any) -> tuple[int, ...]:
    if not isinstance(size, (tuple, list)) or len(size) > MAX_DIMS:
        raise pickle.UnpicklingError("tensor size that is not a sequence of integers")
    dims = tuple(map(_int64, size))
    if min(dims, default=0) < 0:
        raise pickle.UnpicklingError("tensor with a negative size")
    return dims


def _rebuild_sparse_tensor(layout, data):
    """Sparse COO `(indices, values, size[, is_coalesced])` or compressed `(compressed_indices,
    plain_indices, values, size)`, as `Tensor._reduce_ex_internal` writes them (torch._utils)."""
    kind = layout.name.split(".", 1)[1] if isinstance(layout, TorchLayout) else None
    if not isinstance(data, tuple):
        raise pickle.UnpicklingError("sparse tensor without its (indices, values, size) tuple")
    if kind == "sparse_coo" and len(data) in (3, 4):
        tensors, size = data[:2], data[2]
    elif kind in _COMPRESSED and len(data) == 4:
        tensors, size = data[:3], data[3]
    else:
        raise pickle.UnpicklingError("sparse tensor of a layout torch does not rebuild")
    if not all(isinstance(t, TensorRef) for t in tensors):
        raise pickle.UnpicklingError("sparse tensor whose indices or values are not tensors")
    return RebuiltTensor(kind, _shape(size), tensors[-1].dtype, "_rebuild_sparse_tensor", (layout, data))


def _rebuild_nested_tensor(buffer, sizes, strides, storage_offsets):
    if not all(isinstance(t, TensorRef) for t in (buffer, sizes, strides, storage_offsets)):
        raise pickle.UnpicklingError("nested tensor whose buffer or metadata are not tensors")
    return RebuiltTensor("nested", None, buffer.dtype, "_rebuild_nested_tensor",
                         (buffer, sizes, strides, storage_offsets))


def _rebuild_meta_tensor_no_storage(dtype, size, stride, requires_grad=False):
    name = _dtype_name(dtype)
    if len(_shape(stride)) != len(_shape(size)):
        raise pickle.UnpicklingError("meta tensor with as many sizes as strides")
    return RebuiltTensor("meta", _shape(size), name, "_rebuild_meta_tensor_no_storage",
                         (dtype, tuple(size), tuple(stride), bool(requires_grad)), bool(requires_grad))


def _rebuild_wrapper_subclass(cls, *args):
    """A storage-less wrapper tensor subclass. torch rebuilds one only for a class the loading process
    allowlisted (`torch.Tensor` itself fails: "Tensor must define __torch_dispatch__"); its contents are the
    subclass's own, so ckptfix refuses it, naming it."""
    raise pickle.UnpicklingError("a wrapper tensor subclass (torch._utils._rebuild_wrapper_subclass): torch.load "
                                 "rebuilds one only for a class allowlisted with add_safe_globals; ckptfix cannot read it")


def _rebuild_device_tensor_from_cpu_tensor(data, dtype, device, requires_grad=False):
    """A tensor saved from a device without storage access (xla, mtia, maia) as its CPU copy, same dtype."""
    if not isinstance(data, TensorRef) or _dtype_name(dtype) != data.dtype:
        raise pickle.UnpicklingError("device tensor from a CPU tensor of another dtype (torch would convert it)")
    data.requires_grad = bool(requires_grad)
    return data


def _rebuild_device_tensor_from_numpy(data, dtype, device, requires_grad=False):
    """torch < 2.6's form of the same for xla/mtia tensors: a numpy array, which torch's weights-only loader
    refuses (numpy's globals are not on its list); kept as the array record, named by CKF704."""
    if not isinstance(data, OpaqueObject):
        raise pickle.UnpicklingError("device tensor from numpy without a numpy array")
    return data


class _TensorClassType(type):
    """The stand-in for a tensor class (`torch.Tensor`, `torch.FloatTensor`, `torch.cuda.sparse.FloatTensor`,
    `torch.nn.Parameter`). NEWOBJ makes an empty tensor that BUILD fills with `(storage, offset, size,
    stride)`: how torch <= 0.3 pickled tensors, and what torch's weights-only loader still reads (`set_`).
    Calling one (the legacy constructors) is refused, except a sparse class given (indices, values, size)."""

    qualname: str

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls.qualname == "torch.nn.parameter.Parameter":  # NEWOBJ: torch.nn.Parameter(data, requires_grad)
            return _rebuild_parameter(*args, **kwargs)
        if ".sparse." in cls.qualname and len(args) == 3 and not kwargs:
            return _rebuild_sparse_tensor(TorchLayout("torch.sparse_coo"), tuple(args))
        raise pickle.UnpicklingError(f"a call of the legacy tensor constructor {printable(cls.qualname)}; "
                                     "torch.save never writes one")

    def __setattr__(cls, key: str, value: Any) -> None:
        raise AttributeError("read-only")

    def __repr__(cls) -> str:
        return f"<tensor class {printable(cls.qualname)}>"


class _LegacyTensor(TensorRef):
    """What NEWOBJ of a tensor class makes: empty until BUILD gives it `(storage, offset, size, stride)`, once."""

    def __setstate__(self, state: Any) -> None:
        if getattr(self, "storage", None) is not None or not (isinstance(state, tuple) and len(state) == 4):
            raise pickle.UnpicklingError("tensor state other than torch's legacy (storage, offset, size, stride)")
        built = _rebuild_tensor(*state)
        for f in dataclasses.fields(TensorRef):
            object.__setattr__(self, f.name, getattr(built, f.name))


def _tensor_class(qualname: str, pending: list) -> type:
    def new(cls, *args):
        if cls.qualname == "torch.nn.parameter.Parameter":
            return _rebuild_parameter(*args)
        if args:
            raise pickle.UnpicklingError(f"{printable(cls.qualname)} constructed with arguments")
        tensor = object.__new__(_LegacyTensor)
        for f in dataclasses.fields(TensorRef):
            object.__setattr__(tensor, f.name, f.default if f.default is not dataclasses.MISSING else None)
        pending.append(tensor)
        return tensor

    return _TensorClassType("TensorClass", (), {"__new__": new, "qualname": qualname})


class _StorageType(_Record):
    __slots__ = ("name", "dtype")
    name: str
    dtype: str

    def __init__(self, name: str):
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "dtype", STORAGE_DTYPES[name][0])

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __reduce__(self):
        return (_StorageType, (self.name,))


class _Function(_Record):
    """An allowlisted function, wrapped: BUILD on a bare function could rewrite its __defaults__."""

    __slots__ = ("fn",)
    fn: Any

    def __init__(self, fn: Any):
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __setattr__(self, key: str, value: Any) -> None:
        raise AttributeError(f"{type(self).__name__} is read-only")

    def __reduce__(self):
        return (_Function, (self.fn,))

    def __repr__(self) -> str:
        return f"<allowlisted {self.fn.__name__}>"


def _device(spec, index=None):
    # str() of a pickled value is not safe (a memo-shared list prints in 2**depth steps): insist on a str.
    if not isinstance(spec, str) or not (index is None or isinstance(index, int) and 0 <= index <= INT64_MAX):
        raise pickle.UnpicklingError("torch.device with a non-string type or a non-integer index")
    return TorchDevice(f"{spec}:{index}" if index is not None else spec)


def _size(dims=()):
    dims = tuple(dims)
    if not all(isinstance(d, int) for d in dims):  # a torch.Size holds ints; anything else could hide a tuple DAG
        raise pickle.UnpicklingError("torch.Size of something other than integers")
    return dims


def _slice(*args):
    # Printing a slice prints its members: allow the ints and None a real slice holds, nothing else.
    if not all(a is None or isinstance(a, int) for a in args):
        raise pickle.UnpicklingError("slice of something other than integers")
    return slice(*args)


def _encode(text: Any, encoding: Any = "utf-8", *rest: Any) -> bytes:
    # Protocol 2 (torch.save's) spells a bytes value as `_codecs.encode(str, 'latin1')`; nothing else.
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1") or rest:
        raise pickle.UnpicklingError("_codecs.encode used for something other than bytes")
    return text.encode("latin-1")


def _bytearray(*args: Any) -> bytearray:
    # How pickle spells one: (bytes,) at protocols 3-4, (str, 'latin-1') at 2; never a size (an allocation).
    if args == () or len(args) == 1 and isinstance(args[0], bytes):
        return bytearray(*args)
    if len(args) == 2 and isinstance(args[0], str) and args[1] in ("latin1", "latin-1"):
        return bytearray(args[0].encode("latin-1"))
    raise pickle.UnpicklingError("bytearray of something other than bytes")


def _allowlist() -> dict[tuple[str, str], Any]:
    table: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("collections", "Counter"): collections.Counter,
        ("_codecs", "encode"): _Function(_encode),
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): _Function(_bytearray),
        ("builtins", "slice"): _Function(_slice),
        ("torch._utils", "_rebuild_tensor_v2"): _Function(_rebuild_tensor),
        ("torch._utils", "_rebuild_tensor_v3"): _Function(_rebuild_tensor_v3),
        ("torch._utils", "_rebuild_parameter"): _Function(_rebuild_parameter),
        ("torch._utils", "_rebuild_qtensor"): _Function(_rebuild_qtensor),
        ("torch._utils", "_rebuild_parameter_with_state"): _Function(_rebuild_parameter),
        ("torch._tensor", "_rebuild_from_type_v2"): _Function(_rebuild_from_type),
        ("torch._utils", "_rebuild_tensor"): _Function(_rebuild_tensor),  # torch 0.4.0's, legacy files
        ("torch._utils", "_rebuild_sparse_tensor"): _Function(_rebuild_sparse_tensor),
        ("torch._utils", "_rebuild_nested_tensor"): _Function(_rebuild_nested_tensor),
        ("torch._utils", "_rebuild_meta_tensor_no_storage"): _Function(_rebuild_meta_tensor_no_storage),
        ("torch._utils", "_rebuild_wrapper_subclass"): _Function(_rebuild_wrapper_subclass),
        ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): _Function(_rebuild_device_tensor_from_cpu_tensor),
        ("torch._utils", "_rebuild_device_tensor_from_numpy"): _Function(_rebuild_device_tensor_from_numpy),
        ("torch.serialization", "_get_layout"): _Function(_get_layout),
        ("torch", "device"): _Function(_device),
        ("torch", "Size"): _Function(_size),
    }
    for name in STORAGE_DTYPES:
        table[("torch", name)] = _StorageType(name)
    for name, (dtype, _) in STORAGE_DTYPES.items():  # CUDA storages: torch 0.4-era files name them (lpips)
        if dtype not in QUANTIZED_DTYPES and name != "UntypedStorage":
            table[("torch.cuda", name)] = _StorageType(name)
    # dtypes without a typed storage class (uint16/32/64, float8) are saved through `_rebuild_tensor_v3`
    # with an untyped (byte) storage spelled by its module path; the dtype comes as an argument.
    table[("torch.storage", "UntypedStorage")] = _StorageType("UntypedStorage")
    for name in list(DTYPE_SIZES) + list(_DTYPE_ALIASES):
        table[("torch", name)] = TorchDtype(_DTYPE_ALIASES.get(name, name))
    for name in _OTHER_DTYPES:  # dtypes torch allowlists that no tensor ckptfix reads has (int1..int7, ...)
        table.setdefault(("torch", name), TorchDtype(name))
    for name in (_PER_TENSOR, *_PER_CHANNEL, *_SYMMETRIC):  # the symmetric ones: `_rebuild_qtensor` refuses them
        table[("torch", name)] = TorchQScheme(name)
    return table


_OTHER_DTYPES = tuple(f"{k}{n}" for k in ("int", "uint") for n in range(1, 8)) + ("quint4x2", "quint2x4")
_SYMMETRIC = ("per_tensor_symmetric", "per_channel_symmetric")
# The tensor classes torch's weights-only loader allowlists (`torch._tensor_classes`, `torch.Tensor`,
# `torch.nn.Parameter`): each unpickler makes its own stand-ins (`_tensor_class`).
_TENSOR_TYPES = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
TENSOR_CLASSES = frozenset(
    ["torch.Tensor", "torch.nn.parameter.Parameter"]
    + [f"{m}.{t}Tensor" for m in ("torch", "torch.cuda") for t in _TENSOR_TYPES]
    + [f"{m}.{t}Tensor" for m in ("torch.sparse", "torch.cuda.sparse") for t in _TENSOR_TYPES if t != "Bool"])
# Globals torch allowlists that ckptfix reads only to refuse the file, and why (tests/test_torch_differential.py
# checks that every global on torch's list is in ALLOWED_GLOBALS, TENSOR_CLASSES or here). torch 2.4's list (the
# oldest torch ckptfix supports; read from its source) is a subset of 2.13's: it lacks `_codecs.encode`,
# `builtins.bytearray/set/complex`, `int1`-`int7`/`uint1`-`uint7` and the two device-tensor rebuilds, and its
# unpickler reads the same opcodes.
NAMED_ONLY = {
    "torch.storage.TypedStorage": "a storage type without a dtype; torch.load cannot rebuild it either",
    "torch.QUInt4x2Storage": "sub-byte quantized values packed two to a byte: refused by name (`persistent_load`)",
    "torch.QUInt2x4Storage": "sub-byte quantized values packed four to a byte: refused by name (`persistent_load`)",
}


ALLOWED_GLOBALS = _allowlist()


# Sub-byte quantized storages: a tensor's storage holds fewer bytes than its elements, which no
# ckptfix reader (nor torch.load(mmap=True)'s record offsets) accounts for.
_PACKED_QUANTIZED = ("torch.QUInt4x2Storage", "torch.QUInt2x4Storage")


class _SafeUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, opaque: bool, origin: str = "checkpoint"):
        super().__init__(io.BytesIO(data))
        self.opaque, self.origin = opaque, origin
        self.refused: list[str] = []
        self.made: list[OpaqueObject] = []  # every use of a global outside the allowlist
        self.budget = _HashBudget(data)
        self.pending: list[TensorRef] = []  # tensors made by NEWOBJ of a tensor class, filled by BUILD
        self.names: set[str] = set()  # every global the pickle names, as torch spells it

    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 (torch.save's) spells some names the Python 2 way (`__builtin__.long`); map them as
        # pickle and torch's weights-only unpickler do, so names are reported and allowlisted as torch sees them.
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
        self.names.add(f"{module}.{name}")
        found = ALLOWED_GLOBALS.get((module, name))
        if found is None and f"{module}.{name}" in TENSOR_CLASSES:
            return _tensor_class(f"{module}.{name}", self.pending)
        if found in (set, frozenset, collections.OrderedDict, collections.Counter):
            return self.budget.wrap(found)
        if found is not None:
            return found
        self.refused.append(printable(f"{module}.{name}"))
        return _opaque_class(f"{module}.{name}", self.made)

    def code_calls(self) -> list[OpaqueObject]:
        """The calls this pickle makes that are not a known data class's constructor (strict mode refuses them)."""
        return [o for o in self.made if not is_data_call(o)]

    def persistent_load(self, pid: Any) -> Any:
        # Never repr()/str() pid parts: a memo-shared list prints in 2**depth steps. torch writes strs and ints.
        if not (isinstance(pid, tuple) and len(pid) >= 5 and isinstance(pid[0], str) and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unsupported persistent id (a {type(pid).__name__})")
        storage_type, key, location, numel = pid[1], pid[2], pid[3], pid[4]
        if not isinstance(storage_type, _StorageType):
            name = global_name(storage_type)
            if name in _PACKED_QUANTIZED:
                raise UnreadableCheckpoint(
                    f"{self.origin}: holds a {name.split('.')[-1][:-7].lower()} tensor (quantized values packed "
                    "several to a byte); ckptfix reads quantized tensors of one value per element only "
                    "(qint8, quint8, qint32)")
            raise pickle.UnpicklingError("storage of an unknown type")
        if not isinstance(key, str) or not isinstance(location, str):
            raise pickle.UnpicklingError("storage whose key or location is not a string")
        if not isinstance(numel, int) or not 0 <= numel <= INT64_MAX:
            raise pickle.UnpicklingError("storage with a negative or impossible size")
        view = pid[5] if len(pid) > 5 else None  # the legacy stream's (view key, offset, size), or None
        if view is None:
            return StorageRef(key, storage_type.dtype, location, numel)
        if not (isinstance(view, tuple) and len(view) == 3 and all(isinstance(v, int) for v in view[1:])
                and 0 <= view[1] and 0 <= view[2] and view[1] + view[2] <= numel):
            raise pickle.UnpicklingError("storage view outside its storage")
        return StorageRef(key, storage_type.dtype, location, numel, view_start=view[1])




# What `_prescan` does with each opcode (plain ints, compared in its hot loop; the tuple builders are
# numbered so that TUPLE1..TUPLE3 take `action - 1` items).
_A_OTHER = 0  # pops and pushes by its stack effect
_A_TUPLE_MARK, _A_TUPLE1, _A_TUPLE2, _A_TUPLE3 = 1, 2, 3, 4  # build a tuple: weigh it
_A_GET, _A_PUT, _A_MEMOIZE = 5, 6, 7  # memo reads and writes (by index)
_A_DUP, _A_MARK, _A_STOP = 8, 9, 10
_A_LONG_BINARY, _A_LONG_TEXT = 11, 12  # integers: refuse absurd widths
_A_GLOBAL = 13  # GLOBAL / INST: two text lines
_A_BUILD = 14
_A_SETITEM, _A_SETITEMS, _A_ADDITEMS = 15, 16, 17  # hash dict keys / set members


def _opcode_table() -> list:
    """Per opcode byte: (action, arg size or variable-size kind, name, has mark, items popped below it, pushed)."""
    actions = {"TUPLE": _A_TUPLE_MARK, "TUPLE1": _A_TUPLE1, "TUPLE2": _A_TUPLE2, "TUPLE3": _A_TUPLE3,
               "GET": _A_GET, "BINGET": _A_GET, "LONG_BINGET": _A_GET,
               "PUT": _A_PUT, "BINPUT": _A_PUT, "LONG_BINPUT": _A_PUT, "MEMOIZE": _A_MEMOIZE, "DUP": _A_DUP,
               "MARK": _A_MARK, "STOP": _A_STOP, "LONG1": _A_LONG_BINARY, "LONG4": _A_LONG_BINARY,
               "INT": _A_LONG_TEXT, "LONG": _A_LONG_TEXT, "GLOBAL": _A_GLOBAL, "INST": _A_GLOBAL, "BUILD": _A_BUILD,
               "SETITEM": _A_SETITEM, "SETITEMS": _A_SETITEMS, "DICT": _A_SETITEMS, "ADDITEMS": _A_ADDITEMS,
               "FROZENSET": _A_ADDITEMS}
    table: list = [None] * 256
    for op in pickletools.opcodes:
        before = op.stack_before
        has_mark = pickletools.markobject in before
        below = before.index(pickletools.markobject) if has_mark else len(before)
        size = op.arg.n if op.arg is not None else 0
        table[ord(op.code)] = (actions.get(op.name, 0), size, op.name, has_mark, below, len(op.stack_after))
    return table


_OPCODES = _opcode_table()


def _push_table() -> tuple[list[int], list[int]]:
    """The ops `_prescan` takes on its fast path: those that only push one plain item (a number, a string,
    None, an empty tuple...). Per opcode byte: the op's whole length where its argument has a fixed size,
    and the width of the length prefix (1, 4 or 8) where it is counted (strings, bytes); 0 otherwise."""
    fixed, counted = [0] * 256, [0] * 256
    for code, spec in enumerate(_OPCODES):
        if spec is None:
            continue
        action, size, name, has_mark, below, pushed = spec
        if action != _A_OTHER or has_mark or below or pushed != 1 or name in _BUILDS:
            continue
        if size >= 0:
            fixed[code] = 1 + size
        elif size in (-2, -4):  # unsigned 1- and 4-byte lengths (BINSTRING's signed one stays on the slow path)
            counted[code] = 1 if size == -2 else 4
        elif size == -5:
            counted[code] = 8
    return fixed, counted


_PUSH_FIXED, _PUSH_COUNTED = _push_table()


def _hash_budget(data: bytes) -> int:
    # Legitimate pickles hash about one small key per few bytes; 4x the size (at least 10M steps) is ample.
    return max(MAX_HASH_WORK, 4 * len(data))


def pickle_end(data: Any, start: int, origin: str) -> int:
    """Where the pickle that begins at `start` ends (just past its STOP), walking opcode lengths only
    (nothing is built or checked: `_prescan` and the unpickler do that on the slice). `data` may be a map.
    A legacy `torch.save` stream is several pickles back to back, then raw storage bytes."""
    table, n, i = _OPCODES, len(data), start
    from_bytes = int.from_bytes
    while i < n:
        spec = table[data[i]]
        if spec is None:
            break
        size = spec[1]
        at = i + 1
        if size == 0 and spec[0] != _A_STOP and at < n and data[at] == data[i]:  # a run (a deep nest: 100k MARKs)
            op = data[i:at]
            while data[at:at + 1] == op:
                chunk = data[at:at + 65536]
                at += len(chunk) - len(chunk.lstrip(op))
            i = at
            continue
        if size >= 0:
            i = at + size
        elif size == -1:  # up to a newline (two lines for GLOBAL/INST)
            i = data.find(b"\n", at) + 1
            if i and spec[0] == _A_GLOBAL:
                i = data.find(b"\n", i) + 1
            if not i:
                break
        elif size == -2:
            i = at + 1 + data[at] if at < n else n + 1
        elif size in (-3, -4):
            i = at + 4 + from_bytes(data[at:at + 4], "little", signed=size == -3)
        else:
            i = at + 8 + from_bytes(data[at:at + 8], "little")
        if i < at:
            break
        if spec[0] == _A_STOP:
            return i
    raise UnreadableCheckpoint(f"{origin}: corrupt pickle stream (no STOP opcode where one pickle should end)")


# The opcodes torch's weights-only unpickler reads (`torch._weights_only_unpickler.Unpickler.load`, 2.4 to
# 2.13); on any other it stops with "Unsupported operand". Python's pickler writes others at protocols 0, 1,
# 3, 4 and 5: FRAME and MEMOIZE (4+), SHORT_BINUNICODE (4+), BINBYTES (3+), text INT for a bool (0, 1).
_TORCH_OPCODE_NAMES = frozenset({
    "PROTO", "STOP", "GLOBAL", "NEWOBJ", "REDUCE", "BUILD", "APPEND", "APPENDS", "SETITEM", "SETITEMS", "MARK",
    "TUPLE", "TUPLE1", "TUPLE2", "TUPLE3", "NONE", "NEWFALSE", "NEWTRUE", "EMPTY_TUPLE", "EMPTY_LIST", "EMPTY_DICT",
    "EMPTY_SET", "BININT", "BININT1", "BININT2", "BINFLOAT", "BINUNICODE", "SHORT_BINSTRING", "BINPERSID", "BINGET",
    "LONG_BINGET", "BINPUT", "LONG_BINPUT", "LONG1"})
_TORCH_OPCODES = bytes(1 if spec is not None and spec[2] in _TORCH_OPCODE_NAMES else 0 for spec in _OPCODES)
_PROTOCOLS = {ord(op.code): op.proto for op in pickletools.opcodes}  # the protocol that introduced each opcode


def torch_refused_opcode(data: Any) -> str | None:
    """The first opcode torch's weights-only unpickler cannot read (its name and the protocol that writes it),
    or None. Opcode lengths only, as `pickle_end` walks them; nothing is built."""
    table, ok, n, i = _OPCODES, _TORCH_OPCODES, len(data), 0
    from_bytes = int.from_bytes
    while i < n:
        code = data[i]
        spec = table[code]
        if spec is None:
            return None  # damage: the unpickler reports it
        if not ok[code]:
            proto = _PROTOCOLS[code]
            return f"{spec[2]} (pickle protocol {proto}+)" if proto > 1 else f"{spec[2]} (pickle protocol 0/1)"
        size, at = spec[1], i + 1
        if size >= 0:
            i = at + size
        elif size == -1:
            i = data.find(b"\n", at) + 1
            if i and spec[0] == _A_GLOBAL:
                i = data.find(b"\n", i) + 1
            if not i:
                return None
        elif size == -2:
            i = at + 1 + data[at] if at < n else n
        else:  # BINUNICODE's 4-byte length (the 8-byte ones are refused above)
            i = at + 4 + from_bytes(data[at:at + 4], "little", signed=size == -3)
        if spec[0] == _A_STOP:
            return None
    return None


def _prescan(data: bytes, origin: str) -> set[str]:
    """Refuse, before unpickling, what would hang or crash the C unpickler itself, and numbers no checkpoint holds.

    Hashing a tuple hashes its items, recursively and uncached: a tuple DAG built from memo references
    (t1 = (t0, t0), t2 = (t1, t1), ...) takes 2**depth steps to hash, and a tuple nested 100k deep
    overflows the C stack (a segfault). As a dict key or set member either one hangs or kills
    pickle.loads (and torch.load) inside C, where no timeout can stop it. This walks the opcodes
    (nothing is built), tracking how many nodes each tuple expands to and how deep it nests, and
    refuses a tuple deeper than MAX_TUPLE_DEPTH, one larger than both MAX_TUPLE_NODES and the pickle,
    and dict keys / set members whose hashing adds up to more than `_hash_budget`. It also refuses
    integers wider than MAX_INT_BITS (they cannot be converted to float or printed), and what would make
    the C unpickler allocate far more than the pickle holds: a memo index beyond the pickle's size (its
    memo array is grown and zero-filled to the index: 16 GB for one 6-byte LONG_BINPUT) and an
    argument length running past the end.
    The walk models the C unpickler's stack exactly (POP on an empty mark pops the mark, as protocol 0's
    recursive tuples do); where its model runs out (a stack underflow) the stream is refused, never left
    unwalked: a walk that stopped early would let what follows reach the unpickler unchecked. An unknown
    opcode ends the walk: the unpickler stops at the same byte.

    Speed (it runs on every pickle read, ~0.2 us per opcode): ops that only push one plain item (most of a
    state dict: keys, ints, floats, None) take a fast path through two flat tables; runs of MARK (a deep
    nest is 100k of them) are taken in one step. Their effect is exactly the general path's.

    Returns the names of the opcodes off the fast path that torch's weights-only unpickler cannot read (the
    fast path's are all readable in a protocol-2 pickle, torch.save's: `torch_refusals` walks the others).
    """
    # Per stack item: 1 for anything but a tuple, (expanded nodes, nesting depth) for a tuple.
    stack: list[Any] = []
    marks: list[int] = []  # stack heights at each MARK
    memo: dict[Any, Any] = {}
    table, n, i = _OPCODES, len(data), 0
    fixed, counted = _PUSH_FIXED, _PUSH_COUNTED
    push = stack.append
    from_bytes = int.from_bytes
    budget = _hash_budget(data)
    largest = max(MAX_TUPLE_NODES, n)
    built, most = 0, MAX_OBJECTS_BASE + n // 8  # memory grows with what the pickle builds, not its size
    torch_ok, refused = _TORCH_OPCODES, set[str]()
    try:
        while i < n:
            code = data[i]
            step = fixed[code]
            if step:  # a plain push with a fixed-size argument
                i += step
                push(1)
                continue
            width = counted[code]
            if width:  # a plain push of a counted string or bytes
                at = i + 1 + width
                i = at + (data[at - 1] if width == 1 else from_bytes(data[at - width:at], "little"))
                if i > n:
                    raise UnreadableCheckpoint(
                        f"{origin}: corrupt pickle (a {table[code][2]} argument runs past the end; truncated?)")
                push(1)
                continue
            if code == 0x94:  # MEMOIZE (protocol 4+: DCP's .metadata has one per object)
                memo[len(memo)] = stack[-1]
                i += 1
                continue
            if code == 0x68 and i + 2 <= n:  # BINGET: a shared key, dtype or storage type
                push(memo.get(data[i + 1], 1))
                i += 2
                continue
            if code == 0x71 and i + 2 <= n and data[i + 1] <= n:  # BINPUT (its index is checked below otherwise)
                memo[data[i + 1]] = stack[-1]
                i += 2
                continue
            spec = table[code]
            if spec is None:
                return refused
            action, size, name, has_mark, below, pushed = spec
            if not torch_ok[code]:
                refused.add(name)
            at = i + 1
            if code == 0x30 and marks and marks[-1] == len(stack):  # POP with nothing above the mark pops the mark
                marks.pop()
                i = at
                continue
            if action == _A_MARK:  # a run of MARKs in one step
                i = at
                while data[i:i + 1] == b"(":
                    chunk = data[i:i + 65536]
                    i += len(chunk) - len(chunk.lstrip(b"("))
                marks.extend([len(stack)] * (i - at + 1))
                continue
            if size >= 0:
                i = at + size
            elif size == -1:  # up to a newline (two lines for GLOBAL/INST)
                i = data.index(b"\n", at) + 1
                if action == _A_GLOBAL:
                    i = data.index(b"\n", i) + 1
            elif size == -2:  # 1-byte length
                at += 1
                i = at + data[at - 1]
            elif size in (-3, -4):  # 4-byte length
                at += 4
                i = at + from_bytes(data[at - 4:at], "little", signed=size == -3)
            else:  # 8-byte length
                at += 8
                i = at + from_bytes(data[at - 8:at], "little")
            if i > n or i < at:  # the C unpickler would allocate the declared length before noticing
                raise UnreadableCheckpoint(f"{origin}: corrupt pickle (a {name} argument runs past the end; truncated?)")
            if action == _A_OTHER:
                if name in _BUILDS:
                    built += 1
                    if built > most:
                        raise UnreadableCheckpoint(
                            f"{origin}: pickle builds more than {most:,} containers and objects from {n:,} bytes "
                            "(a flood: real checkpoints build about one per 25 bytes); not a checkpoint")
                if has_mark:
                    del stack[marks.pop():]
                if below:
                    if below > len(stack):
                        raise _Underflow
                    del stack[-below:]
                if pushed == 1:
                    push(1)
                elif pushed:
                    stack.extend((1,) * pushed)
                continue
            if action <= _A_TUPLE3:  # a tuple: its expanded size and depth
                if action == _A_TUPLE_MARK:
                    m = marks.pop()
                else:
                    m = len(stack) - (action - 1)
                    if m < 0:
                        raise _Underflow
                items = stack[m:]
                del stack[m:]
                weight, depth = 1, 1
                for item in items:
                    if item.__class__ is tuple:
                        weight += item[0]
                        depth = max(depth, item[1] + 1)
                    else:
                        weight += 1
                if depth > MAX_TUPLE_DEPTH:
                    raise UnreadableCheckpoint(
                        f"{origin}: pickle holds a tuple nested more than {MAX_TUPLE_DEPTH} deep (real checkpoints "
                        "nest a few; hashing one nested ~100k deep overflows the C stack); not a checkpoint")
                if weight > largest:
                    raise UnreadableCheckpoint(
                        f"{origin}: pickle holds a tuple nested {depth} deep that expands to {weight:,} nodes "
                        "(a memo bomb: hashing it would hang or crash the unpickler); not a checkpoint")
                stack.append((weight, depth) if weight > 1 or depth > 1 else 1)
            elif action <= _A_PUT:
                key = (data[at] if size == 1 else from_bytes(data[at:i], "little") if size == 4
                       else int(data[at:i - 1]))
                if action == _A_GET:
                    stack.append(memo.get(key, 1))
                else:
                    if not 0 <= key <= n:  # the C unpickler grows (and zero-fills) its memo array to the index
                        raise UnreadableCheckpoint(f"{origin}: corrupt pickle (memo index {key} in a pickle of {n} bytes)")
                    memo[key] = stack[-1]
            elif action == _A_MEMOIZE:
                memo[len(memo)] = stack[-1]
            elif action == _A_DUP:
                stack.append(stack[-1])
            elif action == _A_MARK:
                marks.append(len(stack))
            elif action == _A_STOP:
                return refused
            elif action in (_A_LONG_BINARY, _A_LONG_TEXT):
                digits = i - at
                if action == _A_LONG_TEXT and digits > 320:  # wider than 1023 bits whatever the digits; never
                    raise UnreadableCheckpoint(  # converted (int() refuses 4300 digits, and is quadratic below)
                        f"{origin}: pickle holds an integer of {digits - 1:,} digits; no checkpoint value is that wide")
                if digits > (127 if action == _A_LONG_BINARY else 300):
                    value = from_bytes(data[at:i], "little", signed=True) if action == _A_LONG_BINARY else int(data[at:i - 1].rstrip(b"L"))
                    if value.bit_length() > MAX_INT_BITS:
                        raise UnreadableCheckpoint(f"{origin}: pickle holds an integer of {value.bit_length()} bits; "
                                                   "no checkpoint value is that wide")
                stack.append(1)
            elif action == _A_GLOBAL:  # GLOBAL / INST
                if name == "INST":
                    del stack[marks.pop():]
                stack.append(1)
            elif action == _A_BUILD:  # BUILD returns its instance: keep the instance's weight
                stack.pop()
            else:  # SETITEM(S) / DICT hash keys, ADDITEMS / FROZENSET hash members
                built += name in ("DICT", "FROZENSET")
                if action == _A_SETITEM:
                    hashed = stack[-2:-1]
                    del stack[-2:]
                else:
                    m = marks.pop()
                    hashed = stack[m::2] if action == _A_SETITEMS else stack[m:]
                    del stack[m:]
                    if name in ("ADDITEMS", "SETITEMS"):
                        if not stack:
                            raise _Underflow
                        stack.pop()
                    stack.append(1)
                budget -= sum(item[0] if item.__class__ is tuple else 1 for item in hashed)
                if budget < 0:
                    raise UnreadableCheckpoint(
                        f"{origin}: pickle makes the unpickler hash more than {_hash_budget(data):,} tuple nodes "
                        "(a memo bomb); not a checkpoint")
    except UnreadableCheckpoint:
        raise
    except Exception:  # the model ran out (stack or marks underflow, a text argument that is not a number)
        raise UnreadableCheckpoint(f"{origin}: corrupt pickle (unpickling stack underflow or a malformed "
                                   f"argument at byte {i})") from None
    if i > n:  # the fast path's last fixed-size argument ran past the end: name its op as the slow path does
        name = next((table[data[j]][2] for j in range(max(0, n - 9), n) if j + fixed[data[j]] == i), "last")
        raise UnreadableCheckpoint(f"{origin}: corrupt pickle (a {name} argument runs past the end; truncated?)")
    return refused


class _Underflow(Exception):
    """`_prescan`'s stack model ran out where the C unpickler's would too."""


class _HashBudget:
    """What set()/frozenset()/OrderedDict() calls in one pickle may hash (their members are built at
    run time, so `_prescan` cannot weigh them): each call is charged its members' expanded size."""

    def __init__(self, data: bytes):
        self.left = _hash_budget(data)

    def charge(self, value: Any) -> None:
        self.left -= _expanded_nodes(value)
        if self.left < 0:
            raise pickle.UnpicklingError("set/dict construction hashes more than the budget allows (a memo bomb)")

    def wrap(self, cls: type) -> "_Function":
        def build(*args: Any) -> Any:
            for arg in args:
                self.charge(arg)
            return cls(*args)

        build.__name__ = cls.__name__
        return _Function(build)


def _expanded_nodes(value: Any) -> int:
    """How many nodes `value` has if every shared container is counted at each use (no recursion)."""
    weights: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(value, False)]
    while stack:
        node, done = stack.pop()
        if not isinstance(node, (tuple, list, set, frozenset, dict)):
            continue
        key = id(node)
        items = list(node.items()) if isinstance(node, dict) else node
        if done:
            weights[key] = 1 + sum(weights.get(id(c), 1) for c in items)
        elif key not in weights:
            weights[key] = 1  # in progress: a cycle counts once
            stack.append((node, True))
            stack.extend((c, False) for c in items)
    return weights.get(id(value), 1)


#: Exact types of the unpickled values that hold nothing else (a subclass is walked as usual).
PLAIN_LEAVES = frozenset({str, int, float, bool, type(None), bytes, complex})


#: What `_check_tree` never walks into: plain values, and the tensors the unpickler built (records, not containers).
_CHECKED_LEAVES = PLAIN_LEAVES | {TensorRef}


def _check_tree(tree: Any, origin: str) -> None:
    """After unpickling: no dict may carry instance attributes that shadow its methods (BUILD on an
    OrderedDict can set `values`/`items`/`get` to an allowlisted callable). Each container once."""
    seen: set[int] = set()
    stack = [tree]
    leaves = _CHECKED_LEAVES
    while stack:
        node = stack.pop()
        if node.__class__ in leaves or id(node) in seen:  # most nodes are keys and numbers: one set lookup
            continue
        if node.__class__ is dict:  # a plain dict has no instance attributes (`getattr` would raise inside)
            seen.add(id(node))
            stack.extend(node.values())
        elif isinstance(node, dict):
            seen.add(id(node))
            attrs = getattr(node, "__dict__", None)
            if attrs:
                bad = [k for k in attrs if not isinstance(k, str) or hasattr(type(node), k)]
                if bad:
                    raise UnreadableCheckpoint(
                        f"{origin}: pickle sets attributes that shadow dict methods ({printable(str(bad[0]))}); "
                        "not a checkpoint")
                stack.extend(attrs.values())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            seen.add(id(node))
            stack.extend(node)
        elif isinstance(node, OpaqueObject):
            seen.add(id(node))
            stack.extend((node.args, node.state, node.items))


def globals_in_pickle(data: bytes) -> list[str]:
    """List every global a pickle would import, by reading its opcodes (nothing is executed)."""
    found: list[str] = []
    strings: list[str | None] = []  # what recent ops pushed: a string, or None for anything else
    memo: dict[Any, str | None] = {}
    memoized = 0
    last_string = False  # whether the previous op pushed a string (only then does a PUT/MEMOIZE store one)
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            pushed_string = False
            if name in ("GLOBAL", "INST"):
                found.append(str(arg).replace(" ", "."))
            elif name == "STACK_GLOBAL" and len(strings) >= 2 and None not in strings[-2:]:
                found.append(f"{strings[-2]}.{strings[-1]}")
            elif name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING",
                          "BINSTRING", "STRING"):
                strings.append(str(arg))
                pushed_string = True
            elif name in ("BINPUT", "LONG_BINPUT", "PUT", "MEMOIZE"):
                memo[memoized if name == "MEMOIZE" else arg] = strings[-1] if last_string and strings else None
                memoized += name == "MEMOIZE"
                pushed_string = last_string
            elif name in ("BINGET", "LONG_BINGET", "GET"):
                strings.append(memo.get(arg))
                pushed_string = memo.get(arg) is not None
            elif opcode.stack_after:
                strings.append(None)
            last_string = pushed_string
            if opcode.name == "STOP":
                break
    except Exception:  # a truncated pickle: report what we saw before the damage
        pass
    return sorted(set(found))


def load_pickle(data: bytes, origin: str, *, opaque: bool = False, refusals: list[str] | None = None) -> Any:
    """Unpickle `data` with the allowlist; globals outside it become inert `OpaqueObject` records. Strict mode
    raises UnsafePickle naming every call that is not a known data class's constructor, with its arguments.
    `refusals`, if given, receives why torch.load(weights_only=True) would refuse this pickle though ckptfix
    reads it: each global outside torch's allowlist, and the first opcode its unpickler cannot read."""
    if len(data) > MAX_PICKLE_BYTES:
        raise UnreadableCheckpoint(f"{origin}: pickle of {len(data)} bytes is implausibly large")
    refused_ops = _prescan(data, origin)
    unpickler = _SafeUnpickler(data, opaque, origin)
    try:
        tree = unpickler.load()
        if any(t.storage is None for t in unpickler.pending):
            raise pickle.UnpicklingError("a tensor class constructed without its (storage, offset, size, stride)")
        _check_tree(tree, origin)
    except UnreadableCheckpoint:
        raise
    except Exception as exc:
        if unpickler.made and not opaque:  # a payload's chained calls fail on our records: report the calls
            _refuse(data, origin, unpickler, unpickler.code_calls() or unpickler.made)
        raise _unreadable(exc, origin) from None
    calls = [] if opaque else unpickler.code_calls()
    if calls:
        _refuse(data, origin, unpickler, calls)
    if refusals is not None:
        refusals.extend(torch_refusals(data, refused_ops, unpickler.names))
    return tree


def torch_refusals(data: bytes, refused_ops: set[str], names: set[str]) -> list[str]:
    """Why torch's weights-only unpickler refuses a pickle ckptfix read: its globals outside torch's allowlist,
    then its first opcode torch cannot read (a protocol-2 pickle's are all off `_prescan`'s fast path; any
    other protocol is walked, up to the first)."""
    out = [f"global {printable(n)}" for n in sorted(names) if torch_refuses(n)]
    op = torch_refused_opcode(data) if data[:2] != b"\x80\x02" else min(refused_ops, default=None)
    if op is not None:
        out.append(f"opcode {op}" if "protocol" in op else f"opcode {op} (not written by torch.save)")
    return out


def _refuse(data: bytes, origin: str, unpickler: _SafeUnpickler, calls: list[OpaqueObject]) -> None:
    named = sorted({n for o in calls for n in call_globals(o)})
    outside = [printable(g) for g in globals_in_pickle(data)
               if tuple(g.rsplit(".", 1)) not in ALLOWED_GLOBALS and g not in DATA_CALLS]
    raise UnsafePickle(origin, [printable(n) for n in named] or outside or unpickler.refused,
                       calls=[describe_call(o) for o in calls if not is_data_call(o)][:5]) from None


def _unreadable(exc: Exception, origin: str) -> UnreadableCheckpoint:
    if isinstance(exc, RecursionError):
        return UnreadableCheckpoint(f"{origin}: pickle is nested too deeply to read")
    if isinstance(exc, MemoryError):
        return UnreadableCheckpoint(f"{origin}: pickle needs more memory than is available")
    detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__  # any damage to the opcode stream
    return UnreadableCheckpoint(f"{origin}: corrupt pickle ({printable(detail, 200)})")
