"""Repair into object storage: the writers fill a private local staging folder, then `publish` uploads it.

repair's writers work on local paths. For an OUT URL (`s3://bucket/run/step-100-fixed/`) they write into a
staging folder (`mkdtemp`: 0700, removed when repair ends), while every copy whose source is a file of the
input's mirror (`ckptfix.remote`) is *recorded* (`Provenance`: staged file, offset, source object, offset,
size) instead of fetched: the staged file keeps a hole there. `publish` then uploads the staged tree:

- a file that is one whole source object: a server-side copy (`fs.copy`: S3 CopyObject, GCS rewrite);
- a file mixing copied ranges and new bytes: on S3 a multipart upload whose parts are `UploadPartCopy`
  (ranges of at least 5 MiB, copied inside the store) or uploaded bytes (the staged bytes, plus as much
  of a neighbouring copied range as a part needs to reach S3's 5 MiB minimum); on a store without part
  copies, one bounded-memory stream (staged bytes, copied ranges fetched in pieces);
- anything else: an ordinary upload of the staged file.

The *switch objects* go last: what a loader opens first to take a prefix for a checkpoint (DCP and
Megatron `.metadata`, a safetensors index, `config.json`/`trainer_state.json`, Megatron's and DeepSpeed's
trackers); a single-file OUT appears only when its upload completes (S3 writes an object atomically). A
failure while publishing deletes what this publish uploaded (best effort) and a killed process leaves
data objects without their switch object: never something a loader takes for a checkpoint. The source is
only ever read.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import socket
import tempfile
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable

from ckptfix.errors import CkptfixError, RepairError

if TYPE_CHECKING:
    from ckptfix.surgery.options import RepairOptions

MIN_PART = 5 << 20  # S3: every part of a multipart upload but the last has at least 5 MiB
MAX_COPY_PART = 5 << 30  # S3: one UploadPartCopy copies at most 5 GiB
PART = 16 << 20  # an uploaded part of staged bytes: bounds memory and keeps parts far below S3's 10,000
MAX_PARTS = 10_000

# Objects a loader opens first to take a prefix for a checkpoint; published after everything else.
SWITCH_NAMES = (".metadata", "latest_checkpointed_iteration.txt", "latest", "config.json", "trainer_state.json")


@dataclass(frozen=True)
class Copy:
    """Bytes [dst_pos, dst_pos + size) of a staged file are bytes [src_pos, ...) of source object `src`."""

    dst_pos: int
    src: str  # the source object's path in its filesystem (bucket/key)
    src_pos: int
    size: int
    whole: bool = False  # the range is the whole source object


class Provenance:
    """The recorder `remote.recording_copies` calls for each copy out of a mirror file: copies into the
    staging folder that can stay inside the store are recorded (True: no bytes fetched), the rest are left
    to the ordinary copy (False: fetched, then copied locally)."""

    def __init__(self, staging: str):
        self.staging = os.path.realpath(staging)
        # by the staged file's (device, inode): the writers fill temporary names they rename into place
        self.copies: dict[tuple[int, int], list[Copy]] = {}

    def copies_of(self, local: str) -> list[Copy]:
        st = os.stat(local)
        return sorted(self.copies.get((st.st_dev, st.st_ino), []), key=lambda c: c.dst_pos)

    def __call__(self, src_local: str, src_pos: int, dst_fd: int, dst_pos: int, size: int) -> bool:
        import ckptfix.remote as remote

        try:
            dst = os.readlink(f"/proc/self/fd/{dst_fd}")
        except OSError:
            return False
        mirror = remote.mirror_of(src_local)
        obj = mirror.objects.get(os.path.abspath(src_local)) if mirror is not None else None
        if obj is None or not dst.startswith(self.staging + os.sep) or size <= 0:
            return False
        whole = src_pos == 0 and size == obj.size
        # Small copies (configs, indexes, headers) are fetched and written: ckptfix itself may read them back
        # from the staging folder (the verify stage), and a part needs 5 MiB anyway.
        if size < MIN_PART:
            return False
        if whole and src_local.endswith(".safetensors"):
            _fill_safetensors_header(remote, src_local, dst_fd, dst_pos, size)  # the verify stage reads it
        st = os.fstat(dst_fd)
        if st.st_size < dst_pos + size:  # the range stays a hole, but the staged file has its length: the
            os.ftruncate(dst_fd, dst_pos + size)  # verify stage reads its header against its size
        self.copies.setdefault((st.st_dev, st.st_ino), []).append(Copy(dst_pos, obj.key, src_pos, size, whole))
        return True


def _fill_safetensors_header(remote: Any, src_local: str, dst_fd: int, dst_pos: int, size: int) -> None:
    """Write a copied safetensors file's 8-byte length and JSON header into the staged file (the rest stays a
    hole, copied inside the store), so that ckptfix's readers see the header the published object will have."""
    remote.ensure(src_local, 0, 8)
    with open(src_local, "rb") as f:
        head = os.pread(f.fileno(), 8, 0)
        length = int.from_bytes(head, "little") if len(head) == 8 else size
        n = 8 + min(length, size - 8)
        remote.ensure(src_local, 0, n)
        data = os.pread(f.fileno(), n, 0)
    os.pwrite(dst_fd, data, dst_pos)


@dataclass
class Published:
    """What `publish` did: objects written, bytes sent from here, bytes copied inside the store."""

    objects: list[str] = field(default_factory=list)
    uploaded: int = 0
    copied: int = 0

    def note(self, url: str) -> str:
        return (f"published {len(self.objects)} object(s) to {url}: {self.uploaded:,} bytes uploaded, "
                f"{self.copied:,} bytes copied inside the store")


def is_switch(rel: str) -> bool:
    base = posixpath.basename(rel)
    return base in SWITCH_NAMES or base.endswith(".index.json")


def switch_last(names: list[str]) -> list[str]:
    """Upload order: data first, then the switch objects, the deepest first (Megatron's `iter_N/.metadata`
    before its tracker), a folder's own index/config last of all."""
    data = sorted(n for n in names if not is_switch(n))
    switches = sorted((n for n in names if is_switch(n)), key=lambda n: (-n.count("/"), n))
    return data + switches


def out_exists(fs: Any, path: str) -> bool:
    fs.invalidate_cache()
    return bool(fs.exists(path))


def publish(staged: str, out_url: str, provenance: Provenance | None = None) -> Published:
    """Upload the staged file or folder `staged` to `out_url`, switch objects last (module doc), under a
    claim (`Claim`): one writer at a time, never over objects already there."""
    import ckptfix.remote as remote

    fs, root = remote.filesystem(out_url)
    root = root.rstrip("/")
    try:
        with Claim(fs, root, os.path.isdir(staged), remote._shown_url(out_url)):
            return _publish(fs, root, staged, out_url, provenance)
    except CkptfixError:  # already one line (a refusal, or the store's error told by `_publish`)
        raise
    except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
        raise remote.storage_error(out_url, exc) from None


def _publish(fs: Any, root: str, staged: str, out_url: str, provenance: Provenance | None) -> Published:
    import ckptfix.remote as remote

    if os.path.isdir(staged):
        rels = []
        for folder, _dirs, files in os.walk(staged):
            rels += [os.path.relpath(os.path.join(folder, f), staged).replace(os.sep, "/") for f in files]
        plan = [(os.path.join(staged, *rel.split("/")), f"{root}/{rel}") for rel in switch_last(rels)]
    else:
        plan = [(staged, root)]
    done = Published()
    first_switch = next((i for i, (_, key) in enumerate(plan) if is_switch(key)), None)  # data first, then these
    try:
        for i, (local, key) in enumerate(plan):
            if i == first_switch and i > 0:
                _confirm_sizes(fs, root, plan[:i])  # before the first switch object: what a loader will read
            _upload(fs, local, key, provenance.copies_of(local) if provenance is not None else [], done)
            done.objects.append(key)
    except BaseException as exc:
        _take_back(fs, done.objects)
        if isinstance(exc, Exception) and not isinstance(exc, RepairError):
            raise remote.storage_error(out_url, exc) from None
        raise
    finally:
        fs.invalidate_cache()
    return done


CLAIM_SUFFIX = ".ckptfix-publishing"


class Claim:
    """The right to publish OUT, taken by creating one small object (`OUT/.ckptfix-publishing` for a folder,
    `OUT.ckptfix-publishing` beside a file) that the store writes only if it does not exist (S3 `If-None-Match:
    *`), then a listing that OUT holds nothing else; removed when the publish ends. So two writers never mix
    their objects: the second stops at the claim, and a writer that started before the first finished stops
    at the listing. A claim left by a killed ckptfix of this machine (its process gone) is taken over: its
    partial objects (no switch object: no checkpoint) are deleted and its multipart uploads aborted first."""

    def __init__(self, fs: Any, root: str, folder: bool, shown: str, *, in_place: bool = False):
        self.fs, self.root, self.folder, self.shown, self.in_place = fs, root, folder, shown, in_place
        self.key = f"{root}/{CLAIM_SUFFIX}" if folder else root + CLAIM_SUFFIX
        self.body = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}).encode()

    def __enter__(self) -> Claim:
        if not self._create():
            self._take_over_or_refuse()
        if not self.in_place and self._out_objects():
            self._release()
            raise RepairError(f"{self.shown}: already exists in the object store (written while this repair ran); "
                              "name a new OUT prefix")
        return self

    def __exit__(self, *exc: Any) -> None:
        self._release()

    def _create(self) -> bool:
        try:
            if hasattr(self.fs, "call_s3"):
                self.fs.pipe_file(self.key, self.body, mode="create")  # If-None-Match: *
            elif self.fs.exists(self.key):  # no conditional write known for this store: check, then write
                return False
            else:
                self.fs.pipe_file(self.key, self.body)
        except Exception as exc:  # noqa: BLE001 - PreconditionFailed means taken; the rest is reported
            if _precondition_failed(exc):
                return False
            raise
        return True

    def _take_over_or_refuse(self) -> None:
        holder = _holder(self.fs, self.key)
        if self.in_place:  # what a killed in-place publish left is undone by restore, not here
            raise RepairError(f"{self.shown}: an in-place repair is publishing here or was killed doing so "
                              f"({escape_claim(holder)}); if none is running: ckptfix restore {self.shown}, then "
                              f"delete {self.key.rpartition('/')[2]}")
        if not _dead_here(holder):
            raise _busy(self.shown, self.key, holder)
        if any(is_switch(k) for k in self._out_objects()) or (not self.folder and self._out_objects()):
            self.fs.rm_file(self.key)  # the killed publish had finished: OUT is whole, only its claim was left
            raise RepairError(f"{self.shown}: already exists in the object store; name a new OUT prefix")
        _abort_uploads(self.fs, self.root)
        _take_back(self.fs, self._out_objects())
        self.fs.rm_file(self.key)
        if not self._create():
            raise RepairError(f"{self.shown}: another ckptfix took the claim first; nothing was published")

    def _out_objects(self) -> list[str]:
        """What OUT holds besides the claim."""
        self.fs.invalidate_cache()
        if not self.folder:
            return [self.root] if self.fs.exists(self.root) else []
        return [str(k) for k in self.fs.find(self.root) if str(k).rstrip("/") != self.key]

    def _release(self) -> None:
        try:
            self.fs.rm_file(self.key)
        except Exception:  # noqa: BLE001 - a claim left behind is taken over by the next run on this machine
            pass


def _holder(fs: Any, key: str) -> dict:
    """What a claim object says of its writer (host, pid); {} when unreadable (someone else's: never taken over)."""
    try:
        holder = json.loads(fs.cat_file(key)[:4096])
    except Exception:  # noqa: BLE001 - any failure reading it leaves the claim standing
        return {}
    return holder if isinstance(holder, dict) else {}


def _busy(shown: str, key: str, holder: dict) -> RepairError:
    return RepairError(f"{shown}: another ckptfix is publishing here ({escape_claim(holder)}); if none is running, "
                       f"delete {key.rpartition('/')[2]} and the objects beside it (a killed publish's: no switch "
                       "object, no checkpoint)")


def _check_out_free(fs: Any, root: str, shown: str) -> None:
    """Before the repair's work: OUT must not exist, and no live writer may hold its claim (a claim a killed
    ckptfix of this machine left, with its partial objects, is taken over when this repair publishes)."""
    fs.invalidate_cache()
    for key in (f"{root}/{CLAIM_SUFFIX}", root + CLAIM_SUFFIX):
        if fs.exists(key):
            holder = _holder(fs, key)
            if not _dead_here(holder):
                raise _busy(shown, key, holder)
            return
    if out_exists(fs, root):
        raise RepairError(f"{shown}: already exists in the object store; name a new OUT prefix")


def _precondition_failed(exc: BaseException) -> bool:
    import ckptfix.remote as remote

    return remote._error_code(exc) in ("PreconditionFailed", "412", "ConditionalRequestConflict") or \
        isinstance(exc, FileExistsError)


def _dead_here(holder: dict) -> bool:
    """The claim's writer ran on this machine and its process is gone."""
    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def escape_claim(holder: dict) -> str:
    from ckptfix.untrusted import escape

    return escape(f"host {holder.get('host')!s:.80}, pid {holder.get('pid')!s:.20}" if holder else "unreadable claim")


def _abort_uploads(fs: Any, root: str) -> None:
    """Multipart uploads a killed publish left open under OUT (S3 keeps their parts until aborted)."""
    if not hasattr(fs, "call_s3"):
        return
    bucket, prefix, _ = fs.split_path(root)
    listed = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix)
    for upload in listed.get("Uploads", []) or []:
        fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def _confirm_sizes(fs: Any, root: str, uploaded: list[tuple[str, str]]) -> None:
    """One listing of OUT before any switch object is written: every data object there, at the size staged
    (a store that dropped or cut an upload without an error must not get a checkpoint that names it)."""
    fs.invalidate_cache()
    listed = {str(k).rstrip("/"): int(v.get("size") or 0) for k, v in fs.find(root, detail=True).items()}
    for local, key in uploaded:
        want, got = os.path.getsize(local), listed.get(key.rstrip("/"))
        if got != want:
            raise RepairError(f"{key}: the store lists {'no object' if got is None else f'{got:,} bytes'} after "
                              f"the upload of {want:,}; the switch objects were not written, nothing is published")


def _take_back(fs: Any, keys: list[str]) -> None:
    """Delete what this publish uploaded (best effort: a failure here leaves data objects without a switch)."""
    for key in reversed(keys):
        try:
            fs.rm_file(key)
        except Exception:  # noqa: BLE001 - the first error is the one reported
            pass


def _upload(fs: Any, local: str, key: str, copies: list[Copy], done: Published) -> None:
    size = os.path.getsize(local)
    if not copies:
        fs.put_file(local, key)
        done.uploaded += size
        return
    if len(copies) == 1 and copies[0].whole and copies[0].dst_pos == 0 and copies[0].size == size:
        fs.copy(copies[0].src, key)  # one whole object: copied inside the store
        done.copied += size
        return
    segments = _segments(size, copies)
    if hasattr(fs, "call_s3"):
        _multipart(fs, local, key, _parts(segments), done)
    else:
        _stream(fs, local, key, segments, done)


# A segment of a staged file: ("staged", pos, size) bytes of the staged file itself, or ("copy", pos, size, Copy)
Segment = tuple


def _segments(size: int, copies: list[Copy]) -> list[Segment]:
    """The staged file as an ordered cover of copied ranges and staged bytes."""
    out: list[Segment] = []
    pos = 0
    for c in copies:
        if c.dst_pos < pos or c.dst_pos + c.size > size:
            raise RepairError(f"internal: overlapping copies recorded for a staged file at {c.dst_pos}")
        if c.dst_pos > pos:
            out.append(("staged", pos, c.dst_pos - pos))
        out.append(("copy", c.dst_pos, c.size, c))
        pos = c.dst_pos + c.size
    if pos < size:
        out.append(("staged", pos, size - pos))
    return out


def _parts(segments: list[Segment]) -> list[list[Segment]]:
    """Multipart parts: a copied range of >= 5 MiB alone (UploadPartCopy, split at 5 GiB), or a run of byte
    pieces (staged bytes, and fetched slices of copied ranges) of >= 5 MiB, except the last part."""
    parts: list[list[Segment]] = []
    pending: list[Segment] = []
    filled = 0

    def flush() -> None:
        nonlocal pending, filled
        if pending:
            parts.append(pending)
        pending, filled = [], 0

    for seg in segments:
        if seg[0] == "staged":
            pos, size = seg[1], seg[2]
            while size > 0:
                take = min(size, PART - filled)
                pending.append(("staged", pos, take))
                filled += take
                pos, size = pos + take, size - take
                if filled >= PART:
                    flush()
            continue
        pos, size, copy = seg[1], seg[2], seg[3]
        if 0 < filled < MIN_PART:  # the pending bytes need part of this range to make a part
            take = min(size, MIN_PART - filled)
            pending.append(("fetch", pos, take, copy))
            filled += take
            pos, size = pos + take, size - take
        if size >= MIN_PART:
            flush()
            while size > 0:
                take = size if size <= MAX_COPY_PART else min(MAX_COPY_PART, size - MIN_PART)
                parts.append([("copy", pos, take, copy)])
                pos, size = pos + take, size - take
        elif size > 0:
            pending.append(("fetch", pos, size, copy))
            filled += size
            if filled >= MIN_PART:
                flush()
    flush()
    if len(parts) > MAX_PARTS:
        raise RepairError(f"internal: {len(parts)} parts for one object (S3 allows {MAX_PARTS})")
    return parts


def _piece_bytes(fs: Any, local: str, piece: Segment) -> bytes:
    """The bytes of a staged or fetched piece (a fetched piece: a slice of its source object)."""
    kind, pos, size = piece[0], piece[1], piece[2]
    if kind == "staged":
        with open(local, "rb") as f:
            f.seek(pos)
            data = f.read(size)
    else:
        copy: Copy = piece[3]
        start = copy.src_pos + (pos - copy.dst_pos)
        data = fs.cat_file(copy.src, start=start, end=start + size)
    if len(data) != size:
        raise RepairError(f"internal: {len(data)} bytes read for a piece of {size}")
    return data


def _multipart(fs: Any, local: str, key: str, parts: list[list[Segment]], done: Published) -> None:
    bucket, obj_key, _ = fs.split_path(key)
    upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=obj_key)["UploadId"]
    etags = []
    try:
        for number, part in enumerate(parts, 1):
            if part[0][0] == "copy":
                _kind, pos, size, copy = part[0]
                start = copy.src_pos + (pos - copy.dst_pos)
                src_bucket, src_key, _ = fs.split_path(copy.src)
                reply = fs.call_s3("upload_part_copy", Bucket=bucket, Key=obj_key, UploadId=upload,
                                   PartNumber=number, CopySource={"Bucket": src_bucket, "Key": src_key},
                                   CopySourceRange=f"bytes={start}-{start + size - 1}")
                etags.append(reply["CopyPartResult"]["ETag"])
                done.copied += size
            else:
                body = b"".join(_piece_bytes(fs, local, piece) for piece in part)
                reply = fs.call_s3("upload_part", Bucket=bucket, Key=obj_key, UploadId=upload, PartNumber=number,
                                   Body=body)
                etags.append(reply["ETag"])
                done.uploaded += len(body)
        fs.call_s3("complete_multipart_upload", Bucket=bucket, Key=obj_key, UploadId=upload,
                   MultipartUpload={"Parts": [{"PartNumber": i, "ETag": e} for i, e in enumerate(etags, 1)]})
    except BaseException:
        try:  # no half object appears; the parts already sent are dropped by the store
            fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=obj_key, UploadId=upload)
        except Exception:  # noqa: BLE001 - the first error is the one reported
            pass
        raise


def _stream(fs: Any, local: str, key: str, segments: list[Segment], done: Published) -> None:
    """A store without part copies: one streamed upload, read in pieces of at most PART bytes."""
    with fs.open(key, "wb") as out:
        for seg in segments:
            pos, size = seg[1], seg[2]
            for at in range(pos, pos + size, PART):
                piece = ("staged" if seg[0] == "staged" else "fetch", at, min(PART, pos + size - at), *seg[3:])
                data = _piece_bytes(fs, local, piece)
                out.write(data)
                done.uploaded += len(data)


def repair_to_object_store(repair: Callable[..., Any], source: str, tokenizer: Any, out_url: str,
                           options: RepairOptions) -> Any:
    """`repair(source, tokenizer, OUT, options)` with OUT in object storage: the ordinary repair (read, plan,
    audit, write, verify) into a private staging folder, then `publish` (module doc)."""
    import ckptfix.remote as remote

    dry_run = options.dry_run
    fs, root = remote.filesystem(out_url)
    root = root.rstrip("/")
    shown = remote._shown_url(out_url)
    if not dry_run:
        if options.force:
            raise RepairError(f"{shown}: --force does not replace objects in object storage; name a new OUT "
                              "prefix (or delete the old one first)")
        try:
            _check_out_free(fs, root, shown)
        except RepairError:
            raise
        except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
            raise remote.storage_error(out_url, exc) from None
    staging = tempfile.mkdtemp(prefix="ckptfix-out-")  # 0700: only this user reads what is staged
    try:
        local_out = os.path.join(staging, posixpath.basename(root) or "out")
        provenance = Provenance(staging)
        with remote.recording_copies(provenance):
            result = repair(source, tokenizer, local_out, replace(options, force=False))
        if dry_run or result.output is None:
            result.output = out_url if dry_run else None
            return result
        remote.check_unchanged(source)  # what was read is one version of the input, not a mix of two saves
        sidecar = f"{local_out}.ckptfix.json"
        if os.path.exists(sidecar):  # a single file's record first: alone it is no checkpoint
            publish(sidecar, f"{out_url}.ckptfix.json", provenance)
        try:
            published = publish(local_out, out_url, provenance)
        except BaseException:
            if os.path.exists(sidecar):
                _take_back(fs, [f"{root}.ckptfix.json"])
            raise
        result.output = out_url
        result.notes.append(published.note(shown))
        return result
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# --- --in-place on a prefix in object storage, and its restore ------------------------------------------

def _inodes(folder: str) -> dict[str, int]:
    """relative name -> inode of every file under `folder`. The writers never change a file of the input:
    they add files and replace or move old ones (a new inode, or an old one under a new name), while a
    mirror file being fetched keeps its inode (its size and times say nothing)."""
    out = {}
    for root, _dirs, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, folder).replace(os.sep, "/")] = os.lstat(path).st_ino
    return out


def repair_in_place_in_object_store(repair_in_place: Callable[..., Any], url: str, tokenizer: Any, out: Any,
                                    options: RepairOptions) -> Any:
    """`repair --in-place` of a DCP/Megatron/sharded-safetensors prefix: the in-place writer works on the
    prefix's sparse mirror (fetching what it reads), then only what it added or replaced is published: new
    data files (their unchanged ranges copied inside the store), the backups (`NAME.ckptfix-bak`: a
    server-side copy of the old object when the writer moved it aside), the restore list, the replaced files,
    and the switch object (`.metadata`, the index) last. `ckptfix restore URL` undoes it."""
    import ckptfix.remote as remote
    from ckptfix.surgery.undo import RESTORE_FILE

    if out is not None and os.fspath(out).rstrip("/") != url.rstrip("/"):
        raise RepairError("--in-place writes into the checkpoint itself; drop -o/--out")
    folder = remote.local_path(url)
    mirror = remote.mirror_of(folder)
    if mirror is None or not os.path.isdir(folder):
        # one object: the local repair's own refusal of its format (read, nothing written), so an s3:// file
        # is refused with the line its local copy gets; the line below only if that ever let one through
        repair_in_place(folder, tokenizer, None, replace(options, dry_run=True))
        raise RepairError(f"{remote._shown_url(url)}: --in-place needs a prefix (a DCP, Megatron or sharded "
                          "safetensors folder), not one object")
    before = _inodes(folder)
    provenance = Provenance(folder)
    with remote.recording_copies(provenance):
        result = repair_in_place(folder, tokenizer, None, options)
    if result.dry_run or result.output is None:
        result.output = mirror.url if result.dry_run else None
        return result
    after = _inodes(folder)
    lists = [n for n in after if posixpath.basename(n) == RESTORE_FILE and n not in before]
    if len(lists) != 1:
        raise RepairError(f"internal: the in-place repair left {len(lists)} restore lists under {mirror.url}")
    restore_list = lists[0]
    with open(os.path.join(folder, *restore_list.split("/")), "rb") as f:  # ckptfix's own, just written
        switch = posixpath.join(posixpath.dirname(restore_list), json.loads(f.read())["switch"])
    old_by_inode = {inode: name for name, inode in before.items()}
    changed = sorted(n for n, v in after.items() if before.get(n) != v)
    fs = mirror.fs
    root = mirror.key
    done = Published()
    order = [n for n in changed if n not in before and n != restore_list] + [restore_list] + \
        [n for n in changed if n in before and n != switch] + [switch]
    try:  # interrupted: the old switch object still stands; `ckptfix restore URL` removes what was added
        with Claim(fs, root, True, mirror.url, in_place=True):
            remote.check_unchanged(mirror.url)  # another writer (an in-place repair) got there first
            _publish_in_place(fs, root, folder, order, switch, old_by_inode, after, provenance, done)
    except CkptfixError:
        raise
    except Exception as exc:  # noqa: BLE001 - every backend error becomes one line
        raise remote.storage_error(mirror.url, exc) from None
    finally:
        fs.invalidate_cache()
    result.output = mirror.url
    if result.backup:
        result.backup = remote.shown(result.backup)
    result.notes.append(done.note(mirror.url) + "; undo: ckptfix restore " + mirror.url)
    return result


def _publish_in_place(fs: Any, root: str, folder: str, order: list[str], switch: str, old_by_inode: dict[int, str],
                      after: dict[str, int], provenance: Provenance, done: Published) -> None:
    """The in-place repair's objects in `order`, the switch object last, after a check of every size."""
    for name in order:
        local, key = os.path.join(folder, *name.split("/")), f"{root}/{name}"
        if name == switch:  # every object the new switch object names is there, at its size
            _confirm_sizes(fs, root, [(os.path.join(folder, *n.split("/")), f"{root}/{n}") for n in order[:-1]])
        moved_from = old_by_inode.get(after[name])
        if moved_from is not None and moved_from != name:
            fs.copy(f"{root}/{moved_from}", key)  # a backup moved aside: the old object, copied in the store
            done.copied += os.path.getsize(local)
        else:
            _upload(fs, local, key, provenance.copies_of(local), done)
        done.objects.append(key)
