"""Checkpoint formats: detect what a path holds and read it into the one checkpoint model.

One module per format, each with plain `read` (and, where repair applies, `write`) functions.
Modules are imported only when a path needs them, to keep `ckptfix inspect` start-up small.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ckptfix.errors import UnreadableCheckpoint

if TYPE_CHECKING:  # checkpoint.py imports formats.pickle_safe; keep this package import-light
    from ckptfix.checkpoint import Checkpoint


def detect(path: str) -> str:
    """The format name of `path`, judged from its content (not its extension alone)."""
    if not os.path.exists(path):
        raise UnreadableCheckpoint(f"{path}: no such file or folder")
    if os.path.isdir(path):
        from ckptfix.formats import folders

        return folders.detect(path)
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot open ({exc.strerror})") from None
    if not head:
        raise UnreadableCheckpoint(f"{path}: empty file (0 bytes)")
    from ckptfix.formats import safetensors_file, torch_file

    kind = torch_file.sniff(head)
    if kind is not None:
        return kind
    if safetensors_file.sniff(head):
        return "safetensors"
    raise UnreadableCheckpoint(f"{path}: not a checkpoint (neither a torch.save zip/pickle nor safetensors; starts with {head[:8]!r})")


def read_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> "Checkpoint":
    """Read any supported checkpoint (metadata only; tensor bytes stay on disk)."""
    path = os.fspath(path)
    kind = detect(path)
    if kind in ("torch-zip", "torch-legacy"):
        from ckptfix.formats import torch_file

        return torch_file.read(path, trust_pickle=trust_pickle)
    if kind == "safetensors":
        from ckptfix.formats import safetensors_file

        return safetensors_file.read(path)
    from ckptfix.formats import folders

    return folders.read(path, kind, trust_pickle=trust_pickle)
