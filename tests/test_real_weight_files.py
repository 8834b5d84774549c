"""Real weight files shipped inside pinned PyPI wheels (fixtures/weight_files.py): each is read by ckptfix as
torch.load(weights_only=True, map_location="cpu") reads it (the same tensors: count, shapes, dtypes, stored
bytes), or, where torch refuses it, ckptfix refuses it too or names why (CKF704). The small wheels run in the
default slice when cached (.ci/run fetches them); the rest is `long`. Nothing is downloaded here: an uncached
file skips."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
sys.path.insert(0, str(Path(__file__).parent))
import torch_differential as diff  # noqa: E402
import weight_files  # noqa: E402


def _param(entry: weight_files.WeightFile):
    marks = [] if entry.package in weight_files.SLICE else [pytest.mark.long]
    return pytest.param(entry, id=f"{entry.package}:{entry.member.rsplit('/', 2)[-2]}/{Path(entry.member).name}",
                        marks=marks)


@pytest.mark.parametrize("entry", [_param(e) for e in weight_files.FILES])
def test_read_as_torch_reads_it(entry: weight_files.WeightFile):
    path = weight_files.cached(entry)
    if path is None:
        pytest.skip(f"{entry.member} not cached: run python fixtures/weight_files.py")
    stats: Counter = Counter()
    assert diff.compare(str(path), stats) is None
    assert stats["both read"] == (1 if entry.torch_reads else 0), dict(stats)
