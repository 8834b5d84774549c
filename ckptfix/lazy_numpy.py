"""numpy, imported on first use.

`ckptfix --version` and `ckptfix inspect` of a small checkpoint must not pay numpy's import (~70-180 ms,
more than the rest of inspect): inspect reads metadata and never needs array code unless it reads tensor
bytes (`--scan`, reserved rows). Modules on that path write

    if TYPE_CHECKING:
        import numpy as np
    else:
        from ckptfix.lazy_numpy import np

so type checkers see numpy itself, and the interpreter imports it at the first `np.<name>`.
"""

from __future__ import annotations

import importlib
from typing import Any


class _LazyModule:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self._name), attr)
        setattr(self, attr, value)  # later reads are plain attribute hits, not this call
        return value


np = _LazyModule("numpy")
