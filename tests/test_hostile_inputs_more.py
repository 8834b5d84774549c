"""Six more hostile inputs, each through the real CLI (`malicious_corpus.run_batch`: `ckptfix.cli.main` in a
separate process): `inspect` and `repair` each give one line on stderr and exit 2, never a traceback,
an internal error (exit 3), a hang or a MemoryError, and repair leaves nothing beside OUT.

Inputs are built from real files: a real `dcp.save` folder of a small LM, `torch.save`, a safetensors
header written by hand; then one field is made wrong.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import warnings
from pathlib import Path

import malicious_corpus as mc
import pytest
import torch
from ckpt_factory import new_run

ROOT = Path(__file__).resolve().parents[1]
TOK = ROOT / "fixtures" / "seed001" / "tokenizer.model"
ERR = "ckptfix: error: "


def _dcp(path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": new_run(vocab=64).model.state_dict(), "step": 1}, checkpoint_id=str(path))
    return path


def _both(path: Path, tmp_path: Path, timeout: float = 20) -> list[dict]:
    """inspect and repair of `path`; each result's stderr is one line and its code is 2."""
    jobs = [{"id": "inspect", "argv": ["inspect", str(path)]},
            {"id": "repair", "argv": ["repair", str(path), "-t", str(TOK), "-o", str(tmp_path / "out")]}]
    results = mc.run_batch(jobs, cwd=tmp_path, timeout=timeout)
    for r in results.values():
        assert r["code"] == 2, r
        assert r["stderr"].startswith(ERR) and r["stderr"].count("\n") == 1, r
        assert "Traceback" not in r["stderr"], r
    assert not any("ckptfix-tmp" in name for name in os.listdir(tmp_path)), os.listdir(tmp_path)
    assert not (tmp_path / "out").exists()
    return [results["inspect"], results["repair"]]


def test_dcp_tensor_properties_as_a_list(tmp_path):
    """TensorProperties pickled with a list state (torch writes a tuple): one line, not AttributeError."""
    from torch.distributed.checkpoint.metadata import TensorProperties

    folder = _dcp(tmp_path / "dcp")
    md = pickle.loads((folder / ".metadata").read_bytes())
    orig = TensorProperties.__getstate__
    TensorProperties.__getstate__ = lambda self: list(orig(self))  # type: ignore[method-assign]
    try:
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    finally:
        TensorProperties.__getstate__ = orig  # type: ignore[method-assign]
    for r in _both(folder, tmp_path):
        assert "expected a tuple or dict of tensor properties, got a list" in r["stderr"], r


@pytest.mark.parametrize("cls", ["TensorStorageMetadata", "ChunkStorageMetadata"])
def test_dcp_dataclass_fields_as_a_list(tmp_path, cls):
    """A DCP dataclass whose pickled fields are a list instead of a dict is refused, not read as empty."""
    import torch.distributed.checkpoint.metadata as m

    folder = _dcp(tmp_path / "dcp")
    md = pickle.loads((folder / ".metadata").read_bytes())
    klass = getattr(m, cls)
    klass.__getstate__ = lambda self: list(vars(self).values())  # type: ignore[attr-defined]
    try:
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    finally:
        del klass.__getstate__
    for r in _both(folder, tmp_path):
        assert f"{cls} fields: expected a dict, got a list" in r["stderr"], r


@pytest.mark.parametrize("shape", [[0, 1 << 62], [1 << 62, 0]])
def test_safetensors_empty_tensor_with_a_huge_dimension(tmp_path, shape):
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]},
                         "lm_head.weight": {"dtype": "F32", "shape": shape, "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    for r in _both(path, tmp_path):
        assert "has an invalid shape" in r["stderr"], r


@pytest.mark.parametrize("shape", [(0, 1 << 62), (1 << 62, 0)])
def test_torch_file_empty_tensor_with_a_huge_dimension(tmp_path, shape):
    path = tmp_path / "ckpt.pth"
    torch.save({"model": {"embed_tokens.weight": torch.empty(shape), "lm_head.weight": torch.empty(shape)}}, path)
    for r in _both(path, tmp_path):
        assert "tensor with a dimension over 2**48" in r["stderr"], r


def test_dcp_size_with_a_huge_dimension(tmp_path):
    folder = _dcp(tmp_path / "dcp")
    md = pickle.loads((folder / ".metadata").read_bytes())
    object.__setattr__(md.state_dict_metadata["model.text_embedding.weight"], "size", torch.Size([0, 1 << 62]))
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    for r in _both(folder, tmp_path):
        assert "expected dimensions of at most 2**48" in r["stderr"], r


def _nested(depth: int) -> list:
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def test_deep_list_in_the_ckptfix_record(tmp_path):
    """A record (the "ckptfix" key of a torch.save dict) holding a list 300 deep: was RecursionError (exit 3)
    under inspect --json; the record is refused in one line by every command."""
    path = tmp_path / "ckpt.pth"
    torch.save({"model": new_run(vocab=64).model.state_dict(),
                "ckptfix": {"schema": "ckptfix.repair/1", "notes": _nested(300)}}, path)
    for r in _both(path, tmp_path):
        assert r["stderr"] == f"{ERR}{path}: ckptfix record: expected a record nested at most 200 deep, got one " \
                              "nested deeper\n", r
    r = mc.run_batch([{"id": 0, "argv": ["inspect", "--json", str(path)]}], cwd=tmp_path)[0]
    assert r["code"] == 2 and r["stderr"].count("\n") == 1, r


def test_deep_list_in_a_ckptfix_json_sidecar(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in new_run(vocab=64).model.state_dict().items()}, str(path))
    sidecar = tmp_path / "model.safetensors.ckptfix.json"
    sidecar.write_text('{"schema": "ckptfix.repair/1", "notes": ' + "[" * 100_000 + "]" * 100_000 + "}")
    for r in _both(path, tmp_path):
        assert "(nested 201 deep; at most 200)" in r["stderr"], r


@pytest.mark.parametrize("field", ["global_step", "max_steps"])
def test_trainer_state_with_a_400_digit_integer(tmp_path, field):
    """trainer_state.json's counter as a 400-digit integer (JSON allows it; ckptfix's parser takes up to 400
    digits): `diff` raised OverflowError (exit 3). A step out of float range is not used; nothing crashes."""
    from safetensors.torch import save_file

    folders = []
    for name in ("a", "b"):
        folder = tmp_path / name
        folder.mkdir()
        save_file({k: v.contiguous() for k, v in new_run(vocab=64).model.state_dict().items()},
                  str(folder / "model.safetensors"))
        state = {"global_step": 3, "max_steps": 10, "log_history": [{"diff": 1}]}
        text = json.dumps(state).replace(f'"{field}": {state[field]}', f'"{field}": {"9" * 400}')
        (folder / "trainer_state.json").write_text(text.replace('"diff": 1', '"diff": ' + "9" * 400))
        folders.append(str(folder))
    jobs = [{"id": "inspect", "argv": ["inspect", folders[0]]},
            {"id": "json", "argv": ["inspect", "--json", folders[0]]},
            {"id": "diff", "argv": ["diff", *folders]},
            {"id": "repair", "argv": ["repair", folders[0], "-t", str(TOK), "-o", str(tmp_path / "out")]}]
    results = mc.run_batch(jobs, cwd=tmp_path)
    for r in results.values():
        assert r["code"] in (0, 1) and "Traceback" not in r["stderr"] and "internal error" not in r["stderr"], r
    assert not any("ckptfix-tmp" in name for name in os.listdir(tmp_path))


def _with_relative_path(folder: Path, rel: str) -> Path:
    md = pickle.loads((folder / ".metadata").read_bytes())
    for info in md.storage_data.values():
        info.relative_path = rel
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    return folder


@pytest.mark.parametrize("rel", ["./__0_0.distcp", "sub/../__0_0.distcp", "__0_0.distcp/"])
def test_dcp_relative_paths_torch_loads(tmp_path, rel):
    """Storage paths torch joins to the folder and loads: the same bytes are read (was EINVAL, exit 3)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    original = _dcp(tmp_path / "orig")
    folder = tmp_path / "dcp"
    shutil.copytree(original, folder)
    (folder / "sub").mkdir()
    _with_relative_path(folder, rel)
    state = {"model": {k: torch.zeros_like(v) for k, v in new_run(vocab=64).model.state_dict().items()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder))  # torch reads it
    results = mc.run_batch([{"id": "scan", "argv": ["inspect", str(folder), "--scan"]},
                            {"id": "diff", "argv": ["diff", str(original), str(folder)]},
                            {"id": "repair", "argv": ["repair", str(folder), "-t", str(TOK), "-o",
                                                      str(tmp_path / "out")]}],
                           cwd=tmp_path, timeout=60)
    assert results["scan"]["code"] == 0, results["scan"]
    assert results["diff"]["code"] == 0 and "0 changed" in results["diff"]["stdout"], results["diff"]
    assert results["repair"]["code"] == 0, results["repair"]


@pytest.mark.parametrize("rel,message", [
    (".", "relative_path: expected a file name inside the checkpoint folder, got the string '.'"),
    ("", "relative_path: expected a file name inside the checkpoint folder, got the string ''"),
    ("./sub/..", "relative_path: expected a file name inside the checkpoint folder, got the string './sub/..'"),
    ("sub", "sub: not a regular file"),
])
def test_dcp_relative_paths_naming_no_file(tmp_path, rel, message):
    """A storage path naming the folder itself or a folder in it: one line (was OSError EINVAL, exit 3)."""
    folder = _with_relative_path(_dcp(tmp_path / "dcp"), rel)
    (folder / "sub").mkdir()
    for r in _both(folder, tmp_path):
        assert message in r["stderr"], r


@pytest.mark.parametrize("link", ["self", "folder", "fifo"])
def test_dcp_data_file_that_is_a_loop_a_folder_link_or_a_fifo(tmp_path, link):
    """The data file's name is a link to itself, a link to its own folder, or a FIFO: one line each, quickly
    (the run's timeout is a hang guard), nothing left beside OUT."""
    folder = _dcp(tmp_path / "dcp")
    data = folder / "__0_0.distcp"
    data.unlink()
    if link == "fifo":
        os.mkfifo(data)
    else:
        os.symlink("__0_0.distcp" if link == "self" else ".", data)
    for r in _both(folder, tmp_path):
        assert "__0_0.distcp" in r["stderr"], r


def test_dcp_folder_with_link_loops_beside_the_data(tmp_path):
    """`loop -> .`, `self -> self`, `a -> b -> a` in a DCP folder: inspect, repair -o and --in-place ignore
    them (they are not named by .metadata) and finish; restore puts the folder back."""
    folder = _dcp(tmp_path / "dcp")
    os.symlink(".", folder / "loop")
    os.symlink("self", folder / "self")
    os.symlink("b", folder / "a")
    os.symlink("a", folder / "b")
    before = sorted(os.listdir(folder))
    jobs = [{"id": "inspect", "argv": ["inspect", str(folder), "--scan"]},
            {"id": "out", "argv": ["repair", str(folder), "-t", str(TOK), "-o", str(tmp_path / "out")]}]
    results = mc.run_batch(jobs, cwd=tmp_path, timeout=60)
    assert results["inspect"]["code"] in (0, 1) and results["out"]["code"] == 0, results
    in_place = mc.run_batch([{"id": "in", "argv": ["repair", str(folder), "-t", str(TOK), "--in-place",
                                                   "--keep-ids"]},
                             ], cwd=tmp_path, timeout=60)["in"]
    assert in_place["code"] == 0, in_place
    restored = mc.run_batch([{"id": "r", "argv": ["restore", str(folder)]}], cwd=tmp_path, timeout=60)["r"]
    assert restored["code"] == 0 and sorted(os.listdir(folder)) == before, (restored, os.listdir(folder))


def test_dcp_metadata_with_100k_items_over_one_record(tmp_path, monkeypatch):
    """A .metadata naming 100,000 non-tensor items, all over the same record (issue 44's fuzz run: each was opened
    and unpickled again, 19 s of CPU): the record is unpickled once and inspect finishes (bench/hostile_scale.py
    times such inputs; the test counts the work)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    import ckptfix
    from ckptfix.formats import dcp_folder

    folder = _dcp(tmp_path / "dcp")
    md = pickle.loads((folder / ".metadata").read_bytes())
    some = md.storage_data[MetadataIndex("step")]
    for i in range(100_000):
        md.state_dict_metadata[f"extra.{i}"] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(f"extra.{i}")] = some
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    opened = []
    real = dcp_folder.object_value
    monkeypatch.setattr(dcp_folder, "object_value", lambda *a: opened.append(a[1].fqn) or real(*a))
    report = ckptfix.inspect(folder)
    assert len(opened) == 1, len(opened)  # "step" and the 100,000 items name one record
    extra = report.ckpt.extras["extra"]
    assert len(extra) == 100_000 and all(v == report.ckpt.extras["step"] == 1 for v in extra.values())
    r = mc.run_batch([{"id": 0, "argv": ["inspect", str(folder)]}], cwd=tmp_path, timeout=120)[0]
    assert r["code"] in (0, 1) and not r["stderr"], r
