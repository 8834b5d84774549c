"""A differential against torch's own weights-only loader: random objects from torch's allowlist, saved by torch.

`generate(seed)` builds one checkpoint-shaped dict (random nesting of tensors of every dtype torch saves,
sparse / nested / meta / quantized tensors, Parameters, views sharing a storage, OrderedDicts, tuples, sets,
dtypes, devices, sizes, and now and then a value torch's allowlist does not hold: a slice, a frozenset, a
Namespace). `save(obj, path, fmt)` writes it with `torch.save` in one of `FORMATS` (zip or legacy stream,
pickle protocol 2-5, storage alignment 64 or 4096, storages tagged with a device string from `DEVICES`, or a
big-endian archive: the zip's records byte-swapped per storage dtype and its `byteorder` record set to "big",
what torch.save writes on a big-endian machine). `compare(path)` loads it with
`torch.load(weights_only=True, map_location="cpu")` and with ckptfix's reader and returns the disagreement,
or None: the same tensors (count, shape, dtype, stored bytes) where torch loads it; ckptfix refusing it or
naming it in CKF704 where torch refuses it.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import pickle
import random
import warnings
import zipfile
from collections import Counter
from typing import Any

import numpy as np
import torch
import torch.utils.serialization

from ckptfix.checkpoint import TensorInfo
from ckptfix.errors import CkptfixError
from ckptfix.formats import torch_file
from ckptfix.formats.common import iter_leaves
from ckptfix.formats.data_globals import uses
from ckptfix.formats.pickle_records import RebuiltTensor, TensorRef
from ckptfix.formats.pickle_safe import globals_in_pickle

NESTED_LEGACY = "a nested tensor in a legacy (non-zip) file"
DENSE_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128, torch.uint16, torch.uint32,
                torch.uint64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz,
                torch.float8_e8m0fnu, torch.complex32, torch.bits8, torch.bits16]
DEVICES = ["cpu", "cuda", "cuda:0", "cuda:3", "mps", "meta", "hpu:0", "xpu:1", "privateuseone:0"]
FORMATS = ["zip-p2", "zip-p2-align4096", "zip-p3", "zip-p4", "zip-p5", "legacy-p2", "legacy-p3", "legacy-p4",
           "legacy-p5", "zip-p2-bigendian", "zip-p2-device", "legacy-p2-device"]


def _dense(rng: random.Random) -> torch.Tensor:
    dtype = rng.choice(DENSE_DTYPES)
    shape = [rng.randint(0, 4) for _ in range(rng.randint(0, 3))]
    base = torch.randint(0, 100, (max(1, int(np.prod(shape))) * 2,), dtype=torch.int64)
    t = base.to(torch.float32).to(dtype) if dtype not in (torch.uint16, torch.uint32, torch.uint64, torch.bits8,
                                                          torch.bits16, torch.complex32) else None
    if t is None:  # no arithmetic on these: their bytes from a random byte tensor
        size = torch.empty(0, dtype=dtype).element_size()
        t = torch.randint(0, 256, (base.numel() * size,), dtype=torch.uint8).view(dtype)
    view = rng.random()
    if view < 0.3 and t.numel() > 2:
        return t[1:1 + int(np.prod(shape))].reshape(shape) if shape else t[1]  # an offset into the storage
    if view < 0.45 and len(shape) == 2:
        return t[:shape[0] * shape[1]].reshape(shape[1], shape[0]).t()  # strided
    return t[:int(np.prod(shape))].reshape(shape)


def _tensor(rng: random.Random, budget: Counter) -> Any:
    kind = rng.random()
    x = torch.randn(3, 4)
    x[x.abs() < 0.6] = 0
    if kind < 0.55:
        return _dense(rng)
    if kind < 0.62:
        return torch.nn.Parameter(torch.randn(rng.randint(0, 3), 2), requires_grad=rng.random() < 0.5)
    if kind < 0.70:
        layout = rng.choice(["coo", "csr", "csc", "bsr", "bsc"])
        return {"coo": lambda: x.to_sparse(), "csr": x.to_sparse_csr, "csc": x.to_sparse_csc,
                "bsr": lambda: x.to_sparse_bsr((1, 2)), "bsc": lambda: x.to_sparse_bsc((1, 2))}[layout]()
    if kind < 0.76:
        return torch.empty(rng.randint(0, 3), 2, dtype=rng.choice([torch.float32, torch.bfloat16]), device="meta")
    if kind < 0.82:
        return torch.nested.nested_tensor([torch.randn(rng.randint(1, 3), 2) for _ in range(rng.randint(1, 3))])
    if kind < 0.90:
        if rng.random() < 0.5:
            return torch.quantize_per_tensor(torch.randn(4), 0.1, 3, rng.choice([torch.quint8, torch.qint8, torch.qint32]))
        return torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2], dtype=torch.float64),
                                          torch.tensor([0, 1]), 0, rng.choice([torch.quint8, torch.qint8]))
    if kind < 0.93:  # torch's lazy conjugate bit: the stored values are before it (pickled as metadata)
        return torch.tensor([1 + 2j, 3 - 1j], dtype=rng.choice([torch.complex64, torch.complex128])).conj()
    shared = budget.setdefault("shared", torch.arange(12, dtype=torch.float32))  # views of one storage
    return shared[rng.randint(0, 6):][:rng.randint(0, 6)]


def _plain(rng: random.Random) -> Any:
    return rng.choice([
        lambda: rng.randint(-5, 1 << 40), lambda: rng.random(), lambda: "s" * rng.randint(0, 300), lambda: None,
        lambda: True, lambda: b"\x00bytes", lambda: complex(1, 2), lambda: 1 << 70, lambda: bytearray(b"ba"),
        lambda: rng.choice([torch.float32, torch.bfloat16, torch.int4, torch.uint7, torch.float8_e5m2]),
        lambda: torch.device(rng.choice(["cpu", "cuda", "cuda:1", "meta", "mps"])),
        lambda: torch.Size([rng.randint(0, 9), 3]), lambda: {1, "a", (2, 3)},
    ])()


def _refused_value(rng: random.Random) -> Any:
    """A value torch's default allowlist does not hold (ckptfix reads it as data and names it, CKF704)."""
    return rng.choice([lambda: slice(1, 5, 2), lambda: frozenset({1, 2}),
                       lambda: argparse.Namespace(lr=0.1, name="run")])()


def _value(rng: random.Random, depth: int, budget: Counter) -> Any:
    roll = rng.random()
    if depth > 3 or roll < 0.35:
        return _tensor(rng, budget) if rng.random() < 0.6 else _plain(rng)
    if roll < 0.37:
        return _refused_value(rng)
    n = rng.randint(0, 4)
    kind = rng.choice(["dict", "odict", "list", "tuple"])
    items = [_value(rng, depth + 1, budget) for _ in range(n)]
    if kind == "dict":
        return {f"k{i}": v for i, v in enumerate(items)}
    if kind == "odict":
        return collections.OrderedDict((f"k{i}", v) for i, v in enumerate(items))
    return items if kind == "list" else tuple(items)


def generate(seed: int) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    budget: Counter = Counter()
    return {f"part{i}": _value(rng, 0, budget) for i in range(rng.randint(1, 5))}


@contextlib.contextmanager
def _location(device: str):
    """Storages saved as if they lived on `device` (`torch.save` records `location_tag(storage)`)."""
    import torch.serialization as ser

    original = ser.location_tag
    ser.location_tag = lambda storage: device
    try:
        yield
    finally:
        ser.location_tag = original


def save(obj: Any, path: str, fmt: str, rng: random.Random) -> None:
    kind, proto = fmt.split("-")[:2]
    kwargs = {"pickle_protocol": int(proto[1:]), "_use_new_zipfile_serialization": kind == "zip"}
    device = rng.choice(DEVICES) if fmt.endswith("-device") else "cpu"
    align = 4096 if "align4096" in fmt else 64
    with _location(device) if device != "cpu" else contextlib.nullcontext(), \
            torch.utils.serialization.config.patch({"save.storage_alignment": align}):
        torch.save(obj, path, **kwargs)
    if fmt.endswith("-bigendian"):
        _to_big_endian(path)


def _to_big_endian(path: str) -> None:
    """Rewrite a little-endian zip as a big-endian machine's torch.save writes it: each typed storage's
    elements byte-swapped (complex ones per half, as `TypedStorage.byteswap`), `byteorder` = big."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    prefix = next(n for n in members if n.endswith("/data.pkl")).split("/")[0]
    sizes: dict[str, int] = {}

    class Reader(pickle.Unpickler):  # trusted: the file this test just wrote
        def persistent_load(self, pid):
            storage_type, key = pid[1], pid[2]
            dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
            size = torch.empty(0, dtype=dtype).element_size()
            sizes[key] = size // 2 if dtype.is_complex else size
            return torch.UntypedStorage(0)

        def find_class(self, module, name):
            if name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3", "_rebuild_qtensor", "_rebuild_sparse_tensor",
                        "_rebuild_nested_tensor", "_rebuild_parameter", "_rebuild_from_type_v2"):
                return lambda *a, **k: None
            return super().find_class(module, name)

    Reader(io.BytesIO(members[f"{prefix}/data.pkl"])).load()
    for key, size in sizes.items():
        name = f"{prefix}/data/{key}"
        if size > 1:
            members[name] = np.frombuffer(members[name], dtype=f"<u{size}").astype(f">u{size}").tobytes()
    members[f"{prefix}/byteorder"] = b"big"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as z:
        for name, data in members.items():
            z.writestr(name, data)


# --- comparing ------------------------------------------------------------------------------------

def _torch_tensors(obj: Any) -> list[torch.Tensor]:
    out, seen, stack = [], set(), [obj]
    while stack:
        node = stack.pop()
        if isinstance(node, torch.Tensor):
            out.append(node)
        elif isinstance(node, (dict, list, tuple, set)) and id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)
    return out


def _ckptfix_tensors(tree: Any) -> list[Any]:
    return [n for n in iter_leaves(tree) if isinstance(n, (TensorRef, RebuiltTensor))]


def _key(t: Any) -> tuple:
    if isinstance(t, torch.Tensor):
        shape = None if t.is_nested else tuple(t.shape)
        return (shape, str(t.dtype).removeprefix("torch."))
    return (t.shape, t.dtype)


def _torch_bytes(t: torch.Tensor) -> bytes:
    if t.is_quantized:
        t = t.int_repr()
    if t.is_conj():  # ckptfix reads the stored values; the bit is in TensorRef.metadata
        t = t.conj()
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _ckptfix_bytes(ref: TensorRef, locate_for: Any) -> bytes:
    info = TensorInfo("t", ref.shape, ref.dtype, locate_for(ref.storage), ref.storage.key, ref.offset, ref.stride)
    stored = info.read_stored()
    return np.ascontiguousarray(stored.astype(stored.dtype.newbyteorder("="))).tobytes() if ref.numel else b""


def compare(path: str, stats: Counter) -> str | None:
    """None if ckptfix reads `path` as torch.load(weights_only=True, map_location="cpu") does, else what differs."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            expected = torch.load(path, weights_only=True, map_location="cpu")
        torch_error = None
    except Exception as exc:  # noqa: BLE001 - whatever torch refuses with
        expected, torch_error = None, exc
    try:
        refusals: list[str] = []
        tree, locate_for, _ = torch_file.load(path, refusals=refusals)
        ours_error = None
    except CkptfixError as exc:
        tree, ours_error = None, exc
    if torch_error is not None:
        stats["torch refuses"] += 1
        if ours_error is not None:
            stats["both refuse"] += 1
            return None
        # what CKF704 reports (checks/weights_only.py): objects torch refuses, and the reader's refusals
        if refusals or any(u.torch_refuses for u in uses(tree)):
            stats["torch refuses, ckptfix CKF704"] += 1
            return None
        return f"torch refuses ({str(torch_error).splitlines()[0][:160]}); ckptfix reads it without CKF704"
    if ours_error is not None:
        return f"torch reads it; ckptfix refuses: {ours_error}"
    if refusals == [NESTED_LEGACY]:  # torch read the nested tensor's sizes from memory that held them by chance
        stats["nested tensor in a legacy file: torch read it by chance"] += 1
        return None
    if refusals:
        return f"torch reads it; ckptfix would name {refusals} in CKF704"
    stats["both read"] += 1
    theirs, ours = _torch_tensors(expected), _ckptfix_tensors(tree)
    if sorted(map(_key, theirs), key=repr) != sorted(map(_key, ours), key=repr):
        return f"tensors differ: torch {sorted(map(_key, theirs), key=repr)} ckptfix {sorted(map(_key, ours), key=repr)}"
    dense_theirs = sorted((_key(t), _torch_bytes(t)) for t in theirs
                          if t.layout == torch.strided and not t.is_nested and t.device.type != "meta")
    dense_ours = sorted((_key(t), _ckptfix_bytes(t, locate_for)) for t in ours if isinstance(t, TensorRef))
    if dense_theirs != dense_ours:
        return "tensor values differ"
    stats["tensors compared"] += len(theirs)
    return None


def globals_of(path: str) -> list[str]:
    """The globals a saved file's pickle names (for the per-global counts)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            return globals_in_pickle(z.read(next(n for n in z.namelist() if n.endswith("/data.pkl"))))
    with open(path, "rb") as f:
        data = f.read()
    names: set[str] = set()
    pos = 0
    for _ in range(5):  # magic, protocol, sys info, the object, storage keys
        from ckptfix.formats.pickle_safe import pickle_end

        end = pickle_end(data, pos, path)
        names.update(globals_in_pickle(data[pos:end]))
        pos = end
    return sorted(names)


def run(seeds: range, folder: str) -> tuple[Counter, Counter, Counter, list[str]]:
    """Every seed in every format: (files per format, and per format read by both / refused by torch; files
    per global; outcome counts; failures)."""
    per_format, per_global, stats, failures = Counter(), Counter(), Counter(), []
    for seed in seeds:
        obj = generate(seed)
        rng = random.Random(seed)
        fmt = FORMATS[seed % len(FORMATS)]
        path = f"{folder}/{seed}-{fmt}.pt"
        try:
            save(obj, path, fmt, rng)
        except Exception as exc:  # noqa: BLE001 - torch cannot write this object in this format
            stats[f"torch.save cannot write ({type(exc).__name__})"] += 1
            continue
        per_format[fmt] += 1
        per_global.update(globals_of(path))
        outcome: Counter = Counter()
        problem = compare(path, outcome)
        stats.update(outcome)
        per_format.update(f"{fmt}: {k}" for k in outcome if k in ("both read", "torch refuses"))
        if problem:
            failures.append(f"seed {seed} {fmt}: {problem}")
    return per_format, per_global, stats, failures
