"""Row plans for vocab-sized tensors, and applying them to weights and optimizer moments.

A `RowPlan` says, for every row of the output, which input row it comes from (or -1: a new row).
The same plan moves an embedding, its tied/untied head, the head bias and every Adam moment, so
a token keeps its trained row and its optimizer history together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfix.checkpoint import widen_stored
from ckptfix.dtypes import NUMPY_DTYPES
from ckptfix.errors import RepairError

# HF's mean_resizing samples with the old covariance scaled down by 1e-9: new rows sit at the mean,
# distinct but close enough that the first logits for new tokens match an average old token.
COVARIANCE_SCALE = 1e-9


@dataclass
class RowPlan:
    source: np.ndarray  # int64, one entry per output row: input row index, or -1 for a new row
    old_rows: int
    kept: int = 0  # same id, same row
    moved: int = 0  # same token string, another id
    new: int = 0
    dropped: int = 0
    dropped_ids: list[int] = field(default_factory=list)  # input rows no output row comes from
    pieces: dict[int, tuple[int, ...]] = field(default_factory=dict)  # new row -> old rows of its text's pieces

    @property
    def new_rows(self) -> int:
        return len(self.source)

    def is_identity(self) -> bool:
        return self.new_rows == self.old_rows and bool(np.all(self.source == np.arange(self.old_rows)))

    def prefix_rows(self) -> int | None:
        """k when the output is input rows 0..k-1 in order followed only by new rows (rows added at the
        end, or trailing rows dropped): those bytes can be copied as they are. None otherwise."""
        keep = min(self.old_rows, self.new_rows)
        if np.array_equal(self.source[:keep], np.arange(keep)) and bool(np.all(self.source[keep:] == -1)):
            return keep
        return None

    def to_json(self) -> dict[str, Any]:
        return {"old_rows": self.old_rows, "new_rows": self.new_rows, "kept": self.kept, "moved": self.moved,
                "new": self.new, "dropped": self.dropped, "dropped_ids": _ranges(self.dropped_ids)}


def _ranges(ids: list[int], limit: int = 20) -> list[str]:
    """[5, 6, 7, 9] -> ["5-7", "9"]: readable lists of lost token ids."""
    out: list[str] = []
    for i in ids:
        if out and out[-1].split("-")[-1] == str(i - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
        if len(out) > limit:
            return out[:limit] + ["..."]
    return out


def plan_by_id(old_rows: int, new_rows: int) -> RowPlan:
    """Keep rows by id: grow with new rows at the end, or drop trailing rows."""
    keep = min(old_rows, new_rows)
    source = np.full(new_rows, -1, dtype=np.int64)
    source[:keep] = np.arange(keep)
    dropped = list(range(keep, old_rows))
    return RowPlan(source, old_rows, kept=keep, new=new_rows - keep, dropped=len(dropped), dropped_ids=dropped)


def plan_by_token(old_rows: int, new_rows: int, old_tokens: list[str | None], new_tokens: list[str | None]) -> RowPlan:
    """Move rows by token string: a token in both tokenizers keeps its trained row wherever its id went."""
    old_index = {tok: i for i, tok in enumerate(old_tokens) if isinstance(tok, str) and i < old_rows}
    source = np.full(new_rows, -1, dtype=np.int64)
    kept = moved = 0
    for j, tok in enumerate(new_tokens[:new_rows]):
        i = old_index.get(tok) if isinstance(tok, str) else None
        if i is None:
            continue
        source[j] = i
        kept, moved = (kept + 1, moved) if i == j else (kept, moved + 1)
    used = set(source[source >= 0].tolist())
    dropped = [i for i in range(min(old_rows, len(old_tokens))) if i not in used]
    return RowPlan(source, old_rows, kept=kept, moved=moved, new=int((source < 0).sum()),
                   dropped=len(dropped), dropped_ids=dropped)


def fill_for(init: str, role: str = "embedding", tied: bool = False) -> str:
    """How a weight's new rows are filled: by `init` (an optimizer state's fill is its `optim_state.Rule`'s).

    Under `pieces`, rows that produce logits (an untied head and its bias, or a tied embedding) get
    "pieces-head": the pieces' mean pulled towards the old mean (HEAD_SHRINK), see its comment."""
    if role == "lookup":  # ids, whatever `init` says for weights
        return "drawn"
    if init == "pieces" and (role in ("head", "head-bias") or tied):
        return "pieces-head"
    return init  # checked against options.INITS when the RepairOptions were made


def drawn_ids(rows: np.ndarray, count: int, rng: np.random.Generator) -> np.ndarray:
    """`count` new rows of an integer lookup table (DeepSeek-V4's hash routing `tid2eid`: each token's top-k
    expert ids, a fixed pseudo-random assignment): each row k distinct ids drawn uniformly from those the
    table holds (with repeats only where it holds fewer than k), as the hash gave every old token its own."""
    width = rows.shape[1] if rows.ndim == 2 else 1
    # the ids of the first 2^20 entries (all of DeepSeek-V4's 129280 x 6): a bounded read whatever the table
    values = np.unique(np.asarray(rows).reshape(-1)[:1 << 20]) if rows.size else np.zeros(1, dtype=rows.dtype)
    out = np.empty((count, width), dtype=rows.dtype)
    for k in range(count):
        out[k] = rng.choice(values, size=width, replace=len(values) < width)
    return out.reshape((count, *rows.shape[1:]))


def new_rows_for(rows: np.ndarray, dtype: str, plan: RowPlan, fill: str, std: float,
                 rng: np.random.Generator) -> np.ndarray:
    """The values of every new row of `plan` (source -1), in row order, for a tensor whose old rows are
    `rows` (as stored). `pieces`: the mean of the old rows of the new token's pieces; a row with no
    pieces (a new special token) gets the old mean plus noise at PIECES_NOISE of each column's standard
    deviation, so no two such rows are equal and each can learn its own direction."""
    count = int((plan.source < 0).sum())
    if fill == "drawn":
        return drawn_ids(rows, count, rng)
    if fill not in ("pieces", "pieces-head"):
        return new_row_values(rows, dtype, count, fill, std, rng)
    pull = HEAD_SHRINK if fill == "pieces-head" else 1.0
    if count == 0 or rows.shape[0] == 0 or dtype not in _WRITABLE_FLOATS:
        return new_row_values(rows, dtype, count, "zeros" if dtype not in _WRITABLE_FLOATS else "mean", std, rng)
    mean, var = column_stats(rows, dtype)
    assert var is not None  # column_stats computes the variance by default
    noise = np.sqrt(var).astype(np.float32) * np.float32(PIECES_NOISE)
    values = np.empty((count, *rows.shape[1:]), dtype=np.float32)
    for k, row in enumerate(np.flatnonzero(plan.source < 0).tolist()):
        ids = plan.pieces.get(row)
        if ids:
            pieces = widen_stored(rows[list(ids)], dtype).astype(np.float64).mean(axis=0)
            values[k] = pieces if pull == 1.0 else mean + pull * (pieces - mean)
        else:
            values[k] = mean + rng.standard_normal(rows.shape[1:], dtype=np.float32) * noise
    return narrow_to_stored(values, dtype)


def new_row_values(rows: np.ndarray, dtype: str, count: int, fill: str, std: float,
                   rng: np.random.Generator) -> np.ndarray:
    """`count` new rows for a tensor whose old rows are `rows` (2-D rows x width, or a 1-D bias), both
    as stored (bfloat16 as its uint16 bits, see `TensorInfo.read_stored`).

    fill: "zeros"; "normal" (N(0, std^2)); "mean", HF's mean_resizing: the old rows' mean plus noise at
    1e-9 of their variance, per column (HF uses the full covariance at that scale, an O(rows x width^2)
    product whose off-diagonal terms move a new row by ~1e-5 of its norm; a 1-D bias gets its plain
    mean); "column-mean": the old rows' mean per column, no noise. Integer tensors always get zeros."""
    width = rows.shape[1:]
    if fill == "zeros" or count == 0 or rows.shape[0] == 0 or dtype not in _WRITABLE_FLOATS:
        if fill != "zeros" and dtype.startswith("float8"):
            raise RepairError(f"--init {fill} cannot compute {dtype} rows; use --init zeros")
        return np.zeros((count, *width), dtype=rows.dtype)
    if fill == "normal":
        values = rng.standard_normal((count, *width), dtype=np.float32) * np.float32(std)
    elif fill == "column-median":  # from a bounded sample of rows: a median needs them all in memory
        sample = widen_stored(rows[::max(1, rows.shape[0] // 16384)], dtype).astype(np.float32)
        values = np.broadcast_to(np.median(sample, axis=0), (count, *width))
    else:
        noisy = fill == "mean" and rows.ndim > 1
        mean, var = column_stats(rows, dtype, variance=noisy)
        values = np.broadcast_to(mean.astype(np.float32), (count, *width))
        if noisy and var is not None:
            scale = np.sqrt(var * COVARIANCE_SCALE).astype(np.float32)
            values = values + rng.standard_normal((count, *width), dtype=np.float32) * scale
    return narrow_to_stored(values, dtype)


def column_stats(rows: np.ndarray, dtype: str, variance: bool = True) -> tuple[np.ndarray, np.ndarray | None]:
    """Per-column mean and (population) variance in float64, a bounded block of rows at a time: the
    rows stay a view of the mapped file and at most ~16 MB is widened at once, whatever the dtype.
    `variance=False` (second-moment fills need only the mean) skips the squares: one pass, no copies."""
    flat_width = math.prod(rows.shape[1:])
    total, squares = np.zeros(flat_width), np.zeros(flat_width) if variance else None
    step = max(1, (1 << 21) // max(1, flat_width))
    for lo in range(0, rows.shape[0], step):
        block = widen_stored(rows[lo:lo + step], dtype).reshape(min(step, rows.shape[0] - lo), flat_width)
        if squares is None:
            total += block.sum(axis=0, dtype=np.float64)  # widened inside the reduction, no float64 copy
            continue
        block = block.astype(np.float64)
        total += block.sum(axis=0)
        squares += np.einsum("ij,ij->j", block, block)
    mean = total / rows.shape[0]
    if squares is None:
        return mean.reshape(rows.shape[1:]), None
    var = np.maximum(squares / rows.shape[0] - mean * mean, 0.0)
    return mean.reshape(rows.shape[1:]), var.reshape(rows.shape[1:])


def narrow_to_stored(values: np.ndarray, dtype: str) -> np.ndarray:
    """float32 values in `dtype`'s stored form, rounded to nearest-even as torch's `.to(dtype)` does."""
    if dtype != "bfloat16":
        with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf, NaN kept: as torch does
            return np.asarray(values, dtype=_WRITABLE_FLOATS[dtype])
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1)))) >> np.uint32(16))
    return np.where(np.isnan(values), np.uint16(0x7FC0), rounded.astype(np.uint16))


def apply_plan(old: np.ndarray, plan: RowPlan, fill: np.ndarray) -> np.ndarray:
    """Gather kept/moved rows from `old` (a stored view) and place `fill` (new-row values) in the gaps."""
    if old.shape[0] != plan.old_rows:
        raise RepairError(f"tensor has {old.shape[0]} rows but the plan expects {plan.old_rows}")
    out = np.empty((plan.new_rows, *old.shape[1:]), dtype=old.dtype)
    # Kept/moved rows are copied run by run straight into `out`: no gathered temporary (fancy indexing
    # would hold a second copy of the tensor) and one memcpy per run.
    src = plan.source
    prev = np.concatenate(([-2], src[:-1]))
    # A run: consecutive outputs from consecutive inputs; every new row (-1) is a run of its own.
    starts = np.flatnonzero((src != prev + 1) | (prev < 0) | (src < 0))
    runs = [(a, b) for a, b in zip(starts.tolist(), starts[1:].tolist() + [len(src)]) if src[a] >= 0]
    if len(runs) <= 4096:
        for a, b in runs:
            first = int(src[a])
            out[a:b] = old[first:first + b - a]
    else:  # rows scattered one by one (a token-string remap): gather in blocks of bounded size
        present = np.flatnonzero(src >= 0)
        for lo in range(0, len(present), 4096):
            rows = present[lo:lo + 4096]
            out[rows] = old[src[rows]]
    missing = np.flatnonzero(src < 0)
    if len(missing):
        out[missing] = fill
    return out


# Rows that produce logits (untied head, tied embedding) under --init pieces start at
# mean + HEAD_SHRINK * (pieces' mean - mean). 1.0 (the pieces' own mean) learns new tokens fastest but
# moves next-token distributions on old text ~30% more than HF's mean init (KL); 0.0 is HF's mean and
# learns no faster than it. 0.6 keeps that KL within ~6% of HF's mean init and most of the gain
# (bench/new_tokens.py, README "New tokens"). The input embedding of an untied model gets the full mean:
# it does not touch old text's distributions.
HEAD_SHRINK = 0.6
PIECES_NOISE = 0.01
_WRITABLE_FLOATS = {n: NUMPY_DTYPES[n] for n in ("float64", "float32", "float16", "bfloat16")}  # computable rows
