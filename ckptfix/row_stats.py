"""Per-row numbers of a vocab tensor for the HTML report, read in bounded chunks.

A row's L2 norm, a second moment's row mean, whether a row is exactly zero (a row whose `exp_avg_sq` is all 0
never had a gradient), and the per-row relative change between two tensors: each from at most CHUNK_ELEMENTS
values at a time, read through `TensorInfo.read_stored()` (a map of the file; a sharded DCP tensor is
assembled one tensor at a time, as `diff` reads it), so memory is the tensor's row count, not its bytes.
`buckets` turns 100k+ rows into at most MAX_POINTS (min, max) pairs: one dead row still shows in its bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ckptfix.checkpoint import TensorInfo, widen_stored
from ckptfix.dtypes import FLOAT_DTYPES

CHUNK_ELEMENTS = 1 << 20  # values per chunk: a float64 temporary of 8 MiB
MAX_POINTS = 2000


def readable_rows(t: TensorInfo) -> bool:
    """A 2-D table of real floats (float8 and quantized tensors arrive as codes: their norms mean nothing)."""
    return len(t.shape) == 2 and t.dtype in FLOAT_DTYPES and not t.dtype.startswith("float8") and t.shape[1] > 0


def row_blocks(t: TensorInfo, rows: int | None = None) -> Iterator[np.ndarray]:
    """Consecutive blocks of `t`'s first `rows` rows (all by default) as float64, CHUNK_ELEMENTS at most each."""
    raw = t.read_stored()
    rows = raw.shape[0] if rows is None else min(rows, raw.shape[0])
    step = max(1, CHUNK_ELEMENTS // max(1, raw.shape[1]))
    for start in range(0, rows, step):
        yield widen_stored(raw[start:min(start + step, rows)], t.dtype).astype(np.float64)


def row_norms(t: TensorInfo) -> np.ndarray:
    """||row_i||_2 for every row."""
    return np.concatenate([np.sqrt(np.einsum("ij,ij->i", x, x)) for x in row_blocks(t)] or [np.zeros(0)])


def row_means_and_zeros(t: TensorInfo) -> tuple[np.ndarray, np.ndarray]:
    """(mean of each row, whether each row is exactly zero)."""
    means, zeros = [], []
    for x in row_blocks(t):
        means.append(x.mean(axis=1))
        zeros.append(~np.any(x != 0, axis=1))
    return np.concatenate(means or [np.zeros(0)]), np.concatenate(zeros or [np.zeros(0, bool)])


def row_changes(a: TensorInfo, b: TensorInfo, rows: int) -> np.ndarray:
    """||b_i - a_i|| / ||a_i|| for the first `rows` rows (0 where equal, inf where a row of zeros moved)."""
    out = []
    for xa, xb in zip(row_blocks(a, rows), row_blocks(b, rows)):
        delta = np.sqrt(np.einsum("ij,ij->i", xb - xa, xb - xa))
        base = np.sqrt(np.einsum("ij,ij->i", xa, xa))
        with np.errstate(divide="ignore", invalid="ignore"):
            out.append(np.where(delta == 0, 0.0, delta / base))
    return np.concatenate(out or [np.zeros(0)])


@dataclass
class Buckets:
    """Rows grouped into at most MAX_POINTS consecutive buckets: `edges[k]` is bucket k's first row."""

    edges: np.ndarray  # len(buckets) + 1 row indices, strictly increasing, last = the row count
    low: np.ndarray  # min of each bucket's finite values (NaN when it has none)
    high: np.ndarray

    @property
    def count(self) -> int:
        return len(self.edges) - 1

    def any(self, mask: np.ndarray) -> np.ndarray:
        """Whether each bucket holds a row where `mask` is true."""
        return np.logical_or.reduceat(mask, self.edges[:-1]) if self.count else np.zeros(0, bool)

    def most(self, codes: np.ndarray) -> np.ndarray:
        """Each bucket's largest code (the rarest category wins, so one row of it still shows)."""
        return np.maximum.reduceat(codes, self.edges[:-1]) if self.count else np.zeros(0, codes.dtype)


def buckets(values: np.ndarray, points: int = MAX_POINTS) -> Buckets:
    """Per-bucket min and max of `values` over at most `points` buckets (one row each when there are fewer)."""
    n = len(values)
    k = min(n, points)
    edges = (np.arange(k + 1, dtype=np.int64) * n) // max(k, 1)
    finite = np.where(np.isfinite(values), values, np.nan)
    if not k:
        return Buckets(edges[:1], np.zeros(0), np.zeros(0))
    with np.errstate(invalid="ignore"):
        low = np.fmin.reduceat(finite, edges[:-1])
        high = np.fmax.reduceat(finite, edges[:-1])
    return Buckets(edges, low, high)
