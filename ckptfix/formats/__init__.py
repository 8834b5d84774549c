"""Checkpoint formats: detect what a path holds and read it into the one checkpoint model.

One module per format, each with plain `read` (and, where repair applies, `write`) functions.
Modules are imported only when a path needs them, to keep `ckptfix inspect` start-up small.
"""

from __future__ import annotations

import os
import stat
from typing import TYPE_CHECKING, BinaryIO

from ckptfix import untrusted
from ckptfix.errors import UnreadableCheckpoint

if TYPE_CHECKING:  # checkpoint.py imports formats.pickle_safe; keep this package import-light
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.record import Record


def open_regular(path: str) -> BinaryIO:
    """Open a regular file for reading (see `ckptfix.untrusted.open_regular`: FIFOs, devices and
    sockets are refused without blocking)."""
    return untrusted.open_regular(path)


def detect(path: str) -> str:
    """The format name of `path`, judged from its content (not its extension alone)."""
    if stat.S_ISDIR(untrusted.check_input(path).st_mode):
        from ckptfix.formats import folders

        return folders.detect(path)
    try:
        with open_regular(path) as f:
            head = f.read(16)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot read ({exc.strerror})") from None
    if not head:
        raise UnreadableCheckpoint(f"{path}: empty file (0 bytes)")
    from ckptfix.formats import safetensors_file, torch_file

    # safetensors first: a header length such as 1152 starts with the bytes 80 04, which look like a
    # pickle's protocol opcode; the '{' at byte 8 settles it.
    if safetensors_file.sniff(head):
        return "safetensors"
    kind = torch_file.sniff(head)
    if kind is not None:
        return kind
    raise UnreadableCheckpoint(f"{path}: not a checkpoint (neither a torch.save zip/pickle nor safetensors; starts with {head[:8]!r})")


def read_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> "Checkpoint":
    """Read any supported checkpoint (metadata only; tensor bytes stay on disk); the shared sections
    are checked at the boundary (`formats.validate`) before anything else sees them."""
    from ckptfix.formats.validate import check_checkpoint

    path = os.fspath(path)
    ckpt = _read(path, detect(path), trust_pickle)
    if ckpt.record is None:  # a folder's ckptfix.json, or the FILE.ckptfix.json sidecar of a bare state_dict
        from ckptfix.record import read_sidecar

        record = read_sidecar(path)
        if record is not None:
            attach_record(ckpt, record)
    return check_checkpoint(ckpt)


def _read(path: str, kind: str, trust_pickle: bool) -> "Checkpoint":
    if kind in ("torch-zip", "torch-legacy"):
        from ckptfix.formats import torch_file

        return torch_file.read(path, trust_pickle=trust_pickle)
    if kind == "safetensors":
        from ckptfix.formats import safetensors_file

        return safetensors_file.read(path)
    from ckptfix.formats import folders

    return folders.read(path, kind, trust_pickle=trust_pickle)


def attach_record(ckpt: "Checkpoint", record: "Record") -> None:
    """Attach a ckptfix record; its parameter names (all of them, or none) name the optimizer's entries."""
    ckpt.record = record
    if ckpt.optimizer is not None and record.param_names is not None:
        ckpt.optimizer.param_names = list(record.param_names)
