"""In-place repairs and their one-command undo (`ckptfix restore FOLDER`).

An in-place repair adds files (new data files, a new shard) and replaces a few small ones (DCP
`.metadata`, an HF index, `config.json`, tokenizer files) after keeping each previous one under
`NAME.ckptfix-bak`. `ckptfix-restore.json` lists both, written ahead of each step (`InPlace`); `restore` puts
every backup back under its name (the file that switches the checkpoint, `.metadata` or the index, first) and
removes the added files. Both can be interrupted and run again: each step is done once or passed over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from typing import Any, Callable

from ckptfix.errors import RepairError
from ckptfix.io import TMP_MARK, atomic_write, create_file, fsync_dir
from ckptfix.untrusted import escape, load_json_file, open_regular

RESTORE_FILE = "ckptfix-restore.json"
BACKUP_SUFFIX = ".ckptfix-bak"
SCRATCH_PREFIX = ".ckptfix-scratch-"


class InPlace:
    """An in-place repair of `folder`, undoable at every instant: `ckptfix-restore.json` is written before
    anything is touched and rewritten before each step (write-ahead), so a kill anywhere leaves a list that
    names everything added or backed up so far. Its `complete` is true only once the switch file is replaced;
    `finish_interrupted` (run before the next in-place repair reads the folder) and `restore` both undo an
    incomplete one. Every backup is made in one step (a hard link of the file about to be replaced, or a
    rename of a file that goes), so a listed backup is either absent (the name still holds the original) or
    whole."""

    def __init__(self, folder: str, switch: str):
        if os.path.lexists(os.path.join(folder, RESTORE_FILE)):
            raise RepairError(f"{folder}: holds an earlier in-place repair; `ckptfix restore {folder}` it first, "
                              "or repair into a new folder (-o)")
        self.folder, self.switch = folder, switch  # `switch`: the file whose replacement switches the checkpoint
        self.added: list[str] = []
        self.backups: dict[str, str] = {}
        self._scratch: str | None = None
        try:
            self._log()  # the undo record before anything is touched
        except (OSError, RepairError):  # e.g. the folder's fsync after the rename failed: nothing else was done
            with contextlib.suppress(OSError):
                os.remove(self.path(RESTORE_FILE))
            raise

    def path(self, name: str) -> str:
        return os.path.join(self.folder, name)

    def _log(self, complete: bool = False) -> None:
        atomic_write(self.path(RESTORE_FILE), json.dumps({"switch": self.switch, "added": self.added,
                                                          "backups": self.backups, "complete": complete},
                                                         indent=2).encode())

    def add(self, name: str) -> str:
        """A new file's path, listed before it is created (a name already taken is refused: never removed
        by an undo that did not create it)."""
        if os.path.lexists(self.path(name)):
            raise RepairError(f"{self.path(name)}: already exists; move it away and run again")
        self.added.append(name)
        self._log()
        return self.path(name)

    def scratch(self) -> str:
        """A private folder inside `folder` for files written before they are moved to their names (listed,
        so an undo removes what a kill left there; removed when the repair completes)."""
        if self._scratch is None:
            n = 0
            while os.path.lexists(self.path(f"{SCRATCH_PREFIX}{n}")):
                n += 1
            self._scratch = self.add(f"{SCRATCH_PREFIX}{n}")
            os.mkdir(self._scratch, 0o700)
        return self._scratch

    def _back_up(self, name: str, *, move: bool) -> str:
        backup = name + BACKUP_SUFFIX
        if os.path.lexists(self.path(backup)):  # never replaced, never written through (a planted link)
            raise RepairError(f"{self.folder}: {backup} already exists; move it away (an earlier backup?) and run "
                              "again")
        self.backups[name] = backup
        self._log()
        if move:
            os.rename(self.path(name), self.path(backup))  # renames the entry itself, a link included
        else:
            _link_or_copy(self.path(name), self.path(backup))
        fsync_dir(self.folder)
        return self.path(backup)

    def keep(self, name: str) -> str | None:
        """Keep the current `name` as its backup before it is replaced by an atomic rename (`atomic_write`):
        a hard link, so the old bytes stay whole under the backup's name. None (and `name` listed as added)
        when there is no such file."""
        if not os.path.lexists(self.path(name)):
            self.add(name)
            return None
        return self._back_up(name, move=False)

    def install(self, name: str, new: str) -> None:
        """The written file `new` becomes `name` in one rename, the current `name` kept first."""
        with open(new, "rb") as f:
            os.fsync(f.fileno())
        self.keep(name)
        os.replace(new, self.path(name))
        fsync_dir(self.folder)

    def remove(self, name: str) -> None:
        """`name` goes (renamed to its backup)."""
        self._back_up(name, move=True)

    def rewrite(self, name: str, write: Callable[[str], bool]) -> bool:
        """`name` rewritten by `write(new_path)` (which reads the current `name` where it is; False: nothing to
        change; True with no file written: `name` goes), then installed."""
        new = os.path.join(self.scratch(), name)
        if not write(new):
            if os.path.lexists(new):
                os.remove(new)
            return False
        if os.path.lexists(new):
            self.install(name, new)
        else:
            self.remove(name)
        return True

    def __enter__(self) -> InPlace:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if kind is None:
            return
        try:  # an error or Ctrl-C before the switch: everything back as it was
            self.abandon()
        except OSError as failed:  # the disk refuses the undo too: the list still says what to do
            raise RepairError(f"{escape(self.folder)}: in-place repair failed ({_reason(exc)}), and putting the "
                              f"folder back failed too ({_reason(failed)}); run `ckptfix restore {escape(self.folder)}` "
                              "once the disk takes writes again") from None
        if isinstance(exc, OSError):
            raise RepairError(f"{escape(self.folder)}: in-place repair failed ({_reason(exc)}); the folder was put "
                              "back as it was") from None

    def switch_over(self, write: Callable[[str], None]) -> None:
        """The switch file (`write(path)` replaces it atomically): the one step that switches the checkpoint;
        then the list marked complete and the scratch folder removed. Every added file is on disk before the
        switch names it (a power loss after the switch never leaves a switch file pointing at lost data)."""
        for name in self.added:
            path = self.path(name)
            if os.path.isfile(path) and not os.path.islink(path):
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(self.folder)
        write(self.path(self.switch))
        fsync_dir(self.folder)
        self._log(complete=True)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)

    def abandon(self) -> None:
        """After an error: everything back as it was (best effort), the switch file too if it was replaced,
        and the restore list removed."""
        _undo(self.folder, self.switch, self.backups, self.added)


def finish_interrupted(folder: str) -> list[str]:
    """Undo an in-place repair of `folder` that was interrupted (its restore list not marked complete), so the
    next repair reads the folder as it was; returns what was done (nothing when there is none)."""
    record = os.path.join(folder, RESTORE_FILE)
    if not os.path.isfile(record) or os.path.islink(record):
        swept = _sweep_temporaries(folder)
        return [f"an interrupted in-place repair's temporary files removed first ({'; '.join(swept)})"] if swept \
            else []
    state = load_json_file(record, limit=MAX_RESTORE_BYTES, what="restore list", error=RepairError,
                           bad="not a restore list (invalid JSON)")
    if not isinstance(state, dict) or state.get("complete") is not False:
        return _finish_complete(folder, state)  # InPlace then refuses a second repair, naming `ckptfix restore`
    done = restore(folder)
    return [f"an interrupted in-place repair undone first ({'; '.join(done) or 'nothing to put back'})"]


def _finish_complete(folder: str, state: Any) -> list[str]:
    """A complete repair killed before it removed its scratch folder (the last step): remove it now."""
    added = state.get("added") if isinstance(state, dict) else None
    left = [name for name in (added if isinstance(added, list) else [])
            if isinstance(name, str) and name.startswith(SCRATCH_PREFIX) and "/" not in name
            and os.path.isdir(os.path.join(folder, name)) and not os.path.islink(os.path.join(folder, name))]
    for name in left:
        shutil.rmtree(os.path.join(folder, name))
    return [f"a finished in-place repair's scratch folder removed ({escape(', '.join(left))})"] if left else []


def _undo(folder: str, switch: str, backups: dict[str, str], added: list[str]) -> list[str]:
    """Every backup back under its name (the switch first), every added entry removed, then the list. Each
    step can be repeated: a backup already put back, an added file already gone, is passed over."""
    done = []
    for name in sorted(backups, key=lambda n: n != switch):  # the checkpoint's switch first
        backup = os.path.join(folder, backups[name])
        if os.path.lexists(backup):
            path = os.path.join(folder, name)
            if _same_entry(backup, path):  # linked, not yet replaced: rename() of two links of one file does nothing
                os.remove(backup)
            else:
                os.replace(backup, path)
            done.append(f"restored {escape(name)}")
    fsync_dir(folder)
    for name in added:
        path = os.path.join(folder, name)
        if name.startswith(SCRATCH_PREFIX) and os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.remove(path)
            done.append(f"removed {escape(name)}")
    if os.path.lexists(os.path.join(folder, RESTORE_FILE)):
        os.remove(os.path.join(folder, RESTORE_FILE))
    fsync_dir(folder)
    return done


def _same_entry(a: str, b: str) -> bool:
    try:
        sa, sb = os.lstat(a), os.lstat(b)
    except FileNotFoundError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _link_or_copy(src: str, dst: str) -> None:
    """`dst` a hard link of `src` (one step: whole or absent); where the file system has no hard links, a copy
    under a temporary name first, linked then."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        tmp = dst + ".part"
        _copy_new(src, tmp)
        os.rename(tmp, dst) if not os.path.lexists(dst) else os.remove(tmp)


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
    try:
        return _restore_folder(folder)
    except OSError as exc:  # a read-only or failing disk: every step can be run again
        raise RepairError(f"{escape(folder)}: restore stopped ({_reason(exc)}); nothing is lost: run "
                          "`ckptfix restore` again once the disk takes writes") from None


def _restore_folder(folder: str) -> list[str]:
    swept = _sweep_temporaries(folder)
    if swept and not os.path.lexists(os.path.join(folder, RESTORE_FILE)):
        return swept  # a run killed while it wrote its first restore list: nothing else was touched
    switch, backups, added = _read_restore_list(folder)
    if switch in backups:
        backup = os.path.join(folder, backups[switch])
        keep = _referenced(folder, switch, backups[switch] if os.path.lexists(backup) else switch)
        needed = sorted(set(added) & keep)
        if needed:
            raise RepairError(f"{escape(os.path.join(folder, RESTORE_FILE))}: would remove "
                              f"{escape(', '.join(needed))}, which the restored {escape(switch)} references; "
                              "nothing restored")
    return swept + _undo(folder, switch, backups, added)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror + (f": {escape(os.path.basename(exc.filename))}" if exc.filename else "")
    return escape(str(exc), 200) or type(exc).__name__


def _sweep_temporaries(folder: str) -> list[str]:
    """The temporary files `io.atomic_file` names `.NAME.ckptfix-tmp-XXXX` that a killed run left in the
    folder (only ckptfix makes such names; a whole one is renamed at once, so what is left is never data)."""
    if not os.path.isdir(folder):
        return []
    done = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(".") and TMP_MARK in name and os.path.isfile(path) and not os.path.islink(path):
            os.remove(path)
            done.append(f"removed {escape(name)} (left by an interrupted run)")
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
            if fs.exists(f"{root}/{backups[name]}"):  # else put back already, or never made
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
        path = os.path.join(folder, backup)
        if os.path.lexists(path) and (not os.path.isfile(path) or os.path.islink(path)):
            raise RepairError(f"{shown}: backup {escape(backup)} is not a regular file; nothing restored")
        if not os.path.lexists(path) and not os.path.lexists(os.path.join(folder, name)):
            # a backup is made in one step, and put back in one: one of the two names always holds the file
            raise RepairError(f"{shown}: neither {escape(name)} nor its backup {escape(backup)} is there; "
                              "nothing restored")
    if state.get("complete") is not False and switch not in backups:  # a complete repair kept its switch file
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
