"""ckptfix: inspect, repair and guard PyTorch training checkpoints that will not resume cleanly.

The public verbs::

    ckptfix.inspect(path, tokenizer=None, scan=False)        -> Report
    ckptfix.repair(path, tokenizer, out, policy="remap", ...) -> RepairResult
    ckptfix.diff(a, b, atol=0.0)                              -> DiffReport
    ckptfix.convert(path, out)                                -> ConvertResult (loads with weights_only=True)
    ckptfix.ResumeGuard(model, optimizer, ..., policy="strict")
    ckptfix.check_training_setup(model, optimizer, scaler)    -> list[Problem]
    ckptfix.read_checkpoint(path)                             -> Checkpoint
    ckptfix.load_tokenizer(path)                              -> TokenizerInfo

Importing ckptfix does not import torch: the names that need it load on first use, so that
`ckptfix inspect` stays fast.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from ckptfix.errors import CkptfixError, RepairError, TokenizerError, UnreadableCheckpoint, UnsafePickle
from ckptfix.formats import read_checkpoint
from ckptfix.inspect import Report, inspect
from ckptfix.version import __version__

_LAZY = {
    "repair": "ckptfix.surgery",
    "RepairResult": "ckptfix.surgery",
    "diff": "ckptfix.compare",
    "DiffReport": "ckptfix.compare",
    "convert": "ckptfix.weights_only",
    "ConvertResult": "ckptfix.weights_only",
    "ResumeGuard": "ckptfix.guard",
    "check_training_setup": "ckptfix.guard",
    "TrainingSetupError": "ckptfix.guard",
    "load_tokenizer": "ckptfix.tokenizers",
    "TokenizerInfo": "ckptfix.tokenizers",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    if name == "integrations":  # `ckptfix.integrations.transformers.ResumeGuardCallback()` after `import ckptfix`
        return import_module("ckptfix.integrations")
    raise AttributeError(f"module 'ckptfix' has no attribute {name!r}")


__all__ = ["inspect", "Report", "read_checkpoint", "CkptfixError", "UnreadableCheckpoint", "UnsafePickle",
           "TokenizerError", "RepairError", "__version__", *_LAZY]
