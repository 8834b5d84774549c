"""Row plans for vocab-sized tensors, and applying them to weights and optimizer moments.

A `RowPlan` says, for every row of the output, which input row it comes from (or -1: a new row).
The same plan moves an embedding, its tied/untied head, the head bias and every Adam moment, so
a token keeps its trained row and its optimizer history together.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfix.errors import RepairError

# Above this width, the full covariance (width x width) is too costly to factorise; use isotropic noise.
MAX_COVARIANCE_WIDTH = 4096
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
    old_index = {tok: i for i, tok in enumerate(old_tokens) if tok is not None and i < old_rows}
    source = np.full(new_rows, -1, dtype=np.int64)
    kept = moved = 0
    for j, tok in enumerate(new_tokens[:new_rows]):
        i = old_index.get(tok) if tok is not None else None
        if i is None:
            continue
        source[j] = i
        kept, moved = (kept + 1, moved) if i == j else (kept, moved + 1)
    used = set(source[source >= 0].tolist())
    dropped = [i for i in range(min(old_rows, len(old_tokens))) if i not in used]
    return RowPlan(source, old_rows, kept=kept, moved=moved, new=int((source < 0).sum()),
                   dropped=len(dropped), dropped_ids=dropped)


class LazyGenerator:
    """A seeded torch.Generator created on first use: a repair that samples nothing never imports torch."""

    def __init__(self, seed: int):
        self.seed, self._generator = seed, None

    def get(self) -> Any:
        if self._generator is None:
            import torch

            self._generator = torch.Generator().manual_seed(self.seed)
        return self._generator


def new_row_values(old, count: int, init: str, std: float, generator) -> Any:
    """Values for `count` new rows of a 2-D (rows x width) or 1-D (bias) torch tensor."""
    import torch

    if isinstance(generator, LazyGenerator):
        generator = generator.get()

    width = old.shape[1:] if old.dim() > 1 else ()
    if count == 0:
        return old.new_zeros((0, *width))
    if init == "zeros" or old.shape[0] == 0:
        return old.new_zeros((count, *width))
    if init == "normal":
        return (torch.randn((count, *width), generator=generator, dtype=torch.float32) * std).to(old.dtype)
    if init != "mean":
        raise RepairError(f"unknown --init {init!r} (choose mean, zeros or normal)")
    rows = old.float()
    mean = rows.mean(dim=0)
    if old.dim() == 1:
        return mean.expand(count).clone().to(old.dtype)
    return _mean_cov_sample(rows, mean, count, generator).to(old.dtype)


def _mean_cov_sample(rows, mean, count: int, generator):
    """Sample like HF's mean_resizing: N(mean, 1e-9 * cov), isotropic noise if cov is not usable."""
    import torch

    width = rows.shape[1]
    if width <= MAX_COVARIANCE_WIDTH and rows.shape[0] > width:
        centered = rows - mean
        cov = centered.T @ centered / rows.shape[0]
        try:
            chol = torch.linalg.cholesky(cov * COVARIANCE_SCALE)
            noise = torch.randn((count, width), generator=generator, dtype=torch.float32)
            return mean + noise @ chol.T
        except RuntimeError:  # not positive-definite (e.g. collinear rows): fall through
            pass
    scale = (rows.var(dim=0).mean() * COVARIANCE_SCALE).sqrt()
    return mean + torch.randn((count, width), generator=generator, dtype=torch.float32) * scale


def apply_plan(old, plan: RowPlan, fill) -> Any:
    """Gather kept/moved rows from `old` (a torch tensor) and place `fill` (new-row values) in the gaps."""
    import torch

    if old.shape[0] != plan.old_rows:
        raise RepairError(f"tensor has {old.shape[0]} rows but the plan expects {plan.old_rows}")
    out = old.new_empty((plan.new_rows, *old.shape[1:]))
    # Kept/moved rows are copied run by run straight into `out`: no gathered temporary (index_select
    # or a boolean-mask assignment would hold a second copy of the tensor) and one memcpy per run.
    src = plan.source
    prev = np.concatenate(([-2], src[:-1]))
    # A run: consecutive outputs from consecutive inputs; every new row (-1) is a run of its own.
    starts = np.flatnonzero((src != prev + 1) | (prev < 0) | (src < 0))
    runs = [(a, b) for a, b in zip(starts.tolist(), starts[1:].tolist() + [len(src)]) if src[a] >= 0]
    if len(runs) <= 4096:
        for a, b in runs:
            first = int(src[a])
            out[a:b].copy_(old[first:first + b - a])
    else:  # rows scattered one by one (a token-string remap): gather in blocks of bounded size
        present = np.flatnonzero(src >= 0)
        for lo in range(0, len(present), 4096):
            dst = torch.from_numpy(present[lo:lo + 4096])
            out.index_copy_(0, dst, old.index_select(0, torch.from_numpy(src[present[lo:lo + 4096]])))
    missing = np.flatnonzero(src < 0)
    if len(missing):
        out[torch.from_numpy(missing)] = fill
    return out


def second_moment_key(key: str) -> bool:
    return key in _SECOND_MOMENTS


def column_mean_f32(rows: np.ndarray) -> np.ndarray:
    """The per-column mean of a float32 (rows x ...) array, accumulated in float64 (no copy of `rows`)."""
    return (np.add.reduce(rows, axis=0, dtype=np.float64) / rows.shape[0]).astype(np.float32)


def moment_fill(old, key: str) -> Any:
    """New rows of an optimizer state tensor: zero first moments; second moments get the old rows' mean
    per column, so Adam's denominator for a new row is a typical one.

    Why not zero: under an inherited step the bias correction no longer scales a zero second moment
    up, so the first update of a new row is |g|/sqrt(1-beta2)*sqrt(1-beta2^t) ... about 1.35 x lr at step
    200 and 3.16 x lr from a few thousand steps on, ~3.7x the size of old rows' updates (measured in
    tests/test_repair_e2e.py); with the mean it is ~0.4-0.8x of theirs."""
    import torch

    width = old.shape[1:]
    if key in _SECOND_MOMENTS and old.shape[0] > 0:
        if old.dtype == torch.float32:  # the same values the streaming writer computes without torch
            return torch.from_numpy(column_mean_f32(old.numpy())).expand(1, *width)
        return old.float().mean(dim=0).to(old.dtype).expand(1, *width)
    return old.new_zeros((1, *width))


_SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "square_avg", "sum")
