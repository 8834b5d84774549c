"""Checkpoints in object storage (`s3://`, `gs://`, `az://`, `hf://`, `file://`): a sparse local mirror.

Every reader in ckptfix works on local paths (listing, stat, `open_regular`, maps, pread). For a URL, a
`Mirror` lists the object prefix once (bounded: object count, key length, no key climbing out of it),
creates a private temporary folder (`mkdtemp`: 0700, removed when the command ends) holding one *sparse*
file per object at its real size, and fetches byte ranges only when a reader asks for them: every place
that reads bytes calls `ensure(path, start, length)` first (the chokepoints: `untrusted.open_regular`'s
file object, `checkpoint.file_map`'s map, `_mapped_storage`, `read_scalar`/`read_last_row`, the legacy
stream, zip archives opened through `reader`). A local path never reaches this module's fetching code: it
stays on the code path it always took, byte for byte.

What is read is counted (`stats()`: requests and bytes, listing included), so tests and `bench/` can
show that inspect costs what the metadata holds, not what the tensors weigh. `strict_reads` (tests; env
CKPTFIX_STRICT_READS=1 for a CLI child) fills every unfetched byte of a mirror file with 0xFF instead of
leaving a hole: a read that bypassed `ensure` then sees NaNs and invalid headers instead of plausible
zeros, so an inspect or repair compared with the local one fails.

Credentials come only from the storage library's usual sources (environment, config files, instance
metadata); ckptfix never reads or prints them: its error lines name the URL and a reason chosen here,
never the library's message (which may quote a signed URL).
"""

from __future__ import annotations

import atexit
import bisect
import contextlib
import io
import os
import posixpath
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from ckptfix.errors import CkptfixError, UnreadableCheckpoint
from ckptfix.untrusted import escape

SCHEMES = ("s3", "gs", "gcs", "az", "abfs", "abfss", "hf", "file")
# The extra that brings each scheme's fsspec backend (pyproject `[project.optional-dependencies]`).
EXTRAS = {"s3": ("s3", "s3fs"), "gs": ("gcs", "gcsfs"), "gcs": ("gcs", "gcsfs"), "az": ("azure", "adlfs"),
          "abfs": ("azure", "adlfs"), "abfss": ("azure", "adlfs"), "hf": ("hf", "huggingface_hub")}

MAX_OBJECTS = 100_000  # objects under one prefix: a Megatron run with 10k ranks x 2 files stays far below
MAX_KEY = 1024  # S3's own limit on a key, in bytes
PAGE = 4096  # fetched ranges are aligned to pages; a small read costs one page or two
READ_AHEAD = 64 << 10  # a sequential reader (a file object) gets this much past what it asked for
READ_AHEAD_MAX = 1 << 20  # a reader going front to back through a map: read-ahead doubles up to this
MAX_REQUEST = 16 << 20  # one ranged GET at most: memory stays bounded whatever the file's size
POISON = b"\xff"

# The retry policy for s3://, explicit and bounded (issue 44). botocore's "standard" mode retries throttling
# (503 SlowDown), 500/502/503/504 and connection errors, S3_ATTEMPTS attempts per request with exponential
# backoff and jitter; s3fs's own wrapper goes around that S3FS_RETRIES times and is what retries a body cut
# short after its headers (IncompleteRead, a dropped connection). A request the store keeps refusing ends after
# MAX_TRIES tries (measured: 12, about 15 s), where the libraries' defaults (legacy mode, 5 x 5 rounds) took 40 s.
S3_ATTEMPTS = 3  # botocore's own default in its standard mode
S3FS_RETRIES = 3  # a body cut twice in a row is still read
MAX_TRIES = (S3FS_RETRIES + 1) * S3_ATTEMPTS  # s3fs's read path makes one round more than its `retries`
S3_OPTIONS = {"config_kwargs": {"retries": {"max_attempts": S3_ATTEMPTS, "mode": "standard"},
                                "connect_timeout": 10, "read_timeout": 60}}
RETRIED_CODES = ("SlowDown", "503", "InternalError", "500", "ServiceUnavailable", "RequestTimeout",
                 "ThrottlingException", "RequestLimitExceeded")

strict_reads = os.environ.get("CKPTFIX_STRICT_READS") == "1"


def is_url(path: Any) -> bool:
    """True for `scheme://...` with a scheme ckptfix reads through fsspec; a local path (even one holding
    '://' further on, or a Windows drive letter) is not a URL."""
    if not isinstance(path, str):
        path = os.fspath(path) if isinstance(path, os.PathLike) else path
        if not isinstance(path, str):
            return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def filesystem(url: str) -> tuple[Any, str]:
    """(fsspec filesystem, the path inside it) for `url`. A missing backend is one line naming its
    `pip install` line."""
    scheme = url.partition("://")[0].lower()
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise CkptfixError(f"{_shown_url(url)}: reading {scheme}:// paths needs fsspec: "
                           f"pip install 'ckptfix[{EXTRAS.get(scheme, ('s3',))[0]}]'") from None
    try:
        fs, path = url_to_fs(url, **(S3_OPTIONS if scheme == "s3" else {}))
    except ImportError:
        extra, package = EXTRAS.get(scheme, (scheme, scheme + "fs"))
        raise CkptfixError(f"{_shown_url(url)}: reading {scheme}:// paths needs {package}: "
                           f"pip install 'ckptfix[{extra}]' (or pip install {package})") from None
    except (ValueError, TypeError) as exc:
        raise CkptfixError(f"{_shown_url(url)}: not a usable {scheme}:// URL ({escape(type(exc).__name__)})") from None
    if scheme == "s3":
        fs.retries = S3FS_RETRIES  # s3fs reads it per call; the instance is cached with the options above
    return fs, path


def _without_trailing_slash(url: str) -> str:
    """`s3://bucket/run/` as `s3://bucket/run`: the slashes off the key, never the scheme's own."""
    scheme, sep, rest = url.partition("://")
    return scheme + sep + rest.rstrip("/")


def _shown_url(url: str) -> str:
    """A URL fit for an error line: no query string (a signed URL's signature lives there), no user info."""
    scheme, _, rest = url.partition("://")
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    host, slash, tail = rest.partition("/")
    host = host.rpartition("@")[2]
    return escape(f"{scheme}://{host}{slash}{tail}", 300)


def storage_error(url: str, exc: BaseException) -> CkptfixError:
    """One line for a failed listing or fetch: the URL and a reason told from the exception's type or
    error code, never its text (botocore quotes request details; a presigned URL carries a signature)."""
    shown = _shown_url(url)
    code = _error_code(exc)
    name = type(exc).__name__
    if isinstance(exc, FileNotFoundError) or code in ("NoSuchKey", "NoSuchBucket", "404", "NotFound"):
        return UnreadableCheckpoint(f"{shown}: no such object or prefix")
    if name in ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError") or \
            code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return CkptfixError(f"{shown}: no usable credentials for the object store ({code or name}); ckptfix takes "
                            "them from the storage library's usual places (environment, config files, instance "
                            "metadata)")
    if isinstance(exc, PermissionError) or code in ("AccessDenied", "403", "AllAccessDisabled"):
        return CkptfixError(f"{shown}: access denied by the object store (the credentials lack read permission)")
    if code in RETRIED_CODES:  # before errno: s3fs turns SlowDown into EBUSY, which says nothing of retries
        return UnreadableCheckpoint(f"{shown}: the object store kept refusing the request ({escape(code, 60)}; "
                                    f"retried, at most {MAX_TRIES} tries)")
    if isinstance(exc, OSError) and exc.errno is not None:
        return UnreadableCheckpoint(f"{shown}: cannot read ({escape(os.strerror(exc.errno))})")
    return UnreadableCheckpoint(f"{shown}: the object store refused the request ({escape(code or name, 60)})")


def _etag(info: dict) -> str:
    """An object's version as a listing states it (S3 `ETag`, GCS `etag`/`generation`; '' when not given)."""
    for name in ("ETag", "etag", "generation", "version_id"):
        value = info.get(name)
        if value:
            return str(value)[:200]
    return ""


def _error_code(exc: BaseException) -> str:
    """The S3 error code a botocore ClientError carries (s3fs wraps it as an OSError's cause)."""
    for err in (exc, exc.__cause__, exc.__context__):
        response = getattr(err, "response", None)
        if isinstance(response, dict):
            return str(response.get("Error", {}).get("Code", ""))[:60]
    return ""


# --- counting -------------------------------------------------------------------------------------

@dataclass
class Stats:
    """What the object store was asked: requests (listing, whole-object and ranged GETs) and bytes fetched."""

    requests: int = 0
    bytes: int = 0
    listings: int = 0

    def to_json(self) -> dict[str, int]:
        return {"requests": self.requests, "bytes": self.bytes, "listings": self.listings}


_STATS = Stats()
_LOCK = threading.Lock()


def stats() -> Stats:
    """The counts since the last `reset_stats()` (process-wide)."""
    return Stats(_STATS.requests, _STATS.bytes, _STATS.listings)


def reset_stats() -> None:
    with _LOCK:
        _STATS.requests = _STATS.bytes = _STATS.listings = 0


def _count(requests: int = 0, nbytes: int = 0, listings: int = 0) -> None:
    with _LOCK:
        _STATS.requests += requests
        _STATS.bytes += nbytes
        _STATS.listings += listings


# --- the mirror -----------------------------------------------------------------------------------

@dataclass
class _Object:
    """One object mirrored as a sparse local file; `filled` holds the fetched [start, end) ranges, merged."""

    key: str  # the fsspec path of the object
    local: str
    size: int
    etag: str = ""  # as listed: the object read is this version (`Mirror.changed`)
    filled: list[tuple[int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_end: int = -1  # where the last fetch ended, and its length: a sequential reader gets read-ahead
    run: int = 0

    def differs(self, now: tuple[int, str] | None) -> bool:
        """Against a listing's (size, ETag): gone, resized, or another ETag (where both listings give one)."""
        if now is None:
            return True
        size, etag = now
        return size != self.size or (bool(self.etag) and bool(etag) and etag != self.etag)

    def missing(self, start: int, end: int) -> list[tuple[int, int]]:
        gaps, pos = [], start
        i = bisect.bisect_right(self.filled, (start, float("inf"))) - 1
        for lo, hi in self.filled[max(i, 0):]:
            if lo >= end:
                break
            if hi <= pos:
                continue
            if lo > pos:
                gaps.append((pos, lo))
            pos = max(pos, hi)
        if pos < end:
            gaps.append((pos, end))
        return gaps

    def mark(self, start: int, end: int) -> None:
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted([*self.filled, (start, end)]):
            if merged and lo <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        self.filled = merged


class Mirror:
    """The objects under one URL (an object or a prefix) as sparse files under a private temporary folder.

    `path` is what the readers get: `<tmp>/<the URL's last name>` (a file, or a folder holding the
    prefix's objects at their relative keys), so names a format recognises (`checkpoint-500`,
    `iter_0000010`, `model.safetensors`) are the same as in a local copy."""

    def __init__(self, url: str):
        self.url = _without_trailing_slash(url)
        self.fs, self.key = filesystem(url)
        self.key = self.key.rstrip("/")
        self.tmp = tempfile.mkdtemp(prefix="ckptfix-remote-")  # 0700: other users cannot read what is fetched
        name = posixpath.basename(self.key) or "root"
        if name in (".", "..") or "\x00" in name:
            name = "root"
        self.path = os.path.join(self.tmp, name)
        self.objects: dict[str, _Object] = {}
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self) -> None:
        entries = self._list()
        if isinstance(entries, tuple):  # one object: (size, etag)
            self._add(self.path, self.key, *entries)
            return
        os.mkdir(self.path, 0o700)
        for key, size, etag in entries:
            rel = key[len(self.key) + 1:]
            parts = rel.split("/")
            if not rel or len(key.encode()) > MAX_KEY or any(p in ("", ".", "..") or "\x00" in p for p in parts):
                raise UnreadableCheckpoint(f"{_shown_url(self.url)}: object key {escape(key, 200)!r} cannot be "
                                           "mirrored (empty, '.' or '..' parts, or longer than 1024 bytes); "
                                           "refusing a prefix whose keys would climb out of it")
            local = os.path.join(self.path, *parts)
            try:
                os.makedirs(os.path.dirname(local), mode=0o700, exist_ok=True)
                self._add(local, key, size, etag)
            except (FileExistsError, NotADirectoryError, IsADirectoryError):
                raise UnreadableCheckpoint(f"{_shown_url(self.url)}: object key {escape(key, 200)!r} and another key make one "
                                           "name both an object and a prefix; no checkpoint is laid out so: "
                                           "refusing the prefix") from None

    def _list(self) -> list[tuple[str, int, str]] | tuple[int, str]:
        """The prefix's objects (key, size, ETag), or (size, ETag) when the URL names one object. Bounded:
        MAX_OBJECTS."""
        found: list[tuple[str, int, str]] = []
        try:
            for root, _dirs, files in self.fs.walk(self.key, detail=True):
                _count(requests=1, listings=1)
                for name, info in files.items():
                    key = info.get("name") or posixpath.join(root, name)
                    found.append((key.rstrip("/"), int(info.get("size") or 0), _etag(info)))
                if len(found) > MAX_OBJECTS:
                    raise UnreadableCheckpoint(f"{_shown_url(self.url)}: more than {MAX_OBJECTS:,} objects under the "
                                               "prefix; name the checkpoint's own folder")
        except CkptfixError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
            raise storage_error(self.url, exc) from None
        found = [(k, s, e) for k, s, e in found if k != self.key and k.startswith(self.key + "/")]
        if found:
            return sorted(found)
        info = self._call(self.fs.info, self.key)  # not `isfile`: it answers False for "access denied" too
        if info.get("type") != "file":
            raise UnreadableCheckpoint(f"{_shown_url(self.url)}: no such object or prefix")
        return int(info.get("size") or 0), _etag(info)

    def changed(self) -> list[str]:
        """The mirrored objects the store now holds in another version (ETag or size) or no longer holds:
        asked once before a repair publishes what it read (an input replaced mid-read, e.g. by the next
        save, must not give a mix of two versions)."""
        self.fs.invalidate_cache()
        now = self._list()
        listed = {self.key: now} if isinstance(now, tuple) else {k: (size, etag) for k, size, etag in now}
        return sorted(obj.key for obj in self.objects.values() if obj.differs(listed.get(obj.key)))

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
            raise storage_error(self.url, exc) from None
        _count(requests=1)
        return result

    def _add(self, local: str, key: str, size: int, etag: str = "") -> None:
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
        try:
            if strict_reads:
                for pos in range(0, size, 1 << 20):
                    os.pwrite(fd, POISON * min(1 << 20, size - pos), pos)
            os.ftruncate(fd, size)
        finally:
            os.close(fd)
        self.objects[local] = _Object(key, local, size, etag)

    def ensure(self, local: str, start: int, length: int, ahead: int = 0) -> None:
        """Fetch what is missing of [start, start + length) (+ `ahead` bytes of read-ahead) of `local`."""
        obj = self.objects.get(local)
        if obj is None or length <= 0 or start >= obj.size:
            return
        lo = max(0, start) // PAGE * PAGE
        with obj.lock:
            if lo == obj.last_end:  # read front to back (a zip member through a map): fetch ahead, as the kernel does
                ahead = max(ahead, min(2 * obj.run, READ_AHEAD_MAX))
            hi = min(obj.size, -(-(start + length + ahead) // PAGE) * PAGE)
            gaps = obj.missing(lo, hi)
            for gap_lo, gap_hi in gaps:
                self._fetch(obj, gap_lo, gap_hi)
            if gaps:
                obj.run = hi - lo
                obj.last_end = hi

    def _fetch(self, obj: _Object, lo: int, hi: int) -> None:
        fd = os.open(obj.local, os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            for pos in range(lo, hi, MAX_REQUEST):
                end = min(hi, pos + MAX_REQUEST)
                data = self._call(self.fs.cat_file, obj.key, start=pos, end=end)
                if len(data) != end - pos:
                    raise UnreadableCheckpoint(f"{_shown_url(self.url)}: object {escape(obj.key, 200)} changed while "
                                               f"it was read ({len(data)} bytes at {pos:,}, expected {end - pos})")
                _count(nbytes=len(data))
                os.pwrite(fd, data, pos)
                obj.mark(pos, end)
        finally:
            os.close(fd)

    def fetch_all(self) -> None:
        """Every byte of every object (repair to a local OUT reads and copies them all anyway)."""
        for local, obj in self.objects.items():
            self.ensure(local, 0, obj.size)

    def url_for(self, local: str) -> str:
        rel = os.path.relpath(local, self.path)
        return self.url if rel == "." else f"{self.url}/{rel.replace(os.sep, '/')}"

    def close(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# --- the registry: which local paths are mirrors --------------------------------------------------

_MIRRORS: dict[str, Mirror] = {}  # mirror.path -> mirror
_BY_URL: dict[str, Mirror] = {}


def local_path(path: Any) -> Any:
    """`path` itself when local; for a URL, the local path of its mirror (made once per URL and command).
    Callers import this module only when a path holds "://", so a local path never loads it."""
    if not is_url(path):
        return path
    url = _without_trailing_slash(os.fspath(path))
    mirror = _BY_URL.get(url)
    if mirror is None:
        mirror = Mirror(url)
        _MIRRORS[mirror.path] = mirror
        _BY_URL[url] = mirror
    return mirror.path


def check_unchanged(url: Any) -> None:
    """Before a repair publishes what it read from `url`: every object read is still the version listed when
    the mirror was made; else one line, and nothing is published."""
    if not is_url(url):
        return
    mirror = _BY_URL.get(_without_trailing_slash(os.fspath(url)))
    line = _changed_line(mirror) if mirror is not None else None
    if line is not None:
        raise UnreadableCheckpoint(line + "; nothing was published")


def changed_inputs_line() -> str | None:
    """The first open mirror whose objects changed since they were listed, as one line (None: none did)."""
    for mirror in list(_BY_URL.values()):
        line = _changed_line(mirror)
        if line is not None:
            return line
    return None


def _changed_line(mirror: Mirror) -> str | None:
    changed = mirror.changed()
    if not changed:
        return None
    more = f" (and {len(changed) - 1} more)" if len(changed) > 1 else ""
    return (f"{_shown_url(mirror.url)}: {escape(changed[0], 200)}{more} changed in the object store while ckptfix "
            "read it (a new save over it?): run again once the checkpoint is stable")


def mirror_of(path: Any) -> Mirror | None:
    """The mirror holding local `path`, if any (a string prefix test: no system call for local paths)."""
    if not _MIRRORS or not isinstance(path, (str, os.PathLike)):
        return None
    text = os.fspath(path)
    if isinstance(text, bytes):
        return None
    for root, mirror in _MIRRORS.items():
        if text == root or text.startswith(root + os.sep):
            return mirror
    if not os.path.isabs(text):
        return mirror_of(os.path.abspath(text)) if _MIRRORS else None
    return None


def ensure(path: Any, start: int, length: int, ahead: int = 0) -> None:
    """The read-side chokepoint: before reading bytes [start, start + length) of `path`, fetch them when
    `path` is a mirror file. Free for a local path."""
    if not _MIRRORS:
        return
    mirror = mirror_of(path)
    if mirror is not None:
        mirror.ensure(os.path.abspath(os.fspath(path)), start, length, ahead)


def ensure_file(path: Any) -> None:
    """All of `path` when it is a mirror file (a legacy torch stream, whose pickles are scanned in place)."""
    mirror = mirror_of(path) if _MIRRORS else None
    if mirror is not None:
        local = os.path.abspath(os.fspath(path))
        obj = mirror.objects.get(local)
        if obj is not None:
            mirror.ensure(local, 0, obj.size)


PREFETCH_GAP = 64 << 10  # ranges this close are fetched as one request: the gap costs less than a round trip
# What inspect may spend on records scattered among the tensors (a step, a norm weight, a zip local
# header per parameter: hundreds of requests for a 7B model); past it, readers leave them for when they
# are read and say so.
PREFETCH_BUDGET = 8
PREFETCH_BYTES = 1 << 20  # and what those requests may download, the gaps merged between ranges included


def _clusters(ranges: list[tuple[str, int, int]]) -> list[tuple[Mirror, str, int, int]]:
    """(mirror, local file, start, end) of the requests that fetch `ranges` of mirror files: neighbours
    within PREFETCH_GAP merged, bytes already fetched left out."""
    spans: dict[tuple[Mirror, str], list[tuple[int, int]]] = {}
    for file, start, length in ranges:
        mirror = mirror_of(file)
        if mirror is None or length <= 0:
            continue
        local = os.path.abspath(os.fspath(file))
        obj = mirror.objects.get(local)
        if obj is not None and obj.missing(start, start + length):
            spans.setdefault((mirror, local), []).append((start, start + length))
    out = []
    for (mirror, local), wanted in spans.items():
        merged: list[tuple[int, int]] = []
        for lo, hi in sorted(wanted):
            if merged and lo - merged[-1][1] <= PREFETCH_GAP:
                merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
            else:
                merged.append((lo, hi))
        out += [(mirror, local, lo, hi) for lo, hi in merged]
    return out


def prefetch(ranges: list[tuple[str, int, int]], budget: int | None = None) -> bool:
    """Fetch these (file, start, length) ranges of mirror files now, neighbours within PREFETCH_GAP merged
    into one request: what a reader will read next, known from metadata (a zip's local headers and small
    records, a DCP item's zip ends), costs a request per cluster instead of one per read. With a `budget`,
    nothing is fetched when that needs more requests than it, or more than PREFETCH_BYTES: False, and the
    caller reads less. Free (True) when local."""
    if not _MIRRORS:
        return True
    clusters = _clusters(ranges)
    if budget is not None and (len(clusters) > budget or sum(hi - lo for *_, lo, hi in clusters) > PREFETCH_BYTES):
        return False
    for mirror, local, lo, hi in clusters:
        mirror.ensure(local, lo, hi - lo)
    return True


def active() -> bool:
    """Whether a checkpoint is being read from object storage in this process."""
    return bool(_MIRRORS)


def fetch_all(path: Any) -> None:
    """Every object of the mirror holding `path` (none when local)."""
    mirror = mirror_of(path) if _MIRRORS else None
    if mirror is not None:
        mirror.fetch_all()


def is_mirrored(path: Any) -> bool:
    return bool(_MIRRORS) and mirror_of(path) is not None


def shown(text: str) -> str:
    """`text` with every mirror's local path spelled as its URL (reports, JSON, error lines); a name beside
    it (the `-o` a fix suggests) as a name beside the URL."""
    for root, mirror in _MIRRORS.items():
        if mirror.tmp in text:
            parent, _, last = mirror.url.rpartition("/")
            if last == os.path.basename(root) and "://" in parent:
                text = text.replace(mirror.tmp, parent)
            else:
                text = text.replace(root, mirror.url)
    return text


def shown_tree(value: Any) -> Any:
    """`shown` applied to every string of a JSON-like tree (a report's `to_json()`)."""
    if not _MIRRORS:
        return value
    if isinstance(value, str):
        return shown(value)
    if isinstance(value, dict):
        return {shown_tree(k): shown_tree(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(shown_tree(v) for v in value)
    return value


def source_name(path: str) -> str:
    """What a record names as the source: the URL for a mirror, else the absolute path."""
    mirror = mirror_of(path)
    return mirror.url_for(os.path.abspath(path)) if mirror is not None else os.path.abspath(path)


def close_all() -> None:
    """Remove every mirror's temporary folder (the end of a command; also at exit)."""
    for mirror in list(_MIRRORS.values()):
        mirror.close()
    _MIRRORS.clear()
    _BY_URL.clear()


atexit.register(close_all)


@contextlib.contextmanager
def session() -> Iterator[None]:
    """A command's span: mirrors made inside are removed at its end, and an error's message names URLs,
    not the temporary folder."""
    try:
        yield
    except CkptfixError as exc:
        if _MIRRORS and exc.args and isinstance(exc.args[0], str):
            exc.args = (shown(exc.args[0]), *exc.args[1:])
        raise
    finally:
        close_all()


# --- reading through the chokepoints ----------------------------------------------------------------

class MirrorFile(io.RawIOBase):
    """A read-only file object over a mirror file: every read fetches its range first (with read-ahead:
    zipfile and the JSON readers read front to back). `fileno()` is the real descriptor, for `fstat`."""

    def __init__(self, raw: Any, local: str, mirror: Mirror):
        self._raw, self._local, self._mirror = raw, local, mirror

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._raw.fileno()

    def tell(self) -> int:
        return self._raw.tell()

    def seek(self, pos: int, whence: int = 0) -> int:
        return self._raw.seek(pos, whence)

    def readinto(self, buffer: Any) -> int:
        pos = self._raw.tell()
        n = len(memoryview(buffer))
        self._mirror.ensure(self._local, pos, n, READ_AHEAD)
        return self._raw.readinto(buffer)

    def read(self, size: int = -1) -> bytes:
        pos = self._raw.tell()
        if size is None or size < 0:
            size = max(0, os.fstat(self._raw.fileno()).st_size - pos)
        self._mirror.ensure(self._local, pos, size, READ_AHEAD)
        return self._raw.read(size)

    def readall(self) -> bytes:
        return self.read(-1)

    def close(self) -> None:
        self._raw.close()
        super().close()


def wrap(f: Any, path: Any) -> Any:
    """`f` (opened on `path`) as itself for a local file, or as a `MirrorFile` for a mirror file."""
    if not _MIRRORS:
        return f
    mirror = mirror_of(path)
    if mirror is None:
        return f
    return MirrorFile(f, os.path.abspath(os.fspath(path)), mirror)


def reader(path: str) -> Any:
    """What to hand a library that opens a file by name (zipfile): the path itself when local, an opened
    `MirrorFile` when mirrored (the library's own open would read holes)."""
    if not is_mirrored(path):
        return path
    return wrap(open(path, "rb"), path)


# --- provenance: copies whose source is a mirror file (the write side fills this in) ----------------

CopyRecorder = Callable[[str, int, int, int, int], bool]
_recorder: CopyRecorder | None = None


@contextlib.contextmanager
def recording_copies(recorder: CopyRecorder) -> Iterator[None]:
    """While active, `record_copy` hands each copy out of a mirror file to `recorder(src_local, src_pos,
    dst_fd, dst_pos, size)`; when it returns True the copy is taken as done (a remote OUT uploads it by
    server-side copy later) and no bytes are fetched."""
    global _recorder
    previous, _recorder = _recorder, recorder
    try:
        yield
    finally:
        _recorder = previous


def recording() -> bool:
    """Whether copies out of mirror files are being recorded (a repair staged for an object-store OUT)."""
    return _recorder is not None


def record_copy(src_fd: int, src_pos: int, dst_fd: int, dst_pos: int, size: int) -> bool:
    """Called by `io.copy_range`/`clone_file`/`clone_records` before copying: True when the copy was
    recorded instead (see `recording_copies`); otherwise the source range is fetched and False returned
    (the caller copies). Free for local files."""
    if not _MIRRORS:
        return False
    try:
        src = os.readlink(f"/proc/self/fd/{src_fd}")
    except OSError:
        return False
    if mirror_of(src) is None:
        return False
    if _recorder is not None and _recorder(src, src_pos, dst_fd, dst_pos, size):
        return True
    ensure(src, src_pos, size)
    return False
