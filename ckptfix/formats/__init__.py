"""Checkpoint formats: detect what a path holds and read it into the one checkpoint model.

One module per format, each with plain `sniff` and `read` functions (and a writer in
`ckptfix.surgery` where repair applies), listed once in `FORMATS`. Modules are imported only when a
path needs them, to keep `ckptfix inspect` start-up small.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from importlib import import_module
from typing import TYPE_CHECKING, Any, BinaryIO, Callable

import ckptfix.untrusted as untrusted
from ckptfix.errors import UnreadableCheckpoint, UnrecognisedFolder

if TYPE_CHECKING:  # checkpoint.py imports formats.pickle_safe; keep this package import-light
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.record import Record


def open_regular(path: str) -> BinaryIO:
    """Open a regular file for reading (see `ckptfix.untrusted.open_regular`: FIFOs, devices and
    sockets are refused without blocking)."""
    return untrusted.open_regular(path)


@dataclass(frozen=True)
class Format:
    """One checkpoint format: how it is recognised, read, and written by `repair`.

    Functions are named "module:function" and imported only when used. `sniff`: for files
    `sniff(head: bytes)` (the first 16 bytes), for folders `sniff(path)`; truthy when it is this
    format (None: the format is produced by another row's reader). `read(path, *, trust_pickle)`
    returns a `Checkpoint`. `write` is the repair writer (`ckptfix.surgery`); without one, `refuse`
    may name `function(path) -> str`, the message repair refuses with. `notes(plan) -> list[str]`:
    what a repair of this format will do beyond the common plan, added by `make_plan` (so
    `--dry-run` shows it).
    """

    name: str
    sniff: str | None
    read: str
    write: str | None = None
    folder: bool = False
    refuse: str | None = None
    notes: str | None = None


# Adding a format: one module (sniff + read, and a writer for repair) plus one line here. Rows are
# sniffed in order, files and folders separately.
FORMATS: tuple[Format, ...] = (
    # safetensors before torch: a header length such as 1152 starts with the bytes 80 04, which look
    # like a pickle's protocol opcode; the '{' at byte 8 settles it.
    Format("safetensors", "safetensors_file:sniff", "safetensors_file:read", "write_hf:write_safetensors_file"),
    Format("torch", "torch_file:sniff", "torch_file:read", "write_torch:write_torch_checkpoint"),
    # a torch file with Lightning's keys: torch_file.read names it (common.checkpoint_from_tree)
    Format("lightning", None, "torch_file:read", "write_torch:write_torch_checkpoint"),
    # a torch file with Composer's {'state': {'model', 'optimizers', 'schedulers'}} layout, named the same way
    Format("composer", None, "torch_file:read", "write_torch:write_torch_checkpoint"),
    # before dcp: a Megatron-Core torch_dist iteration folder (or its save folder) is a DCP folder with common.pt
    Format("megatron", "megatron_folder:sniff", "megatron_folder:read", "write_megatron:write_megatron_folder",
           folder=True, notes="write_megatron:plan_notes"),
    Format("dcp", "dcp_folder:sniff", "dcp_folder:read", "write_dcp:write_dcp_folder", folder=True,
           notes="write_dcp:plan_notes"),
    # before deepspeed: a universal folder also holds a *model_states.pt
    Format("deepspeed-universal", "deepspeed_universal:sniff", "deepspeed_universal:read",
           "write_deepspeed:write_universal_folder", folder=True, notes="write_deepspeed:plan_notes"),
    Format("deepspeed", "deepspeed_folder:sniff", "deepspeed_folder:read", folder=True,
           refuse="deepspeed_folder:repair_unsupported"),
    # litgpt: lit_model.pth beside model_config.yaml (padded_vocab_size: the rows the model is rebuilt with)
    Format("litgpt", "litgpt_folder:sniff", "litgpt_folder:read", "write_litgpt:write_litgpt_folder", folder=True),
    # an adapter folder: repair rewrites its modules_to_save embedding/head copies
    Format("peft-adapter", "hf_folder:sniff_adapter", "hf_folder:read_adapter", "write_hf:write_hf_folder", folder=True),
    Format("hf-trainer", "hf_folder:sniff_trainer", "hf_folder:read_trainer", "write_hf:write_hf_folder", folder=True),
    Format("accelerate", "accelerate_folder:sniff", "accelerate_folder:read", "write_accelerate:write_accelerate_folder",
           folder=True, notes="write_accelerate:plan_notes"),
    Format("hf-model", "hf_folder:sniff_model", "hf_folder:read_model", "write_hf:write_hf_folder", folder=True),
)
BY_NAME = {f.name: f for f in FORMATS}


def resolve(ref: str) -> Callable[..., Any]:
    """A table entry's function: readers live in ckptfix.formats, writers in ckptfix.surgery."""
    module, name = ref.split(":")
    package = "ckptfix.surgery" if module.startswith("write_") else "ckptfix.formats"
    return getattr(import_module(f"{package}.{module}"), name)


def detect(path: str) -> str:
    """The format name of `path`, judged from its content (not its extension alone)."""
    folder = stat.S_ISDIR(untrusted.check_input(path).st_mode)
    probe: str | bytes = path if folder else _head(path)
    for f in FORMATS:
        if f.folder == folder and f.sniff is not None and resolve(f.sniff)(probe):
            return f.name
    if folder:
        listing = ", ".join(sorted(os.listdir(path))[:6]) or "empty"
        raise UnrecognisedFolder(f"{path}: folder holds no checkpoint ckptfix recognises ({listing})")
    raise UnreadableCheckpoint(f"{path}: not a checkpoint (neither a torch.save zip/pickle nor safetensors; "
                               f"starts with {probe[:8]!r})")


# What the framework's own loader does with an empty file (said in the refusal; here, not in the readers: this
# package's own code imports no reader module, whose imports come back up to it)
TORCH_LOAD_EMPTY = "(torch.load dies on it with EOFError, naming no file; so does Lightning's fit(ckpt_path=...))"
SAFETENSORS_EMPTY = ("(safetensors' load_file and transformers' from_pretrained die on it with SafetensorError 'Error "
                     "while deserializing header: header too small', naming no file)")


def _head(path: str) -> bytes:
    said = SAFETENSORS_EMPTY if path.endswith(".safetensors") else TORCH_LOAD_EMPTY
    return read_head(path, empty=said)


def read_head(path: str, *, empty: str = "") -> bytes:
    """A file's first 16 bytes (what `sniff` reads), through the one open readers use; a file that cannot be
    read or is empty is one line (`empty`: what its framework's loader then does, appended)."""
    try:
        with open_regular(path) as f:
            head = f.read(16)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{path}: cannot read ({exc.strerror})") from None
    if not head:
        raise UnreadableCheckpoint(f"{path}: empty file (0 bytes)" + (f" {empty}" if empty else ""))
    return head


def read_checkpoint(path: str | os.PathLike, *, trust_pickle: bool = False) -> "Checkpoint":
    """Read any supported checkpoint (metadata only; tensor bytes stay on disk); the shared sections
    are checked at the boundary (`formats.validate`) before anything else sees them."""
    from ckptfix.formats.validate import check_checkpoint

    path = os.fspath(path)
    if "://" in path:  # a URL: read through its sparse local mirror (ckptfix.remote)
        from ckptfix.remote import local_path

        path = str(local_path(path))
    untrusted.input_root(path)
    ckpt = resolve(BY_NAME[detect(path)].read)(path, trust_pickle=trust_pickle)
    if ckpt.record is None:  # a folder's ckptfix.json, or the FILE.ckptfix.json sidecar of a bare state_dict
        from ckptfix.record import read_sidecar

        record = read_sidecar(path)
        if record is not None:
            attach_record(ckpt, record)
    return check_checkpoint(ckpt)


def attach_record(ckpt: "Checkpoint", record: "Record") -> None:
    """Attach a ckptfix record; its parameter names (all of them, or none) name the optimizer's entries."""
    ckpt.record = record
    if ckpt.optimizer is not None and record.param_names is not None:
        ckpt.optimizer.param_names = list(record.param_names)
