"""Optional integrations with training frameworks; each submodule imports its framework lazily.

`ckptfix.integrations.transformers.ResumeGuardCallback()` works after a plain `import ckptfix`: the
submodule (and its framework) is imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import Any

_SUBMODULES = ("transformers", "lightning")


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
