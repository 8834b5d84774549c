"""Archive integrity that torch.load itself does not check."""

from __future__ import annotations

from typing import Any, Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.formats.common import iter_tensor_refs


def _archive(ctx: Context):
    handle = ctx.ckpt.handle
    return handle if handle is not None and hasattr(handle, "members") else None


def _records(ctx: Context) -> list[tuple[str, Any, int]]:
    """(storage key, its zip member or None, the bytes the storage declares), once per storage; one walk of the
    tree for both checks that ask (kept on the context)."""
    cached = getattr(ctx, "_integrity_records", None)
    if cached is not None:
        return cached
    archive = _archive(ctx)
    records: list[tuple[str, Any, int]] = []
    seen = set()
    for ref in iter_tensor_refs(ctx.ckpt.raw) if archive is not None else ():
        key = ref.storage.key
        if key not in seen:
            seen.add(key)
            records.append((key, archive.members.get(f"{archive.prefix}/data/{key}"), ref.storage.nbytes))
    object.__setattr__(ctx, "_integrity_records", records)
    return records


@check("CKF701", "error", "tensor record shorter than its storage",
       "A zip record holds fewer bytes than its storage's numel x itemsize declares.")
def short_records(ctx: Context) -> Iterator[Finding]:
    short = []
    for key, info, nbytes in _records(ctx):
        if info is None:  # torch.load raises "failed finding central directory"/"file not found" for it
            short.append(f"data/{key} (missing, {nbytes} bytes expected)")
        elif info.file_size < nbytes:
            short.append(f"data/{key} ({info.file_size} of {nbytes} bytes)")
    if short:
        yield finding("CKF701", f"{len(short)} record(s) are shorter than their storage: {', '.join(short[:5])}",
                      pytorch="torch.load(mmap=True) does not notice: the tensor reads the bytes that follow the "
                      "record (the next zip header) as values.", fix="Restore the file from a good copy.")


@check("CKF730", "error", "tensor record longer than its storage",
       "A zip record holds more bytes than its storage's numel x itemsize declares: torch.load refuses it "
       "(\"record size ... does not match expected size\"), though not with mmap=True.")
def long_records(ctx: Context) -> Iterator[Finding]:
    long = [f"data/{key} ({info.file_size} bytes for {nbytes})" for key, info, nbytes in _records(ctx)
            if info is not None and info.file_size > nbytes]
    if long:
        yield finding("CKF730", f"{len(long)} record(s) are longer than their storage: {', '.join(long[:5])}",
                      pytorch="torch.load refuses the file (record size does not match); with mmap=True it loads "
                      "the storage's first bytes and ignores the rest, so the file is not what was saved.",
                      fix="Restore the file from a good copy.")


@check("CKF702", "warning", "duplicate zip member names",
       "The archive holds two members with one name; torch.load silently uses one of them (which one "
       "depends on where the copies lie, not on their order).")
def duplicate_members(ctx: Context) -> Iterator[Finding]:
    archive = _archive(ctx)
    if archive is not None and archive.duplicates:
        yield finding("CKF702", f"duplicated members: {', '.join(archive.duplicates[:5])}",
                      pytorch="torch.load silently reads one copy of each name, found by binary search: measured "
                      "reading the first copy in one layout and the last in another. ckptfix reads the last, so "
                      "--scan/--verify may check other bytes than torch.load uses.",
                      fix="Re-save the checkpoint; find out what wrote into the archive twice.")


@check("CKF703", "error", "zip CRC mismatch",
       "With --verify: a record's bytes do not match its CRC-32 (bit rot or a partial write).")
def crc_mismatch(ctx: Context) -> Iterator[Finding]:
    archive = _archive(ctx)
    if archive is None or not ctx.verify:
        return
    bad = archive.verify_crcs(ctx.progress)
    if bad:
        yield finding("CKF703", f"{len(bad)} record(s) fail their CRC-32 check: {', '.join(bad[:5])}",
                      pytorch="torch.load does not verify CRCs: corrupted values load silently.",
                      fix="Restore the file from a good copy; the corrupted tensors are listed above.",
                      tensors=bad)
