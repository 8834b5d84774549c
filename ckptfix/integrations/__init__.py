"""Optional integrations with training frameworks; each submodule imports its framework lazily.

`ckptfix.integrations.transformers.ResumeGuardCallback()` works after a plain `import ckptfix`: the
submodule (and its framework) is imported on first attribute access.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # type checkers see the submodules; the interpreter imports each (and its framework) on use
    from ckptfix.integrations import lightning as lightning
    from ckptfix.integrations import transformers as transformers

_SUBMODULES = ("transformers", "lightning")

if not TYPE_CHECKING:

    def __getattr__(name: str):
        if name in _SUBMODULES:
            return importlib.import_module(f"{__name__}.{name}")
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
