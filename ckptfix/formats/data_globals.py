"""Globals outside the unpickler's allowlist that are plain data, and what `torch.load(weights_only=True)` accepts.

`pickle_safe` reads every global inertly: it never imports or calls one, it records how the pickle uses
it (an `OpaqueObject`: constructed by NEWOBJ and filled by BUILD, or called by REDUCE). This module
decides what those records are:

* `DATA_CLASSES`: the globals known to be plain data, each with the reason it is safe to read and to
  convert. A *call* (REDUCE) is accepted only for these (`DATA_CALLS`); any other call is code and the
  strict reader refuses the file, naming the call and its arguments.
* An object of any other class that the pickle only *constructs* (NEWOBJ, then BUILD with its
  `__dict__`: a user's config dataclass, DeepSpeed's LossScaler, an `argparse.Namespace`) is data too:
  loading it runs no function of the file's choosing except the class's own `__setstate__`, and
  converting it keeps only its state.
* `TORCH_WEIGHTS_ONLY_GLOBALS`: what the installed torch's weights-only unpickler accepts by default.

`uses()` lists every such record with its place in the tree and its fields decoded as data (for
`inspect`); `convert()` turns them into values `torch.load(weights_only=True)` loads (for
`ckptfix convert`). Both only read the records: nothing here imports a global's module except
numpy (to decode a dtype string) and pure `pathlib`/`datetime` arithmetic.
"""

from __future__ import annotations

import datetime
import math
import pathlib
import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.dtypes import DTYPE_SIZES, contiguous_stride
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
    printable,
)
from ckptfix.plain import plain
from ckptfix.untrusted import INT64_MAX

# torch 2.13's default weights-only allowlist: the keys of `torch._weights_only_unpickler._get_allowed_globals()`
# (torch/_weights_only_unpickler.py; dtypes, storage and tensor classes, rebuild functions, and five builtins).
# inspect must not import torch, so the list is written out; tests/test_weights_only.py compares it with the
# installed torch's. Names added by `torch.serialization.add_safe_globals` in the loading process are not known here.
_TORCH_NON_TORCH = ("_codecs.encode", "builtins.bytearray", "builtins.complex", "builtins.set", "collections.Counter",
                    "collections.OrderedDict")
_TORCH_TYPES = ("BFloat16", "Bool", "Byte", "Char", "Double", "Float", "Half", "Int", "Long", "Short")
_TORCH_NAMES = (
    [f"torch.{t}Storage" for t in _TORCH_TYPES + ("ComplexDouble", "ComplexFloat", "QInt32", "QInt8", "QUInt2x4",
                                                  "QUInt4x2", "QUInt8")]
    + [f"torch.{t}Tensor" for t in _TORCH_TYPES]
    + [f"torch.cuda.{t}Storage" for t in _TORCH_TYPES + ("ComplexDouble", "ComplexFloat")]
    + [f"torch.cuda.{t}Tensor" for t in _TORCH_TYPES]
    + [f"torch.{p}.{t}Tensor" for p in ("sparse", "cuda.sparse") for t in _TORCH_TYPES if t != "Bool"]
    + [f"torch._utils._rebuild_{f}" for f in ("device_tensor_from_cpu_tensor", "device_tensor_from_numpy",
                                              "meta_tensor_no_storage", "nested_tensor", "parameter",
                                              "parameter_with_state", "qtensor", "sparse_tensor", "tensor",
                                              "tensor_v2", "tensor_v3", "wrapper_subclass")]
    + ["torch._tensor._rebuild_from_type_v2", "torch.Size", "torch.Tensor", "torch.device",
       "torch.nn.parameter.Parameter", "torch.serialization._get_layout", "torch.storage.TypedStorage",
       "torch.storage.UntypedStorage"]
    + [f"torch.{d}" for d in ("bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128",
                              "complex32", "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64",
                              "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu",
                              "qint32", "qint8", "quint2x4", "quint4x2", "quint8", "per_channel_affine",
                              "per_channel_affine_float_qparams", "per_channel_symmetric", "per_tensor_affine",
                              "per_tensor_symmetric")]
    + [f"torch.{k}{n}" for k in ("int", "uint") for n in (1, 2, 3, 4, 5, 6, 7, 8, 16, 32, 64)]
)
TORCH_WEIGHTS_ONLY_GLOBALS: frozenset[str] = frozenset(_TORCH_NON_TORCH) | frozenset(_TORCH_NAMES)


def torch_refuses(name: str) -> bool:
    """Whether torch.load(weights_only=True) refuses a pickle that names this global (by default)."""
    if name.startswith("__builtin__."):  # protocol 2's spelling; torch reads it as builtins
        name = "builtins." + name.split(".", 1)[1]
    return name not in TORCH_WEIGHTS_ONLY_GLOBALS


@dataclass(frozen=True)
class DataClass:
    """A global known to be plain data: what it becomes when converted, and why reading it is safe."""

    to: str  # what `convert` makes of it
    reason: str  # why constructing / calling it runs no code of the file's choosing
    call: bool = False  # the pickle calls it (REDUCE) with data arguments


_NUMPY = ("numpy.core.multiarray", "numpy._core.multiarray")
_PATHS = ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path", "PurePath")
# Enums of the training libraries users save into checkpoints: `Enum(value)` only looks the member up.
KNOWN_ENUMS = (
    "transformers.trainer_utils.IntervalStrategy", "transformers.trainer_utils.SaveStrategy",
    "transformers.trainer_utils.HubStrategy", "transformers.trainer_utils.SchedulerType",
    "transformers.training_args.OptimizerNames", "transformers.debug_utils.DebugOption",
    "accelerate.utils.dataclasses.DistributedType", "accelerate.utils.dataclasses.PrecisionType",
    "accelerate.utils.dataclasses.RNGType", "deepspeed.runtime.zero.config.ZeroStageEnum",
    "lightning.pytorch.trainer.states.TrainerFn", "lightning.pytorch.trainer.states.RunningStage",
    "lightning.pytorch.trainer.states.TrainerStatus",
    # Megatron-LM's saved `args` (common.pt of a torch_dist checkpoint: attention_backend=AttnBackend.auto)
    *(f"megatron.core.enums.{n}" for n in ("ModelType", "Fp8Recipe", "Fp4Recipe")),
    *(f"megatron.core.transformer.enums.{n}" for n in ("ModelType", "LayerType", "AttnType", "AttnMaskType",
                                                        "AttnBackend", "CudaGraphScope")),
)

# The one list of convertible data classes (SECURITY.md documents it). Objects of other classes that are
# only constructed (NEWOBJ + BUILD) are converted by the general rule (their state, as a dict).
DATA_CLASSES: dict[str, DataClass] = {
    **{f"{m}.scalar": DataClass("a Python int/float/bool/complex (the dtype is recorded)",
                                "numpy rebuilds a scalar from a dtype and its raw bytes; ckptfix decodes the "
                                "bytes itself (np.frombuffer) after checking their length", call=True) for m in _NUMPY},
    "numpy.dtype": DataClass("(part of its scalar or array)", "a dtype is built from a type code such as 'f8'; "
                             "only numeric codes are accepted", call=True),
    **{f"{m}._reconstruct": DataClass("a tensor of the same dtype, shape and bytes (a list of Python numbers for "
                                      "uint16/32/64)",
                                      "an empty ndarray filled by BUILD with (shape, dtype, raw bytes); object "
                                      "arrays (pickled elements) are refused", call=True) for m in _NUMPY},
    "numpy.ndarray": DataClass("(part of its array)", "only named as the class `_reconstruct` builds", call=False),
    **{f"pathlib.{p}": DataClass("a str", "a path is built from its string parts; joining strings runs nothing",
                                 call=True) for p in _PATHS},
    **{f"pathlib._local.{p}": DataClass("a str", "Python 3.13's module for the same path classes", call=True)
       for p in _PATHS},
    "datetime.datetime": DataClass("an ISO 8601 str", "rebuilt from 10 packed bytes (and a timezone)", call=True),
    "datetime.date": DataClass("an ISO 8601 str", "rebuilt from 4 packed bytes", call=True),
    "datetime.time": DataClass("an ISO 8601 str", "rebuilt from 6 packed bytes", call=True),
    "datetime.timedelta": DataClass("a float (seconds)", "three integers", call=True),
    "datetime.timezone": DataClass("(part of its datetime)", "an offset and a name", call=True),
    "collections.deque": DataClass("a list (maxlen recorded)", "an empty deque, then APPENDs", call=True),
    "collections.defaultdict": DataClass("a dict (the default factory is dropped and recorded)",
                                         "an empty dict; its factory is only named, never called while loading",
                                         call=True),
    "copyreg._reconstructor": DataClass("like the object it constructs", "protocol 0/1's `object.__new__(cls)`; "
                                        "accepted only with base `builtins.object` and no extra state", call=True),
    "builtins.bytes": DataClass("bytes", "protocol 2 (torch.save's) spells an empty bytes value `bytes()`; only "
                                "that call, with no arguments, is accepted", call=True),
    "builtins.frozenset": DataClass("a set", "torch's allowlist has `set` but not `frozenset`"),
    "builtins.slice": DataClass("a (start, stop, step) tuple", "three ints or None"),
    "argparse.Namespace": DataClass("a dict of its attributes", "constructed empty; BUILD sets its __dict__"),
    "omegaconf.dictconfig.DictConfig": DataClass("a dict (interpolations kept as their '${...}' strings)",
                                                 "constructed empty; BUILD sets `_content` (nodes) and metadata"),
    "omegaconf.listconfig.ListConfig": DataClass("a list", "as DictConfig"),
    **{f"omegaconf.nodes.{n}": DataClass("its value", "a node holding one value in `_val`")
       for n in ("AnyNode", "StringNode", "IntegerNode", "FloatNode", "BooleanNode", "BytesNode", "PathNode",
                 "EnumNode", "UnionNode", "ValueNode")},
    **{n: DataClass("its value (str or int)", "`Enum(value)` looks a member up by value", call=True)
       for n in KNOWN_ENUMS},
    # Library objects checkpoints hold, constructed (NEWOBJ + BUILD), never called: each class defines no
    # `__new__` and no `__setstate__` but object's (omegaconf's metadata dataclasses), or a `__setstate__` that
    # only assigns its fields (omegaconf containers); tests/test_data_calls.py imports each and checks it.
    **{f"omegaconf.base.{n}": DataClass("(part of its config)", "a dataclass of flags; BUILD sets its fields")
       for n in ("ContainerMetadata", "Metadata")},
    **{f"deepspeed.runtime.fp16.loss_scaler.{n}": DataClass("a dict of its attributes",
                                                            "a plain class: BUILD sets its __dict__")
       for n in ("LossScaler", "DynamicLossScaler")},
    "torch.torch_version.TorchVersion": DataClass("a str", "a str subclass (Composer saves torch.__version__): "
                                                  "NEWOBJ is str.__new__(cls, text)"),
    "deepspeed.utils.tensor_fragment.fragment_address": DataClass("a dict of its fields",
                                                                  "a dataclass (numel, start): BUILD sets its fields"),
}
# Types a pickle only names (omegaconf's key and element types): allowlisted, calling one builds plain data.
NAMED_TYPES = frozenset({*(f"builtins.{t}" for t in ("dict", "list", "tuple", "int", "float", "str", "bool", "bytes")),
                         "typing.Any"})
DATA_CALLS: frozenset[str] = frozenset(n for n, c in DATA_CLASSES.items() if c.call)


# --- which calls are data, judged per argument ------------------------------------------------------
# A name on the list is not enough: `copyreg._reconstructor(Popen, Popen, argv)` runs `Popen.__init__(argv)`
# under pickle.load. Each entry's reason holds only for the arguments it assumes, so a call is data only when
# its arguments are exactly those (tests/test_data_calls.py gives every entry every kind of argument).

def _is_str(x: Any) -> bool:
    return isinstance(x, str)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_bytes(x: Any) -> bool:
    return isinstance(x, (bytes, str))  # protocol 0-2 spell numpy's and datetime's bytes as latin-1 str


def _is_record(x: Any, *classes: str) -> bool:
    return isinstance(x, OpaqueObject) and x.cls in classes and not x.kwargs


def _args(*checks: Any, optional: int = 0) -> Any:
    """A predicate: positional arguments, the last `optional` of which may be absent."""
    def ok(args: tuple) -> bool:
        if not len(checks) - optional <= len(args) <= len(checks):
            return False
        return all(check(a) for check, a in zip(checks, args))
    return ok


_DTYPE = lambda x: _is_record(x, "numpy.dtype")  # noqa: E731
_TZ = lambda x: x is None or _is_record(x, "datetime.timezone")  # noqa: E731
_NONE = lambda x: x is None  # noqa: E731
_BOOL = lambda x: isinstance(x, bool)  # noqa: E731
# defaultdict stores its factory and calls it on a missing key after loading: only these builtins are data.
_PLAIN_FACTORIES = {f"builtins.{t}" for t in ("list", "dict", "set", "int", "float", "str", "tuple", "bool")}
_ARGUMENTS: dict[str, Any] = {
    **{f"{m}.scalar": _args(_DTYPE, _is_bytes, optional=1) for m in _NUMPY},
    "numpy.dtype": _args(_is_str, _BOOL, _BOOL, optional=2),
    **{f"{m}._reconstruct": _args(lambda x: global_name(x) == "numpy.ndarray",
                                  lambda x: isinstance(x, tuple) and all(_is_int(d) for d in x), _is_bytes)
       for m in _NUMPY},
    **{f"{m}.{p}": lambda args: all(_is_str(a) for a in args) for m in ("pathlib", "pathlib._local") for p in _PATHS},
    "datetime.datetime": _args(_is_bytes, _TZ, optional=1),
    "datetime.date": _args(_is_bytes),
    "datetime.time": _args(_is_bytes, _TZ, optional=1),
    "datetime.timedelta": _args(_is_int, _is_int, _is_int, optional=2),
    "datetime.timezone": _args(lambda x: _is_record(x, "datetime.timedelta"), _is_str, optional=1),
    "collections.deque": _args(lambda x: isinstance(x, (list, tuple)), lambda x: x is None or _is_int(x),
                               optional=2),
    "collections.defaultdict": _args(lambda x: x is None or global_name(x) in _PLAIN_FACTORIES
                                     or (global_name(x) is None and not isinstance(x, OpaqueObject) and callable(x)),
                                     optional=1),  # the last: a class ckptfix's own allowlist gave (set, Counter)
    # protocol 0/1's `object.__new__(cls)`: the same as NEWOBJ of cls. Any other base runs base.__init__(state).
    "copyreg._reconstructor": _args(lambda x: global_name(x) is not None,
                                    lambda x: global_name(x) == "builtins.object", _NONE),
    **{n: _args(lambda x: _is_str(x) or _is_int(x)) for n in KNOWN_ENUMS},
    "builtins.bytes": _args(),  # b"" as protocol 2 writes it
}
assert set(_ARGUMENTS) == DATA_CALLS, "every data call has its argument rule"
# Constructions with arguments (NEWOBJ: `cls.__new__(cls, *args)`) known to be data, with the arguments assumed.
_NEW_ARGUMENTS: dict[str, Any] = {"torch.torch_version.TorchVersion": _args(_is_str)}
NEW_WITH_ARGUMENTS: frozenset[str] = frozenset(_NEW_ARGUMENTS)


def is_data_call(rec: OpaqueObject) -> bool:
    """Whether a call the pickle makes cannot run code: a data-list global given exactly the arguments its
    reason assumes (REDUCE), or a construction (NEWOBJ) without arguments. NEWOBJ with arguments is
    `cls.__new__(cls, *args)` (what `__reduce_ex__` emits for `copyreg.__newobj__`): the class's own `__new__`
    given values of the file's choosing (numpy.memmap's opens and truncates a file), so data only for a class on
    the data list. Nested records are judged on their own (each is in the unpickler's `made` list)."""
    if not rec.called:
        if not (rec.args or rec.kwargs):
            return True
        rule = _NEW_ARGUMENTS.get(rec.cls)
        return rule is not None and not rec.kwargs and bool(rule(rec.args))
    rule = _ARGUMENTS.get(rec.cls)
    return rule is not None and not rec.kwargs and bool(rule(rec.args))


def call_globals(rec: OpaqueObject) -> list[str]:
    """The globals a call names: the function and any class passed to it (`_reconstructor`'s class and base)."""
    return [rec.cls, *(n for n in map(global_name, rec.args) if n is not None)]

_OMEGA_NODE = "omegaconf.nodes."
_NUMPY_CODE = re.compile(r"[biufc]\d{1,2}")


@dataclass
class Use:
    """One object the pickle builds from a global outside ckptfix's allowlist (or a builtin torch refuses)."""

    path: str
    cls: str
    how: str  # "constructed", "called" or "named"
    globals: list[str]  # every global name this value needs (nested ones included)
    fields: Any  # its contents as plain data, for the report
    convertible: bool = True
    why_not: str = ""
    runs_code: list[str] = field(default_factory=list)  # calls (nested ones included) that are not data

    @property
    def torch_refuses(self) -> list[str]:
        return [g for g in self.globals if torch_refuses(g)]

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "class": self.cls, "how": self.how, "globals": self.globals,
                "torch_weights_only_refuses": self.torch_refuses, "fields": self.fields,
                "convertible": self.convertible, **({"why_not": self.why_not} if self.why_not else {}),
                **({"runs_code": self.runs_code} if self.runs_code else {})}


# --- decoding records into data -------------------------------------------------------------------

class NotData(Exception):
    """A record that is not the plain data its class promises (wrong arguments, object arrays...)."""


def _numpy_dtype(rec: Any) -> Any:
    import numpy as np

    if not (isinstance(rec, OpaqueObject) and rec.cls == "numpy.dtype" and rec.args and isinstance(rec.args[0], str)):
        raise NotData("a numpy value without a numeric dtype")
    code = rec.args[0]
    if not _NUMPY_CODE.fullmatch(code):
        raise NotData(f"numpy dtype {printable(code, 20)!r} is not a plain number type")
    try:
        dtype = np.dtype(code)
    except TypeError:  # 'f3', 'c1', 'i0', 'u3': the pattern's shape, not a size numpy has
        raise NotData(f"numpy dtype {code!r} is not one numpy knows (numpy refuses it too)") from None
    state = rec.state
    if isinstance(state, tuple) and len(state) > 1 and state[1] in ("<", ">", "|", "="):
        dtype = dtype.newbyteorder(state[1]) if state[1] in ("<", ">") else dtype
    return dtype


def _dtype_class(rec: Any) -> str:
    """The class torch's weights-only BUILD needs allowlisted for a numpy dtype (numpy.dtypes.Float64DType)."""
    try:
        return f"numpy.dtypes.{type(_numpy_dtype(rec)).__name__}"
    except NotData:
        return "numpy.dtype"


def numpy_scalar(rec: OpaqueObject) -> tuple[Any, str]:
    """(Python value, dtype name) of a pickled numpy scalar."""
    if len(rec.args) != 2 or not isinstance(rec.args[1], bytes):
        raise NotData("numpy scalar without its bytes")
    import numpy as np

    dtype = _numpy_dtype(rec.args[0])
    if len(rec.args[1]) != dtype.itemsize:
        raise NotData("numpy scalar whose bytes do not match its dtype")
    return np.frombuffer(rec.args[1], dtype=dtype)[0].item(), dtype.name


def numpy_array(rec: OpaqueObject) -> Any:
    """The numpy array a pickled `_reconstruct` + BUILD describes (decoded from its bytes; never unpickled)."""
    import numpy as np

    state = rec.state
    if not (isinstance(state, tuple) and len(state) == 5 and isinstance(state[1], tuple)):
        raise NotData("numpy array without its (version, shape, dtype, order, data) state")
    _, shape, dtype_rec, fortran, data = state
    if not all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape) or len(shape) > 32:
        raise NotData("numpy array with an impossible shape")
    dtype = _numpy_dtype(dtype_rec)
    if not isinstance(data, bytes):
        raise NotData("numpy array of Python objects (its elements are pickled, not raw bytes)")
    if len(data) != math.prod(shape) * dtype.itemsize:
        raise NotData("numpy array whose bytes do not match its shape")
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize > INT64_MAX:  # empty, but its strides overflow int64
        raise NotData(f"numpy array of shape {list(shape)[:8]}: its strides exceed 2**63 bytes (numpy refuses it too)")
    return np.frombuffer(data, dtype=dtype).reshape(shape, order="F" if fortran else "C")


def _path(rec: OpaqueObject) -> str:
    if not all(isinstance(a, str) for a in rec.args):
        raise NotData("path made of something other than strings")
    windows = "Windows" in rec.cls
    return str((pathlib.PureWindowsPath if windows else pathlib.PurePosixPath)(*rec.args))


def _timezone(rec: Any) -> datetime.tzinfo | None:
    if rec is None:
        return None
    if not (isinstance(rec, OpaqueObject) and rec.cls == "datetime.timezone" and rec.args):
        raise NotData("datetime with a timezone ckptfix does not know")
    offset = _timedelta(rec.args[0])
    return datetime.timezone(offset, *(a for a in rec.args[1:2] if isinstance(a, str)))


def _timedelta(rec: Any) -> datetime.timedelta:
    if not (isinstance(rec, OpaqueObject) and rec.cls == "datetime.timedelta"
            and all(isinstance(a, int) and abs(a) < 1 << 40 for a in rec.args) and len(rec.args) <= 3):
        raise NotData("timedelta of something other than integers")
    try:
        return datetime.timedelta(*rec.args)
    except OverflowError:  # more than 999,999,999 days
        raise NotData("timedelta out of range (Python's limit is 999,999,999 days)") from None


def _datetime(rec: OpaqueObject) -> str:
    raw = rec.args[0] if rec.args else None
    if not isinstance(raw, bytes):
        raise NotData(f"{rec.cls} without its packed bytes")
    try:
        if rec.cls == "datetime.date" and len(raw) == 4:
            return datetime.date(raw[0] * 256 + raw[1], raw[2], raw[3]).isoformat()
        if rec.cls == "datetime.time" and len(raw) == 6:
            us = (raw[3] << 16) | (raw[4] << 8) | raw[5]
            return datetime.time(raw[0], raw[1], raw[2], us, _timezone(rec.args[1] if len(rec.args) > 1 else None)
                                 ).isoformat()
        if rec.cls == "datetime.datetime" and len(raw) == 10:
            us = (raw[7] << 16) | (raw[8] << 8) | raw[9]
            tz = _timezone(rec.args[1] if len(rec.args) > 1 else None)
            return datetime.datetime(raw[0] * 256 + raw[1], raw[2] & 0x7F, raw[3], raw[4], raw[5], raw[6], us, tz,
                                     fold=raw[2] >> 7).isoformat()
    except ValueError as exc:
        raise NotData(f"{rec.cls} out of range ({exc})") from None
    raise NotData(f"{rec.cls} with {len(raw)} packed bytes")


def _object_state(rec: OpaqueObject) -> dict:
    """The attributes of an object the pickle constructed (NEWOBJ + BUILD): `__dict__`, slots, dict items."""
    if rec.args or rec.kwargs:
        raise NotData(f"{rec.cls} is constructed with arguments ({len(rec.args)}); their meaning is the class's")
    state, out = rec.state, {}
    if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)) \
            and isinstance(state[1], dict):  # (__dict__, slots)
        out.update(state[0] or {})
        out.update(state[1])
    elif isinstance(state, dict):
        out.update(state)
    elif state is not None:
        raise NotData(f"{rec.cls} has a custom state ({type(state).__name__}); only its class knows what it means")
    if rec.items:
        if out:
            raise NotData(f"{rec.cls} is a container with attributes")
        return dict(rec.items)
    if not all(isinstance(k, str) for k in out):
        raise NotData(f"{rec.cls} has attributes that are not strings")
    return out


# --- what a record becomes ------------------------------------------------------------------------

@dataclass
class Conversion:
    path: str
    cls: str
    to: str
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "class": self.cls, "to": self.to, **({"detail": self.detail} if self.detail else {})}


# Levels of containers and records `Converter` follows; each costs up to 5 Python frames, so this stays well
# below Python's recursion limit (1000) wherever the converter is called from. Real state dicts nest a few.
MAX_CONVERT_DEPTH = 100


@dataclass
class Converter:
    """Turns a tree read by `pickle_safe` into one `torch.load(weights_only=True)` loads. New tensors (from
    numpy arrays) get fresh storage keys; `arrays` maps each key to the array whose bytes it holds."""

    next_key: int
    summary: bool = False  # for the report: arrays are described, not copied into lists
    conversions: list[Conversion] = field(default_factory=list)
    arrays: dict[str, Any] = field(default_factory=dict)
    memo: dict[int, Any] = field(default_factory=dict)
    depth: int = 0

    def value(self, node: Any, path: str) -> Any:
        if node is None or isinstance(node, (bool, int, float, complex, str, bytes, bytearray, TensorRef,
                                             RebuiltTensor, TorchDtype, TorchDevice, TorchLayout)):
            return node
        if id(node) in self.memo:
            return self.memo[id(node)]
        self.depth += 1
        try:
            if self.depth > MAX_CONVERT_DEPTH:
                raise RepairError(f"{path}: nested more than {MAX_CONVERT_DEPTH} deep; too deep to convert")
            return self._value(node, path)
        finally:
            self.depth -= 1

    def _value(self, node: Any, path: str) -> Any:
        if isinstance(node, dict):  # OrderedDict, Counter and dict stay what they are (torch allows all three)
            out = node.__class__() if type(node) in (dict,) or type(node).__module__ == "collections" else {}
            self.memo[id(node)] = out
            for k, v in node.items():
                out[self.key(k, path)] = self.value(v, _join(path, k))
            return out
        if isinstance(node, list):
            out_list: list = []
            self.memo[id(node)] = out_list
            out_list.extend(self.value(v, _join(path, i)) for i, v in enumerate(node))
            return out_list
        if isinstance(node, tuple):
            out_tuple = tuple(self.value(v, _join(path, i)) for i, v in enumerate(node))
            self.memo[id(node)] = out_tuple
            return out_tuple
        if isinstance(node, set):
            return {self.key(v, path) for v in node}
        if isinstance(node, frozenset):
            self.note(path, "builtins.frozenset", "set")
            return {self.key(v, path) for v in node}
        if isinstance(node, slice):
            self.note(path, "builtins.slice", "tuple")
            return (node.start, node.stop, node.step)
        name = global_name(node)
        if name is not None:
            self.note(path, name, "str", "a reference to a class or function, kept as its name")
            return name
        if isinstance(node, OpaqueObject):
            out = self.record(node, path)
            self.memo[id(node)] = out
            return out
        raise RepairError(f"{path}: cannot convert a {type(node).__name__}")

    def key(self, k: Any, path: str) -> Any:
        value = self.value(k, path)
        try:
            hash(value)
        except TypeError:
            raise RepairError(f"{path}: a dict key or set member that converts to an unhashable value") from None
        return value

    def note(self, path: str, cls: str, to: str, detail: str = "") -> None:
        self.conversions.append(Conversion(path or "(top level)", cls, to, detail))

    def record(self, rec: OpaqueObject, path: str) -> Any:
        try:
            return self._record(rec, path)
        except NotData as exc:
            raise RepairError(f"{path or '(top level)'}: {printable(rec.cls)} is not convertible: {exc}") from None

    def _record(self, rec: OpaqueObject, path: str) -> Any:
        cls = rec.cls
        if cls.endswith(".scalar") and cls.rsplit(".", 1)[0] in _NUMPY:
            value, dtype = numpy_scalar(rec)
            self.note(path, cls, type(value).__name__, f"numpy {dtype}")
            return value
        if cls.endswith("._reconstruct") and cls.rsplit(".", 1)[0] in _NUMPY:
            return self.array(numpy_array(rec), path, cls)
        if cls == "numpy.dtype":  # a dtype value (np.dtype("float32") in a config): its name; np.dtype(name) rebuilds it
            dtype = _numpy_dtype(rec)
            self.note(path, cls, "str", "the dtype's name")
            return dtype.name if dtype.isnative else dtype.str
        if cls.rsplit(".", 1)[-1] in _PATHS and cls.rsplit(".", 1)[0] in ("pathlib", "pathlib._local"):
            self.note(path, cls, "str")
            return _path(rec)
        if cls in ("datetime.datetime", "datetime.date", "datetime.time"):
            self.note(path, cls, "str", "ISO 8601")
            return _datetime(rec)
        if cls == "datetime.timedelta":
            self.note(path, cls, "float", "seconds")
            return _timedelta(rec).total_seconds()
        if cls == "collections.deque":
            maxlen = rec.args[1] if len(rec.args) > 1 else None
            self.note(path, cls, "list", f"maxlen={maxlen}")
            first = list(rec.args[0]) if rec.args and isinstance(rec.args[0], (list, tuple)) else []
            return [self.value(v, _join(path, i)) for i, v in enumerate(first + list(rec.items.values()))]
        if cls == "collections.defaultdict":
            factory = global_name(rec.args[0]) if rec.args else None
            self.note(path, cls, "dict", f"default_factory {factory} dropped")
            return {self.key(k, path): self.value(v, _join(path, k)) for k, v in rec.items.items()}
        if cls in KNOWN_ENUMS:
            if len(rec.args) != 1 or not isinstance(rec.args[0], (str, int)):
                raise NotData("enum member of something other than a str or int")
            self.note(path, cls, type(rec.args[0]).__name__, "the member's value")
            return rec.args[0]
        if cls == "omegaconf.dictconfig.DictConfig" or cls == "omegaconf.listconfig.ListConfig":
            self.note(path, cls, "dict" if "Dict" in cls else "list")
            return self.value(_omega_content(rec), path)
        if cls.startswith(_OMEGA_NODE):
            return self.value(_object_state(rec).get("_val"), path)
        if cls == "copyreg._reconstructor":
            return self._reconstructor(rec, path)
        if cls == "builtins.bytes" and is_data_call(rec):
            return b""
        if cls in _NEW_ARGUMENTS and not rec.called and is_data_call(rec) and rec.state is None and not rec.items:
            self.note(path, cls, "str")
            return rec.args[0]
        if rec.called:
            raise NotData("a call of a function ckptfix does not know (not data)")
        state = _object_state(rec)
        self.note(path, cls, "dict", f"{len(state)} attribute(s)")
        out: dict = {}
        self.memo[id(rec)] = out
        for k, v in state.items():
            out[k] = self.value(v, _join(path, k))
        return out

    def _reconstructor(self, rec: OpaqueObject, path: str) -> Any:
        if len(rec.args) != 3 or global_name(rec.args[0]) is None or global_name(rec.args[1]) != "builtins.object" \
                or rec.args[2] is not None:
            raise NotData("copyreg._reconstructor of something other than a plain object")
        stand_in = OpaqueObject(global_name(rec.args[0]) or "", state=rec.state, items=rec.items)
        return self._record(stand_in, path)

    def array(self, array: Any, path: str, cls: str) -> Any:
        name = array.dtype.name
        if self.summary:
            return {"array": list(array.shape), "dtype": name}
        if name not in _WRITABLE or not array.dtype.isnative:
            self.note(path, cls, "list", f"numpy {name} {list(array.shape)}, values kept (torch has few operations "
                      f"on {name}; numpy.random.set_state and numpy code take the list)")
            return array.tolist()
        key = str(self.next_key)
        self.next_key += 1
        contiguous = array if array.flags.c_contiguous else array.copy(order="C")
        self.arrays[key] = contiguous
        shape = tuple(int(d) for d in array.shape)
        storage = StorageRef(key, name, "cpu", int(array.size))
        self.note(path, cls, "tensor", f"numpy {name} {list(shape)}, same bytes")
        return TensorRef(storage, 0, shape, contiguous_stride(shape), name)


# numpy dtypes that become tensors; uint16/32/64 (numpy's RNG key is uint32) become lists: torch has few operations
# on them, and the code that reads them back (numpy.random.set_state) takes a list
_WRITABLE = {"float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool", "complex64",
             "complex128"}
assert _WRITABLE <= set(DTYPE_SIZES)


def _omega_content(rec: OpaqueObject) -> Any:
    state = rec.state if isinstance(rec.state, dict) else {}
    content = state.get("_content")
    if isinstance(content, (dict, list)) or content is None or isinstance(content, str):
        return content
    raise NotData("an omegaconf container without its content")


def _join(path: str, key: Any) -> str:
    text = printable(str(key) if isinstance(key, (str, int)) else type(key).__name__, 60)
    return f"{path}.{text}" if path else text


# --- finding them (inspect) -----------------------------------------------------------------------

MAX_USES = 200  # reported records; a file with more says how many


def raw_uses(ckpt: Any) -> list[Use]:
    """`uses(ckpt.raw)`, walked once per checkpoint (kept on it: the checks and the report both ask)."""
    if ckpt.raw_uses is None:
        ckpt.raw_uses = uses(ckpt.raw) if ckpt.raw is not None else []
    return ckpt.raw_uses


def uses(tree: Any) -> list[Use]:
    """Every object in `tree` built from a global torch's weights-only loader or ckptfix's allowlist does not
    know, outermost first, with its path and fields. Each container once (memo-shared pickles stay linear);
    a path is spelled only for what is found (a 150k-entry optimizer state costs one pass, no strings)."""
    found: list[Use] = []
    seen: set[int] = set()
    stack: list[tuple[Any, Any]] = [(tree, None)]  # (node, crumb): crumb = (parent crumb, key) or None
    while stack and len(found) < MAX_USES:
        node, crumb = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, dict):
            items: Any = node.items()
        elif isinstance(node, (list, tuple, set)):
            items = enumerate(node)
        elif isinstance(node, (OpaqueObject, frozenset, slice)) or global_name(node) is not None:
            found.append(describe(node, _spell(crumb)))
            continue
        else:
            continue
        stack.extend([(v, (crumb, k)) for k, v in items if not isinstance(v, _LEAVES)][::-1])
    return found


_LEAVES = (str, int, float, bool, bytes, type(None), TensorRef, RebuiltTensor, TorchDtype, TorchDevice)


def _spell(crumb: Any) -> str:
    keys = []
    while crumb is not None:
        crumb, key = crumb
        keys.append(key)
    path = ""
    for key in reversed(keys):
        path = _join(path, key)
    return path


def describe(node: Any, path: str) -> Use:
    """One record as a `Use`: its globals, and its fields decoded (or why it cannot be converted)."""
    found, code = _globals_in(node)
    names = sorted(found)
    where = path or "(top level)"
    cls = global_name(node) or (node.cls if isinstance(node, OpaqueObject) else f"builtins.{type(node).__name__}")
    how = "named" if global_name(node) else "called" if getattr(node, "called", False) else \
        "constructed" if isinstance(node, OpaqueObject) else "built"
    if code:  # never decoded as data: what it would run is the report
        return Use(where, cls, how, names, None, convertible=False,
                   why_not=f"{where}: loading it would call {', '.join(code[:3])}: code, not data", runs_code=code)
    conv = Converter(next_key=0, summary=True)
    try:
        fields = _summary(conv.value(node, path))
        return Use(where, cls, how, names, fields)
    except RepairError as exc:
        return Use(where, cls, how, names, None, convertible=False, why_not=str(exc))


def _globals_in(node: Any) -> tuple[set[str], list[str]]:
    """Every global name a record needs, nested records included (numpy.dtype inside a scalar...), and every
    call among them that is not data (only present when read with --trust-pickle), bounded."""
    out: set[str] = set()
    code: list[str] = []
    seen: set[int] = set()
    stack, budget = [node], 10_000
    while stack and budget > 0:
        budget -= 1
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        name = global_name(n)
        if name is not None:
            out.add(name)
        elif isinstance(n, OpaqueObject):
            out.add(n.cls)
            if not is_data_call(n):
                code.append(describe_call(n))
                out.update(call_globals(n))
            if n.cls == "numpy.dtype":
                out.add(_dtype_class(n))  # what BUILD on the dtype needs allowlisted in torch
            if n.cls.endswith("._reconstruct"):
                out.add("numpy.ndarray")
            stack.extend((n.args, n.state, list(n.items.values()), list(n.items)))
        elif isinstance(n, frozenset):
            out.add("builtins.frozenset")
            stack.extend(n)
        elif isinstance(n, slice):
            out.add("builtins.slice")
        elif isinstance(n, dict):
            if type(n).__name__ in ("OrderedDict", "Counter"):
                out.add(f"collections.{type(n).__name__}")
            stack.extend(n.keys())
            stack.extend(n.values())
        elif isinstance(n, (list, tuple, set)):
            stack.extend(n)
    return out, code


# Globals that ckptfix may name in an `add_safe_globals` line: with them allowlisted, torch's weights-only loader
# builds only data whatever arguments a file gives (each entry's reason above). `copyreg._reconstructor` is left
# out: allowlisted, it would call `base.__init__` for any other allowlisted class a file names as base. A class
# ckptfix does not know (a user's dataclass, a library's object) is never named: under torch.load its own
# `__new__`/`__setstate__` run, which ckptfix cannot check without importing it. `ckptfix convert` needs neither.
def safe_to_allowlist(name: str) -> bool:
    if name.startswith("__builtin__."):
        name = "builtins." + name.split(".", 1)[1]
    if name in TORCH_WEIGHTS_ONLY_GLOBALS:
        return True
    if name.startswith("numpy.dtypes.") and name.endswith("DType"):  # the class BUILD on a numpy dtype needs
        return name[len("numpy.dtypes."):-len("DType")] in _NUMPY_DTYPE_CLASSES
    return name in NAMED_TYPES or (name in DATA_CLASSES and name != "copyreg._reconstructor")


_NUMPY_DTYPE_CLASSES = {"Bool", "Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64", "Float16",
                        "Float32", "Float64", "LongDouble", "Complex64", "Complex128", "CLongDouble", "Byte", "UByte",
                        "Short", "UShort", "Int", "UInt", "Long", "ULong", "LongLong", "ULongLong"}


def _summary(value: Any) -> Any:
    """A converted value as JSON-safe data for the report, bounded."""
    return plain(value)


def add_safe_globals_line(names: list[str]) -> str:
    """The exact line that makes torch.load(weights_only=True) accept these globals (if you trust the file).

    Each global is imported with `from module import name` (a dotted attribute path can be shadowed: DeepSpeed's
    `deepspeed.utils.tensor_fragment` is a function, the module of the same name holds `fragment_address`)."""
    names = sorted({("builtins." + n.split(".", 1)[1]) if n.startswith("__builtin__.") else n for n in names})
    imports: list[str] = []
    exprs: list[str] = []
    used: set[str] = set()
    for name in names:
        module, attr = name.rsplit(".", 1)
        if module == "builtins":  # always in scope
            exprs.append(attr)
            continue
        alias = attr if attr not in used else f"{attr}_{len(used)}"
        used.add(alias)
        imports.append(f"from {module} import {attr}" + (f" as {alias}" if alias != attr else ""))
        exprs.append(alias)
    return "; ".join(["import torch", *imports, f"torch.serialization.add_safe_globals([{', '.join(exprs)}])"])


def describe_call(rec: OpaqueObject) -> str:
    """`module.function(arg, ...)` for the refusal message: what loading the file would call, bounded."""
    budget = [12]
    base = global_name(rec.args[1]) if rec.cls == "copyreg._reconstructor" and len(rec.args) == 3 else None
    if base not in (None, "builtins.object"):  # copyreg: obj = base.__new__(cls, state); base.__init__(obj, state)
        return f"{printable(base or '')}.__init__(<new {printable(global_name(rec.args[0]) or '?')}>, " \
               f"{_brief(rec.args[2], budget)})"
    if not rec.called:  # NEWOBJ
        return f"{printable(rec.cls)}.__new__({', '.join(_brief(a, budget) for a in rec.args[:4])}" \
               f"{', ...' if len(rec.args) > 4 else ''})"
    return f"{printable(rec.cls)}({', '.join(_brief(a, budget) for a in rec.args[:4])}" \
           f"{', ...' if len(rec.args) > 4 else ''})"


def _brief(value: Any, budget: list[int]) -> str:
    budget[0] -= 1
    if budget[0] < 0:
        return "..."
    if isinstance(value, (str, bytes)):
        text = repr(value[:60]) + ("..." if len(value) > 60 else "")
        return printable(text, 80)
    if value is None or isinstance(value, (bool, int, float)):
        return printable(repr(value), 40)
    if isinstance(value, OpaqueObject):
        return f"<{'result of ' if value.called else ''}{printable(value.cls)}>"
    name = global_name(value)
    if name is not None:
        return printable(name)
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_brief(v, budget) for v in list(value)[:4])
        return f"({inner}{', ...' if len(value) > 4 else ''})"
    return f"<{type(value).__name__}>"
