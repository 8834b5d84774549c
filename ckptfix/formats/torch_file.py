"""`torch.save` files: the zip format (`*/data.pkl` + `*/data/N` records) and the legacy stream.

Reading parses the zip central directory and the pickle only: tensor records are located lazily
(one local-header read each) and never read unless a tensor's values are asked for.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import struct
import sys
import zipfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator

from ckptfix.checkpoint import ByteRange, Checkpoint, file_map
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.formats import common
from ckptfix.formats.pickle_records import RebuiltTensor, StorageRef
from ckptfix.formats.pickle_safe import DTYPE_SIZES, MAX_PICKLE_BYTES, load_pickle, pickle_end
from ckptfix.untrusted import escape

try:
    from lzma import LZMAError as _LZMAError
except ImportError:  # pragma: no cover - Python built without lzma
    _LZMAError = OSError  # type: ignore[misc, assignment]

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_SMALL_RECORD = 4096  # a step, a scalar, a LayerNorm: fetched with its header from object storage
MAX_SMALL_RECORD = 64 << 20  # data.pkl and friends are read whole; refuse anything larger
MAX_INFLATE_RATIO = 50  # a compressed member (never written by torch.save) may inflate at most this much


@dataclass
class TorchArchive:
    """An opened `torch.save` zip: its member table, the prefix, and where each record lies."""

    path: str
    prefix: str
    members: dict[str, zipfile.ZipInfo]
    duplicates: list[str]
    size: int
    big_endian: bool = False  # the `byteorder` record says "big" (see `byte_order`)
    # records whose local header `open_archive` left unread (object storage, `_prefetch_headers`), by (name,
    # header offset): the next member's header offset and name, which each must end before when it is read
    # (`_end_before_next`); every other member was checked against its next one when the archive was opened
    unchecked: dict[tuple[str, int], tuple[int, str]] = field(default_factory=dict)
    # members `open_archive` read while its zip was open (`preload`), handed out once by `read_member`
    preloaded: dict[str, bytes | None] = field(default_factory=dict)
    mapped: Any = field(default=None, repr=False)
    starts: dict[int, int] = field(default_factory=dict, repr=False)  # local header offset -> data start

    def record_range(self, key: str, itemsize: int = 1) -> ByteRange:
        """Where record data/`key` lies; in a big-endian archive, a range of `itemsize`-byte elements is
        marked for byte-swapping (torch.load swaps a storage by its dtype, an UntypedStorage not at all)."""
        info = self.members.get(f"{self.prefix}/data/{key}")
        if info is None:
            raise UnreadableCheckpoint(f"{self.path}: tensor record data/{key} is missing from the archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnreadableCheckpoint(
                f"{self.path}: record data/{key} is compressed; torch.save never compresses records "
                "(inflating it could be a zip bomb)")
        start = self._data_start(info)
        if start + info.file_size > self.size:
            raise UnreadableCheckpoint(f"{self.path}: record data/{key} runs past the end of the file (truncated?)")
        if (info.filename, info.header_offset) in self.unchecked:
            self._end_before_next(info, start)
        return ByteRange(self.path, start, info.file_size, self.big_endian and itemsize > 1)

    def _map(self) -> Any:
        """The archive's file, mapped once for it (`file_map` stats the file per call: 300,000 stats for 150,000
        step records, each read through its local header)."""
        if self.mapped is None or self.mapped.closed:
            self.mapped = file_map(self.path)
        return self.mapped

    def _data_start(self, info: zipfile.ZipInfo) -> int:
        start = self.starts.get(info.header_offset)
        if start is None:  # each local header read once: `_refuse_overlaps` reads them all, a step's read again
            start = self.starts[info.header_offset] = self._read_data_start(info)
        return start

    def _read_data_start(self, info: zipfile.ZipInfo) -> int:
        mapped = self._map()
        if not 0 <= info.header_offset < self.size:  # a lying central directory (negative would wrap around)
            raise UnreadableCheckpoint(f"{self.path}: zip entry {info.filename!r} points outside the file")
        header = mapped[info.header_offset:info.header_offset + _LOCAL_HEADER.size]
        if len(header) < _LOCAL_HEADER.size or header[:4] != b"PK\x03\x04":
            raise UnreadableCheckpoint(f"{self.path}: bad zip local header for {info.filename}")
        fields = _LOCAL_HEADER.unpack(header)
        name_len, extra_len = fields[-2], fields[-1]
        return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len

    def _end_before_next(self, info: zipfile.ZipInfo, start: int) -> None:
        """`_refuse_overlaps` for one record, when it is read: the local header it points at is its own (not
        another member's), and its bytes end before the next member's header."""
        name_at = info.header_offset + _LOCAL_HEADER.size
        name = bytes(self._map()[name_at:name_at + len(info.orig_filename.encode())])
        if name != info.orig_filename.encode():
            _overlap(self.path, info.filename, name.decode("utf-8", "replace"))
        next_header, next_name = self.unchecked[(info.filename, info.header_offset)]
        if start + info.compress_size > next_header:
            _overlap(self.path, info.filename, next_name)

    def verify_crcs(self, progress=None) -> list[str]:
        """Members whose stored bytes do not match the CRC-32 in the central directory."""
        mapped = file_map(self.path)
        infos = [i for i in self.members.values() if i.compress_type == zipfile.ZIP_STORED]
        items = progress(infos, sum(i.file_size for i in infos), "verify") if progress else infos
        bad = []
        for info in items:
            start = self._data_start(info)
            if start + info.file_size > len(mapped):  # a zip64 size of 4 EiB: no CRC over bytes that are not there
                bad.append(info.filename.split("/", 1)[-1])
                continue
            crc = 0
            for pos in range(start, start + info.file_size, 1 << 24):
                crc = zlib.crc32(mapped[pos:min(pos + (1 << 24), start + info.file_size)], crc)
            if crc != info.CRC:
                bad.append(info.filename.split("/", 1)[-1])
        return bad

    def read_member(self, suffix: str, zf: zipfile.ZipFile | None = None) -> bytes | None:
        """A small member's bytes (data.pkl, byteorder, version), bounded; `zf`: the archive already open
        (parsing a central directory of 150,000 records costs ~0.5 s: `open_archive` parses it once)."""
        if suffix in self.preloaded:
            return self.preloaded.pop(suffix)
        info = self.members.get(f"{self.prefix}/{suffix}")
        if info is None:
            return None
        if info.file_size > MAX_SMALL_RECORD:
            raise UnreadableCheckpoint(f"{self.path}: {suffix} declares {info.file_size} bytes; refusing to read it")
        if info.compress_size > self.size or (info.compress_type == zipfile.ZIP_STORED
                                              and info.compress_size != info.file_size):
            # zipfile reads a stored member with one read(compress_size): a lying size allocates it first
            raise UnreadableCheckpoint(f"{self.path}: {suffix} declares {info.compress_size:,} stored bytes for "
                                       f"{info.file_size:,} (a file of {self.size:,}); corrupt zip directory")
        if info.compress_type != zipfile.ZIP_STORED and info.file_size > MAX_INFLATE_RATIO * info.compress_size + (1 << 20):
            # torch.save never compresses; a repacked archive compresses a pickle ~5-10x, a bomb 1000x
            raise UnreadableCheckpoint(f"{self.path}: {suffix} inflates {info.compress_size:,} bytes to "
                                       f"{info.file_size:,}; refusing to inflate it (a zip bomb?)")
        try:
            if zf is not None:
                with zf.open(info) as member:
                    return _read_at_most(member, info.file_size, f"{self.path}: {suffix}")
            with _zip_file(self.path) as opened, opened.open(info) as member:
                return _read_at_most(member, info.file_size, f"{self.path}: {suffix}")
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, NotImplementedError, RuntimeError,
                zlib.error, _LZMAError) as exc:  # zlib/lzma: a corrupt compressed member
            raise UnreadableCheckpoint(f"{self.path}: cannot read {suffix}: {exc}") from None


def _read_at_most(member: Any, size: int, origin: str) -> bytes:
    """A member's bytes, never more than it declares: zipfile's read() of a deflated member inflates the whole
    stream in one call whatever the directory says (a 2 MB stream claiming 1 KB took 2 GB); read(n) inflates n."""
    chunks: list[bytes] = []
    got = 0
    while True:
        chunk = member.read(min(1 << 20, size - got + 1))
        if not chunk:
            return b"".join(chunks)
        got += len(chunk)
        if got > size:
            raise UnreadableCheckpoint(f"{origin}: inflates to more than the {size:,} bytes its zip entry declares; "
                                       "corrupt or hostile archive")
        chunks.append(chunk)


def sniff(head: bytes) -> str | None:
    """'torch-zip', 'torch-legacy' or None, from the first bytes of a file."""
    if head.startswith(ZIP_MAGIC):
        return "torch-zip"
    if head[:1] == b"\x80" and len(head) > 2 and head[1] <= 5:
        return "torch-legacy"
    return None


@contextlib.contextmanager
def _zip_file(path: str) -> Iterator[zipfile.ZipFile]:
    """zipfile on `path`; for an object in object storage, on a file that fetches what zipfile reads
    (its end records, central directory and the members it opens), never the records between."""
    remote = sys.modules.get("ckptfix.remote")
    source: Any = remote.reader(path) if remote is not None else path
    try:
        with zipfile.ZipFile(source) as zf:
            yield zf
    finally:
        if source is not path:
            source.close()


def open_archive(path: str, preload: tuple[str, ...] = ()) -> TorchArchive:
    """The archive's member table, checked; `preload`: small members read now, with the same parse of the
    central directory (`read_member` hands each out once)."""
    try:
        with _zip_file(path) as zf:
            infos = zf.infolist()
            archive = _checked_archive(path, infos, zf)
            for suffix in preload:
                archive.preloaded[suffix] = archive.read_member(suffix, zf)
            return archive
    except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, NotImplementedError, OverflowError) as exc:
        # NotImplementedError: a damaged "version needed to extract" field ("zip file version 6.4")
        raise UnreadableCheckpoint(f"{path}: not a readable zip archive ({exc}); truncated or corrupt?") from None


def _checked_archive(path: str, infos: list[zipfile.ZipInfo], zf: zipfile.ZipFile) -> TorchArchive:
    nul = next((i.orig_filename for i in infos if "\x00" in i.orig_filename), None)
    if nul is not None:  # Python's zipfile cuts the name at the NUL, torch's miniz does not: they read different members
        raise UnreadableCheckpoint(f"{path}: zip member name '{escape(nul[:120])}' holds a NUL byte; Python and "
                                   "torch.load's zip reader would read different members; refusing it")
    names = [i.filename for i in infos]
    pkl = [n for n in names if n.endswith("/data.pkl") and n.count("/") == 1]
    # torch.jit.save archives hold a data.pkl too (of __torch__ classes): tell them apart first.
    if any(n.endswith("/constants.pkl") or "/code/" in n for n in names):
        raise UnreadableCheckpoint(
            f"{path}: a TorchScript archive (torch.jit.save), not a checkpoint; torch.load(weights_only=True) "
            "refuses it too. Load it with torch.jit.load if you trust it.")
    if not pkl:
        raise UnreadableCheckpoint(f"{path}: zip archive without data.pkl: not a torch.save checkpoint")
    if len(pkl) > 1:
        # Zip readers disagree on which copy wins: what ckptfix inspects might not be what torch.load runs.
        raise UnreadableCheckpoint(f"{path}: the archive holds {len(pkl)} data.pkl members "
                                   f"({', '.join(repr(n) for n in pkl[:3])}); refusing an ambiguous checkpoint")
    prefix = pkl[0].split("/", 1)[0]
    outside = [n for n in names if not n.startswith(prefix + "/")]
    if outside:  # torch.load refuses these too ("file in archive is not in a subdirectory")
        raise UnreadableCheckpoint(f"{path}: zip member {outside[0][:120]!r} lies outside the archive folder "
                                   f"{prefix!r}; torch.load refuses such a file")
    members: dict[str, zipfile.ZipInfo] = {}
    duplicates = []
    for info in infos:
        if info.filename in members:
            duplicates.append(info.filename)
        members[info.filename] = info  # the last one of a duplicated name wins here (torch: depends, see CKF702)
    archive = TorchArchive(path, prefix, members, sorted(set(duplicates)), os.path.getsize(path))
    nexts = _next_headers(infos, archive.size)
    records = [i for i in infos if i.filename.startswith(f"{prefix}/data/")]
    others = [i for i in infos if not i.filename.startswith(f"{prefix}/data/")]  # data.pkl, byteorder, version
    if _prefetch_headers(path, records, others):
        others = infos
    else:
        archive.unchecked = {(i.filename, i.header_offset): nexts[(i.filename, i.header_offset)] for i in records}
    _refuse_overlaps(archive, others, nexts)
    archive.big_endian = byte_order(archive, zf) == "big"
    return archive


def _prefetch_headers(path: str, records: list[zipfile.ZipInfo], others: list[zipfile.ZipInfo]) -> bool:
    """In object storage, every member's local header (and each small record whole) in a few requests:
    True. The tensor records' ones (`records`; `others` always) only within `remote.PREFETCH_BUDGET`
    requests: when they lie among large records (a step after each parameter's moments: a request each,
    hundreds for a large model), False, and they are read with their records."""
    remote = sys.modules.get("ckptfix.remote")
    if remote is None or not remote.active():
        return True

    def span(i: zipfile.ZipInfo) -> tuple[str, int, int]:
        return (path, i.header_offset, _LOCAL_HEADER.size + len(i.orig_filename.encode()) + 128
                + (i.file_size if i.file_size <= _SMALL_RECORD else 0))

    remote.prefetch([span(i) for i in others])
    return remote.prefetch([span(i) for i in records], budget=remote.PREFETCH_BUDGET)


def _next_headers(infos: list[zipfile.ZipInfo], size: int) -> dict[tuple[str, int], tuple[int, str]]:
    """Each member's next member in the file, by header offset: its header offset and name (the file's end
    for the last). Keyed by (name, header offset): a duplicated name is two members."""
    order = sorted(infos, key=lambda i: i.header_offset)
    nexts = [(i.header_offset, i.filename) for i in order[1:]] + [(size, "")]
    return {(i.filename, i.header_offset): after for i, after in zip(order, nexts)}


def _overlap(path: str, first: str, second: str) -> None:
    first, second = sorted((first, second))
    raise UnreadableCheckpoint(
        f"{path}: zip members '{escape(first[:120])}' and '{escape(second[:120])}' overlap in the "
        "file (one's bytes would be read as the other's); not an archive torch.save writes")


def _refuse_overlaps(archive: TorchArchive, infos: list[zipfile.ZipInfo],
                     nexts: dict[tuple[str, int], tuple[int, str]]) -> None:
    """No zip writer lays two members over the same bytes; torch.load would read one record's bytes as another's
    tensor without a word (measured: a central directory pointing data/1 at data/0 loads both as data/0's values).
    Each member of `infos` must end before the next member's header (`nexts`), whoever that is."""
    for info in infos:
        end = archive._data_start(info) + info.compress_size
        next_header, next_name = nexts[(info.filename, info.header_offset)]
        if next_header < end <= archive.size:  # a size past the end is named where the member is read
            _overlap(archive.path, info.filename, next_name)


def byte_order(archive: TorchArchive, zf: zipfile.ZipFile | None = None) -> str:
    """The archive's `byteorder` record (torch >= 2.1 writes the saving machine's `sys.byteorder`). Without
    one, torch.load assumes little (`get_default_load_endianness()` unset); any other value it refuses
    ("Unknown endianness type")."""
    info = archive.members.get(f"{archive.prefix}/byteorder")
    if info is None:
        return "little"
    if info.file_size > 16:
        raise UnreadableCheckpoint(f"{archive.path}: byteorder record of {info.file_size} bytes; torch.load refuses it")
    value = archive.read_member("byteorder", zf)
    if value not in (b"little", b"big"):
        raise UnreadableCheckpoint(f"{archive.path}: byteorder record {value!r} is neither 'little' nor 'big'; "
                                   "torch.load refuses it too")
    return value.decode()


def check_whole(path: str, *, scan: bool = False) -> None:
    """Raise `UnreadableCheckpoint` unless `path` is a whole torch.save file, without unpickling anything: a zip's
    central directory parses and every record lies inside the file (`scan`: and matches its CRC-32); a legacy
    stream is read with the allowlist in opaque mode (nothing imported or called)."""
    from ckptfix.formats import read_head

    kind = sniff(read_head(path))
    if kind == "torch-zip":
        archive = open_archive(path)  # the central directory, at the end: a truncated file has none
        for name in archive.members:
            if name.startswith(f"{archive.prefix}/data/"):
                archive.record_range(name.split("/data/", 1)[1])  # each record lies inside the file
        if scan:
            bad = archive.verify_crcs()
            if bad:
                raise UnreadableCheckpoint(f"{path}: {len(bad)} record(s) fail their CRC-32 ({', '.join(bad[:3])})")
    elif kind == "torch-legacy":
        load(path, opaque=True)
    else:
        raise UnreadableCheckpoint(f"{path}: neither a torch.save zip nor a legacy torch.save stream")


def load(path: str, *, opaque: bool = False,
         refusals: list[str] | None = None) -> tuple[Any, common.Locator, TorchArchive | None]:
    """Unpickle a torch file with the allowlist: the tree, how to find each storage, the archive.
    `refusals` receives why torch.load(weights_only=True) refuses the pickle (`pickle_safe.load_pickle`)."""
    from ckptfix.formats import read_head

    kind = sniff(read_head(path))
    if kind == "torch-zip":
        archive = open_archive(path, preload=("data.pkl",))
        tree = load_pickle(archive.read_member("data.pkl") or b"", path, opaque=opaque, refusals=refusals)
        return tree, lambda storage: (lambda: archive.record_range(storage.key, DTYPE_SIZES[storage.dtype])), archive
    if kind == "torch-legacy":
        tree, ranges = _load_legacy(path, opaque, refusals)
        return tree, lambda storage: (lambda: _legacy_range(path, ranges, storage.key)), None
    raise UnreadableCheckpoint(f"{path}: not a torch.save file")


def _load_legacy(path: str, opaque: bool, refusals: list[str] | None = None) -> tuple[Any, dict[str, ByteRange]]:
    """The pre-1.6 stream: magic, protocol, sys info, the object, storage keys, then raw storages.

    The file is mapped, never read whole: only the pickles at its head are copied out (each bounded by
    MAX_PICKLE_BYTES), and each storage costs an 8-byte pread of its size; its bytes stay in the file.
    A plain map, not `file_map`'s: finding a pickle's end indexes it byte by byte, in C."""
    remote = sys.modules.get("ckptfix.remote")
    if remote is not None:  # the pickles are found by scanning the map in C: an object is fetched whole
        remote.ensure_file(path)
    with open(path, "rb") as f:
        try:
            data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError, OverflowError) as exc:  # ENOMEM: a (sparse) file larger than the address space left
            raise UnreadableCheckpoint(f"{path}: cannot map the legacy stream ({exc}); "
                                       f"a file of {os.fstat(f.fileno()).st_size:,} bytes") from None
        with data:
            return _read_legacy_stream(path, data, f.fileno(), opaque, refusals)


def _read_legacy_stream(path: str, data: mmap.mmap, fd: int, opaque: bool,
                        refusals: list[str] | None = None) -> tuple[Any, dict[str, ByteRange]]:
    try:
        stream = _PickleStream(data)
        # opaque too: with --trust-pickle an arbitrary pickle is then "not a torch.save file", not "refused"
        if stream.next(path, opaque=opaque) != LEGACY_MAGIC:
            raise UnreadableCheckpoint(f"{path}: a pickle, but not a torch.save file (no torch magic number)")
        stream.next(path)  # protocol version
        stream.next(path)  # sys info
        tree = stream.next(path, opaque=opaque, refusals=refusals)
        keys = stream.next(path)
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise UnreadableCheckpoint(f"{path}: corrupt legacy checkpoint (storage keys are not a list of names)")
        # element sizes: every storage a tensor uses, and storages saved on their own (a bare FloatStorage)
        refs = list(common.iter_tensor_refs(tree))
        storages = {ref.storage.key: ref.storage for ref in refs}
        if refusals is not None and any(ref.dtype != ref.storage.dtype for ref in refs):
            # a dtype without a typed storage class (uint16, float8...): torch's legacy reader asks the
            # UntypedStorage for a dtype and fails
            refusals.append("an untyped storage in a legacy (non-zip) file")
        if refusals is not None and any(isinstance(n, RebuiltTensor) and n.kind == "nested"
                                        for n in common.iter_leaves(tree)):
            # the legacy stream's storages follow its pickle: torch builds the nested tensor from sizes it has
            # not read yet (uninitialized memory: a wrong shape or "Storage size calculation overflowed")
            refusals.append("a nested tensor in a legacy (non-zip) file")
        storages.update((s.key, s) for s in common.iter_leaves(tree) if isinstance(s, StorageRef))
        ranges, pos = {}, stream.pos
        for key in keys:  # little-endian on every machine: torch converts on write (writeFileRaw)
            (numel,) = struct.unpack("<q", os.pread(fd, 8, pos))
            if numel < 0:
                raise UnreadableCheckpoint(f"{path}: corrupt legacy checkpoint (storage {key} has a negative size)")
            storage = storages.get(key)
            itemsize = storage.nbytes // storage.numel if storage and storage.numel else 1
            ranges[key] = ByteRange(path, pos + 8, numel * itemsize)
            pos += 8 + numel * itemsize
            if pos > len(data):
                raise UnreadableCheckpoint(f"{path}: legacy checkpoint is truncated")
        return tree, ranges
    except (struct.error, TypeError) as exc:
        raise UnreadableCheckpoint(f"{path}: corrupt legacy checkpoint ({exc})") from None


class _PickleStream:
    """Pickles back to back in a mapped file: each is found by its opcode lengths, then unpickled safely."""

    def __init__(self, data: Any):
        self.data, self.pos = data, 0

    def next(self, origin: str, opaque: bool = False, refusals: list[str] | None = None) -> Any:
        end = pickle_end(self.data, self.pos, origin)
        if end - self.pos > MAX_PICKLE_BYTES:
            raise UnreadableCheckpoint(f"{origin}: pickle of {end - self.pos} bytes is implausibly large")
        chunk = self.data[self.pos:end]
        self.pos = end
        return load_pickle(chunk, origin, opaque=opaque, refusals=refusals)


# What torch.load (torch 2.13) does with a torch.save zip cut short or emptied, and so every resume built on it
# (Lightning's fit(ckpt_path=...), a training loop's own): measured in tests/test_resume_lightning.py
TORCH_LOAD_CUT = ("(torch.load dies on it with RuntimeError 'PytorchStreamReader failed reading zip archive: failed "
                  "finding central directory', naming no file; so does Lightning's fit(ckpt_path=...))")
def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    """Read a `torch.save` file into the checkpoint model (metadata only)."""
    refusals: list[str] = []
    try:
        tree, locate_for, archive = load(path, opaque=trust_pickle, refusals=refusals)
    except UnreadableCheckpoint as exc:
        if str(exc).endswith("truncated or corrupt?"):  # no central directory: the file was cut short
            raise UnreadableCheckpoint(f"{exc} {TORCH_LOAD_CUT}") from None
        raise
    ckpt = common.checkpoint_from_tree(path, "torch", tree, locate_for)
    ckpt.weights_only_refusals = refusals
    if archive is not None and archive.duplicates:
        ckpt.notes.append(f"duplicate zip member names (torch.load may read either copy): {', '.join(archive.duplicates[:5])}")
    ckpt.handle = archive
    ckpt.unopened_records = unopened_records(archive)
    return ckpt


def unopened_records(archive: TorchArchive | None) -> int:
    """Tensor records whose local header was left for when they are read (`_prefetch_headers`)."""
    return len(archive.unchecked) if archive is not None else 0


def _legacy_range(path: str, ranges: dict[str, ByteRange], key: str) -> ByteRange:
    if key not in ranges:
        raise UnreadableCheckpoint(f"{path}: storage {key} missing from the legacy stream")
    return ranges[key]
