"""Safe writes: temp file in the target folder, fsync, `os.replace`, fsync the folder.

A reader of the target path sees the old file or the complete new one, never a partial write,
whatever happens to the process. Temp names are recognisable (`.NAME.ckptfix-tmp-*`) and removed
on any error. The source of a repair is never written; writing over it (in-place) keeps a backup.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
import tempfile
import threading
from typing import BinaryIO, Iterator

from ckptfix.errors import RepairError

TMP_MARK = ".ckptfix-tmp-"


def _default_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def fsync_dir(path: str) -> None:
    fd = os.open(path or ".", os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _describe(exc: OSError, path: str) -> str:
    if exc.errno == errno.ENOSPC:
        return f"{path}: no space left on device; nothing was written"
    if exc.errno == errno.EDQUOT:
        return f"{path}: disk quota exceeded; nothing was written"
    return f"{path}: write failed ({exc.strerror or exc}); nothing was written"


def backup_path(path: str) -> str:
    """`path.bak`, or `path.bak1`, ... : the first name not taken."""
    backup, n = f"{path}.bak", 1
    while os.path.lexists(backup):
        backup, n = f"{path}.bak{n}", n + 1
    return backup


@contextlib.contextmanager
def atomic_file(path: str, *, mode_like: str | None = None, backup: bool = False) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it atomically becomes `path`.

    `backup=True` first hard-links the current `path` to `path.bak` (the old bytes stay intact even
    while mmap'd: `os.replace` swaps the name, never the old file's contents).
    """
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{TMP_MARK}", dir=folder)
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        mode = os.stat(mode_like).st_mode & 0o777 if mode_like and os.path.exists(mode_like) else _default_mode()
        os.chmod(tmp, mode)  # mkstemp creates 0600; a checkpoint should be as readable as its source
        if backup and os.path.exists(path):
            os.link(path, backup_path(path))
        os.replace(tmp, path)
        fsync_dir(folder)
    except OSError as exc:
        _remove(tmp)
        raise RepairError(_describe(exc, path)) from None
    except BaseException:
        _remove(tmp)
        raise


@contextlib.contextmanager
def atomic_folder(path: str, *, backup: bool = False) -> Iterator[str]:
    """Yield a temp folder to fill; on success it replaces `path` (an existing one is moved aside first:
    kept as `path.bak` when `backup`, else deleted once the new folder is in place)."""
    parent = os.path.dirname(os.path.abspath(path))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}{TMP_MARK}", dir=parent)
    try:
        yield tmp
        for name in os.listdir(tmp):
            file = os.path.join(tmp, name)
            if os.path.isfile(file):
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        os.chmod(tmp, 0o777 & ~(0o666 & ~_default_mode()))
        fsync_dir(tmp)
        old = None
        if os.path.lexists(path):
            old = backup_path(path) if backup else f"{tmp}-old"
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
        if old and not backup:
            shutil.rmtree(old, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise RepairError(_describe(exc, path)) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f, chunk)


def _sha256_of(f: BinaryIO, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def folder_files(folder: str) -> list[str]:
    """Every regular file under `folder`, as sorted relative paths."""
    out = []
    for root, _, names in os.walk(folder):
        out.extend(os.path.relpath(os.path.join(root, n), folder) for n in names)
    return sorted(f for f in out if os.path.isfile(os.path.join(folder, f)))


class BackgroundHash:
    """sha256 of the repair source computed on another thread while the main thread writes
    (hashlib drops the GIL). A folder's hash is the sha256 of its manifest: one line
    "<sha256>  <relative path>" per file, sorted, as `sha256sum` prints it.

    Files are opened here, before any write starts: an in-place repair replaces the name while the
    thread may still be starting, and the open descriptors keep hashing the original bytes."""

    def __init__(self, path: str):
        self.path, self.value, self.error = path, None, None
        self.files: list[tuple[str, BinaryIO]] = []
        try:
            names = folder_files(path) if os.path.isdir(path) else [""] if os.path.isfile(path) else []
            self.files = [(n, open(os.path.join(path, n) if n else path, "rb")) for n in names]
        except OSError as exc:
            self.error = exc
        self.is_folder = os.path.isdir(path)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            digests = []
            for name, f in self.files:
                with f:
                    digests.append(f"{_sha256_of(f)}  {name}\n")
            if not self.files:
                return
            manifest = "".join(digests).encode()
            self.value = hashlib.sha256(manifest).hexdigest() if self.is_folder else digests[0].split()[0]
        except OSError as exc:
            self.error = exc

    def result(self) -> str | None:
        self.thread.join()
        return self.value


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
