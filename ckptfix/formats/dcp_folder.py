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
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
from dataclasses import dataclass, field
from typing import Any, Callable

from ckptfix.checkpoint import ByteRange, Checkpoint, TensorInfo, file_map
from ckptfix.errors import UnreadableCheckpoint, UnsafePickle
from ckptfix.formats import common
from ckptfix.formats.pickle_safe import OpaqueObject, TensorRef, TorchDtype, load_pickle

METADATA_FILE = ".metadata"
_MD = "torch.distributed.checkpoint.metadata."
# The only classes a DCP `.metadata` pickle may name (besides the weights allowlist: torch.Size, dtypes).
DCP_GLOBALS = frozenset({
    _MD + "Metadata", _MD + "MetadataIndex", _MD + "TensorStorageMetadata", _MD + "BytesStorageMetadata",
    _MD + "ChunkStorageMetadata", _MD + "TensorProperties", _MD + "StorageMeta", _MD + "_MEM_FORMAT_ENCODING",
    "torch.distributed.checkpoint.filesystem._StorageInfo", "torch.serialization._get_layout",
    "pathlib.PosixPath", "pathlib.WindowsPath", "pathlib.PurePosixPath", "pathlib.PureWindowsPath",
})
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
    chunks: int = 1
    blobs: list[tuple[str, int, int, Any]] = field(default_factory=list)  # (file, offset, length, transforms)


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    """Read a DCP folder: model, optimizer (FQN-keyed), scheduler; everything else into extras."""
    items, version = read_metadata(path)
    ckpt = Checkpoint(path=path, format="dcp", raw=items)
    ckpt.extras["dcp_version"] = version
    tree = _tree(path, items, ckpt, trust_pickle)
    model_key = _pick(tree, common.MODEL_KEYS, lambda v: isinstance(v, dict) and _has_tensor(v))
    optim_key = _pick(tree, common.OPTIMIZER_KEYS, common.is_optimizer_state)
    sched_key = _pick(tree, common.SCHEDULER_KEYS, lambda v: isinstance(v, dict))
    used = {k for k in (model_key, optim_key, sched_key) if k is not None}
    if model_key is not None:
        ckpt.model = _flat_tensors(tree[model_key])
    else:  # a bare `dcp.save(model.state_dict())`: top-level tensors are the model
        ckpt.model = {k: v for k, v in tree.items() if isinstance(v, TensorInfo)}
        used.update(ckpt.model)
    ckpt.sections["model"] = model_key or ""
    ckpt.tied = common.find_tied(ckpt.model)
    if optim_key is not None:
        ckpt.optimizer = common.parse_optimizer(tree[optim_key], None, f"{path}: {optim_key}")
        ckpt.sections["optimizer"] = optim_key
    if sched_key is not None:
        ckpt.scheduler = tree[sched_key]
        ckpt.sections["scheduler"] = sched_key
    ckpt.extras.update({k: v for k, v in tree.items() if k not in used})
    ckpt.files = {"metadata": os.path.join(path, METADATA_FILE)}
    if not ckpt.model and ckpt.optimizer is None:
        raise UnreadableCheckpoint(f"{path}: DCP checkpoint holds no model tensors or optimizer state "
                                   f"(top-level keys: {', '.join(map(str, list(tree)[:8]))})")
    return ckpt


def _pick(tree: dict, keys: tuple[str, ...], accept: Callable[[Any], bool]) -> str | None:
    return next((k for k in keys if k in tree and accept(tree[k])), None)


# --- .metadata -------------------------------------------------------------------------------------

def read_metadata(path: str) -> tuple[dict[str, Item], str | None]:
    """Every item the `.metadata` pickle describes, by FQN, and the DCP metadata version."""
    file = os.path.join(path, METADATA_FILE)
    from ckptfix.formats import open_regular

    try:
        with open_regular(file) as f:
            data = f.read(MAX_ITEM_PICKLE + 1)
    except OSError as exc:
        raise UnreadableCheckpoint(f"{file}: cannot read ({exc.strerror})") from None
    if len(data) > MAX_ITEM_PICKLE:
        raise UnreadableCheckpoint(f"{file}: metadata larger than {MAX_ITEM_PICKLE} bytes; refusing to read it")
    root = load_pickle(data, file, opaque=True)
    outside = sorted({o.cls for o in _opaques(root)} - DCP_GLOBALS)
    if outside:  # opaque mode imported nothing, but we only interpret what we know
        raise UnsafePickle(file, outside)
    state = _fields(root, "Metadata", file)
    md = state.get("state_dict_metadata")
    if not isinstance(md, dict):
        raise UnreadableCheckpoint(f"{file}: Metadata without state_dict_metadata")
    planner_data = state.get("planner_data")
    planner = planner_data if isinstance(planner_data, dict) else {}
    items = {}
    for fqn, entry in md.items():
        path_keys = planner.get(fqn)
        items[str(fqn)] = _item(str(fqn), entry, tuple(path_keys) if isinstance(path_keys, (tuple, list))
                                else _guess_path(str(fqn)), file)
    for index, info in (state.get("storage_data") or {}).items():
        where = _fields(index, "MetadataIndex", file)
        blob = _fields(info, "_StorageInfo", file)
        item = items.get(str(where.get("fqn")))
        if item is not None:
            item.blobs.append((os.path.join(path, str(blob.get("relative_path"))), int(blob.get("offset", 0)),
                               int(blob.get("length", 0)), blob.get("transform_descriptors")))
    version = state.get("version")
    return items, str(version) if version is not None else None


def _opaques(node: Any) -> list[OpaqueObject]:
    """Every OpaqueObject in a tree (classes and call arguments included), each container once."""
    found, seen, stack = [], set(), [node]
    while stack:
        node = stack.pop()
        if id(node) in seen:
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


def _fields(obj: Any, name: str, origin: str) -> dict:
    """A DCP dataclass's fields (their pickled `__dict__`), after checking its class name."""
    if not (isinstance(obj, OpaqueObject) and obj.cls.rsplit(".", 1)[-1] == name):
        raise UnreadableCheckpoint(f"{origin}: expected a DCP {name}, found {getattr(obj, 'cls', type(obj).__name__)}")
    state = obj.state
    if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
        state = {**(state[0] or {}), **state[1]}
    return state if isinstance(state, dict) else {}


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
    dtype = pstate[0] if isinstance(pstate, tuple) and pstate else (pstate or {}).get("dtype")
    if not isinstance(dtype, TorchDtype):
        raise UnreadableCheckpoint(f"{origin}: tensor {fqn!r} has no readable dtype")
    chunks = fields.get("chunks")
    return Item(fqn, path, is_tensor=True, shape=tuple(int(d) for d in fields.get("size", ())),
                dtype=dtype.name, chunks=len(chunks) if isinstance(chunks, list) else 1)


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
    for item in items.values():
        value = _tensor(path, item, pending) if item.is_tensor else _object(path, item, trust_pickle)
        _insert(root, item.path, value)
    if pending:
        ckpt.notes.append(f"{len(pending)} tensor(s) cannot be read in place ({pending[0]}); "
                          "inspect still works, values need torch.distributed.checkpoint")
    return _listify(root)


def _insert(root: dict, keys: tuple, value: Any) -> None:
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


def _object(path: str, item: Item, trust_pickle: bool) -> Any:
    """A non-tensor item: a small `torch.save`d object, unpickled with the allowlist."""
    if len(item.blobs) != 1:
        raise UnreadableCheckpoint(f"{path}: item {item.fqn!r} has {len(item.blobs)} storage records, expected 1")
    file, start, length, transforms = item.blobs[0]
    if transforms:
        return {"unread": f"stored with transforms {transforms}"}
    if length > MAX_ITEM_PICKLE:
        return {"unread": f"{length} bytes"}
    blob = _Blob(file, start, length, item.fqn)
    return load_pickle(blob.member("data.pkl"), f"{file}: {item.fqn}", opaque=trust_pickle)


def _tensor(path: str, item: Item, pending: list[str]) -> TensorInfo:
    """A lazily readable tensor: its bytes are the `data/<key>` record of its blob's zip."""
    problem = _unreadable_reason(item)
    info = TensorInfo(name=item.fqn, shape=item.shape, dtype=item.dtype, locate=_refuse(item, problem),
                      storage_id=f"dcp:{item.fqn}")
    if problem:
        pending.append(f"{item.fqn}: {problem}")
        return info
    file, start, length, _ = item.blobs[0]
    if not os.path.exists(file):
        raise UnreadableCheckpoint(f"{path}: data file {os.path.basename(file)} (holding {item.fqn!r}) is missing")
    blob = _Blob(file, start, length, item.fqn)
    ref = load_pickle(blob.member("data.pkl"), f"{file}: {item.fqn}")
    if not isinstance(ref, TensorRef) or ref.shape != item.shape or ref.dtype != item.dtype:
        raise UnreadableCheckpoint(f"{file}: record of {item.fqn!r} does not hold the {list(item.shape)} "
                                   f"{item.dtype} tensor .metadata describes")
    if not ref.fits_storage():
        raise UnreadableCheckpoint(f"{file}: record of {item.fqn!r} addresses bytes outside its storage")
    where = blob.record(f"data/{ref.storage.key}")
    info.locate, info.offset, info.stride, info.ref = (lambda: where), ref.offset, ref.stride, ref
    info.storage_id = f"{file}:{where.start}"
    return info


def _unreadable_reason(item: Item) -> str:
    if item.chunks != 1 or len(item.blobs) != 1:
        return f"stored in {max(item.chunks, len(item.blobs))} chunks (a sharded save)"
    file, start, length, transforms = item.blobs[0]
    if transforms:
        return f"stored with transforms {transforms} (e.g. compression)"
    if os.path.exists(file) and bytes(file_map(file)[start:start + 4]) != _ZIP_MAGIC:
        return "not a torch.save record (SAFETENSORS serialization is not supported)"
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
        except (zipfile.BadZipFile, OSError, EOFError, ValueError, struct.error) as exc:
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
        self.window.seek(self._data_start(info))
        return self.window.read(info.file_size)

    def record(self, name: str) -> ByteRange:
        """Where a tensor record's raw bytes lie in the `.distcp` file itself."""
        info = self._info(name)
        start = self._data_start(info)
        if start + info.file_size > self.window.length:
            raise UnreadableCheckpoint(f"{self.file}: {name} of {self.fqn!r} runs past its record")
        return ByteRange(self.file, self.start + start, info.file_size)

