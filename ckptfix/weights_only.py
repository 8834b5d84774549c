"""`convert` (`ckptfix convert`): write a copy of a `torch.save` file that `torch.load(weights_only=True)` loads.

The file is read by the allowlist unpickler (nothing imported, nothing called). Objects of known data
classes (`formats/data_globals.DATA_CLASSES`) and objects the pickle only constructs (a Namespace, a
dataclass, DeepSpeed's LossScaler) become plain values; every conversion is listed in the output's
`ckptfix` record. Tensor records are copied byte for byte; numpy arrays become new tensor records
holding the same bytes. A file that calls code is refused (UnsafePickle) before anything is written.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfix.errors import RepairError
from ckptfix.formats import detect, torch_file, torch_save
from ckptfix.formats.common import iter_leaves, iter_tensor_refs
from ckptfix.formats.data_globals import Conversion, Converter, Use, torch_refuses, uses
from ckptfix.formats.pickle_records import OpaqueObject, StorageRef, global_name
from ckptfix.formats.pickle_safe import globals_in_pickle
from ckptfix.io import BackgroundHash, atomic_file, backup_path, check_output_path, output_target


@dataclass
class ConvertResult:
    """What `convert` found and (unless dry_run) wrote. `to_json()` is the `--json` schema."""

    source: str
    output: str | None
    dry_run: bool
    uses: list[Use]
    conversions: list[Conversion] = field(default_factory=list)
    backup: str | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"schema": "ckptfix.convert/1", "source": self.source, "output": self.output, "dry_run": self.dry_run,
                "refused_by_torch": sorted({g for u in self.uses for g in u.torch_refuses}),
                "objects": [u.to_json() for u in self.uses],
                "conversions": [c.to_json() for c in self.conversions], "backup": self.backup, "notes": self.notes}


def convert(checkpoint: str | os.PathLike, out: str | os.PathLike | None = None, *, dry_run: bool = False,
            force: bool = False) -> ConvertResult:
    """Convert the objects that keep `torch.load(weights_only=True)` from loading `checkpoint` into plain data.

    `out` may equal the input only with `force`; the original is then kept as a `.bak`.
    """
    source = os.fspath(checkpoint)
    kind = detect(source)
    if kind not in ("torch", "torch-zip", "torch-legacy"):
        raise RepairError(f"{source}: convert works on one torch.save file (this is {kind}); "
                          "convert the .pt/.pth/.bin/.pkl files in it one by one")
    refusals: list[str] = []  # opcodes of another pickle protocol...: the copy, protocol 2, has none
    tree, locate_for, archive = torch_file.load(source, refusals=refusals)  # strict: a file that calls code is refused here
    found = uses(tree)
    conv = Converter(next_key=_next_key(tree))
    new_tree = conv.value(tree, "")
    result = ConvertResult(source, os.fspath(out) if out is not None else None, dry_run, found, conv.conversions)
    if not any(u.torch_refuses for u in found) and not refusals:
        result.output = None
        result.notes.append("nothing to convert: torch.load(weights_only=True) loads this file as it is; "
                            "nothing written")
        return result
    _check_plain(new_tree)
    if dry_run:
        return result
    out, in_place = output_target(source, out, force=force)
    # everything that could refuse OUT is checked before it is written (a sidecar name too long, OUT inside the
    # input's folder...): a refusal after the replace would leave OUT behind on an exit 2
    check_output_path(source, out, force=force, sidecar=not isinstance(new_tree, dict))
    hasher = BackgroundHash(source)
    try:
        # not final: the record with a placeholder hash of the same length (the writer pickles it twice)
        result.backup = _write(source, out, new_tree, conv, locate_for, archive, in_place,
                               lambda final: _record(tree, source, hasher.result() if final else "0" * 64,
                                                     conv.conversions))
    finally:
        hasher.release()
    return result


def _next_key(tree: Any) -> int:
    keys = [int(ref.storage.key) for ref in iter_tensor_refs(tree) if ref.storage.key.isdigit()]
    return max(keys, default=-1) + 1


def _check_plain(tree: Any) -> None:
    """Nothing but what torch's weights-only unpickler builds may be left (a bug here must not write a file)."""
    for node in iter_leaves(tree):
        if isinstance(node, (OpaqueObject, frozenset, slice)) or global_name(node) is not None:
            raise RepairError(f"internal: a {type(node).__name__} survived the conversion")


def _record(tree: Any, source: str, sha256: str | None, conversions: list[Conversion]) -> dict[str, Any]:
    """The `ckptfix` entry: a previous record (a repair's) gains the conversions; otherwise a small one of its own."""
    from ckptfix.record import CONVERSIONS_KEY, CONVERT_SCHEMA, RECORD_KEY, Record
    from ckptfix.version import __version__

    previous = tree.get(RECORD_KEY) if isinstance(tree, dict) else None
    entry = [c.to_json() for c in conversions]
    if isinstance(previous, dict):
        record = Record.from_json(Converter(next_key=0).value(previous, RECORD_KEY), f"{source}: {RECORD_KEY}")
        record.provenance[CONVERSIONS_KEY] = entry
        return record.to_json()
    return Record(schema=CONVERT_SCHEMA, provenance={
        "version": __version__, "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "source": os.path.abspath(source), "source_sha256": sha256, CONVERSIONS_KEY: entry}).to_json()


def _write(source: str, out: str, tree: Any, conv: Converter, locate_for: Any, archive: Any, in_place: bool,
           record: Any) -> str | None:
    def source_for(storage: StorageRef) -> torch_save.StorageSource:
        if storage.key in conv.arrays:  # a numpy array's bytes, as they were in the pickle
            array = conv.arrays[storage.key]
            return torch_save.StorageSource(produce=lambda: np.ascontiguousarray(array))
        crc = None
        if archive is not None:
            info = archive.members.get(f"{archive.prefix}/data/{storage.key}")
            crc = info.CRC if info is not None else None
        return torch_save.StorageSource(copy_from=locate_for(storage), crc=crc)

    def finish(t: Any, final: bool) -> Any:  # a dict carries its record; anything else gets a sidecar
        return {**t, "ckptfix": record(final)} if isinstance(t, dict) else t

    prefix = archive.prefix if archive is not None else "archive"
    version = archive.read_member("version") if archive is not None else None
    backup = backup_path(out) if in_place else None
    with atomic_file(out, mode_like=source, backup=in_place) as f:
        torch_save.write(f, tree, source_for, prefix=prefix, finish=finish, version=version)
        _verify(f, out, prefix)  # before the temporary file becomes OUT: a refusal leaves nothing
    if not isinstance(tree, dict):
        import json

        with atomic_file(out + ".ckptfix.json") as f:
            f.write((json.dumps(record(True), indent=2) + "\n").encode())
    return backup


def _verify(f: Any, out: str, prefix: str) -> None:
    """The written pickle (in the temporary file `f`) names only globals torch's weights-only unpickler accepts."""
    import zipfile

    f.flush()
    with zipfile.ZipFile(f) as archive:  # our own output, just written
        data = archive.read(f"{prefix}/data.pkl")
    refused = [g for g in globals_in_pickle(data) if torch_refuses(g)]
    if refused:
        raise RepairError(f"internal: {out} still names {', '.join(refused)}")
