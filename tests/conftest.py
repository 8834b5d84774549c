"""Test-session settings shared by every module."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test models are tiny: one intra-op thread is many times faster than several on this 2-core
    machine (OpenMP workers spin while they wait for a core) and keeps runs deterministic."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The S3 API server of the object-storage tests (moto's server mode; skips without the `s3` extra).
from s3_server import s3, s3_server  # noqa: E402, F401
