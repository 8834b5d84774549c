"""Write a repaired `torch.distributed.checkpoint` (DCP) folder, offline, in one process, no process group.

Only what changes is written. The reader (`dcp_folder`) knows every item of the source's `.metadata`:
its planner path, and for a tensor its pieces (one per saving rank) with the record holding each. The
edited tensors (vocab weights assembled from their pieces, resized, and their moments) go through
`dcp.save` (single process, `no_dist`) into one new data file; the new `.metadata` is DCP's own
`Metadata` built with DCP's own types: the source's entries for everything unchanged (pointing at the
source's data files, copied or left where they are) and the new save's entries for what changed. Each
changed tensor is one piece covering it whole, so `dcp.load` reads it at any world size (DCP reshards
on load: every rank narrows the pieces that overlap its own shard). Unchanged items, tensors or
pickled objects (torchtitan's BytesIO dataloader state, anything the allowlist would not unpickle) are
never unpickled nor rewritten: their bytes stay as saved.

Two modes:
- a new folder (`-o OUT`): the source's data files still referenced are copied with reflink (copy-on-write,
  no data copied; the old vocab pieces stay in them, unreferenced) where the file system has it, else with
  `copy_file_range` of the records still referenced only, each at its own offset, the replaced records
  left as holes (neither read nor written); never hard links. The folder appears atomically.
- in place (`--in-place`): the new data file is added to the source folder, the previous `.metadata`
  (and `ckptfix.json`) kept as backups listed in `ckptfix-restore.json`, and the new `.metadata` swapped
  in with one rename; `ckptfix restore FOLDER` puts the old ones back. Cost: the changed tensors alone.

Measured on torch 2.13, single process: `dcp.load` with the default planner requires every key of
the state dict it fills to be in the checkpoint ("Missing key in checkpoint state_dict: optim.state.
<fqn>.step"), while keys of the checkpoint absent from the state dict are ignored. `set_state_dict`
accepts an optimizer state dict with `state == {}` (FQN `params` in `param_groups`) and leaves the
optimizer with no state at all, i.e. fresh. So when the policy drops optimizer state the folder keeps
the optimizer's `param_groups` only (the schedule position's lr stays) and the record says how to load
it: a template from `get_state_dict` must have its optimizer `state` emptied first.
"""

from __future__ import annotations

import inspect
import io
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import numpy as np

from ckptfix.checkpoint import stored_to_torch
from ckptfix.errors import RepairError
from ckptfix.formats import dcp_folder
from ckptfix.formats.dcp_folder import METADATA_FILE, DcpLayout, Item
from ckptfix.io import (
    atomic_file,
    atomic_folder,
    atomic_write,
    backup_path,
    clone_records,
    copy_input_entry,
    create_file,
    move_new,
    prefetch,
)
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.undo import BACKUP_SUFFIX, RESTORE_FILE, InPlace

RECORD_FILE = "ckptfix.json"


@dataclass
class DcpEdits:
    """What changes in the folder: items rewritten (fqn -> (planner path, new value)) and items removed."""

    writes: dict[str, tuple[tuple, Any]] = field(default_factory=dict)
    removes: set[str] = field(default_factory=set)


def write_dcp_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                     in_place: bool, progress: Any = None, incremental: bool = False, edits: DcpEdits | None = None,
                     rewrites: dict[str, Callable[[BinaryIO], None]] | None = None) -> str | None:
    """Write the repaired folder to `out` (a new folder), or into the source itself when `incremental`.
    `edits` (default: `plan_edits`) and `rewrites` (files beside the data, each replaced by what its function
    writes to a file; default: Lightning's meta.pt when the plan changes it) let a format built on DCP (Megatron)
    say what changes."""
    layout = _layout(plan)
    edits = plan_edits(plan, layout, rng) if edits is None else edits
    if rewrites is None:
        meta = _meta_bytes(plan, rng if not incremental else np.random.default_rng(0))  # meta.pt holds no rows
        rewrites = {dcp_folder.LIGHTNING_META: _bytes_writer(meta)} if meta is not None else {}
    if incremental:
        return _write_in_place(plan, layout, edits, record_fn, progress, rewrites)
    src = plan.ckpt.path
    backup = backup_path(out) if in_place and os.path.exists(out) else None
    kept = _kept_records(layout, edits, src)
    referenced = sorted(kept)
    with atomic_folder(out, backup=in_place) as tmp, ThreadPoolExecutor(1) as pool:
        # The unchanged data files are copied (in the kernel) while the changed tensors are computed and
        # saved: the repair then takes about as long as the copy alone. Leaving the `with` waits for it.
        copies = [_Copy(pool, os.path.join(src, name), os.path.join(tmp, name), kept[name]) for name in referenced]
        try:
            new_file = _save_changed(edits, tmp, _new_data_name(src), progress)
        except BaseException:
            for copy in copies:  # nothing more to copy for a folder that will not be written
                copy.future.cancel()
            raise
        metadata = merged_metadata(layout, edits, new_file, tmp, src)
        if {info.relative_path for info in metadata.storage_data.values()} - {new_file} != set(referenced):
            raise RepairError("the merged .metadata names other data files than were copied; nothing written")
        for name in _other_files(src):  # links stay links, never followed out of the folder; FIFOs refused
            if name in rewrites:
                _rewrite(os.path.join(tmp, name), rewrites[name])
            else:
                copy_input_entry(os.path.join(src, name), os.path.join(tmp, name), src)
        methods: dict[str, int] = {}
        holes = 0
        for copy in (progress(copies, sum(c.nbytes for c in copies), "copy") if progress else copies):
            method = copy.result()  # a bar advances as each file's copy ends
            methods[method] = methods.get(method, 0) + 1
            holes += copy.left_out if method != "reflink" else 0
        method = ", ".join(f"{m} x{n}" for m, n in methods.items()) or "nothing copied"
        left_out = f"; the replaced records ({holes / 1e6:,.1f} MB) left out as holes" if holes else ""
        plan.notes.append(f"DCP: {len(referenced)} data file(s) copied ({method}{left_out}); changed tensors "
                          f"written to {new_file}")
        _write_metadata(metadata, os.path.join(tmp, METADATA_FILE))
        with create_file(os.path.join(tmp, RECORD_FILE), replace=True) as f:
            f.write(_record(record_fn))
    return backup


def plan_notes(plan: RepairPlan) -> list[str]:
    """What a DCP repair does beyond the common plan (`make_plan` adds it, so --dry-run shows it)."""
    layout, notes = _layout(plan), []
    if plan.drop_optimizer_state and layout.optimizer_prefix:
        notes.append(
            f"DCP: the optimizer entry {layout.optimizer_prefix[0]!r} keeps param_groups but no state; dcp.load of "
            "a get_state_dict template reports its state keys missing: empty the template's optimizer 'state' "
            "before dcp.load, then set_state_dict leaves the optimizer fresh")
    if plan.reset_scheduler and layout.scheduler_prefix:
        notes.append(f"DCP: the scheduler entry {layout.scheduler_prefix[0]!r} was removed; do not load it "
                     "(a new schedule starts)")
    return notes


def _layout(plan: RepairPlan) -> DcpLayout:
    layout = plan.ckpt.raw
    if not isinstance(layout, DcpLayout):  # a Checkpoint built elsewhere: read the folder again
        layout = dcp_folder.read(plan.ckpt.path).raw
    return layout


# --- what changes ------------------------------------------------------------------------------------

def plan_edits(plan: RepairPlan, layout: DcpLayout, rng: np.random.Generator) -> DcpEdits:
    """The items to rewrite or remove, decided from the plan; every edit of the plan lands in an item."""
    edits, produced = DcpEdits(), {}
    for name, fqn in layout.model_items.items():
        edit = plan.weights.get(plan.ckpt.tied.get(name, name))
        if edit is not None:
            if edit.name not in produced:  # a tied head gets the very same values as its embedding
                produced[edit.name] = _Produce(edit, plan, rng)
            edits.writes[fqn] = (layout.items[fqn].path, produced[edit.name])
    missing = [n for n in plan.weights if layout.model_items.get(n) not in edits.writes]
    if missing:
        raise RepairError(f"{plan.ckpt.path}: cannot find the DCP item of {', '.join(missing)}; nothing written")
    if plan.drop_optimizer_state:
        edits.removes.update(_optimizer_state_items(layout))
    else:
        for key, edit in plan.moments.items():
            moment_fqn = layout.moment_items.get(key)
            if moment_fqn is None or moment_fqn not in layout.items:
                raise RepairError(f"{plan.ckpt.path}: cannot find the DCP item of {edit.name}; nothing written")
            edits.writes[moment_fqn] = (layout.items[moment_fqn].path, _Produce(edit, plan, rng))
    if plan.reset_scheduler:
        _plan_scheduler_reset(plan, layout, edits)
    return edits


class _Produce:
    """A changed tensor, computed (as stored, numpy) when it is saved, so copying can start first;
    computed once, shared by a tied head and its embedding."""

    def __init__(self, edit: Any, plan: RepairPlan, rng: np.random.Generator):
        self.edit, self.plan, self.rng = edit, plan, rng
        self.value: np.ndarray | None = None

    def __call__(self) -> np.ndarray:
        if self.value is None:
            self.value = self.edit.produce(self.plan.init, self.plan.std, self.rng)
        return self.value

    def torch(self) -> Any:
        return stored_to_torch(self(), self.edit.source.dtype)

    @property
    def nbytes(self) -> int:  # what a progress bar counts
        return int(self.edit.source.nbytes)


class _Copy:
    """One data file's copy (its records still referenced), queued on the worker; `nbytes` for a progress
    bar, `left_out` the bytes of its replaced records."""

    def __init__(self, pool: ThreadPoolExecutor, src: str, dst: str, keep: list[tuple[int, int]]):
        self.nbytes = sum(length for _, length in keep)
        self.left_out = os.path.getsize(src) - self.nbytes
        self.future = pool.submit(clone_records, src, dst, keep)

    def result(self) -> str:
        return self.future.result()


def _kept_records(layout: DcpLayout, edits: DcpEdits, source: str) -> dict[str, list[tuple[int, int]]]:
    """Per source data file that items kept as they are point into, the byte ranges (offset, length) of
    those items' records, sorted, adjacent ones merged: what a new folder copies."""
    ranges: dict[str, list[tuple[int, int]]] = {}
    for fqn, item in layout.items.items():
        if fqn not in edits.removes and fqn not in edits.writes:
            for file, offset, length, _ in item.blobs:
                ranges.setdefault(os.path.relpath(file, source), []).append((offset, length))
    merged: dict[str, list[tuple[int, int]]] = {}
    for name, spans in ranges.items():
        out: list[tuple[int, int]] = []
        for offset, length in sorted(spans):
            if out and offset <= out[-1][0] + out[-1][1]:  # adjacent (or, in a damaged file, overlapping)
                start = out[-1][0]
                out[-1] = (start, max(out[-1][1], offset + length - start))
            else:
                out.append((offset, length))
        merged[name] = out
    return merged


def _optimizer_state_items(layout: DcpLayout) -> set[str]:
    prefix = layout.optimizer_prefix
    out = set()
    for fqn, item in layout.items.items():
        path = item.path
        if path[:len(prefix)] == prefix and len(path) > len(prefix):
            head = path[len(prefix)]
            if head == "state" or (layout.flattened_optimizer and str(head).startswith("state.")):
                out.add(fqn)
    return out


def _plan_scheduler_reset(plan: RepairPlan, layout: DcpLayout, edits: DcpEdits) -> None:
    if layout.scheduler_prefix is None:
        raise RepairError(f"{plan.ckpt.path}: the scheduler lives in {dcp_folder.LIGHTNING_META}, which repair "
                          "does not rewrite; use --policy fresh (and build a new scheduler when resuming)")
    prefix = layout.scheduler_prefix
    edits.removes.update(f for f, item in layout.items.items() if item.path[:len(prefix)] == prefix)
    # the schedule starts again from its base LR: each group's `lr` item takes its `initial_lr`
    by_path = {item.path: item for item in layout.items.values()}
    for fqn, item in layout.items.items():
        if item.path[:len(layout.optimizer_prefix)] != layout.optimizer_prefix or item.is_tensor:
            continue
        last = str(item.path[-1])
        if last == "lr" or last.endswith(".lr"):
            sibling = by_path.get(item.path[:-1] + (last[:-2] + "initial_lr",))
            if sibling is not None:
                value = dcp_folder.object_value(plan.ckpt.path, sibling, False)
                if isinstance(value, (int, float)):
                    edits.writes[fqn] = (item.path, value)


# --- writing -------------------------------------------------------------------------------------------

def _new_data_name(*folders: str) -> str:
    """A data file name no rank file uses (`__<rank>_<n>.distcp`) and the folders do not hold yet."""
    n = 0
    while any(os.path.lexists(os.path.join(f, f"__ckptfix{n}_0.distcp")) for f in folders):
        n += 1
    return f"__ckptfix{n}_0.distcp"


def _save_changed(edits: DcpEdits, folder: str, name: str, progress: Any = None, scratch: str | None = None) -> str:
    """`dcp.save` the changed items (nested as in the source) into `folder/name`; returns `name`. `scratch`: where
    `dcp.save` writes first (default `folder`; an in-place repair's listed scratch folder)."""
    if not edits.writes:
        return name
    # torch.distributed.checkpoint takes ~2 s to import: a worker imports it while this thread computes
    # the changed tensors (numpy; the copies and page faults run without the GIL).
    importer = threading.Thread(target=_import_dcp, daemon=True)
    importer.start()
    produces = [v for _, v in edits.writes.values() if isinstance(v, _Produce)]
    # every changed tensor's bytes requested from the disk at once (a cold cache reads them while torch imports)
    prefetch([r for value in produces for r in value.edit.source.byte_ranges()])
    total = sum(p.nbytes for p in produces)
    for value in (progress(produces, total, "repair") if progress and produces else produces):
        value()  # in plan order: the rng draws stay the same
    importer.join()
    import torch.distributed.checkpoint as dcp  # done by the worker; raises here if it failed
    from torch.distributed.checkpoint.api import CheckpointException

    tree: dict = {}
    for path, value in edits.writes.values():
        dcp_folder.insert_at(tree, path, value.torch() if isinstance(value, _Produce) else value)
    scratch = tempfile.mkdtemp(prefix=".dcp-save", dir=scratch or folder)
    try:
        single = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process"
            warnings.simplefilter("ignore")
            try:
                dcp.save(tree, checkpoint_id=scratch, **single)
            # dcp.save wraps the disk's error in a CheckpointException, a BaseException: `except Exception`
            # missed it (an EIO mid-write was a traceback and exit 1; found by the every-point fault run)
            except (Exception, CheckpointException) as exc:  # noqa: BLE001
                raise RepairError(f"{folder}: writing the changed tensors failed ({_save_failure(exc)}); "
                                  "nothing was written") from None
        files = [f for f in os.listdir(scratch) if f.endswith(".distcp")]
        if files != ["__0_0.distcp"]:
            raise RepairError(f"dcp.save wrote {files}, expected one data file; nothing written")
        move_new(os.path.join(scratch, files[0]), os.path.join(folder, name))
        move_new(os.path.join(scratch, METADATA_FILE), os.path.join(folder, f".{name}.metadata"))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return name


def _import_dcp() -> None:
    try:
        import torch.distributed.checkpoint  # noqa: F401
    except Exception:  # noqa: BLE001 - the main thread's own import reports it
        pass


def merged_metadata(layout: DcpLayout, edits: DcpEdits, new_file: str, folder: str, source: str):
    """DCP's `Metadata` for the repaired folder: unchanged items as the source has them, changed ones as
    the new save wrote them (their storage renamed to `new_file`)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex

    sdm, planner, storage = {}, {}, {}
    for fqn, item in layout.items.items():
        if fqn in edits.removes or fqn in edits.writes:
            continue
        sdm[fqn], planner[fqn] = _storage_metadata(item), item.path
        for index, (where, blob) in enumerate(zip(item.blob_offsets, item.blobs)):
            file, offset, length, transforms = blob
            storage[MetadataIndex(fqn, where, index)] = _StorageInfo(
                os.path.relpath(file, source), offset, length, transforms)
    if edits.writes:
        side = os.path.join(folder, f".{new_file}.metadata")
        new = _read_own_metadata(side)
        os.remove(side)
        if set(new.state_dict_metadata) != set(edits.writes):
            raise RepairError("dcp.save named the changed items differently from the source; nothing written")
        sdm.update(new.state_dict_metadata)
        planner.update({k: v for k, v in (new.planner_data or {}).items() if k in edits.writes})
        for index, info in new.storage_data.items():
            storage[index] = _StorageInfo(new_file, info.offset, info.length,
                                          getattr(info, "transform_descriptors", None))
    return Metadata(state_dict_metadata=sdm, planner_data=planner, storage_data=storage)


def _read_own_metadata(path: str):
    """The `.metadata` our own `dcp.save` just wrote (never the source's: that one is read by the allowlist)."""
    import pickle

    with open(path, "rb") as f:
        return pickle.load(f)


def _storage_metadata(item: Item):
    import torch
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        TensorProperties,
        TensorStorageMetadata,
    )

    if not item.is_tensor:
        return BytesStorageMetadata()
    pieces = item.pieces or [((0,) * len(item.shape), item.shape)]
    return TensorStorageMetadata(TensorProperties(dtype=getattr(torch, item.dtype)), torch.Size(item.shape),
                                 [ChunkStorageMetadata(torch.Size(o), torch.Size(s)) for o, s in pieces])


def _write_metadata(metadata: Any, path: str) -> None:
    """As `FileSystemWriter.finish` writes it: one pickle of the Metadata."""
    import pickle

    with create_file(path, replace=True) as f:  # in ckptfix's own temporary folder
        pickle.dump(metadata, f)
        f.flush()
        os.fsync(f.fileno())


def _meta_bytes(plan: RepairPlan, rng: np.random.Generator) -> bytes | None:
    """Lightning's meta.pt with the recorded vocab sizes the plan changes in it (`hyper_parameters`), or None
    when it keeps its bytes. Its other entries (loops, callbacks, schedulers) are written back as read."""
    from ckptfix.recorded import apply
    from ckptfix.surgery.write_hf import rewrite_torch_file

    key = f"{dcp_folder.LIGHTNING_META}:"
    changes = {(path[0][len(key):], *path[1:]): value for path, value in plan.recorded.items()
               if isinstance(path[0], str) and path[0].startswith(key)}
    meta = plan.ckpt.files.get(dcp_folder.LIGHTNING_META)
    if not changes or meta is None:
        return None
    buf = io.BytesIO()
    rewrite_torch_file(meta, buf, plan, rng, lambda tree, table: apply(tree, changes))
    return buf.getvalue()


def _save_failure(exc: BaseException) -> str:
    """The disk's own error inside dcp.save's CheckpointException (its `failures`: rank -> exception)."""
    failures = getattr(exc, "failures", None)
    inner = next(iter(failures.values()), exc) if isinstance(failures, dict) and failures else exc
    if isinstance(inner, tuple) and inner and isinstance(inner[0], BaseException):  # (exception, its frames)
        inner = inner[0]
    while isinstance(inner, BaseException) and not isinstance(inner, OSError) and inner.__cause__ is not None:
        inner = inner.__cause__
    if isinstance(inner, OSError) and inner.strerror:
        return inner.strerror
    return f"{type(inner).__name__}: {str(inner).splitlines()[0][:200] if str(inner) else ''}"


def _bytes_writer(data: bytes) -> Callable[[BinaryIO], None]:
    def write(f: BinaryIO) -> None:
        f.write(data)
    return write


def _rewrite(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Replace `path` with what `write` writes (a real file: a torch writer copies records into it), atomically
    (`io.atomic_file`: a new temp file, never written through a link)."""
    with atomic_file(path) as f:
        write(f)


def _other_files(src: str) -> list[str]:
    """Files beside the data that belong to the checkpoint (Lightning's meta.pt, a user's notes), not ours."""
    ours = {METADATA_FILE, RECORD_FILE, RESTORE_FILE}
    return sorted(n for n in os.listdir(src) if n not in ours and not n.endswith((".distcp", BACKUP_SUFFIX)))


def _record(record_fn: Callable[[], dict]) -> bytes:
    return record_json(record_fn())


# --- in place ---------------------------------------------------------------------------------------------

def _write_in_place(plan: RepairPlan, layout: DcpLayout, edits: DcpEdits, record_fn: Callable[[], dict],
                    progress: Any = None, rewrites: dict[str, Callable[[BinaryIO], None]] | None = None) -> str:
    """New data file + backups + one atomic rename of `.metadata`; returns the backup of the metadata."""
    folder = plan.ckpt.path
    undo = InPlace(folder, METADATA_FILE)
    new_file = _new_data_name(folder)
    with undo:
        if edits.writes:
            undo.add(new_file)
            undo.add(f".{new_file}.metadata")
        _save_changed(edits, folder, new_file, progress, scratch=undo.scratch())
        metadata = merged_metadata(layout, edits, new_file, folder, folder)
        backup = undo.keep(METADATA_FILE)
        undo.keep(RECORD_FILE)
        atomic_write(undo.path(RECORD_FILE), _record(record_fn))
        for name, write in (rewrites or {}).items():
            undo.keep(name)
            _rewrite(undo.path(name), write)

        def replace_metadata(path: str) -> None:
            import pickle

            with atomic_file(path) as f:  # a temp of a unique name, created O_EXCL|O_NOFOLLOW
                pickle.dump(metadata, f)

        undo.switch_over(replace_metadata)
    plan.notes.append(f"DCP in place: changed tensors written to {new_file}; the previous .metadata is kept as "
                      f"{METADATA_FILE}{BACKUP_SUFFIX} (undo: ckptfix restore {folder})")
    return backup or ""
