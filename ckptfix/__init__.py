"""ckptfix: inspect, repair and guard PyTorch training checkpoints that will not resume cleanly.

The public verbs::

    ckptfix.inspect(path, tokenizer=None, scan=False)        -> Report
    ckptfix.repair(path, tokenizer, out, policy="remap", ...) -> RepairResult
    ckptfix.repair(path, tokenizer, out, options=RepairOptions(policy="remap", ...))
    ckptfix.diff(a, b, atol=0.0)                              -> DiffReport
    ckptfix.convert(path, out)                                -> ConvertResult (loads with weights_only=True)
    ckptfix.latest_checkpoint(run_dir, scan=False)            -> Latest (the newest whole checkpoint of a run)
    ckptfix.ResumeGuard(model, optimizer, ..., policy="strict")
    ckptfix.check_training_setup(model, optimizer, scaler)    -> list[Problem]
    ckptfix.read_checkpoint(path)                             -> Checkpoint
    ckptfix.load_tokenizer(path)                              -> TokenizerInfo

Importing ckptfix imports neither torch nor numpy: every public name but the exceptions loads on first
use, so that `ckptfix --version` and `ckptfix inspect` start fast. Type checkers and IDEs read the
`TYPE_CHECKING` imports below and see each name's real type; `_LAZY` is the same table for the
interpreter (tests/test_public_api.py checks that the two agree).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ckptfix.errors import CkptfixError, RepairError, TokenizerError, UnreadableCheckpoint, UnsafePickle

if TYPE_CHECKING:
    from ckptfix import integrations as integrations
    from ckptfix.compare import DiffReport as DiffReport
    from ckptfix.compare import diff as diff
    from ckptfix.formats import read_checkpoint as read_checkpoint
    from ckptfix.guard import ResumeError as ResumeError
    from ckptfix.guard import ResumeGuard as ResumeGuard
    from ckptfix.guard import TrainingSetupError as TrainingSetupError
    from ckptfix.guard import check_training_setup as check_training_setup
    from ckptfix.inspect import Report as Report
    from ckptfix.inspect import inspect as inspect
    from ckptfix.latest import Latest as Latest
    from ckptfix.latest import latest_checkpoint as latest_checkpoint
    from ckptfix.surgery import RepairResult as RepairResult
    from ckptfix.surgery import repair as repair
    from ckptfix.surgery.options import RepairOptions as RepairOptions
    from ckptfix.tokenizers import TokenizerInfo as TokenizerInfo
    from ckptfix.tokenizers import load_tokenizer as load_tokenizer
    from ckptfix.weights_only import ConvertResult as ConvertResult
    from ckptfix.weights_only import convert as convert

from ckptfix.version import __version__

_LAZY = {
    "inspect": "ckptfix.inspect",
    "Report": "ckptfix.inspect",
    "read_checkpoint": "ckptfix.formats",
    "repair": "ckptfix.surgery",
    "RepairResult": "ckptfix.surgery",
    "RepairOptions": "ckptfix.surgery.options",
    "diff": "ckptfix.compare",
    "DiffReport": "ckptfix.compare",
    "convert": "ckptfix.weights_only",
    "ConvertResult": "ckptfix.weights_only",
    "latest_checkpoint": "ckptfix.latest",
    "Latest": "ckptfix.latest",
    "ResumeGuard": "ckptfix.guard",
    "ResumeError": "ckptfix.guard",
    "check_training_setup": "ckptfix.guard",
    "TrainingSetupError": "ckptfix.guard",
    "load_tokenizer": "ckptfix.tokenizers",
    "TokenizerInfo": "ckptfix.tokenizers",
}

if not TYPE_CHECKING:  # hidden from type checkers: they see the typed imports above, and flag unknown names
    import sys
    import types

    class _Package(types.ModuleType):
        """The import system binds each loaded submodule as an attribute of its package: `ckptfix.inspect`
        would become the module `ckptfix/inspect.py` once anything imported it. The public name is the
        function; the module stays reachable as `sys.modules["ckptfix.inspect"]`."""

        def __setattr__(self, name, value):
            if name == "inspect" and isinstance(value, types.ModuleType):
                return
            super().__setattr__(name, value)

    sys.modules[__name__].__class__ = _Package

    def __getattr__(name: str):
        from importlib import import_module

        if name in _LAZY:
            value = getattr(import_module(_LAZY[name]), name)
            globals()[name] = value  # once: later lookups are plain attribute reads
            return value
        if name == "integrations":  # `ckptfix.integrations.transformers.ResumeGuardCallback()` after `import ckptfix`
            return import_module("ckptfix.integrations")
        raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")


__all__ = ["CkptfixError", "UnreadableCheckpoint", "UnsafePickle", "TokenizerError", "RepairError", "__version__",
           *_LAZY]
