"""ckptfix's reader against torch's weights-only loader (issue 35): every global on torch's allowlist is handled,
every format torch writes is read as torch reads it, and what torch refuses ckptfix refuses or names (CKF704).
The generator and comparator are tests/torch_differential.py; real old files: tests/test_real_weight_files.py."""

from __future__ import annotations

import copyreg
import io
import pickle
import struct
import sys
from pathlib import Path

import pytest
import torch

from ckptfix.formats import pickle_safe

sys.path.insert(0, str(Path(__file__).parent))
import torch_differential as diff  # noqa: E402


def test_every_global_on_torchs_allowlist_is_handled():
    """Fails when torch adds a global to its weights-only allowlist that ckptfix's reader does not handle."""
    from torch._weights_only_unpickler import _get_allowed_globals

    handled = {f"{m}.{n}" for m, n in pickle_safe.ALLOWED_GLOBALS} | pickle_safe.TENSOR_CLASSES | \
        set(pickle_safe.NAMED_ONLY)
    missing = sorted(set(_get_allowed_globals()) - handled)
    assert not missing, f"torch {torch.__version__} allowlists globals ckptfix does not read: {missing}"


def _report(per_format, per_global, stats, failures) -> None:
    print("\nfiles per format:", dict(sorted(per_format.items())))
    print("files per torch global:", dict(sorted(per_global.items())))
    print("outcomes:", dict(stats))
    assert not failures, "\n".join(failures[:20])


def test_differential_slice(tmp_path):
    """A few hundred generated files, every format: ckptfix reads each as torch does (< 30 s)."""
    per_format, per_global, stats, failures = diff.run(range(0, 240), str(tmp_path))
    assert sum(per_format[f] for f in diff.FORMATS) == 240 and stats["both read"] > 40 and stats["torch refuses"] > 40
    _report(per_format, per_global, stats, failures)


@pytest.mark.long
def test_differential_long(tmp_path):
    per_format, per_global, stats, failures = diff.run(range(1000, 7000), str(tmp_path))
    _report(per_format, per_global, stats, failures)


# --- the oldest writers, reproduced: a legacy stream as torch 0.1-0.4 wrote it ------------------------

class _Storage:
    def __init__(self, tensor: torch.Tensor, key: str, location: str, view: tuple | None = None):
        self.tensor, self.key, self.location, self.view = tensor, key, location, view


class _OldPickler(pickle._Pickler):  # type: ignore[name-defined]  # the Python one: its dispatch table
    """torch.save's legacy stream as old releases wrote it: `torch._utils._rebuild_tensor(storage, offset,
    size, stride)` (0.4.0) or NEWOBJ of a tensor class plus BUILD with that state (0.1-0.3), CUDA storages."""

    def __init__(self, f, style: str, location: str):
        super().__init__(f, protocol=2)
        self.style, self.location, self.storages = style, location, {}

    def persistent_id(self, obj):
        if isinstance(obj, _Storage):
            self.storages[obj.key] = obj.tensor
            cls = (torch.cuda if obj.location.startswith("cuda") else torch).FloatStorage
            return ("storage", cls, obj.key, obj.location, obj.tensor.numel(), obj.view)
        return None

    def reducer_override(self, obj):
        if not isinstance(obj, torch.Tensor):
            return NotImplemented
        base = obj._base if obj._base is not None else obj
        key = str(id(base))
        start = 1 if self.style == "view" and obj.storage_offset() >= 1 else 0
        view = (f"{key}v", start, base.numel() - start) if start else None  # a slice of its root storage
        state = (_Storage(base, key, self.location, view), obj.storage_offset() - start, tuple(obj.shape), obj.stride())
        if self.style == "newobj":
            return NotImplemented  # `_save_newobj`
        return torch._utils._rebuild_tensor, state

    def _state(self, obj):
        base = obj._base if obj._base is not None else obj
        return (_Storage(base, str(id(base)), self.location), obj.storage_offset(), tuple(obj.shape), obj.stride())

    def _save_newobj(self, obj):  # NEWOBJ torch.FloatTensor (), BUILD state: no class check on `obj`
        self.save_reduce(copyreg.__newobj__, (torch.FloatTensor,), self._state(obj), obj=None)
        self.memoize(obj)

    dispatch = {**pickle._Pickler.dispatch, torch.Tensor: _save_newobj}  # type: ignore[attr-defined]


def _legacy_file(path: Path, obj, style: str, location: str) -> None:
    body = io.BytesIO()
    pickler = _OldPickler(body, style, location)
    pickler.dump(obj)
    with open(path, "wb") as f:
        for head in (0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True,
                                                    "type_sizes": {"short": 2, "int": 4, "long": 4}}):
            pickle.dump(head, f, protocol=2)
        f.write(body.getvalue())
        pickle.dump(list(pickler.storages), f, protocol=2)
        for tensor in pickler.storages.values():
            f.write(struct.pack("<q", tensor.numel()) + tensor.numpy().tobytes())


@pytest.mark.parametrize("style", ["rebuild_tensor", "newobj", "view"])
@pytest.mark.parametrize("location", ["cpu", "cuda:0", "cuda"])
def test_pre_1_0_legacy_streams(tmp_path, style, location):
    """torch 0.4.0's `_rebuild_tensor` with CUDA storages (lpips' v0.0 weights), 0.1-0.3's NEWOBJ + BUILD,
    and a storage view: torch.load(weights_only=True) reads each, and ckptfix reads the same tensors."""
    base = torch.arange(24, dtype=torch.float32)
    obj = {"w": base[2:14].view(3, 4), "t": base[:12].view(3, 4).t(), "b": torch.arange(5, dtype=torch.float32) * 2}
    path = tmp_path / "old.pth"
    _legacy_file(path, obj, style, location)
    stats = diff.Counter()
    assert diff.compare(str(path), stats) is None
    assert stats["both read"] == 1 and stats["tensors compared"] == 3


def test_big_endian_archive_values(tmp_path):
    """A big-endian archive is read byte-swapped per storage dtype, as torch.load does; repair refuses it."""
    import ckptfix
    from ckptfix.errors import CkptfixError

    path, named = tmp_path / "be.pt", tmp_path / "be-slice.pt"
    state = {"w": torch.arange(6, dtype=torch.float32).view(2, 3), "c": torch.tensor([1 + 2j]),
             "h": torch.tensor([1.5], dtype=torch.bfloat16), "u": torch.tensor([258], dtype=torch.uint16)}
    torch.save(state, path)
    torch.save({**state, "s": slice(1, 2)}, named)  # a value convert rewrites
    for p in (path, named):
        diff._to_big_endian(str(p))
    stats = diff.Counter()
    assert diff.compare(str(path), stats) is None and stats["tensors compared"] == 4
    ckpt = ckptfix.formats.read_checkpoint(str(path))
    assert ckpt.model["w"].read().tolist() == [[0, 1, 2], [3, 4, 5]]
    assert ckpt.model["w"].to_torch().tolist() == [[0, 1, 2], [3, 4, 5]]
    from ckptfix.weights_only import convert

    with pytest.raises(CkptfixError, match="big-endian"):
        convert(str(named), str(tmp_path / "out.pt"))


def test_protocols_torch_refuses_are_named(tmp_path):
    """torch.save(pickle_protocol=4) loads with weights_only=False only: ckptfix reads it and CKF704 says why."""
    import ckptfix
    from ckptfix.formats import torch_file

    path = tmp_path / "p4.pt"
    torch.save({"model": {"w": torch.ones(2, 2)}}, path, pickle_protocol=4)
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    refusals: list[str] = []
    torch_file.load(str(path), refusals=refusals)
    assert refusals == ["opcode FRAME (pickle protocol 4+)"]
    finding = next(f for f in ckptfix.inspect(str(path)).findings if f.code == "CKF704")
    assert "FRAME (pickle protocol 4+)" in finding.message
    from ckptfix.weights_only import convert

    convert(str(path), str(tmp_path / "p2.pt"))  # the copy is protocol 2: torch's weights-only loader reads it
    assert torch.load(tmp_path / "p2.pt", weights_only=True)["model"]["w"].tolist() == [[1, 1], [1, 1]]


def test_tensor_subclass_is_named(tmp_path, monkeypatch):
    """A tensor subclass torch refuses (its class is a global outside the allowlist) is read as a tensor and
    named by CKF704, without importing the class."""
    import ckptfix

    class Marked(torch.Tensor):
        pass

    import types

    Marked.__module__, Marked.__qualname__ = "somelib_tensors", "Marked"
    module = types.ModuleType("somelib_tensors")
    module.Marked = Marked  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "somelib_tensors", module)
    data = io.BytesIO()
    torch.save({"model": {"w": torch.ones(2).as_subclass(Marked)}}, data)
    path = tmp_path / "sub.pt"
    path.write_bytes(data.getvalue())
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    finding = next(f for f in ckptfix.inspect(str(path)).findings if f.code == "CKF704")
    assert "somelib_tensors.Marked" in finding.message


def test_sparse_nested_meta_inspected_and_converted(tmp_path):
    """A checkpoint holding sparse, nested and meta tensors (and a slice torch refuses): inspect reads it, and
    `convert` writes a copy torch's weights-only loader reads with the same tensors."""
    import ckptfix
    from ckptfix.weights_only import convert

    x = torch.tensor([[0.0, 1.5, 0.0], [2.0, 0.0, 3.0]])
    src, out = tmp_path / "mixed.pt", tmp_path / "mixed.weights_only.pt"
    torch.save({"model": {"w": torch.ones(2, 3), "coo": x.to_sparse(), "csr": x.to_sparse_csr(),
                          "meta": torch.nn.Parameter(torch.empty(4, 2, device="meta")),
                          "nested": torch.nested.nested_tensor([torch.ones(2, 2), torch.zeros(1, 2)]),
                          "conj": torch.tensor([1 + 2j, 3 - 4j]).conj()},
                "window": slice(0, 8)}, src)
    report = ckptfix.inspect(str(src))
    assert "CKF704" in [f.code for f in report.findings]
    convert(str(src), str(out))
    loaded = torch.load(out, weights_only=True)["model"]
    assert torch.equal(loaded["coo"].to_dense(), x) and torch.equal(loaded["csr"].to_dense(), x)
    assert loaded["meta"].is_meta and isinstance(loaded["meta"], torch.nn.Parameter) and loaded["meta"].shape == (4, 2)
    assert loaded["nested"].is_nested and torch.equal(loaded["nested"].unbind()[0], torch.ones(2, 2))
    assert loaded["conj"].is_conj() and loaded["conj"].resolve_conj().tolist() == [1 - 2j, 3 + 4j]
    stats = diff.Counter()
    assert diff.compare(str(out), stats) is None and stats["tensors compared"] == 6


class _Call:
    """An object torch.save pickles as `fn(*args)`: the rarer rebuild functions on torch's allowlist."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


@pytest.mark.parametrize("name", ["cpu_tensor", "parameter_with_state", "sparse_class", "wrapper_subclass"])
def test_rarer_rebuild_functions(tmp_path, name):
    """`_rebuild_device_tensor_from_cpu_tensor` (xla/mtia tensors), `_rebuild_parameter_with_state`, a legacy
    sparse tensor class called with (indices, values, size): read as torch reads them; a wrapper subclass,
    which torch refuses for every class on its default list, is refused too."""
    import collections

    u = torch._utils
    value = {
        "cpu_tensor": _Call(u._rebuild_device_tensor_from_cpu_tensor, (torch.arange(4.0), torch.float32, "xla:0", False)),
        "parameter_with_state": _Call(u._rebuild_parameter_with_state,
                                      (torch.ones(2), True, collections.OrderedDict(), ({"tag": 1}, None))),
        "sparse_class": _Call(torch.sparse.FloatTensor, (torch.tensor([[0, 1]]), torch.tensor([1.0, 2.0]), torch.Size([3]))),
        "wrapper_subclass": _Call(u._rebuild_wrapper_subclass, (torch.Tensor, torch.float32, (2, 3), (3, 1), 0,
                                                               torch.strided, torch.device("meta"), False)),
    }[name]
    path = tmp_path / f"{name}.pt"
    torch.save({"x": value}, path)
    stats = diff.Counter()
    assert diff.compare(str(path), stats) is None
    assert stats["both read" if name != "wrapper_subclass" else "both refuse"] == 1, dict(stats)
