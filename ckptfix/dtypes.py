"""The one dtype table: every dtype a checkpoint can hold, by torch's name, with what each layer needs.

Part of the checkpoint model (formats and surgery import from here, never the other way round).
Each row: element size, the numpy dtype of its stored bits (numpy has no bfloat16 or float8: those
come as raw uint16/uint8), whether it is a float, torch's typed storage class (`torch.save` writes
the others as an UntypedStorage with `_rebuild_tensor_v3`), and safetensors' code.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DType:
    name: str  # torch's name, without "torch."
    size: int  # bytes per element
    numpy: str  # numpy dtype (its name: importing numpy is left to the code that reads bytes)
    is_float: bool = False
    storage: str | None = None  # torch's typed storage class
    safetensors: str | None = None  # safetensors' dtype code


DTYPES: dict[str, DType] = {d.name: d for d in (
    DType("float64", 8, "float64", True, "DoubleStorage", "F64"),
    DType("float32", 4, "float32", True, "FloatStorage", "F32"),
    DType("float16", 2, "float16", True, "HalfStorage", "F16"),
    DType("bfloat16", 2, "uint16", True, "BFloat16Storage", "BF16"),
    DType("int64", 8, "int64", storage="LongStorage", safetensors="I64"),
    DType("int32", 4, "int32", storage="IntStorage", safetensors="I32"),
    DType("int16", 2, "int16", storage="ShortStorage", safetensors="I16"),
    DType("int8", 1, "int8", storage="CharStorage", safetensors="I8"),
    DType("uint8", 1, "uint8", storage="ByteStorage", safetensors="U8"),
    DType("bool", 1, "bool", storage="BoolStorage", safetensors="BOOL"),
    DType("uint16", 2, "uint16", safetensors="U16"),
    DType("uint32", 4, "uint32", safetensors="U32"),
    DType("uint64", 8, "uint64", safetensors="U64"),
    DType("complex64", 8, "complex64", storage="ComplexFloatStorage", safetensors="C64"),
    DType("complex128", 16, "complex128", storage="ComplexDoubleStorage"),
    DType("float8_e4m3fn", 1, "uint8", True, safetensors="F8_E4M3"),
    DType("float8_e5m2", 1, "uint8", True, safetensors="F8_E5M2"),
    DType("float8_e4m3fnuz", 1, "uint8", True, safetensors="F8_E4M3FNUZ"),
    DType("float8_e5m2fnuz", 1, "uint8", True, safetensors="F8_E5M2FNUZ"),
    # the rest of what torch.save writes with an untyped storage (torch.storage._new_dtypes()); numpy has
    # none of them: their raw bits (a complex32 is two float16s)
    DType("float8_e8m0fnu", 1, "uint8"),
    DType("float4_e2m1fn_x2", 1, "uint8"),
    DType("complex32", 4, "uint32"),
    DType("bits8", 1, "uint8"),
    DType("bits16", 2, "uint16"),
    DType("bits1x8", 1, "uint8"),
    DType("bits2x4", 1, "uint8"),
    DType("bits4x2", 1, "uint8"),
    # quantized tensors (torch.ao, `quantize_per_tensor`/`_per_channel`): the integer representation is
    # stored; scale, zero point and axis live in the pickle (`pickle_safe.TensorRef.quantizer`)
    DType("qint8", 1, "int8", storage="QInt8Storage"),
    DType("quint8", 1, "uint8", storage="QUInt8Storage"),
    DType("qint32", 4, "int32", storage="QInt32Storage"),
)}
# Quantized dtypes: read as their integers, carried verbatim, never resized (rows of a quantized
# tensor are not values ckptfix can compute, and per-channel scales would have to follow them).
QUANTIZED_DTYPES: frozenset[str] = frozenset({"qint8", "quint8", "qint32"})

# Views of the table, for the layers that need one column.
DTYPE_SIZES: dict[str, int] = {n: d.size for n, d in DTYPES.items()}
NUMPY_DTYPES: dict[str, str] = {n: d.numpy for n, d in DTYPES.items()}
FLOAT_DTYPES: frozenset[str] = frozenset(n for n, d in DTYPES.items() if d.is_float)
STORAGE_CLASS: dict[str, str] = {n: d.storage for n, d in DTYPES.items() if d.storage is not None}
# torch storage class -> (dtype, element size); an UntypedStorage holds bytes
STORAGE_DTYPES: dict[str, tuple[str, int]] = {
    **{d.storage: (n, d.size) for n, d in DTYPES.items() if d.storage is not None},
    "UntypedStorage": ("uint8", 1),
}
SAFETENSORS_TO_TORCH: dict[str, str] = {d.safetensors: n for n, d in DTYPES.items() if d.safetensors is not None}
TORCH_TO_SAFETENSORS: dict[str, str] = {n: code for code, n in SAFETENSORS_TO_TORCH.items()}
# torch's other spellings (torch.float is torch.float32, ...), as a pickle may name them
TORCH_ALIASES: dict[str, str] = {
    "float": "float32", "double": "float64", "half": "float16", "long": "int64", "int": "int32",
    "short": "int16", "cfloat": "complex64", "cdouble": "complex128", "chalf": "complex32",
}


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The row-major strides (in elements) of a contiguous tensor of `shape`."""
    stride, acc = [], 1
    for dim in reversed(shape):
        stride.append(acc)
        acc *= max(dim, 1)
    return tuple(reversed(stride))
