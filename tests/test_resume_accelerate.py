"""Issue 42: what a real `Accelerator.save_state` folder lacks for `Accelerator.load_state` (CKF315, CKF316).

One module-scoped save (a Linear, AdamW, LambdaLR, two objects registered for checkpointing, four micro-steps with
gradient accumulation 2, so `Accelerator.step` is 4
and the schedule at 2); each resume file is then removed, halved or emptied in a
copy, accelerate's own `load_state` is run on it, and ckptfix's finding (or one-line refusal) must name the file and
say what load_state did. Measured (accelerate 1.15, torch 2.13):

    file                     removed                           halved / empty
    model.safetensors        FileNotFoundError (pytorch_model.bin)  SafetensorError 'Error while deserializing header'
    optimizer.bin            FileNotFoundError                 RuntimeError 'PytorchStreamReader ...' / EOFError
    scheduler.bin            FileNotFoundError                 RuntimeError 'PytorchStreamReader ...' / EOFError
    random_states_0.pkl      loads; RNGs and step not restored  loads; RNGs and step not restored
    custom_checkpoint_0.pkl  RuntimeError 'Number of custom checkpoints'  RuntimeError / EOFError

The last custom_checkpoint_N.pkl removed is not detectable (accelerate records no count); one below the highest is.
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from damage import damage
from torch import nn

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect
from ckptfix.latest import latest_checkpoint

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.accelerate

CODES = ("CKF315", "CKF316")
FILES = ("model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl", "custom_checkpoint_0.pkl")


class Counter:
    """A registered object (accelerate saves it as custom_checkpoint_N.pkl)."""

    def __init__(self) -> None:
        self.n = 0

    def state_dict(self) -> dict:
        return {"n": self.n}

    def load_state_dict(self, state: dict) -> None:
        self.n = state["n"]


def _build():
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    counters = [Counter(), Counter()]
    acc.register_for_checkpointing(*counters)
    model, opt, sched = acc.prepare(model, opt, sched)
    return acc, model, opt, sched, counters


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc_resume")
    acc, model, opt, sched, counters = _build()
    for _ in range(4):
        with acc.accumulate(model):
            acc.backward(model(torch.randn(2, 4)).pow(2).mean())
            opt.step()
            sched.step()
            opt.zero_grad()
        counters[0].n += 1
    acc.save_state(str(root / "state"))
    return root / "state", acc.step, torch.get_rng_state()


def _resume(folder):
    """accelerate's own resume into a fresh setup: ('ok', details) or (exception name, message)."""
    acc, model, opt, sched, counters = _build()
    torch.manual_seed(123)
    try:
        acc.load_state(str(folder))
    except Exception as exc:  # noqa: BLE001 (what load_state raises is the measurement)
        return type(exc).__name__, str(exc)
    return "ok", {"step": acc.step, "opt_entries": len(opt.state_dict()["state"]),
                  "last_epoch": sched.scheduler.last_epoch, "counter": counters[0].n}


def _damaged(saved, tmp_path, name, how):
    d = tmp_path / "state"
    shutil.copytree(saved[0], d)
    damage(d / name, how)
    return d


def test_healthy_save_state_has_no_new_finding(saved, tmp_path):
    d = tmp_path / "state"
    shutil.copytree(saved[0], d)
    assert sorted(p.name for p in d.iterdir()) == ["custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl",
                                                   *FILES[:2], "random_states_0.pkl", "scheduler.bin"]
    report = inspect(str(d))
    assert not [f for f in report.findings if f.code in CODES]
    outcome, details = _resume(d)
    assert outcome == "ok" and details == {"step": saved[1], "opt_entries": 2, "last_epoch": 2, "counter": 4}


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("how", ["removed", "half", "zero"])
def test_damaged_file_is_named_with_what_load_state_does(saved, tmp_path, name, how, caplog):
    d = _damaged(saved, tmp_path, name, how)
    with caplog.at_level(logging.INFO, logger="accelerate.checkpointing"):
        outcome, details = _resume(d)
    try:
        report = inspect(str(d))
    except CkptfixError as exc:  # a torn weights/optimizer/scheduler file: ckptfix cannot read it either
        assert how != "removed" and name in FILES[:3]
        text = str(exc)
        assert "\n" not in text and name in text and "Accelerator.load_state dies on it" in text
        assert outcome in text  # RuntimeError / EOFError / SafetensorError: named as load_state raised it
        return
    hits = [f for f in report.findings if f.code in CODES and name in f.message]
    assert len(hits) == 1, [(f.code, f.message) for f in report.findings]
    hit = hits[0]
    if name == "random_states_0.pkl":  # swallowed: the resume goes on with the new run's RNG and step 0
        assert outcome == "ok" and details["step"] == 0 != saved[1] and details["opt_entries"] == 2
        assert "Could not load random states" in caplog.text
        assert hit.code == "CKF316" and hit.severity == "warning"
        assert "Could not load random states" in hit.pytorch and "Accelerator.step" in hit.pytorch
        return
    assert hit.code == "CKF315" and hit.severity == "error" and report.exit_code == 1
    assert outcome != "ok" and outcome in hit.pytorch
    if name == "model.safetensors":
        assert "pytorch_model.bin" in details and "pytorch_model.bin" in hit.pytorch
    elif how == "removed" and name != "custom_checkpoint_0.pkl":
        assert name in details
    elif how == "removed":
        assert "Number of custom checkpoints" in details and "Number of custom checkpoints" in hit.pytorch


def test_rng_not_restored_without_random_states(saved, tmp_path):
    """The RNG itself: with the file, load_state restores torch's generator as saved; without it, it does not."""
    whole = tmp_path / "whole"
    shutil.copytree(saved[0], whole)
    _resume(whole)
    restored = torch.get_rng_state()
    d = _damaged(saved, tmp_path, "random_states_0.pkl", "removed")
    _resume(d)
    assert not torch.equal(torch.get_rng_state(), restored)


def test_latest_skips_a_save_missing_a_file_load_state_reads(saved, tmp_path):
    """`automatic_checkpoint_naming` folders: load_state() takes the highest checkpoint_N; latest the newest whole."""
    run = tmp_path / "checkpoints"
    for n in (0, 1, 2):
        shutil.copytree(saved[0], run / f"checkpoint_{n}")
    (run / "checkpoint_2" / "optimizer.bin").unlink()
    (run / "checkpoint_1" / "random_states_0.pkl").unlink()  # load_state resumes (RNG not restored): still whole
    result = latest_checkpoint(run)
    assert result.path == str(run / "checkpoint_1")
    assert result.checked[0].reasons == ["no optimizer.bin"]
    assert any("random_states_0.pkl" in n for n in result.checked[1].notes)
    assert _resume(run / "checkpoint_2")[0] == "FileNotFoundError" and _resume(run / "checkpoint_1")[0] == "ok"
    (run / "checkpoint_1" / "custom_checkpoint_0.pkl").write_bytes(b"")
    assert "custom_checkpoint_0.pkl: empty file (0 bytes)" in latest_checkpoint(run).checked[1].reasons
