"""One table of formats (`ckptfix.formats.FORMATS`): every row resolves, detection and reading go through
it, repair finds its writer there, and a format's own notes are decided with the plan (--dry-run shows them)."""

from __future__ import annotations

import pytest
from ckpt_factory import trained_checkpoint

import ckptfix
from ckptfix.formats import BY_NAME, FORMATS, detect, read_checkpoint, resolve
from ckptfix.surgery import _writer_for

accelerate = pytest.importorskip("accelerate")
from test_repair_accelerate import source, tokenizers  # noqa: E402,F401  (module fixtures)


def test_every_row_resolves_and_names_are_unique():
    assert len(BY_NAME) == len(FORMATS)
    for f in FORMATS:
        for ref in (f.sniff, f.read, f.write, f.refuse, f.notes):
            if ref is not None:
                assert callable(resolve(ref)), (f.name, ref)
        if f.write is not None:
            assert _writer_for(f.name) is resolve(f.write)


def test_a_torch_file_is_detected_and_read_through_the_table(tmp_path):
    path = trained_checkpoint(tmp_path / "c.pth", 30, steps=1)
    assert detect(str(path)) == "torch"
    assert read_checkpoint(path).format == "torch"


def test_dry_run_shows_the_format_notes(source, tokenizers, tmp_path):  # noqa: F811
    root, _, _ = source
    result = ckptfix.repair(root / "bin", tokenizers[40], tmp_path / "out", policy="reset", dry_run=True)
    assert any("removed (policy reset)" in n for n in result.to_json()["notes"])
    assert not (tmp_path / "out").exists()


def test_the_model_imports_no_format_and_dtypes_are_one_table():
    import ast
    from pathlib import Path

    import ckptfix.checkpoint
    from ckptfix.dtypes import DTYPE_SIZES, DTYPES, SAFETENSORS_TO_TORCH, STORAGE_DTYPES
    from ckptfix.formats import pickle_safe, safetensors_file

    tree = ast.parse(Path(ckptfix.checkpoint.__file__).read_text())
    modules = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in modules if m.startswith("ckptfix.formats")]  # no import runs upward
    assert pickle_safe.DTYPE_SIZES is DTYPE_SIZES and safetensors_file.DTYPES is SAFETENSORS_TO_TORCH
    assert all(DTYPES[name].size == size for name, size in STORAGE_DTYPES.values())
