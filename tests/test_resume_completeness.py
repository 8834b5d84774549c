"""Issue 42: what a real HF Trainer checkpoint-N/ lacks for resume_from_checkpoint (CKF310-CKF313)."""

from __future__ import annotations

import shutil

import pytest

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect

pytest.importorskip("transformers")
from test_latest import trainer_run as run_fixture  # noqa: E402 (the real Trainer run fixture)

trainer_run = run_fixture

EXPECT = {"optimizer.pt": "CKF310", "scheduler.pt": "CKF310", "trainer_state.json": "CKF311",
          "rng_state.pth": "CKF313"}


def _copy(trainer_run, tmp_path):
    d = tmp_path / "checkpoint-6"
    shutil.copytree(trainer_run / "checkpoint-6", d)
    return d


def test_healthy_checkpoint_has_no_new_finding(trainer_run, tmp_path):
    report = inspect(str(_copy(trainer_run, tmp_path)))
    assert not [f for f in report.findings if f.code in ("CKF310", "CKF311", "CKF312", "CKF313")]


@pytest.mark.parametrize("name", sorted(EXPECT))
@pytest.mark.parametrize("how", ["removed", "half", "zero"])
def test_damaged_file_is_named(trainer_run, tmp_path, name, how):
    d = _copy(trainer_run, tmp_path)
    f = d / name
    if how == "removed":
        f.unlink()
    else:
        data = f.read_bytes()
        f.write_bytes(data[: len(data) // 2] if how == "half" else b"")
    code = "CKF312" if (name, how) == ("rng_state.pth", "removed") else EXPECT[name]
    try:
        report = inspect(str(d))
    except CkptfixError as exc:  # a torn optimizer.pt / scheduler.pt is refused, naming the file
        assert how != "removed" and name in ("optimizer.pt", "scheduler.pt") and name in str(exc)
        return
    hits = [f for f in report.findings if f.code == code]
    assert hits and name in hits[0].message
    if code != "CKF312":
        assert report.exit_code == 1
