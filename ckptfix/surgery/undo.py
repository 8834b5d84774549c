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
from ckptfix.io import fsync_dir

RESTORE_FILE = "ckptfix-restore.json"
BACKUP_SUFFIX = ".ckptfix-bak"
_WRITE_TMP = ".ckptfix-tmp"  # `atomic_write`'s temporary file beside its target


class InPlace:
    """Collects what an in-place repair of `folder` adds and backs up; `commit()` writes the restore list."""

    def __init__(self, folder: str, switch: str):
        if os.path.exists(os.path.join(folder, RESTORE_FILE)):
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
        if not os.path.exists(self.path(name)):
            self.added.append(name)
            return None
        backup = name + BACKUP_SUFFIX
        (os.rename if move else shutil.copy2)(self.path(name), self.path(backup))
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
            if os.path.exists(self.path(backup)):
                os.replace(self.path(backup), self.path(name))
        for name in self.added:
            if os.path.exists(self.path(name)):
                os.remove(self.path(name))
        for name in (RESTORE_FILE, RESTORE_FILE + _WRITE_TMP):
            if os.path.exists(self.path(name)):
                os.remove(self.path(name))


def atomic_write(path: str, data: bytes) -> None:
    tmp = path + _WRITE_TMP
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def restore(folder: str) -> list[str]:
    """Undo an in-place repair of `folder`. Returns what was done, one line each."""
    record = os.path.join(folder, RESTORE_FILE)
    try:
        with open(record, "rb") as f:
            state = json.loads(f.read())
        backups, added = dict(state.get("backups") or {}), list(state.get("added") or [])
    except (OSError, ValueError, TypeError, AttributeError):
        raise RepairError(f"{folder}: no in-place repair to undo ({RESTORE_FILE} missing or unreadable)") from None
    done = []
    switch = state.get("switch")
    for name in sorted(backups, key=lambda n: n != switch):  # the checkpoint's switch first
        name = os.path.basename(str(name))
        os.replace(os.path.join(folder, os.path.basename(str(backups[name]))), os.path.join(folder, name))
        done.append(f"restored {name}")
    for name in added:
        path = os.path.join(folder, os.path.basename(str(name)))
        if os.path.exists(path):
            os.remove(path)
            done.append(f"removed {name}")
    os.remove(record)
    fsync_dir(folder)
    return done
