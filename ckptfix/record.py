"""The ckptfix record: what `ckptfix repair` did to a checkpoint, or what `ResumeGuard.record()` saw when
it was saved. One type, written by `to_json` and read by `from_json`; nothing else reads it by key.

Where it lives: under the "ckptfix" key of a torch.save dict, in `ckptfix.json` inside a folder, or in
`FILE.ckptfix.json` next to a bare state_dict or a `.safetensors` file (`sidecar_path`).

Two facts in it are used later, so they are only written when they are true:
- `param_names` (optimizer index -> parameter name, in optimizer order) is written only when every
  optimizer entry was named; a partial list would make a later reader treat guesses as names.
- `tokenizer` is the tokenizer the checkpoint's rows now belong to, with a fingerprint of its id -> token
  table (`ckptfix.identity.fingerprint`), so a later repair can move rows by token string from it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from ckptfix.errors import UnreadableCheckpoint

REPAIR_SCHEMA = "ckptfix.repair/1"
NAMES_SCHEMA = "ckptfix.names/1"  # `ResumeGuard.record()`: names (and the tokenizer) at save time
CONVERT_SCHEMA = "ckptfix.convert/1"  # `ckptfix convert`: pickled objects made weights-only loadable
CONVERSIONS_KEY = "weights_only_conversions"  # provenance: what `ckptfix convert` turned into plain data
RECORD_KEY = "ckptfix"  # the key in a torch.save dict
FOLDER_FILE = "ckptfix.json"  # the file in a folder checkpoint
SIDECAR_SUFFIX = ".ckptfix.json"  # next to a single-file checkpoint whose format has no room for it


@dataclass(frozen=True)
class TokenizerRef:
    """A tokenizer as the record names it: where it was, its size and its fingerprint."""

    path: str | None
    size: int
    fingerprint: str | None = None  # None in records written before fingerprints existed

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "size": self.size}
        if self.fingerprint is not None:
            out["fingerprint"] = self.fingerprint
        return out

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "TokenizerRef | None":
        if doc is None:
            return None
        _need(isinstance(doc, Mapping), where, "tokenizer", "an object")
        path, size, fp = doc.get("path"), doc.get("size"), doc.get("fingerprint")
        _need(path is None or isinstance(path, str), where, "tokenizer.path", "a string")
        _need(isinstance(size, int) and not isinstance(size, bool) and size >= 0, where, "tokenizer.size",
              "a non-negative integer")
        _need(fp is None or isinstance(fp, str), where, "tokenizer.fingerprint", "a string")
        return cls(path, size, fp)


@dataclass
class Record:
    """A ckptfix record. Fields a later ckptfix run acts on are typed; the rest is provenance."""

    schema: str = REPAIR_SCHEMA
    param_names: list[str] | None = None  # every optimizer index's name, or None (never partial)
    param_names_method: str | None = None  # how repair found them (mapping method), for the guard's trust
    tokenizer: TokenizerRef | None = None  # the tokenizer the rows belong to now
    from_tokenizer: TokenizerRef | None = None  # the one they were moved from (repair)
    rewarm: bool = False  # the optimizer state was dropped: the loop should re-warm the LR
    optimizer_state: str | None = None  # kept | remapped | dropped
    scheduler_state: str | None = None  # kept | reset
    provenance: dict[str, Any] = field(default_factory=dict)  # source, sha256, changes, notes ... (shown only)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": self.schema, "tool": "ckptfix"}
        out.update(self.provenance)
        if self.tokenizer is not None:
            out["tokenizer"] = self.tokenizer.to_json()
        if self.from_tokenizer is not None or self.schema == REPAIR_SCHEMA:
            out["from_tokenizer"] = self.from_tokenizer.to_json() if self.from_tokenizer else None
        if self.optimizer_state is not None:
            out["optimizer_state"] = self.optimizer_state
        if self.scheduler_state is not None:
            out["scheduler_state"] = self.scheduler_state
        if self.schema == REPAIR_SCHEMA:
            out["rewarm"] = self.rewarm
        if self.param_names is not None:
            out["param_names"] = list(self.param_names)
            if self.param_names_method is not None:
                out["param_names_method"] = self.param_names_method
        return out

    @classmethod
    def from_json(cls, doc: Any, where: str) -> "Record":
        """Read a record (any ckptfix version) from parsed JSON or an unpickled dict; `where` names it in errors.

        A `param_names` list with holes (written by ckptfix before 0.2 for partly mapped optimizers) is
        read as absent: those names were never all known."""
        _need(isinstance(doc, Mapping), where, "record", "a JSON object")
        schema = doc.get("schema", REPAIR_SCHEMA)
        _need(isinstance(schema, str), where, "schema", "a string")
        names = doc.get("param_names")
        _need(names is None or isinstance(names, (list, tuple)), where, "param_names", "a list")
        complete = names is not None and all(isinstance(n, str) and n for n in names)
        method = doc.get("param_names_method")
        typed = {"schema", "tool", "param_names", "param_names_method", "tokenizer", "from_tokenizer", "rewarm",
                 "optimizer_state", "scheduler_state"}
        return cls(
            schema=schema,
            param_names=[str(n) for n in names] if complete else None,
            param_names_method=method if complete and isinstance(method, str) else None,
            tokenizer=TokenizerRef.from_json(doc.get("tokenizer"), where),
            from_tokenizer=TokenizerRef.from_json(doc.get("from_tokenizer"), where),
            rewarm=doc.get("rewarm") is True,
            optimizer_state=_str_or_none(doc.get("optimizer_state")),
            scheduler_state=_str_or_none(doc.get("scheduler_state")),
            provenance={str(k): v for k, v in doc.items() if k not in typed},
        )


def sidecar_path(path: str) -> str:
    """Where a record lives outside the checkpoint: `ckptfix.json` in a folder, `FILE.ckptfix.json` beside a file."""
    return os.path.join(path, FOLDER_FILE) if os.path.isdir(path) else path + SIDECAR_SUFFIX


def read_sidecar(path: str) -> Record | None:
    """The record stored beside (or inside, for a folder) checkpoint `path`, if there is one."""
    from ckptfix.untrusted import load_json_file

    file = sidecar_path(path)
    if not os.path.lexists(file):
        return None
    # a record is kilobytes: bounded read of a regular file, bounded digits and nesting
    doc = load_json_file(file, limit=1 << 26, what="ckptfix record", bad="not a ckptfix record (invalid JSON)")
    return Record.from_json(doc, file)


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _need(ok: bool, where: str, name: str, expected: str) -> None:
    if not ok:
        raise UnreadableCheckpoint(f"{where}: ckptfix record field {name!r} is not {expected}")


def record_json(record: dict[str, Any]) -> bytes:
    """A record's JSON as written to `ckptfix.json` or a sidecar (`Record.to_json()`'s dict)."""
    return (json.dumps(record, indent=2, sort_keys=False) + "\n").encode()
