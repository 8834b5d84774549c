"""Issue 33, item 10: a numpy dtype in a checkpoint is data (convertible, never CKF705), and the printed fix
of a file ckptfix cannot convert does not begin with a dangling "or, if you trust the file:"."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_weights_only import Custom

import ckptfix


def test_a_numpy_dtype_is_data(tmp_path):
    src = tmp_path / "dt.pth"
    torch.save({"model": {"w": torch.zeros(2)}, "cfg": {"dtype": np.dtype("float32"), "big": np.dtype(">i4")}}, src)
    report = ckptfix.inspect(src)
    assert [f.code for f in report.findings] == ["CKF704"]
    assert report.findings[0].message == (
        "torch.load(weights_only=True) refuses this file because of: numpy.dtype, numpy.dtypes.Float32DType, "
        "numpy.dtypes.Int32DType; at cfg.dtype (numpy.dtype: 'float32'); cfg.big (numpy.dtype: '>i4')")
    assert report.findings[0].fix.startswith(f"ckptfix convert {src} -o {tmp_path / 'dt.weights_only.pth'} ")
    out = ckptfix.convert(src, tmp_path / "out.pth")
    assert [(c.path, c.to, c.detail) for c in out.conversions] == [
        ("cfg.dtype", "str", "the dtype's name"), ("cfg.big", "str", "the dtype's name")]
    cfg = torch.load(tmp_path / "out.pth", weights_only=True)["cfg"]
    assert cfg == {"dtype": "float32", "big": ">i4"}
    assert np.dtype(cfg["big"]) == np.dtype(">i4")  # the name gives the dtype back


def test_the_fix_of_an_unconvertible_file_starts_with_what_to_do(tmp_path):
    src = tmp_path / "c.pth"
    torch.save({"model": {"w": torch.ones(1)}, "c": Custom()}, src)
    (ckf704,) = [f for f in ckptfix.inspect(src).findings if f.code == "CKF704"]
    assert ckf704.fix == (
        "re-save these values as plain data (dict, list, numbers, tensors) in the training script; allowlist "
        f"{Custom.__module__}.Custom with torch.serialization.add_safe_globals only if you wrote those classes (ckptfix "
        "names no class it cannot check)")
    assert not ckf704.fix.startswith("or")
    with pytest.raises(ckptfix.RepairError, match="not convertible"):
        ckptfix.convert(src, tmp_path / "o.pth")
