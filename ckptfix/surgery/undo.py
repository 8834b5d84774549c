"""In-place repairs and their one-command undo (`ckptfix restore FOLDER`).

An in-place repair adds files (new data files, a new shard) and replaces a few small ones (DCP
`.metadata`, an HF index, `config.json`, tokenizer files) after keeping each previous one under
`NAME.ckptfix-bak`. `ckptfix-restore.json` lists both; `restore` puts every backup back under its name
(the file that switches the checkpoint, `.metadata` or the index, first) and removes the added files.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable

from ckptfix.errors import RepairError
from ckptfix.io import atomic_write, create_file, fsync_dir
from ckptfix.untrusted import escape, load_json_file, open_regular

RESTORE_FILE = "ckptfix-restore.json"
BACKUP_SUFFIX = ".ckptfix-bak"


class InPlace:
    """Collects what an in-place repair of `folder` adds and backs up; `commit()` writes the restore list."""

    def __init__(self, folder: str, switch: str):
        if os.path.lexists(os.path.join(folder, RESTORE_FILE)):
            raise RepairError(f"{folder}: holds an earlier in-place repair; `ckptfix restore {folder}` it first, "
                              "or repair into a new folder (-o)")
        self.folder, self.switch = folder, switch  # `switch`: the file whose replacement switches the checkpoint
        self.added: list[str] = []
        self.backups: dict[str, str] = {}

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def add(self, name: str) -> str:
        self.added.append(name)
        return self.path(name)

    def keep(self, name: str, *, move: bool = False) -> str | None:
        """Keep the current `name` as its backup (moved, for a file about to be written anew, or copied);
        returns the backup's path, None when there is no such file (then the new one counts as added)."""
        if not os.path.lexists(self.path(name)):
            self.added.append(name)
            return None
        backup = name + BACKUP_SUFFIX
        if os.path.lexists(self.path(backup)):  # never replaced, never written through (a planted link)
            raise RepairError(f"{self.folder}: {backup} already exists; move it away (an earlier backup?) and run "
                              "again")
        if move:
            os.rename(self.path(name), self.path(backup))  # renames the entry itself, a link included
        else:
            _copy_new(self.path(name), self.path(backup))
        self.backups[name] = backup
        return self.path(backup)

    def __enter__(self) -> InPlace:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is not None:  # an error or Ctrl-C before the switch: everything back as it was
            self.abandon()

    def switch_over(self, write: Callable[[str], None]) -> None:
        """The restore list, then the switch file (`write(path)` replaces it atomically): the one step that
        switches the checkpoint."""
        self.commit()
        write(self.path(self.switch))
        fsync_dir(self.folder)

    def commit(self) -> None:
        atomic_write(self.path(RESTORE_FILE), json.dumps(
            {"switch": self.switch, "added": self.added, "backups": self.backups}, indent=2).encode())

    def abandon(self) -> None:
        """After an error: everything back as it was (best effort), the switch file too if it was replaced,
        and the restore list removed (it lists nothing left to undo; left there, it would stop the next
        in-place repair)."""
        for name, backup in self.backups.items():
            if os.path.lexists(self.path(backup)):
                os.replace(self.path(backup), self.path(name))
        for name in self.added:
            if os.path.lexists(self.path(name)):
                os.remove(self.path(name))
        if os.path.lexists(self.path(RESTORE_FILE)):
            os.remove(self.path(RESTORE_FILE))


def _copy_new(src: str, dst: str) -> None:
    """A copy of the folder's file `src` as the new file `dst` (read without leaving the folder)."""
    with open_regular(src, error=RepairError) as fin, create_file(dst) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)
    shutil.copymode(src, dst)


MAX_RESTORE_BYTES = 1 << 20  # the list names a few files; a real one is under 1 KB
MAX_NAME = 255  # a file name's length on Linux file systems


def restore(folder: str) -> list[str]:
    """Undo an in-place repair of `folder`. Returns what was done, one line each.

    The restore list is an input like any other: a bounded regular file, typed, every name a plain entry of
    the folder (no separator, no `..`), each backup the name's own `NAME.ckptfix-bak`; and nothing is removed
    that the restored metadata or index references. Any doubt: exit 2, nothing touched. A URL (an in-place
    repair of a prefix in object storage) is restored there (`_restore_in_object_store`)."""
    if "://" in folder:
        from ckptfix.remote import is_url

        if is_url(folder):
            return _restore_in_object_store(folder)
    switch, backups, added = _read_restore_list(folder)
    keep = _referenced(folder, switch, backups[switch])
    needed = sorted(set(added) & keep)
    if needed:
        raise RepairError(f"{escape(os.path.join(folder, RESTORE_FILE))}: would remove {escape(', '.join(needed))}, "
                          f"which the restored {escape(switch)} references; nothing restored")
    done = []
    for name in sorted(backups, key=lambda n: n != switch):  # the checkpoint's switch first
        os.replace(os.path.join(folder, backups[name]), os.path.join(folder, name))
        done.append(f"restored {escape(name)}")
    for name in added:
        path = os.path.join(folder, name)
        if os.path.lexists(path):
            os.remove(path)
            done.append(f"removed {escape(name)}")
    os.remove(os.path.join(folder, RESTORE_FILE))
    fsync_dir(folder)
    return done


def _restore_in_object_store(url: str) -> list[str]:
    """`ckptfix restore URL`: the restore list checked as for a folder (on the prefix's mirror), then the
    backups copied back over their names inside the store (the switch object first), the backups, the added
    objects and the restore list deleted."""
    import ckptfix.remote as remote

    folder = remote.local_path(url)
    mirror = remote.mirror_of(folder)
    if mirror is None or not os.path.isdir(folder):
        raise RepairError(f"{remote._shown_url(url)}: no in-place repair to undo ({RESTORE_FILE} missing)")
    switch, backups, added = _read_restore_list(folder)
    done = restore(folder)  # every check of a local restore, on the mirror (nothing remote touched yet)
    fs, root = mirror.fs, mirror.key
    try:
        for name in sorted(backups, key=lambda n: n != switch):  # the checkpoint's switch first
            fs.copy(f"{root}/{backups[name]}", f"{root}/{name}")
        for name in [*backups.values(), *added, RESTORE_FILE]:
            if fs.exists(f"{root}/{name}"):
                fs.rm_file(f"{root}/{name}")
    except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
        raise remote.storage_error(url, exc) from None
    finally:
        fs.invalidate_cache()
    return done


def _read_restore_list(folder: str) -> tuple[str, dict[str, str], list[str]]:
    record = os.path.join(folder, RESTORE_FILE)
    shown = escape(record)
    if not os.path.isdir(folder) or not os.path.lexists(record):
        raise RepairError(f"{escape(folder)}: no in-place repair to undo ({RESTORE_FILE} missing)")
    if os.path.islink(record):
        raise RepairError(f"{shown}: a link, not the list an in-place repair writes; nothing restored")
    state = load_json_file(record, limit=MAX_RESTORE_BYTES, what="restore list", error=RepairError,
                           bad="not a restore list (invalid JSON)")
    if not isinstance(state, dict) or not isinstance(state.get("backups"), dict) \
            or not isinstance(state.get("added"), list) or not isinstance(state.get("switch"), str):
        raise RepairError(f"{shown}: not a restore list (expected switch, backups and added); nothing restored")
    switch = _plain_name(state["switch"], shown, "switch")
    backups = {_plain_name(k, shown, "backups"): _plain_name(v, shown, "backups") for k, v in state["backups"].items()}
    added = [_plain_name(n, shown, "added") for n in state["added"]]
    for name, backup in backups.items():
        if backup != name + BACKUP_SUFFIX:
            raise RepairError(f"{shown}: backups: {escape(name)} -> {escape(backup)} is not its {BACKUP_SUFFIX}; "
                              "nothing restored")
        if not os.path.isfile(os.path.join(folder, backup)) or os.path.islink(os.path.join(folder, backup)):
            raise RepairError(f"{shown}: backup {escape(backup)} is missing or not a regular file; nothing restored")
    if switch not in backups:  # every in-place repair keeps the file it switches
        raise RepairError(f"{shown}: no backup of {escape(switch)}, the file it switches; nothing restored")
    if set(added) & (set(backups) | set(backups.values()) | {RESTORE_FILE}):
        raise RepairError(f"{shown}: added names a file it also restores; nothing restored")
    return switch, backups, added


def _plain_name(name: object, shown: str, field: str) -> str:
    """A name of an entry directly in the folder: a string, no separator, NUL, `.` or `..`, not too long."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\x00" in name or len(name.encode("utf-8", "surrogatepass")) > MAX_NAME:
        raise RepairError(f"{shown}: {field}: {escape(repr(name), 80)} is not a file name in the folder; "
                          "nothing restored")
    return name


def _referenced(folder: str, switch: str, backup: str) -> set[str]:
    """The data files the switch file about to be restored references (DCP `.metadata`: its storage files;
    a safetensors index: its shards)."""
    if switch == ".metadata":
        from ckptfix.formats.dcp_folder import read_metadata

        items, _ = read_metadata(folder, backup)
        return {os.path.basename(blob[0]) for item in items.values() for blob in item.blobs}
    index = load_json_file(os.path.join(folder, backup), what="index", error=RepairError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    return {v for v in weight_map.values() if isinstance(v, str)} if isinstance(weight_map, dict) else set()
