"""Safe writes: temp file in the target folder, fsync, `os.replace`, fsync the folder.

A reader of the target path sees the old file or the complete new one, never a partial write,
whatever happens to the process. Temp names are recognisable (`.NAME.ckptfix-tmp-*`) and removed
on any error. The source of a repair is never written; writing over it (in-place) keeps a backup.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from typing import BinaryIO, Callable, Iterator

from ckptfix.errors import RepairError

TMP_MARK = ".ckptfix-tmp-"


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _default_mode() -> int:
    return 0o666 & ~_umask()


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


# Every file ckptfix creates: never through a link, never onto an entry someone else put there.
_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def create_file(path: str, *, replace: bool = False) -> BinaryIO:
    """A new file at `path`, opened O_CREAT|O_EXCL|O_NOFOLLOW (a planted link or file makes it fail, it is
    never written through). `replace=True` is for ckptfix's own temporary folders only: the entry already at
    `path` (a copy of the input's, about to be rewritten; a link stays a link there) is unlinked first."""
    if replace and (os.path.islink(path) or os.path.isfile(path)):
        os.unlink(path)  # the entry itself: a link is removed, its target never touched
    try:
        fd = os.open(path, _NEW_FILE, 0o666)
    except FileExistsError:
        raise RepairError(f"{path}: already exists (ckptfix creates its files new and never writes through a "
                          "link or onto another file); move it away and run again") from None
    return os.fdopen(fd, "wb")


def move_new(src: str, dst: str) -> None:
    """Move `src` to the new name `dst` in the same file system; an entry already at `dst` (a planted link)
    makes it fail instead of being replaced (link then unlink: `os.link` never overwrites)."""
    try:
        os.link(src, dst, follow_symlinks=False)
    except FileExistsError:
        raise RepairError(f"{dst}: already exists; move it away and run again") from None
    os.unlink(src)


def write_new(path: str, data: bytes, *, replace: bool = False) -> None:
    with create_file(path, replace=replace) as f:
        f.write(data)


def atomic_write(path: str, data: bytes) -> None:
    """`path` replaced by `data` atomically: a temp of a unique name (mkstemp: O_EXCL|O_NOFOLLOW), fsync,
    `os.replace` (which replaces a link at `path`, never writes through it), fsync of the folder."""
    with atomic_file(path) as f:
        f.write(data)


def atomic_new(path: str, data: bytes) -> None:
    """`path` created with `data`, whole or not at all: as `atomic_write`, but linked to `path` (`move_new`: an
    entry already there, a planted link included, makes it fail and is never replaced or written through)."""
    with atomic_file(path, new=True) as f:
        f.write(data)


def backup_path(path: str) -> str:
    """`path.bak`, or `path.bak1`, ... : the first name not taken."""
    backup, n = f"{path}.bak", 1
    while os.path.lexists(backup):
        backup, n = f"{path}.bak{n}", n + 1
    return backup


@contextlib.contextmanager
def atomic_file(path: str, *, mode_like: str | None = None, backup: bool = False,
                new: bool = False) -> Iterator[BinaryIO]:
    """Yield a file to write; on success it atomically becomes `path`.

    `backup=True` first hard-links the current `path` to `path.bak` (the old bytes stay intact even
    while mmap'd: `os.replace` swaps the name, never the old file's contents). `new=True`: `path` must not
    exist (`move_new` links the temp there instead of replacing).
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}{TMP_MARK}", dir=folder)
    except OSError as exc:  # a missing or read-only folder, /proc, a name too long
        raise RepairError(_describe(exc, path)) from None
    try:
        with os.fdopen(fd, "w+b") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        mode = os.stat(mode_like).st_mode & 0o777 if mode_like and os.path.exists(mode_like) else _default_mode()
        os.chmod(tmp, mode)  # mkstemp creates 0600; a checkpoint should be as readable as its source
        if backup and os.path.exists(path):
            os.link(path, backup_path(path))
        if new:
            move_new(tmp, path)
        else:
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
    kept as `path.bak` when `backup`, else deleted once the new folder is in place).

    Where the file system can (Linux `renameat2(RENAME_EXCHANGE)`), an existing `path` is swapped with
    the new folder in one step, so `path` always names a complete folder, the old or the new one."""
    parent = os.path.dirname(os.path.abspath(path))
    try:
        tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(os.path.abspath(path))}{TMP_MARK}", dir=parent)
    except OSError as exc:
        raise RepairError(_describe(exc, path)) from None
    swapped = False  # after the swap `tmp` names the old folder: never delete it on an error
    try:
        yield tmp
        _fsync_tree(tmp)
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; a folder gets what mkdir would give
        fsync_dir(tmp)
        if os.path.lexists(path) and _exchange(tmp, path):
            swapped = True
            fsync_dir(parent)
            if backup:
                os.rename(tmp, backup_path(path))
                fsync_dir(parent)
            else:
                _discard(tmp)
            return
        old = None
        if os.path.lexists(path):
            old = backup_path(path) if backup else f"{tmp}-old"
            os.rename(path, old)
        os.rename(tmp, path)
        fsync_dir(parent)
        if old and not backup:
            _discard(old)
    except OSError as exc:
        if swapped:
            raise RepairError(f"{path}: written, but the previous folder was left at {tmp} "
                              f"({exc.strerror or exc})") from None
        shutil.rmtree(tmp, ignore_errors=True)
        raise RepairError(_describe(exc, path)) from None
    except BaseException:
        if not swapped:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def prefetch(ranges: list[tuple[str, int, int]]) -> None:
    """Ask the kernel to start reading these (file, start, length) ranges now (POSIX_FADV_WILLNEED):
    on a cold cache all of them are queued at once, instead of one page fault's read-ahead at a time
    when the bytes are copied. Only a hint: errors are ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    for file, start, length in ranges:
        with contextlib.suppress(OSError):
            fd = os.open(file, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, start, length, os.POSIX_FADV_WILLNEED)
            finally:
                os.close(fd)


def _fsync_tree(folder: str) -> None:
    """fsync every regular file under `folder` and every folder in it (not symlinks' targets)."""
    for root, _, names in os.walk(folder, topdown=False):
        for name in names:
            file = os.path.join(root, name)
            if os.path.isfile(file) and not os.path.islink(file):
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        if root != folder:
            fsync_dir(root)


def _exchange(a: str, b: str) -> bool:
    """Swap two paths atomically (Linux `renameat2(RENAME_EXCHANGE)`). False where that is not available."""
    try:
        import ctypes

        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except Exception:  # not Linux/glibc: no renameat2
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):  # kernel or file system lacks it
        return False
    raise OSError(err, os.strerror(err), b)


def _discard(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        _remove(path)


def _remove(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


_COPY_CHUNK = 1 << 26


def copy_range(src_fd: int, dst_fd: int, src_pos: int, dst_pos: int, size: int) -> str:
    """Copy `size` bytes between open files at the given offsets, kernel side (`copy_file_range`;
    plain reads and writes where it is unsupported); returns the method, "copy_file_range" or "read/write".

    Each copied chunk's writeback is started at once (POSIX_FADV_DONTNEED on a dirty range begins
    writing it back): the disk writes while the copy goes on, instead of all of it waiting for the
    final fsync as after `cp` + `sync`; pages still dirty or under writeback stay cached."""
    if _from_object_store(src_fd, dst_fd, src_pos, dst_pos, size):
        return "recorded"
    done, method = 0, "copy_file_range"
    while done < size:
        n, method = _copy_chunk(src_fd, dst_fd, src_pos + done, dst_pos + done, min(_COPY_CHUNK, size - done))
        if n <= 0:
            raise OSError(errno.EIO, f"short copy from the source at byte {src_pos + done}")
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # only a hint
                os.posix_fadvise(dst_fd, dst_pos + done, n, os.POSIX_FADV_DONTNEED)
        done += n
        _report_copied(src_fd, src_pos + done)
    return method


def _from_object_store(src_fd: int, dst_fd: int, src_pos: int, dst_pos: int, size: int) -> bool:
    """For a source mirrored from object storage (`ckptfix.remote`): True when the copy was recorded for a
    server-side copy (a remote OUT), else its bytes are fetched first and the caller copies them. Nothing
    (no import) when no URL was named."""
    remote = sys.modules.get("ckptfix.remote")
    return remote is not None and remote.record_copy(src_fd, src_pos, dst_fd, dst_pos, size)


def _copy_chunk(src_fd: int, dst_fd: int, src_pos: int, dst_pos: int, n: int) -> tuple[int, str]:
    if hasattr(os, "copy_file_range"):
        try:
            return os.copy_file_range(src_fd, dst_fd, n, src_pos, dst_pos), "copy_file_range"
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
    data = os.pread(src_fd, n, src_pos)
    return os.pwrite(dst_fd, data, dst_pos), "read/write"


def sha256_file(path: str, chunk: int = 1 << 24) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f, chunk)


def _sha256_of(f: BinaryIO, chunk: int = 1 << 24, before: Callable[[int], None] | None = None) -> str:
    """Hashed from a read-only map of the file: no copy into a buffer (~15% faster than reads).
    `before(end)` is called before each chunk ending at byte `end` is read (pacing, see BackgroundHash)."""
    h = hashlib.sha256()
    try:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError):  # an empty file, or one that cannot be mapped: plain reads
        while block := f.read(chunk):
            h.update(block)
        return h.hexdigest()
    with mapped:
        if hasattr(mapped, "madvise"):
            mapped.madvise(mmap.MADV_SEQUENTIAL)
        with memoryview(mapped) as view:
            for pos in range(0, len(view), chunk):
                if before is not None:
                    before(min(pos + chunk, len(view)))
                h.update(view[pos:pos + chunk])
    return h.hexdigest()


def folder_files(folder: str) -> list[str]:
    """Every regular file under `folder`, as sorted relative paths."""
    out: list[str] = []
    for root, _, names in os.walk(folder):
        out.extend(os.path.relpath(os.path.join(root, n), folder) for n in names)
    return sorted(f for f in out if os.path.isfile(os.path.join(folder, f)))


# Hashes that pace themselves behind a copy of the same file (normally none, or the one of a running repair).
_pacers: list["BackgroundHash"] = []


def _report_copied(src_fd: int, end: int) -> None:
    """A copy has read its source up to byte `end`: tell the hashes of that file."""
    if not _pacers:
        return
    st = os.fstat(src_fd)
    for pacer in list(_pacers):
        pacer.copied((st.st_dev, st.st_ino), end)


class BackgroundHash:
    """sha256 of the repair source computed on another thread while the main thread writes
    (hashlib drops the GIL). A folder's hash is the sha256 of its manifest: one line
    "<sha256>  <relative path>" per file, sorted, as `sha256sum` prints it.

    Files are opened here, before any write starts: an in-place repair replaces the name while the
    thread may still be starting, and the open descriptors keep hashing the original bytes.

    Paced (`paced=True`, for a single file the writer copies front to back): the hash stays at most
    `lead` bytes ahead of the copy (`copy_range`) of the same file, from byte 0 on. Each source byte is
    then read from disk once, by the copy, and found in the page cache by the hash; unpaced, the hash
    (faster than a disk-bound copy) ran ahead, and for a checkpoint larger than memory its pages were
    evicted before the copy reached them: read twice. Once the copy has started, waiting never outlasts
    `stall` seconds without progress; `result()` (the writer is done) or `release()` ends all waiting.
    Warm, the copy outruns the hash, which then never waits."""

    def __init__(self, path: str, *, paced: bool = False, lead: int = 1 << 26, stall: float = 0.5,
                 chunk: int = 1 << 24):
        self.path = path
        self.value: str | None = None
        self.error: OSError | None = None
        self.lead, self.stall, self.chunk = lead, stall, chunk
        self.position = 0  # in the current file: where the chunk being (or waiting to be) hashed ends
        self._cond = threading.Condition()
        self._paced_file: tuple[int, int] | None = None  # (st_dev, st_ino) of the file a copy will read
        self._copied = 0  # the furthest byte of it the copy has read
        self._last_report: float | None = None  # no copy progress yet: wait for it without a time limit
        self._released = False
        self.files: list[tuple[str, BinaryIO]] = []
        try:
            names = folder_files(path) if os.path.isdir(path) else [""] if os.path.isfile(path) else []
            self.files = [(n, open(os.path.join(path, n) if n else path, "rb")) for n in names]
        except OSError as exc:
            self.error = exc
        self.is_folder = os.path.isdir(path)
        if paced and len(self.files) == 1:
            st = os.fstat(self.files[0][1].fileno())
            self._paced_file = (st.st_dev, st.st_ino)
            _pacers.append(self)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def copied(self, file_id: tuple[int, int], end: int) -> None:
        if file_id != self._paced_file:
            return
        with self._cond:
            self._copied = max(self._copied, end)
            self._last_report = time.monotonic()
            self._cond.notify_all()

    def _pace(self, end: int) -> None:
        """Wait while reading up to `end` would put the hash more than `lead` ahead of the copy."""
        self.position = end
        if self._paced_file is None:
            return
        with self._cond:
            while not self._released and end > self._copied + self.lead:
                if self._last_report is not None and time.monotonic() - self._last_report > self.stall:
                    return
                self._cond.wait(self.stall)

    def _run(self) -> None:
        try:
            digests = []
            for name, f in self.files:
                with f:
                    digests.append(f"{_sha256_of(f, self.chunk, self._pace)}  {name}\n")
            if not self.files:
                return
            manifest = "".join(digests).encode()
            self.value = hashlib.sha256(manifest).hexdigest() if self.is_folder else digests[0].split()[0]
        except OSError as exc:
            self.error = exc
        finally:
            self.release()

    def release(self) -> None:
        """Stop pacing: the copy is over (or was never coming)."""
        with self._cond:
            self._released = True
            self._cond.notify_all()
        with contextlib.suppress(ValueError):
            _pacers.remove(self)

    def result(self) -> str | None:
        self.release()
        self.thread.join()
        return self.value


def same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


# --- whole-file copies for folder repairs ----------------------------------------------------------
# Never hard links: a later `torch.save`/`dcp.save` that truncates the copy in place would write
# through the link into the source.

FICLONE = 0x40049409  # linux/fs.h _IOW(0x94, 9, int): share the source's extents, copy-on-write
_NO_CLONE = (errno.EOPNOTSUPP, errno.EXDEV, errno.EINVAL, errno.ENOTTY, errno.ENOSYS, errno.EBADF, errno.EPERM)


def clone_file(src: str, dst: str) -> str:
    """Copy `src` to a new file `dst` the cheapest way the file system allows; returns the method:
    "reflink" (FICLONE: no data copied, blocks shared copy-on-write), "copy_file_range" (kernel-side
    copy, server-side on NFS) or "read/write"."""
    from ckptfix.untrusted import open_regular

    if os.path.islink(src):  # reproduced as a link, never followed out of the folder (see copy_input_entry)
        _copy_link(src, dst, os.path.dirname(src))
        return "link"
    with open_regular(src, error=RepairError) as fin, create_file(dst) as fout:  # never a FIFO or device
        size = os.fstat(fin.fileno()).st_size
        if _from_object_store(fin.fileno(), fout.fileno(), 0, 0, size):
            os.ftruncate(fout.fileno(), size)
            method = "recorded"
        else:
            method = _clone(fin.fileno(), fout.fileno()) or _kernel_copy(fin.fileno(), fout.fileno())
    shutil.copymode(src, dst)
    return method


def clone_records(src: str, dst: str, keep: list[tuple[int, int]]) -> str:
    """`clone_file` for a file of which only the `keep` byte ranges (offset, length) are still used.
    A reflink shares the whole file (no data copied: leaving parts out would save nothing); otherwise
    only those ranges are copied, each to its own offset, and the rest of `dst` is a hole (it reads as
    zeros and takes no disk). For a DCP rank file whose vocab records were replaced: the records kept
    keep their offsets (the `.metadata` entries stay valid) and the old vocab bytes are neither read nor
    written, so the copy costs what `cp` of the records still used would."""
    from ckptfix.untrusted import open_regular

    with open_regular(src, error=RepairError) as fin, create_file(dst) as fout:
        remote = sys.modules.get("ckptfix.remote")
        # a mirror file's unfetched parts are holes: never shared whole, only its kept ranges copied
        method = None if remote is not None and remote.is_mirrored(src) else _clone(fin.fileno(), fout.fileno())
        if method is None:
            method = "copy_file_range"
            for offset, length in keep:
                if copy_range(fin.fileno(), fout.fileno(), offset, offset, length) != method:
                    method = "read/write"
            os.ftruncate(fout.fileno(), os.fstat(fin.fileno()).st_size)
    shutil.copymode(src, dst)
    return method


def _clone(src_fd: int, dst_fd: int) -> str | None:
    try:
        import fcntl

        fcntl.ioctl(dst_fd, FICLONE, src_fd)
        return "reflink"
    except (ImportError, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno not in _NO_CLONE:
            raise
        return None


def _kernel_copy(src_fd: int, dst_fd: int) -> str:
    size, done, method = os.fstat(src_fd).st_size, 0, "copy_file_range"
    while done < size:
        n = min(_COPY_CHUNK, size - done)
        if method == "copy_file_range" and hasattr(os, "copy_file_range"):
            try:
                n = os.copy_file_range(src_fd, dst_fd, n, done, done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                    raise
                method = "read/write"
                continue
        else:
            method = "read/write"
            n = os.pwrite(dst_fd, os.pread(src_fd, n, done), done)
        if n <= 0:
            raise OSError(errno.EIO, f"short copy at byte {done}")
        done += n
    return method


def clone_files(pairs: list[tuple[str, str]]) -> str:
    """`clone_file` for each (src, dst); the methods used, e.g. "reflink" or "copy_file_range x3"."""
    used: dict[str, int] = {}
    for src, dst in pairs:
        method = clone_file(src, dst)
        used[method] = used.get(method, 0) + 1
    return ", ".join(f"{m} x{n}" for m, n in used.items()) or "nothing copied"


# --- where a repair may write, and what a folder copy takes ------------------------------------------

SIDECAR_SUFFIX = ".ckptfix.json"
# The temporary name adds `.` + TMP_MARK + 8 random characters (and a folder swap `-old`) to OUT's name.
_TMP_EXTRA = 1 + len(TMP_MARK) + 8 + 4


def output_target(source: str, out: str | os.PathLike | None, *, force: bool) -> tuple[str, bool]:
    """(OUT as a string, whether it names the source itself); refuses a missing OUT and an existing one
    without --force. Shared by repair and convert, before their fuller `check_output_path`."""
    if out is None:
        raise RepairError("an output path is required (-o OUT), or --dry-run")
    out = os.fspath(out)
    in_place = same_file(source, out) or os.path.abspath(source) == os.path.abspath(out)
    if os.path.lexists(out) and not force:
        raise RepairError(f"{out}: already exists; pass force=True to replace it"
                          + (" (the original is kept as a .bak)" if in_place else ""))
    return out, in_place


def check_output_path(source: str, out: str, *, force: bool, sidecar: bool = False) -> None:
    """Refuse, before anything is read or written, an OUT the writer cannot or must not create.

    OUT's parent must be an existing folder (ckptfix creates OUT, never its parents); OUT's name must
    leave room for the temporary name beside it; OUT may be the input itself (in place, with --force)
    but never inside the input folder nor an ancestor of the input, whatever --force says (replacing
    an ancestor would delete the input); an existing `OUT.ckptfix.json` sidecar is replaced only with
    --force."""
    from ckptfix.untrusted import escape

    shown = escape(out)
    name = os.path.basename(os.path.normpath(out))
    if not name or name in (".", ".."):
        raise RepairError(f"{shown}: not a file or folder name to write")
    try:
        name_max = os.pathconf(os.path.dirname(os.path.abspath(out)) or "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    extra = _TMP_EXTRA + (len(SIDECAR_SUFFIX) if sidecar else 0)
    if len(os.fsencode(name)) + extra > name_max:
        raise RepairError(f"{shown}: name too long ({len(os.fsencode(name))} bytes; at most {name_max - extra} "
                          "leave room for the temporary file beside it)")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        what = "does not exist" if not os.path.lexists(parent) else "is not a folder"
        raise RepairError(f"{shown}: the output's folder {escape(parent)} {what}; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise RepairError(f"{shown}: cannot write in {escape(parent)} (permission denied)")
    src_real, out_real = os.path.realpath(source), os.path.realpath(out)
    if src_real != out_real:
        if _is_within(out_real, src_real):
            raise RepairError(f"{shown}: inside the input folder {escape(source)}; write the repair elsewhere")
        if _is_within(src_real, out_real):
            raise RepairError(f"{shown}: a folder that contains the input {escape(source)}; replacing it would "
                              "delete the input (force=True does not allow that)")
    if sidecar and os.path.lexists(out + SIDECAR_SUFFIX) and not force:
        raise RepairError(f"{escape(out + SIDECAR_SUFFIX)}: already exists (the record of a previous repair?); "
                          "pass force=True to replace it with OUT")


def _is_within(path: str, folder: str) -> bool:
    return os.path.commonpath([path, folder]) == folder and path != folder


def _copy_link(src: str, dst: str, root: str) -> None:
    """Reproduce the symlink `src` at `dst`: its text when it points inside `root`, else an absolute link
    to the same target. The target is never opened."""
    target = os.readlink(src)
    resolved = os.path.join(os.path.dirname(src), target)
    inside = not os.path.isabs(target) and _is_within(os.path.realpath(resolved), os.path.realpath(root))
    os.symlink(target if inside else os.path.abspath(resolved), dst)


def copy_input_entry(src: str, dst: str, root: str) -> list[str]:
    """Copy one entry of the input folder `root` into the output, taking only what really lives there:
    regular files are copied, folders walked (explicitly, links not followed), symlinks reproduced as
    links and never read (one that points inside `root` keeps its relative text; one that points
    outside becomes an absolute link to the same target, whose bytes are never copied). A FIFO, device
    or socket is refused. Files are copied with `clone_file` (reflink, else copy_file_range; never a hard
    link); returns the method used for each."""
    from ckptfix.untrusted import escape

    methods: list[str] = []
    stack = [(src, dst)]
    folders: list[tuple[str, str]] = []
    while stack:  # explicit: a folder nested thousands deep must not exhaust the Python stack
        src, dst = stack.pop()
        st = os.lstat(src)
        if stat.S_ISLNK(st.st_mode):
            _copy_link(src, dst, root)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(dst)
            folders.append((src, dst))
            stack.extend((os.path.join(src, n), os.path.join(dst, n)) for n in sorted(os.listdir(src)))
        elif stat.S_ISREG(st.st_mode):
            methods.append(clone_file(src, dst))
            shutil.copystat(src, dst)
        else:
            kind = "a named pipe" if stat.S_ISFIFO(st.st_mode) else "a device, socket or special file"
            raise RepairError(f"{escape(src)}: {kind}, not a regular file; a folder copy takes no FIFOs, "
                              "devices or sockets")
    for src, dst in reversed(folders):  # times last: filling a folder changes its mtime
        shutil.copystat(src, dst)
    return methods
