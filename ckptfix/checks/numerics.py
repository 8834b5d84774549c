"""NaN/Inf in weights and optimizer moments: only with `--scan`, the one check that reads tensor bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.checkpoint import TensorInfo, distinct_stored, widen_stored
from ckptfix.checks.codes import Context, Finding, check, finding

CHUNK = 1 << 22  # elements per read: bounded memory whatever the tensor size


def non_finite_count(tensor: TensorInfo) -> int:
    """How many elements are NaN or +-Inf, reading the tensor in bounded chunks."""
    if not tensor.is_float or tensor.dtype.startswith("float8") or tensor.numel == 0:
        return 0
    values, weight = distinct_stored(tensor.read_stored())  # an expanded or overlapping view: its values once
    values = widen_stored(values, tensor.dtype)
    return weight * sum(int(chunk.size - np.count_nonzero(np.isfinite(chunk))) for chunk in _blocks(values, CHUNK))


def _blocks(values: np.ndarray, chunk: int) -> Iterator[np.ndarray]:
    """`values` as 1-D pieces of at most `chunk` elements, copying at most one piece at a time."""
    if values.ndim <= 1 or values.flags.c_contiguous:
        flat = values.reshape(-1)
        for i in range(0, flat.size, chunk):
            yield flat[i:i + chunk]
        return
    inner = max(1, int(np.prod(values.shape[1:], dtype=np.float64)))
    if inner > chunk:  # one row is larger than a piece: split the rows themselves
        for row in values:
            yield from _blocks(row, chunk)
        return
    step = max(1, chunk // inner)
    for i in range(0, values.shape[0], step):
        yield values[i:i + step].reshape(-1)


def _scan(ctx: Context, tensors: list[TensorInfo], label: str) -> dict[str, int]:
    items = ctx.progress(tensors, sum(t.nbytes for t in tensors), label) if ctx.progress else tensors
    counts = {}
    for t in items:
        n = non_finite_count(t)
        if n:
            counts[t.name] = n
    return counts


def _report(code: str, counts: dict[str, int], what: str, fix: str) -> Iterator[Finding]:
    if not counts:
        return
    worst = sorted(counts.items(), key=lambda kv: -kv[1])
    listing = ", ".join(f"{n} ({c})" for n, c in worst[:5])
    yield finding(code, f"{len(counts)} {what} tensor(s) hold NaN/Inf values: {listing}",
                  pytorch="NaN/Inf propagate through every forward pass and Adam update that touches them; "
                  "with AMP, GradScaler then skips every step.", fix=fix, tensors=[n for n, _ in worst])


@check("CKF501", "error", "NaN/Inf in model weights",
       "With --scan: model weights contain NaN or Inf (count per tensor).")
def weights_non_finite(ctx: Context) -> Iterator[Finding]:
    if not ctx.scan:
        return
    counts = _scan(ctx, [ctx.ckpt.model[n] for n in ctx.ckpt.model if n not in ctx.ckpt.tied], "weights")
    yield from _report("CKF501", counts, "weight", "Resume from an earlier checkpoint saved before the divergence.")


@check("CKF502", "error", "NaN/Inf in optimizer moments",
       "With --scan: optimizer state tensors contain NaN or Inf (count per tensor).")
def moments_non_finite(ctx: Context) -> Iterator[Finding]:
    if not ctx.scan or ctx.ckpt.optimizer is None:
        return
    tensors = []
    for index, key, t in ctx.ckpt.optimizer.tensors():
        name = ctx.mapping.names.get(index, f"state[{index}]")
        tensors.append(TensorInfo(f"{name}:{key}", t.shape, t.dtype, t.locate, t.storage_id, t.offset, t.stride))
    counts = _scan(ctx, tensors, "moments")
    yield from _report("CKF502", counts, "moment", ctx.repair_command("--policy fresh"))
