"""`RepairOptions`: every choice a repair takes, as one value, checked once where it is made.

The public `ckptfix.repair(...)` and `ckptfix repair` build one; the object-store and in-place paths and the
plan stage take it whole, so a new option touches this type, the CLI and the code that uses it, and no
function in between. An option that needs the checkpoint to be judged (`own_rows` against the recorded vocab
size) is checked here only as far as it can be without it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Callable, Iterable

from ckptfix.errors import RepairError
from ckptfix.policies import REPAIR_POLICIES, canonical

INITS = ("pieces", "mean", "zeros", "normal")

Progress = Callable[[Iterable, int, str], Iterable]


@dataclass(frozen=True)
class RepairOptions:
    """The options of `ckptfix.repair` (its docstring says what each does), with its defaults.

    `policy` and `init` stay None for "the default": which one depends on the checkpoint and the tokenizers
    (`plan.default_policy`, `plan.default_init`). An empty string means the same, as it always has."""

    from_tokenizer: str | os.PathLike | None = None
    policy: str | None = None
    init: str | None = None
    std: float = 0.02
    pad_to_multiple_of: int | None = None
    dry_run: bool = False
    force: bool = False
    trust_pickle: bool = False
    seed: int = 0
    in_place: bool = False
    keep_ids: bool = False
    keep: tuple[str, ...] = ()
    own_rows: int | None = None
    progress: Progress | None = None  # how progress is reported (the CLI's --quiet chooses it)

    def __post_init__(self) -> None:
        # any iterable of paths, kept as a tuple: the value stays hashable and cannot change under the repair
        object.__setattr__(self, "keep", tuple(self.keep))
        if self.policy and canonical(self.policy) not in REPAIR_POLICIES:
            raise RepairError(f"unknown --policy {self.policy!r} (choose {', '.join(REPAIR_POLICIES)})")
        if self.init and self.init not in INITS:
            raise RepairError(f"unknown --init {self.init!r} (choose {', '.join(INITS)})")
        if self.pad_to_multiple_of is not None and self.pad_to_multiple_of < 1:
            raise RepairError("--pad-to-multiple-of must be a positive integer")
        # a NaN or infinite std would write NaN/inf rows into the embedding without a word
        if not (math.isfinite(self.std) and self.std > 0):
            raise RepairError(f"--std must be a positive number, not {self.std!r}")
        if self.seed < 0:  # numpy's generators refuse it, but only once the writer starts
            raise RepairError(f"--seed must be a non-negative integer, not {self.seed}")
        if self.own_rows is not None and self.own_rows < 1:
            raise RepairError(f"--own-rows must be a positive integer, not {self.own_rows}")
