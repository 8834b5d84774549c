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


def new_row_values(old, count: int, init: str, std: float, generator) -> Any:
    """Values for `count` new rows of a 2-D (rows x width) or 1-D (bias) torch tensor."""
    import torch

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
    source = torch.from_numpy(plan.source)
    present = source >= 0
    out[present] = old.index_select(0, source[present])
    if (~present).any():
        out[~present] = fill
    return out


def moment_fill(old, key: str) -> Any:
    """New rows of an optimizer state tensor. Zero first moments; the mean old second moment per column,
    so Adam's denominator for a new row is a typical one: zero exp_avg_sq under an inherited step would
    make the first updates of new rows several times lr (bias correction is already ~1)."""
    width = old.shape[1:]
    if key in ("exp_avg_sq", "max_exp_avg_sq", "exp_avg_sq_row", "square_avg", "sum") and old.shape[0] > 0:
        return old.float().mean(dim=0).to(old.dtype).expand(1, *width)
    return old.new_zeros((1, *width))
