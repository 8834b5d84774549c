"""bitsandbytes' 8-bit blockwise-quantized optimizer state, resized row by row (numpy, no torch).

bitsandbytes keeps each 8-bit state as uint8 codes shaped like the parameter, one float32 scale
(`absmax`) per block of `BLOCKSIZE` consecutive elements of the flattened tensor, and a 256-value code
book (`qmap`): value = qmap[code] * absmax[block] (bitsandbytes/backends/cpu/ops.py, the blockwise
dequantize and `_optimizer_update_8bit_blockwise_cpu`, blocksize 256 for every 8-bit optimizer).

Resizing: dequantize, move rows by the row plan (new rows as the state's rule says), requantize in
bitsandbytes' own layout (blocks of 256, absmax = max |value| per block, the nearest code). A block
whose kept values stay at the same flat positions keeps its scale and codes, so those values are
bit-identical after dequantization; new values in it are coded with that scale (clipped to it if
larger). Only blocks that mix moved rows are requantized, within 8-bit precision (as every step of
bitsandbytes requantizes); the plan's notes count them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfix.checkpoint import TensorInfo
from ckptfix.surgery.rows import RowPlan, apply_plan, new_rows_for

BLOCKSIZE = 256  # bitsandbytes' 8-bit optimizers: `blocksize = 256` (optim/optimizer.py, backends/cpu/ops.py)


def blocks_for(numel: int) -> int:
    return -(-numel // BLOCKSIZE)


@dataclass
class BlockwiseRows:
    """One quantized state (codes, absmax, qmap) resized by `plan`; computed once for both outputs."""

    codes: TensorInfo
    absmax: TensorInfo
    qmap: TensorInfo
    plan: RowPlan
    fill: str  # the state's rule: zeros | column-mean
    requantized: int = 0  # blocks whose kept values moved (requantized within 8-bit precision)
    clipped: int = 0  # new values larger than their block's kept scale
    _result: Any = field(default=None, repr=False)

    @property
    def width(self) -> int:
        return int(np.prod(self.codes.shape[1:], dtype=np.int64))

    def check(self) -> str | None:
        """Why this state cannot be resized here (its layout is not bitsandbytes' own), or None."""
        if self.codes.dtype != "uint8" or self.qmap.shape != (256,) or len(self.absmax.shape) != 1:
            return f"codes {self.codes.dtype} {list(self.codes.shape)}, absmax {list(self.absmax.shape)}, " \
                   f"qmap {list(self.qmap.shape)}: not bitsandbytes' 8-bit blockwise layout"
        if self.absmax.shape[0] != blocks_for(self.codes.numel):
            return f"{self.absmax.shape[0]} block scales for {self.codes.numel} values: not blocks of {BLOCKSIZE}"
        return None

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(codes, absmax) of the resized state."""
        if self._result is None:
            self._result = self._compute()
        return self._result

    def _compute(self) -> tuple[np.ndarray, np.ndarray]:
        width, plan = self.width, self.plan
        codes = self.codes.read_stored().reshape(self.codes.shape[0], width)
        absmax = np.asarray(self.absmax.read(), dtype=np.float32)
        qmap = np.asarray(self.qmap.read(), dtype=np.float32)
        values = _dequantize(codes.reshape(-1), absmax, qmap).reshape(codes.shape)
        fill = new_rows_for(values, "float32", plan, self.fill, 0.0, np.random.default_rng(0))
        out_values = apply_plan(values, plan, fill).reshape(-1)
        # where each output value comes from in the source's flat order (-1: a new value)
        cols = np.arange(width, dtype=np.int64)
        src = np.where(plan.source[:, None] >= 0, plan.source[:, None] * width + cols, -1).reshape(-1)
        n_out = out_values.size
        n_blocks = blocks_for(n_out)
        pad = n_blocks * BLOCKSIZE - n_out
        src_b = np.concatenate([src, np.full(pad, -1)]).reshape(n_blocks, BLOCKSIZE)
        vals_b = np.concatenate([out_values, np.zeros(pad, np.float32)]).reshape(n_blocks, BLOCKSIZE)
        pos_b = np.arange(n_blocks * BLOCKSIZE).reshape(n_blocks, BLOCKSIZE)
        in_place = (src_b == pos_b) | (src_b < 0)  # kept at its own flat position, or new (or padding)
        has_old = (src_b >= 0).any(axis=1)
        keep = in_place.all(axis=1) & has_old & (np.arange(n_blocks) < absmax.size)
        out_absmax = np.abs(vals_b).max(axis=1).astype(np.float32)
        out_absmax[keep] = absmax[np.flatnonzero(keep)]
        scaled = vals_b / np.where(out_absmax == 0, np.float32(1), out_absmax)[:, None]
        self.clipped = int((np.abs(scaled[keep]) > 1).sum())
        out_codes = _nearest(np.clip(scaled, -1, 1), qmap)
        flat_codes = codes.reshape(-1)
        kept_at = np.broadcast_to(keep[:, None], src_b.shape) & (src_b >= 0)
        out_codes[kept_at] = flat_codes[src_b[kept_at]]
        self.requantized = int((has_old & ~keep).sum())
        new_shape = (plan.new_rows, *self.codes.shape[1:])
        return out_codes.reshape(-1)[:n_out].reshape(new_shape), out_absmax


def _dequantize(codes: np.ndarray, absmax: np.ndarray, qmap: np.ndarray) -> np.ndarray:
    scales = np.repeat(absmax, BLOCKSIZE)[:codes.size]
    return qmap[codes] * scales


def _nearest(scaled: np.ndarray, qmap: np.ndarray) -> np.ndarray:
    """The index of the nearest code (bitsandbytes' CPU quantizer takes the argmin of |value - code|)."""
    order = np.argsort(qmap, kind="stable")
    book = qmap[order]
    right = np.clip(np.searchsorted(book, scaled), 1, len(book) - 1)
    left = right - 1
    pick = np.where(np.abs(scaled - book[left]) <= np.abs(book[right] - scaled), left, right)
    return order[pick].astype(np.uint8)
