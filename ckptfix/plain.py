"""`plain`: a JSON-safe summary of any value read from a checkpoint (inspect's --json, the data-object report).

Its own module so that the readers (`formats/data_globals.py`) and inspect share it without importing each other.
"""

from __future__ import annotations

from typing import Any

from ckptfix.checkpoint import TensorInfo
from ckptfix.formats.pickle_records import OpaqueObject, RebuiltTensor, TensorRef, TorchDevice, TorchDtype, TorchLayout


def plain(value: Any) -> Any:
    """A JSON-safe summary of a checkpoint value (tensors become shape/dtype descriptions).

    Bounded: at most `PLAIN_BUDGET` nodes per value, so a memo-shared pickle DAG (which a naive walk
    expands exponentially) summarises in linear time."""
    return _plain(value, 0, [PLAIN_BUDGET])


PLAIN_BUDGET = 2000


def _plain(value: Any, depth: int, budget: list[int]) -> Any:
    budget[0] -= 1
    if isinstance(value, (TensorInfo, TensorRef)):
        return {"tensor": list(value.shape), "dtype": value.dtype}
    if isinstance(value, RebuiltTensor):  # sparse, nested, meta
        return {"tensor": list(value.shape) if value.shape is not None else None, "dtype": value.dtype,
                "kind": value.kind}
    if isinstance(value, (TorchDtype, TorchDevice, TorchLayout)):
        return repr(value)
    if isinstance(value, OpaqueObject):
        return {"object": value.cls}
    if isinstance(value, float) and value != value:
        return "nan"
    if isinstance(value, float) and value in (float("inf"), float("-inf")):
        return str(value)
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 3 or budget[0] <= 0:
        return f"<{type(value).__name__}>"
    if isinstance(value, dict):
        items = list(value.items())
        out = {str(k): _plain(v, depth + 1, budget) for k, v in items[:50]}
        if len(items) > 50:
            out["..."] = f"{len(items) - 50} more"
        return out
    if isinstance(value, (list, tuple, set, frozenset)):
        seq = list(value)
        listed = [_plain(v, depth + 1, budget) for v in seq[:20]]
        return listed + [f"... {len(seq) - 20} more"] if len(seq) > 20 else listed
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return repr(value)[:80]
