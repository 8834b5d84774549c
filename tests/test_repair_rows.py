"""New-row values are computed with numpy (no torch import in a repair); they must be what torch
would store: the same rounding to bfloat16/float16, the same bits for every special value."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptfix.checkpoint import stored_to_torch
from ckptfix.errors import RepairError
from ckptfix.surgery.rows import COVARIANCE_SCALE, column_stats, narrow_to_stored, new_row_values


def edge_floats() -> torch.Tensor:
    """Values that stress rounding: ties at every bfloat16/float16 boundary, subnormals, overflow,
    infinities, NaN, signed zeros, plus random values over many magnitudes."""
    g = torch.Generator().manual_seed(0)
    ties = (torch.arange(-512, 512, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)  # exact bf16 ties
    near = (torch.arange(-512, 512, dtype=torch.int32) << 16 | 0x7FFF).view(torch.float32)
    special = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), 3.4e38, -3.4e38, 65504.0,
                            65520.0, 1e-40, -1e-45, 6e-8, 3e-8, 2.98e-8, 1.0 + 2**-11, 1.0 + 3 * 2**-11])
    spread = torch.randn(4096, generator=g) * torch.logspace(-30, 30, 4096)
    return torch.cat([ties, near, special, spread])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64, torch.float32])
def test_narrowing_matches_torch_bit_for_bit(dtype):
    values = edge_floats()
    ours = stored_to_torch(narrow_to_stored(values.numpy(), str(dtype).split(".")[1]), str(dtype).split(".")[1])
    theirs = values.to(dtype)
    assert ours.dtype == theirs.dtype
    nan = torch.isnan(theirs)
    assert torch.equal(torch.isnan(ours), nan)
    assert torch.equal(ours[~nan].view(torch.uint8) if dtype == torch.float64 else ours[~nan],
                       theirs[~nan].view(torch.uint8) if dtype == torch.float64 else theirs[~nan])
    assert torch.equal(torch.signbit(ours[~nan]), torch.signbit(theirs[~nan]))  # -0.0 stays -0.0


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_mean_init_sits_at_the_old_rows_mean_with_tiny_per_column_noise(dtype):
    g = torch.Generator().manual_seed(1)
    old = (torch.randn(3000, 48, generator=g) * torch.linspace(0.01, 2.0, 48) + torch.linspace(-1, 1, 48))
    old = old.to(getattr(torch, dtype))
    stored = old.view(torch.uint16).numpy() if dtype == "bfloat16" else old.numpy()
    rows = new_row_values(stored, dtype, 200, "mean", 0.02, np.random.default_rng(0))
    new = stored_to_torch(rows, dtype).float()
    mean = old.float().mean(0)
    assert new.shape == (200, 48)
    # Rounded to the dtype, new rows are the column mean (the 1e-9 covariance noise is far below
    # bfloat16/float16 resolution); in float32 they differ from it by about sqrt(1e-9 * var).
    atol = {"float32": 6 * (4 * COVARIANCE_SCALE) ** 0.5, "bfloat16": 1e-2, "float16": 2e-3}[dtype]
    torch.testing.assert_close(new, mean.expand(200, -1), atol=atol, rtol=0)
    if dtype == "float32":
        noise = (new - mean).std(0)
        expected = (old.float().var(0) * COVARIANCE_SCALE).sqrt()
        assert torch.all(noise > 0.7 * expected) and torch.all(noise < 1.3 * expected)
        assert len({tuple(r) for r in new.tolist()}) == 200  # distinct rows


def test_column_stats_bounded_blocks_match_numpy_whole():
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((5000, 300)).astype(np.float32) * 3 + 1  # several 16 MB blocks
    mean, var = column_stats(rows, "float32")
    np.testing.assert_allclose(mean, rows.astype(np.float64).mean(0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(var, rows.astype(np.float64).var(0), rtol=1e-9)
    mean_only, no_var = column_stats(rows, "float32", variance=False)
    assert no_var is None
    np.testing.assert_array_equal(mean_only, mean)  # the same sums, widened inside the reduction


def test_moment_bias_and_integer_rows():
    rng = np.random.default_rng(0)
    sq = np.abs(rng.standard_normal((100, 8))).astype(np.float32)
    np.testing.assert_allclose(new_row_values(sq, "float32", 3, "column-mean", 0.02, rng),
                               np.broadcast_to(sq.mean(0), (3, 8)), rtol=1e-6)
    bias = rng.standard_normal(100).astype(np.float32)
    np.testing.assert_allclose(new_row_values(bias, "float32", 4, "mean", 0.02, rng), np.full(4, bias.mean()),
                               rtol=1e-6)  # a bias gets its plain mean, no noise
    ids = np.arange(100, dtype=np.int64).reshape(50, 2)
    assert not new_row_values(ids, "int64", 2, "mean", 0.02, rng).any()
    normal = new_row_values(np.zeros((10, 1000), np.float32), "float32", 50, "normal", 0.5, rng)
    assert abs(float(normal.std()) - 0.5) < 0.01


def test_float8_rows_need_zeros():
    raw = np.zeros((10, 4), dtype=np.uint8)
    with pytest.raises(RepairError, match="--init zeros"):
        new_row_values(raw, "float8_e4m3fn", 2, "mean", 0.02, np.random.default_rng(0))
    assert not new_row_values(raw, "float8_e4m3fn", 2, "zeros", 0.02, np.random.default_rng(0)).any()
