"""`torch.distributed.checkpoint` (DCP) folders: `.metadata` plus `__<rank>_<n>.distcp` data files.

`.metadata` is a pickled `torch.distributed.checkpoint.metadata.Metadata`. It is read without torch
and without a process group: `pickle_safe` opaque mode turns every class into an inert record, and
only the handful of DCP dataclasses listed in `DCP_GLOBALS` are interpreted; a pickle naming any
other class is refused (`UnsafePickle`), exactly like the weights allowlist.

Layout measured on torch 2.13 (default `FileSystemWriter`, `SerializationFormat.TORCH_SAVE`): every
item, tensor or not, is its own complete `torch.save` zip written back to back into the `.distcp`
file; `storage_data[MetadataIndex]` gives `(relative_path, offset, length)` of that zip. Tensor bytes
are therefore not raw at `offset`: they are the zip's `data/<key>` record, which we locate by reading
the little zip's directory and pickle in place (a few hundred bytes per tensor, never the values).
Non-tensor items (`param_groups` options, user ints) are small pickles and are read eagerly.

State-dict structure comes from `planner_data` (fqn -> path tuple, e.g. `('optim', 'state',
'0.weight', 'exp_avg')`), so parameter FQNs that contain dots stay intact.

Sharded saves (FSDP2/DTensor on N ranks): a tensor's `TensorStorageMetadata.chunks` lists each rank's
piece (offsets, sizes) and `storage_data` keys each piece by `MetadataIndex(fqn, offsets)`; every piece is
its own `torch.save` zip in the saving rank's `__<rank>_0.distcp`. Such a tensor is a `ShardedTensor`:
metadata now, and `read_stored()` assembles the pieces (each read in place) into one array.

Layouts read (measured with real saves on torch 2.13, see tests/fsdp_factory.py):
- nested `{model, optim, sched, ...}` from `get_state_dict` (optimizer state keyed by FQN);
- torchtitan's CheckpointManager: model FQNs at the top level, `optimizer` flattened by
  `flatten_optimizer_state_dict=True` (`state.<fqn>.exp_avg`, `param_groups.<fqn>.lr`), `lr_scheduler`,
  `dataloader`, `train_state`;
- Lightning's ModelParallelStrategy: `state_dict` and `optimizer_0` through DCP, the rest (`lr_schedulers`,
  `global_step`) in a `torch.save`d `meta.pt` beside `.metadata`.
A tied head is saved twice by DCP (both FQNs, identical bytes) while the optimizer holds state for one of
them only: it is reported tied when every piece of the two tensors has the same size and CRC-32 and the
optimizer (if any) lists just one of them.
"""

from __future__ import annotations

import io
import math
import os
import posixpath
import re
import struct
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.checkpoint import (
    ByteRange,
    Checkpoint,
    TensorInfo,
    contiguous_stride,
    file_map,
    stored_to_torch,
)
from ckptfix.dtypes import NUMPY_DTYPES
from ckptfix.errors import UnreadableCheckpoint, UnsafePickle
from ckptfix.formats import common
from ckptfix.formats.pickle_records import OpaqueObject, TensorRef, TorchDtype
from ckptfix.formats.pickle_safe import PLAIN_LEAVES, load_pickle
from ckptfix.untrusted import fail, want_dict, want_int, want_list, want_shape, want_str

METADATA_FILE = ".metadata"
LIGHTNING_META = "meta.pt"  # Lightning ModelParallelStrategy: what is not in DCP, torch.saved by rank 0
_MD = "torch.distributed.checkpoint.metadata."
# The only classes a DCP `.metadata` pickle may name (besides the weights allowlist: torch.Size, dtypes).
DCP_GLOBALS = frozenset({
    _MD + "Metadata", _MD + "MetadataIndex", _MD + "TensorStorageMetadata", _MD + "BytesStorageMetadata",
    _MD + "ChunkStorageMetadata", _MD + "TensorProperties", _MD + "StorageMeta", _MD + "_MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.serialization._get_layout",
    "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath",
})
_PLAN = "torch.distributed.checkpoint.planner."
# Megatron-Core keeps each rank's save plan in `.metadata` (`all_local_plans`, to reuse it on the next save).
# They are data, never interpreted here: the dataclasses only constructed (NEWOBJ + BUILD), the enum only called
# with its int value (`_planner_uses_are_data`).
PLANNER_GLOBALS = frozenset({_PLAN + "SavePlan", _PLAN + "WriteItem", _PLAN + "TensorWriteData",
                             _PLAN + "BytesIOWriteData", "torch.distributed.checkpoint.filesystem._StoragePrefix"})
PLANNER_ENUMS = frozenset({_PLAN + "WriteItemType", _PLAN + "LoadItemType"})
MAX_ITEM_PICKLE = 64 << 20  # a non-tensor item is read whole; refuse anything larger
_LOCAL_HEADER = struct.Struct("<4s5H3L2H")
_ZIP_MAGIC = b"PK\x03\x04"


@dataclass
class Item:
    """One `.metadata` entry: a tensor (shape, dtype, chunk blobs) or a pickled object (one blob)."""

    fqn: str
    path: tuple  # the nested state-dict keys (planner_data)
    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: str = "uint8"
    pieces: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)  # (offsets, sizes)
    blobs: list[tuple[str, int, int, Any]] = field(default_factory=list)  # (file, offset, length, transforms)
    blob_offsets: list[tuple[int, ...] | None] = field(default_factory=list)  # the piece each blob holds
    unopened: bool = False  # in object storage: its records are opened when read (`_prefetch_records`)

    @property
    def chunks(self) -> int:
        return max(len(self.pieces), 1)

    def blob_for(self, offsets: tuple[int, ...]) -> tuple[str, int, int, Any] | None:
        """The stored record of the piece at `offsets` (a single-piece item: its one blob)."""
        for where, blob in zip(self.blob_offsets, self.blobs):
            if where == offsets or (where is None and len(self.blobs) == 1):
                return blob
        return None


@dataclass
class DcpLayout:
    """What the reader learnt about the folder, for inspect's report and the writer (`ckpt.raw`)."""

    items: dict[str, Item]
    world_size: int  # ranks that wrote a data file (`__<rank>_<n>.distcp`)
    data_files: list[str]
    model_items: dict[str, str] = field(default_factory=dict)  # model tensor name -> item fqn
    moment_items: dict[tuple[Any, str], str] = field(default_factory=dict)  # (param fqn, key) -> item fqn
    optimizer_prefix: tuple = ()  # planner path of the optimizer entry
    scheduler_prefix: tuple | None = None  # planner path of the scheduler entry (None: not in DCP)
    flattened_optimizer: bool = False  # torchtitan: `state.<fqn>.<key>` keys
    meta_file: str | None = None  # Lightning's meta.pt


def sniff(path: str) -> bool:
    """A DCP save: the folder has the `.metadata` file `dcp.save` writes (last), or only its `.distcp` data files
    (a save that did not finish: `read` refuses it naming `.metadata`)."""
    return os.path.exists(os.path.join(path, ".metadata")) or any(n.endswith(".distcp") for n in os.listdir(path))


# What `torch.distributed.checkpoint.load` (torch 2.13) does with a folder whose `.metadata` or a data file is missing
# or torn: measured in tests/test_resume_dcp.py
DCP_LOAD_NO_METADATA = ("dcp.load raises CheckpointException (AssertionError 'metadata is None; global metadata read "
                        "failed: ...') before loading anything")
DCP_LOAD_DATA = {"missing": "dcp.load raises CheckpointException wrapping FileNotFoundError on it",
                 "short": "dcp.load raises CheckpointException wrapping an EOFError that names no file"}


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    """Read a DCP folder: model, optimizer (FQN-keyed), scheduler; everything else into extras."""
    if not os.path.exists(os.path.join(path, METADATA_FILE)):
        data = sorted(n for n in os.listdir(path) if n.endswith(".distcp"))
        raise UnreadableCheckpoint(f"{path}: no {METADATA_FILE} beside {len(data)} .distcp data file(s) (dcp.save "
                                   f"writes it last: the save did not finish); {DCP_LOAD_NO_METADATA}")
    try:
        items, version = read_metadata(path)
    except UnsafePickle:
        raise
    except UnreadableCheckpoint as exc:
        if ": corrupt pickle (" not in str(exc):  # a pickle torch reads, refused by ckptfix's own bounds: no claim
            raise
        raise UnreadableCheckpoint(f"{exc}; {DCP_LOAD_NO_METADATA}") from None  # torn: pickle.load fails too
    problems = data_file_problems(path, items)
    if problems:
        raise UnreadableCheckpoint(f"{path}: {problems[0][0]}; " + DCP_LOAD_DATA[problems[0][1]]
                                   + (f" ({len(problems) - 1} more data file(s) torn)" if len(problems) > 1 else ""))
    layout = DcpLayout(items, *_data_files(path, items))
    ckpt = Checkpoint(path=path, format="dcp", raw=layout)
    ckpt.extras["dcp_version"] = version
    tree = _tree(path, items, ckpt, trust_pickle)
    model_key = _pick(tree, common.MODEL_KEYS, lambda v: isinstance(v, dict) and _has_tensor(v))
    optim_key = _pick(tree, _optimizer_keys(tree), _is_optimizer)
    sched_key = _pick(tree, common.SCHEDULER_KEYS, lambda v: isinstance(v, dict))
    used = {k for k in (model_key, optim_key, sched_key) if k is not None}
    if model_key is not None:
        ckpt.model = _flat_tensors(tree[model_key])
    else:  # a bare `dcp.save(model.state_dict())` or torchtitan: top-level tensors are the model
        ckpt.model = {k: v for k, v in tree.items() if isinstance(v, TensorInfo)}
        used.update(ckpt.model)
    ckpt.sections["model"] = model_key or ""
    layout.model_items = {name: _item_fqn(model_key, name) for name in ckpt.model}
    if optim_key is not None:
        optimizer = tree[optim_key]
        layout.optimizer_prefix = (optim_key,)
        if _is_flattened_optimizer(optimizer):
            optimizer, layout.flattened_optimizer = _unflatten_optimizer(optimizer), True
        ckpt.optimizer = common.parse_optimizer(optimizer, None, f"{path}: {optim_key}")
        ckpt.sections["optimizer"] = optim_key
        layout.moment_items = _moment_items(optim_key, optimizer, layout.flattened_optimizer)
    if sched_key is not None:
        ckpt.scheduler = tree[sched_key]
        ckpt.sections["scheduler"] = sched_key
        layout.scheduler_prefix = (sched_key,)
    ckpt.extras.update({k: v for k, v in tree.items() if k not in used})
    ckpt.files = {"metadata": os.path.join(path, METADATA_FILE)}
    _read_lightning_meta(path, ckpt, layout, trust_pickle)
    ckpt.tied = common.find_tied(ckpt.model)
    ckpt.tied.update(_saved_ties(ckpt, layout))
    if not ckpt.model and ckpt.optimizer is None:
        raise UnreadableCheckpoint(f"{path}: DCP checkpoint holds no model tensors or optimizer state "
                                   f"(top-level keys: {', '.join(map(str, list(tree)[:8]))})")
    return ckpt


def _pick(tree: dict, keys: tuple[str, ...], accept: Callable[[Any], bool]) -> str | None:
    return next((k for k in keys if k in tree and accept(tree[k])), None)


def _optimizer_keys(tree: dict) -> tuple[str, ...]:
    # Lightning's ModelParallelStrategy names them optimizer_0, optimizer_1, ...
    numbered = sorted((k for k in tree if isinstance(k, str) and re.fullmatch(r"optimizer_\d+", k)),
                      key=lambda k: int(k.rsplit("_", 1)[1]))
    return common.OPTIMIZER_KEYS + tuple(numbered)


def _is_optimizer(value: Any) -> bool:
    return common.is_optimizer_state(value) or _is_flattened_optimizer(value)


def _is_flattened_optimizer(value: Any) -> bool:
    """torchtitan's `flatten_optimizer_state_dict=True` form: `state.<fqn>.<key>` / `param_groups.<fqn>.<opt>`."""
    return (isinstance(value, dict) and bool(value) and "state" not in value
            and all(isinstance(k, str) and k.startswith(("state.", "param_groups.")) for k in value)
            and any(k.startswith("param_groups.") for k in value))


def _unflatten_optimizer(flat: dict) -> dict:
    """The flattened form as an FQN-keyed `Optimizer.state_dict()`; parameters with equal options share a group
    (the flattened form keeps each parameter's options, not the groups' boundaries)."""
    state: dict[str, dict] = {}
    options: dict[str, dict] = {}
    for key, value in flat.items():
        section, _, rest = key.partition(".")
        fqn, _, name = rest.rpartition(".")
        (state if section == "state" else options).setdefault(fqn, {})[name] = value
    groups: dict[str, dict] = {}
    for fqn, opts in options.items():
        group = groups.setdefault(repr(sorted(opts.items(), key=lambda kv: kv[0])), {**opts, "params": []})
        group["params"].append(fqn)
    return {"state": state, "param_groups": list(groups.values())}


def _item_fqn(prefix: str | None, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _moment_items(optim_key: str, optimizer: dict, flattened: bool) -> dict[tuple[Any, str], str]:
    state = optimizer.get("state")
    out = {}
    for index, entries in (state.items() if isinstance(state, dict) else ()):
        for key, value in (entries.items() if isinstance(entries, dict) else ()):
            if isinstance(value, TensorInfo):
                out[(index, key)] = (f"{optim_key}.state.{index}.{key}")
    return out


def _data_files(path: str, items: dict[str, Item]) -> tuple[int, list[str]]:
    """The world size at save time, from the rank numbers of the data files the metadata names."""
    files = sorted({blob[0] for item in items.values() for blob in item.blobs})
    ranks = {int(m.group(1)) for f in files if (m := re.match(r"__(\d+)_\d+\.distcp$", os.path.basename(f)))}
    return (max(ranks) + 1 if ranks else 1), files


data_files = _data_files  # shared with megatron_folder, which reads the same .metadata and data files


def _read_lightning_meta(path: str, ckpt: Checkpoint, layout: DcpLayout, trust_pickle: bool) -> None:
    """Lightning ModelParallelStrategy keeps `lr_schedulers`, `global_step`, ... in `meta.pt` beside the shards."""
    meta = os.path.join(path, LIGHTNING_META)
    if not os.path.isfile(meta):
        return
    from ckptfix.errors import CkptfixError
    from ckptfix.formats import torch_file

    try:
        tree, _, _ = torch_file.load(meta, opaque=trust_pickle)
    except CkptfixError as exc:
        ckpt.notes.append(f"{LIGHTNING_META} not read ({exc}); its schedule is not checked")
        return
    if not isinstance(tree, dict):
        return
    layout.meta_file = meta
    ckpt.files[LIGHTNING_META] = meta
    scheds = tree.get("lr_schedulers")
    if ckpt.scheduler is None and isinstance(scheds, list) and scheds and isinstance(scheds[0], dict):
        ckpt.scheduler = scheds[0]
        ckpt.sections["scheduler"] = f"{LIGHTNING_META}:lr_schedulers[0]"
    ckpt.extras.update({f"{LIGHTNING_META}:{k}": v for k, v in tree.items() if k != "lr_schedulers"})


def _saved_ties(ckpt: Checkpoint, layout: DcpLayout) -> dict[str, str]:
    """Tied heads: DCP saves both FQNs with the same bytes; the optimizer (if any) holds only the first."""
    params = {p for g in ckpt.optimizer.groups for p in g.params} if ckpt.optimizer is not None else None
    kinds: dict[tuple, list[str]] = {}
    for name, info in ckpt.model.items():
        if len(info.shape) == 2 and info.numel >= 2:
            kinds.setdefault((info.shape, info.dtype), []).append(name)
    # a tie is two names of one shape, the second not in the optimizer: only such groups are fingerprinted
    # (each piece's zip directory is a read: a request per piece in object storage)
    candidates = {n for names in kinds.values() if len(names) > 1
                  and (params is None or any(n not in params for n in names)) for n in names}
    seen: dict[tuple, str] = {}
    ties = {}
    for name, info in ckpt.model.items():
        if name not in candidates:
            continue
        item = layout.items.get(layout.model_items.get(name, ""))
        fingerprint = _fingerprint(item) if item is not None else None
        if fingerprint is None:
            continue
        key = (info.shape, info.dtype, fingerprint)
        first = seen.setdefault(key, name)
        if first != name and (params is None or (first in params and name not in params)):
            ties[name] = first
    return ties


def _fingerprint(item: Item) -> tuple | None:
    """Each piece's offsets, sizes and its data records' CRC-32s (from the zip directory: no values read)."""
    parts = []
    for offsets, sizes in (item.pieces or [((), item.shape)]):
        blob = item.blob_for(offsets) if item.pieces else (item.blobs[0] if len(item.blobs) == 1 else None)
        if blob is None or blob[3]:
            return None
        try:
            members = _Blob(blob[0], blob[1], blob[2], item.fqn).members
        except UnreadableCheckpoint:
            return None
        parts.append((offsets, sizes, tuple(sorted((n, i.CRC, i.file_size) for n, i in members.items()
                                                   if n.startswith("data/")))))
    return tuple(parts)


def data_file_problems(path: str, items: dict[str, Item]) -> list[tuple[str, str]]:
    """Each data file `.metadata` names that is missing or ends before its last record: (why, "missing" or
    "short"), in name order. Structure only: sizes, no bytes read."""
    ends: dict[str, tuple[int, str]] = {}
    for item in items.values():
        for blob in item.blobs:
            end = blob[1] + blob[2]
            if end > ends.get(blob[0], (-1, ""))[0]:
                ends[blob[0]] = (end, item.fqn)
    problems = []
    for file, (end, fqn) in sorted(ends.items()):
        name = os.path.relpath(file, path)
        if not os.path.lexists(file):
            problems.append((f"{name} is missing (.metadata places {fqn!r} and others in it)", "missing"))
        elif not os.path.isfile(file):
            continue  # a folder, a FIFO, a link loop: the record reader refuses it, naming what it is
        elif (size := os.path.getsize(file)) == 0:
            problems.append((f"{name} is empty (0 bytes); .metadata places data up to byte {end:,}", "short"))
        elif size < end:
            problems.append((f"{name} holds {size:,} bytes; .metadata places data up to byte {end:,} (truncated)",
                             "short"))
    return problems


# --- .metadata -------------------------------------------------------------------------------------

def read_metadata(path: str, name: str = METADATA_FILE) -> tuple[dict[str, Item], str | None]:
    """Every item the `.metadata` pickle (or its backup `name`) describes, by FQN, and the DCP metadata version."""
    file = os.path.join(path, name)
    from ckptfix.formats import open_regular

    try:
        with open_regular(file) as f:  # read(n) allocates n bytes up front: never more than the file holds
            data = f.read(min(os.fstat(f.fileno()).st_size, MAX_ITEM_PICKLE) + 1)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{file}: cannot read ({exc.strerror})") from None
    if len(data) > MAX_ITEM_PICKLE:
        raise UnreadableCheckpoint(f"{file}: metadata larger than {MAX_ITEM_PICKLE} bytes; refusing to read it")
    root = load_pickle(data, file, opaque=True)
    opaques = _opaques(root)
    outside = sorted({o.cls for o in opaques} - DCP_GLOBALS - PLANNER_GLOBALS - PLANNER_ENUMS)
    outside += _planner_calls(opaques)
    if outside:  # opaque mode imported nothing, but we only interpret what we know; trusting changes nothing
        raise UnsafePickle(file, outside, hint=False)
    state = _fields(root, "Metadata", file)
    md = state.get("state_dict_metadata")
    if not isinstance(md, dict):
        raise UnreadableCheckpoint(f"{file}: Metadata without state_dict_metadata")
    planner_data = state.get("planner_data")
    planner = planner_data if isinstance(planner_data, dict) else {}
    items = {}
    for fqn, entry in md.items():
        fqn = want_str(fqn, file, "state_dict_metadata key")
        path_keys = planner.get(fqn)
        keys = _planner_path(path_keys, file, fqn) if path_keys is not None else _guess_path(fqn)
        items[fqn] = _item(fqn, entry, keys, file)
    storage = state.get("storage_data")
    for index, info in (want_dict(storage, file, "storage_data") if storage is not None else {}).items():
        where = _fields(index, "MetadataIndex", file)
        item = items.get(want_str(where.get("fqn"), file, "storage_data key fqn"))
        if item is not None:
            item.blobs.append(_blob(path, _fields(info, "_StorageInfo", file), file, item.fqn))
            item.blob_offsets.append(_dims(where.get("offset"), file) if where.get("offset") is not None else None)
    version = state.get("version")
    _prefetch_records(items)
    return items, str(version) if isinstance(version, (str, int)) else None


_BLOB_END = 8192  # a record's zip this small (a step, a scalar, a bias) is fetched whole
_BLOB_PAGE = 4096  # of a larger one, each end: its zip's data.pkl, and its central directory and end records


def _prefetch_records(items: dict[str, Item]) -> None:
    """In object storage (`ckptfix.remote`), what inspect reads of each record, in a few merged requests
    before the readers ask for it piece by piece: the pickled objects (param_groups values, a scheduler's
    state) whole, and each tensor record's ends (a small one whole: its zip's pickle and end records) when
    those lie together within `remote.PREFETCH_BUDGET` requests (a small or 1-rank save). Where they lie
    among the large ones (a request or two each: a step after each parameter's moments, tens of thousands
    of pieces for a large sharded run), the tensor records are left unopened (`Item.unopened`): `.metadata`
    gives their shapes and dtypes, and each is opened and checked when its rows are read."""
    remote = sys.modules.get("ckptfix.remote")
    if remote is None or not remote.active():
        return

    def ends(item: Item) -> list[tuple[str, int, int]]:
        return [r for file, start, length, _ in item.blobs
                for r in ([(file, start, length)] if length <= _BLOB_END else
                          [(file, start, _BLOB_PAGE), (file, start + length - _BLOB_PAGE, _BLOB_PAGE)])]

    remote.prefetch([r for item in items.values() if not item.is_tensor for r in ends(item)])
    tensors = [item for item in items.values() if item.is_tensor]
    if not remote.prefetch([r for item in tensors for r in ends(item)], budget=remote.PREFETCH_BUDGET):
        for item in tensors:
            item.unopened = True


def _opened_when_read(item: Item, blob: tuple) -> bool:
    """A record in object storage left for when its rows are read (`_prefetch_records`)."""
    remote = sys.modules.get("ckptfix.remote")
    return item.unopened and not blob[3] and remote is not None and remote.is_mirrored(blob[0])


MAX_PATH_KEYS = 64  # state-dict nesting in a planner path; real ones are 2-4 deep


def _planner_path(value: Any, origin: str, fqn: str) -> tuple:
    """planner_data[fqn]: the nested state-dict keys, strings or ints, a few deep."""
    keys = want_list(value, origin, f"planner_data[{fqn!r}]", max_len=MAX_PATH_KEYS)
    if not keys or not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in keys):
        raise fail(origin, f"planner_data[{fqn!r}]", "a non-empty path of string or integer keys", value)
    return tuple(keys)


def _blob(folder: str, info: dict, origin: str, fqn: str) -> tuple[str, int, int, Any]:
    """A _StorageInfo: (data file inside the folder, offset, length, transforms), checked."""
    rel = want_str(info.get("relative_path"), origin, f"storage of {fqn!r}: relative_path", max_len=4096)
    # torch joins it to the folder as given ("./__0_0.distcp" loads); "." or "" would name the folder itself
    norm = posixpath.normpath(rel.replace("\\", "/")) if rel.strip() else "."
    if os.path.isabs(rel) or norm == "." or norm == ".." or norm.startswith("../"):
        raise fail(origin, f"storage of {fqn!r}: relative_path", "a file name inside the checkpoint folder", rel)
    offset = want_int(info.get("offset", 0), origin, f"storage of {fqn!r}: offset")
    length = want_int(info.get("length", 0), origin, f"storage of {fqn!r}: length")
    return os.path.join(folder, norm), offset, length, _transforms(info.get("transform_descriptors"), origin, fqn)


def _transforms(value: Any, origin: str, fqn: str) -> list[str] | None:
    """DCP's `transform_descriptors`: a few short strings (e.g. a compression's name). Checked here, because
    they are printed: str() of a memo-shared list walks it as a tree (2**40 steps for a 40-level DAG)."""
    if value is None:
        return None
    items = want_list(value, origin, f"storage of {fqn!r}: transform_descriptors", max_len=64)
    return [want_str(t, origin, f"storage of {fqn!r}: transform_descriptors item", max_len=256) for t in items]


def _opaques(node: Any) -> list[OpaqueObject]:
    """Every OpaqueObject in a tree (classes and call arguments included), each container once."""
    found, seen, stack = [], set(), [node]
    while stack:
        node = stack.pop()
        if node.__class__ in PLAIN_LEAVES or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, OpaqueObject):
            found.append(node)
            stack.extend([node.args, node.state, node.items])
        elif isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, (list, tuple, set, frozenset)):
            stack.extend(node)
    return found


def _planner_calls(opaques: list[OpaqueObject]) -> list[str]:
    """Uses of the planner classes that are not plain data: a dataclass called, an enum called with anything
    but one int."""
    bad = set()
    for o in opaques:
        if o.cls in PLANNER_GLOBALS and (o.called or o.kwargs):
            bad.add(f"{o.cls}(...) called")
        elif o.cls in PLANNER_ENUMS and not (o.called and len(o.args) == 1 and type(o.args[0]) is int):
            bad.add(f"{o.cls} used other than as its value")
    return sorted(bad)


def _fields(obj: Any, name: str, origin: str) -> dict:
    """A DCP dataclass's fields (their pickled `__dict__`), after checking its class name."""
    if not (isinstance(obj, OpaqueObject) and obj.cls.rsplit(".", 1)[-1] == name):
        raise UnreadableCheckpoint(f"{origin}: expected a DCP {name}, found {getattr(obj, 'cls', type(obj).__name__)}")
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
        state = {**(state[0] if isinstance(state[0], dict) else {}), **state[1]}
    if state is None:
        return {}
    if not isinstance(state, dict):
        raise fail(origin, f"{name} fields", "a dict", state)
    return state


def _item(fqn: str, entry: Any, path: tuple, origin: str) -> Item:
    kind = entry.cls.rsplit(".", 1)[-1] if isinstance(entry, OpaqueObject) else type(entry).__name__
    if kind == "BytesStorageMetadata":
        return Item(fqn, path, is_tensor=False)
    if kind != "TensorStorageMetadata":
        raise UnreadableCheckpoint(f"{origin}: item {fqn!r} has unknown storage metadata {kind}")
    fields = _fields(entry, kind, origin)
    props = fields.get("properties")
    # TensorProperties pickles its fields as a tuple (dtype, layout, requires_grad, memory_format, pin_memory).
    pstate = props.state if isinstance(props, OpaqueObject) else None
    if isinstance(pstate, tuple) and pstate:
        dtype = pstate[0]
    elif isinstance(pstate, dict):
        dtype = pstate.get("dtype")
    elif pstate is None:
        dtype = None
    else:
        raise fail(origin, f"properties of {fqn!r}", "a tuple or dict of tensor properties", pstate)
    if not isinstance(dtype, TorchDtype):
        raise UnreadableCheckpoint(f"{origin}: tensor {fqn!r} has no readable dtype")
    chunks = fields.get("chunks")
    pieces = [_piece(c, origin) for c in chunks] if isinstance(chunks, list) else []
    return Item(fqn, path, is_tensor=True, shape=want_shape(fields.get("size", ()), origin, f"{fqn!r} size"), dtype=dtype.name,
                pieces=pieces)


def _piece(chunk: Any, origin: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    fields = _fields(chunk, "ChunkStorageMetadata", origin)
    return _dims(fields.get("offsets", ()), origin), _dims(fields.get("sizes", ()), origin)


def _dims(value: Any, origin: str) -> tuple[int, ...]:
    """A torch.Size as saved (a tuple of ints after the allowlist unpickler)."""
    if not isinstance(value, (tuple, list)) or not all(isinstance(d, int) and d >= 0 for d in value):
        raise UnreadableCheckpoint(f"{origin}: a tensor size or offset that is not a tuple of counts")
    return want_shape(value, origin, "chunk size or offset")  # int64 counts, at most 64 of them


def _guess_path(fqn: str) -> tuple:
    """Without planner_data: `optim.state.<fqn>.<key>` keeps the FQN whole; otherwise split once."""
    head, _, rest = fqn.partition(".")
    if not rest:
        return (head,)
    for part in ("state.", "param_groups."):
        if rest.startswith(part):
            inner, _, key = rest[len(part):].rpartition(".")
            if part == "param_groups." and inner.isdigit():
                return (head, part[:-1], int(inner), key)
            return (head, part[:-1], inner, key)
    return (head, rest)


# --- items -> a nested state dict -------------------------------------------------------------------

def _tree(path: str, items: dict[str, Item], ckpt: Checkpoint, trust_pickle: bool) -> dict:
    """The state dict as saved (nested by planner paths): tensors lazy, small objects unpickled."""
    root: dict = {}
    pending: list[Any] = []
    unread: list[str] = []
    # Non-tensor items naming the same bytes are unpickled once: each is a torch.save zip of its own (~0.1 ms
    # to open and unpickle), and a .metadata of 100,000 items over one record took 19 s (issue 44's fuzz run)
    objects: dict[tuple, Any] = {}
    for item in items.values():
        value: Any
        if item.is_tensor:
            value = _tensor(path, item, pending)
        else:
            where = tuple(item.blobs[0][:3]) if len(item.blobs) == 1 else None
            value = objects.get(where) if where is not None else None
            if value is None:
                value = object_value(path, item, trust_pickle)
                if where is not None:
                    objects[where] = value
        if isinstance(value, dict) and set(value) == {"unread"}:
            unread.append(f"{item.fqn} ({value['unread']})")
        insert_at(root, item.path, value)
    if unread:
        ckpt.notes.append(f"{len(unread)} non-tensor item(s) not unpickled: {', '.join(unread[:3])}"
                          f"{', ...' if len(unread) > 3 else ''}; repair carries them unchanged")
    if pending:
        ckpt.notes.append(f"{len(pending)} tensor(s) cannot be read in place ({pending[0]}); "
                          "inspect still works, values need torch.distributed.checkpoint")
    ckpt.unopened_records = unopened_records(items)
    return _listify(root)


def unopened_records(items: dict[str, Item]) -> int:
    """Tensor records left for when they are read (`_prefetch_records`); per-parameter steps have their own
    count (`common.read_steps`)."""
    return sum(1 for item in items.values() if item.is_tensor and item.path[-1] != "step"
               for blob in item.blobs if _opened_when_read(item, blob))


def insert_at(root: dict, keys: tuple, value: Any) -> None:
    node = root
    for key in keys[:-1]:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            return  # a path both a leaf and a branch: keep the first
    node[keys[-1]] = value


def _listify(node: Any, key: Any = None) -> Any:
    """Dicts keyed 0..n-1 back into lists (DCP flattens `param_groups` into indexed paths).

    An optimizer's `state` stays a dict: saved by index rather than FQN, its keys are 0..n-1 too.
    """
    if not isinstance(node, dict):
        return node
    out = {k: _listify(v, k) for k, v in node.items()}
    if key != "state" and out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
        return [out[i] for i in range(len(out))]
    return out


def _has_tensor(node: dict) -> bool:
    return any(isinstance(v, TensorInfo) or (isinstance(v, dict) and _has_tensor(v)) for v in node.values())


def _flat_tensors(node: dict, prefix: str = "") -> dict[str, TensorInfo]:
    out = {}
    for key, value in node.items():
        if isinstance(value, TensorInfo):
            value.name = prefix + str(key)  # the name inside the model, like every other format
            out[value.name] = value
        elif isinstance(value, dict):
            out.update(_flat_tensors(value, f"{prefix}{key}."))
    return out


def object_value(path: str, item: Item, trust_pickle: bool) -> Any:
    """A non-tensor item: a small `torch.save`d object, unpickled with the allowlist."""
    if len(item.blobs) != 1:
        raise UnreadableCheckpoint(f"{path}: item {item.fqn!r} has {len(item.blobs)} storage records, expected 1")
    file, start, length, transforms = item.blobs[0]
    if transforms:
        return {"unread": f"stored with transforms {transforms}"}
    if length > MAX_ITEM_PICKLE:
        return {"unread": f"{length} bytes"}
    blob = _Blob(file, start, length, item.fqn)
    try:
        value = load_pickle(blob.member("data.pkl"), f"{file}: {item.fqn}", opaque=trust_pickle)
    except UnsafePickle as exc:
        # e.g. torchtitan's BytesIO loss history and dataloader state: not unpickled, never needed to
        # repair (the writer carries every item it does not change byte for byte)
        return {"unread": f"needs globals outside the allowlist ({', '.join(exc.globals_needed)})"}
    if not trust_pickle:  # data objects (a pathlib path, a Namespace) are read inertly; DCP interprets none
        from ckptfix.formats.data_globals import uses

        found = sorted({u.cls for u in uses(value)})
        if found:
            return {"unread": f"holds {', '.join(found)} (data outside the allowlist)"}
    return value


def _tensor(path: str, item: Item, pending: list[str]) -> TensorInfo:
    """A lazily readable tensor: its bytes are the `data/<key>` record of its blob's zip (or, sharded, of
    each piece's blob)."""
    problem = _unreadable_reason(item)
    if problem:
        pending.append(f"{item.fqn}: {problem}")
        return TensorInfo(name=item.fqn, shape=item.shape, dtype=item.dtype, locate=_refuse(item, problem),
                          storage_id=f"dcp:{item.fqn}")
    if len(item.pieces) > 1:
        return ShardedTensor(name=item.fqn, shape=item.shape, dtype=item.dtype, locate=_refuse(item, "sharded"),
                             storage_id=f"dcp:{item.fqn}", item=item)
    if _opened_when_read(item, item.blobs[0]):
        return _unopened_record(path, item.fqn, item.shape, item.dtype, item.blobs[0])
    return _record_tensor(path, item.fqn, item.shape, item.dtype, item.blobs[0])


tensor_info = _tensor  # shared with megatron_folder


def _record_tensor(path: str, name: str, shape: tuple[int, ...], dtype: str, blob_at: tuple) -> TensorInfo:
    """The tensor whose `torch.save` zip lies at `blob_at` (file, offset, length, transforms)."""
    file, start, length, _ = blob_at
    if not os.path.exists(file):
        raise UnreadableCheckpoint(f"{path}: data file {os.path.basename(file)} (holding {name!r}) is missing")
    blob = _Blob(file, start, length, name)
    ref = load_pickle(blob.member("data.pkl"), f"{file}: {name}")
    if not isinstance(ref, TensorRef) or ref.shape != shape or ref.dtype != dtype:
        raise UnreadableCheckpoint(f"{file}: record of {name!r} does not hold the {list(shape)} "
                                   f"{dtype} tensor .metadata describes")
    if not ref.fits_storage():
        raise UnreadableCheckpoint(f"{file}: record of {name!r} addresses bytes outside its storage")
    where = blob.record(f"data/{ref.storage.key}")
    return TensorInfo(name=name, shape=shape, dtype=dtype, locate=lambda: where, storage_id=f"{file}:{where.start}",
                      offset=ref.offset, stride=ref.stride)


def _unopened_record(path: str, name: str, shape: tuple[int, ...], dtype: str, blob_at: tuple) -> TensorInfo:
    """The tensor at `blob_at` as `.metadata` describes it, its record opened and checked when first read.
    DCP's writer saves each record as its own whole storage (a view is cloned first): element 0, contiguous,
    which opening checks, so the offset and stride given now are the record's."""
    opened: list[TensorInfo] = []

    def locate() -> ByteRange:
        if not opened:
            if blob_at[2] <= _BLOB_END:  # the whole record in one request, not its zip end then its pickle
                sys.modules["ckptfix.remote"].prefetch([blob_at[:3]])
            problem = _blob_problem(blob_at)
            if problem:
                raise UnreadableCheckpoint(f"{blob_at[0]}: record of {name!r}: {problem}")
            tensor = _record_tensor(path, name, shape, dtype, blob_at)
            if tensor.offset or (tensor.stride is not None and tuple(tensor.stride) != contiguous_stride(shape)):
                raise UnreadableCheckpoint(f"{blob_at[0]}: record of {name!r} holds a view (offset {tensor.offset}, "
                                           f"stride {tensor.stride}), not the whole storage DCP writes")
            opened.append(tensor)
        return opened[0].locate()

    return TensorInfo(name=name, shape=shape, dtype=dtype, locate=locate, storage_id=f"{blob_at[0]}@{blob_at[1]}")


@dataclass
class ShardedTensor(TensorInfo):
    """A tensor saved in pieces (one per rank): `read_stored()` assembles them; no single byte range."""

    item: Item | None = None

    def read_stored(self) -> np.ndarray:
        out: np.ndarray = np.empty(self.shape, dtype=NUMPY_DTYPES[self.dtype])
        self.read_rows_into(out)
        out.flags.writeable = False
        return out

    def byte_ranges(self) -> list[tuple[str, int, int]]:
        assert self.item is not None
        return [(file, start, length) for file, start, length, _ in self.item.blobs]

    def read_rows_into(self, dst: np.ndarray) -> None:
        """Rows 0..len(dst)-1: each piece's part in that range is copied from its mapped record straight
        into place (one memcpy per piece; pieces wholly outside are not read)."""
        assert self.item is not None
        folder, rows = os.path.dirname(self.item.blobs[0][0]), dst.shape[0]
        for offsets, sizes in self.item.pieces:
            if offsets[0] >= rows:
                continue
            blob = self.item.blob_for(offsets)
            if blob is None:
                raise UnreadableCheckpoint(f"{folder}: no stored record for a piece of {self.item.fqn!r}")
            piece = _record_tensor(folder, self.item.fqn, sizes, self.dtype, blob).read_stored()
            take = min(sizes[0], rows - offsets[0])
            where = (slice(offsets[0], offsets[0] + take),) + tuple(slice(o, o + n) for o, n in zip(offsets[1:], sizes[1:]))
            dst[where] = piece[:take]

    def to_torch(self):
        return stored_to_torch(self.read_stored().copy(), self.dtype)


def _unreadable_reason(item: Item) -> str:
    if len(item.pieces) > 1:
        return _pieces_problem(item)
    if len(item.blobs) != 1:
        return f"{len(item.blobs)} storage records for one piece"
    return "" if _opened_when_read(item, item.blobs[0]) else _blob_problem(item.blobs[0])


def _blob_problem(blob: tuple) -> str:
    file, start, length, transforms = blob
    if transforms:
        return f"stored with transforms {transforms} (e.g. compression)"
    if os.path.exists(file) and bytes(file_map(file)[start:start + 4]) != _ZIP_MAGIC:
        return "not a torch.save record (SAFETENSORS serialization is not supported)"
    return ""


def _pieces_problem(item: Item) -> str:
    """Pieces must tile the tensor (inside it, counts adding up) and each have one readable record."""
    if item.dtype not in NUMPY_DTYPES:
        return f"dtype {item.dtype} cannot be assembled"
    total = 0
    for offsets, sizes in item.pieces:
        if len(offsets) != len(item.shape) or len(sizes) != len(item.shape) or any(
                o + n > d for o, n, d in zip(offsets, sizes, item.shape)):
            return f"a piece at {list(offsets)} of {list(sizes)} lies outside the {list(item.shape)} tensor"
        blob = item.blob_for(offsets)
        if blob is None:
            return f"no storage record for the piece at {list(offsets)}"
        problem = "" if _opened_when_read(item, blob) else _blob_problem(blob)
        if problem:
            return problem
        total += math.prod(sizes)
    if total != math.prod(item.shape):
        return f"its {len(item.pieces)} pieces hold {total} of {math.prod(item.shape)} elements (overlap or gap)"
    return ""


def _refuse(item: Item, problem: str) -> Callable[[], ByteRange]:
    def locate() -> ByteRange:
        raise UnreadableCheckpoint(f"{item.fqn}: {problem}; load it with "
                                   "torch.distributed.checkpoint.load")
    return locate


class _Window(io.RawIOBase):
    """`length` bytes of a mapped file from `start`, as a seekable file: zipfile reads a blob in place."""

    def __init__(self, file: str, start: int, length: int):
        try:
            self.mapped = file_map(file)
        except (OSError, ValueError) as exc:
            raise UnreadableCheckpoint(f"{file}: cannot open DCP data file ({exc})") from None
        self.start, self.length, self.pos = start, length, 0
        if start + length > len(self.mapped):
            raise UnreadableCheckpoint(f"{file}: record at {start} runs past the end of the file (truncated?)")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = max(0, {0: pos, 1: self.pos + pos, 2: self.length + pos}[whence])
        return self.pos

    def readinto(self, buffer) -> int:
        end = min(self.length, self.pos + len(buffer))
        n = max(0, end - self.pos)
        buffer[:n] = self.mapped[self.start + self.pos:self.start + end]
        self.pos += n
        return n


class _Blob:
    """One item's `torch.save` zip inside a `.distcp` file."""

    def __init__(self, file: str, start: int, length: int, fqn: str):
        self.file, self.start, self.fqn = file, start, fqn
        self.window = _Window(file, start, length)
        try:
            with zipfile.ZipFile(self.window) as zf:
                self.members = {i.filename.split("/", 1)[-1]: i for i in zf.infolist()}
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error, NotImplementedError) as exc:
            # NotImplementedError: a damaged "version needed to extract" field ("zip file version 25.5")
            raise UnreadableCheckpoint(f"{file}: record of {fqn!r} is not a readable torch.save zip ({exc})") from None

    def _info(self, name: str) -> zipfile.ZipInfo:
        info = self.members.get(name)
        if info is None:
            raise UnreadableCheckpoint(f"{self.file}: record of {self.fqn!r} lacks {name}")
        if info.compress_type != zipfile.ZIP_STORED:
            raise UnreadableCheckpoint(f"{self.file}: {name} of {self.fqn!r} is compressed; torch.save never does that")
        return info

    def _data_start(self, info: zipfile.ZipInfo) -> int:
        self.window.seek(info.header_offset)
        header = self.window.read(_LOCAL_HEADER.size)
        if len(header) < _LOCAL_HEADER.size or header[:4] != _ZIP_MAGIC:
            raise UnreadableCheckpoint(f"{self.file}: bad zip local header in the record of {self.fqn!r}")
        fields = _LOCAL_HEADER.unpack(header)
        return info.header_offset + _LOCAL_HEADER.size + fields[-2] + fields[-1]

    def member(self, name: str) -> bytes:
        info = self._info(name)
        if info.file_size > MAX_ITEM_PICKLE:
            raise UnreadableCheckpoint(f"{self.file}: {name} of {self.fqn!r} declares {info.file_size} bytes")
        start = self._data_start(info)
        if start + info.file_size > self.window.length:  # read(n) would allocate the claimed size first
            raise UnreadableCheckpoint(f"{self.file}: {name} of {self.fqn!r} runs past the end of its record (truncated?)")
        self.window.seek(start)
        return self.window.read(info.file_size)

    def record(self, name: str) -> ByteRange:
        """Where a tensor record's raw bytes lie in the `.distcp` file itself."""
        info = self._info(name)
        start = self._data_start(info)
        if start + info.file_size > self.window.length:
            raise UnreadableCheckpoint(f"{self.file}: {name} of {self.fqn!r} runs past its record")
        return ByteRange(self.file, self.start + start, info.file_size)

