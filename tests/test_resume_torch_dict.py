"""Issue 42: a plain `torch.save` training checkpoint (model/optimizer/scheduler/scaler + step) missing a key a training
loop's resume reads (CKF318), or torn.

One module-scoped save after 3 real AdamW steps with a warm-up LambdaLR and a GradScaler. No one loader reads such a
dict, so both kinds of loop are run: one that indexes every key (nanoGPT's train.py, the PyTorch tutorials) and one that
loads a key only when present. Measured (torch 2.13):

    removed key    indexing loop        loading only what is present
    model          KeyError: 'model'    the fresh initialisation's weights
    optimizer      KeyError             a fresh optimizer (no moments, step 0)
    scheduler      KeyError             the schedule restarts (last_epoch 0; a warning: a loop may rebuild it
                                        with last_epoch=<the saved step>)
    file halved    RuntimeError 'PytorchStreamReader failed reading zip archive'
    file emptied   EOFError

A missing `scaler` key is not detectable (nothing else in the dict records that a GradScaler was used); the loop then
starts a fresh scaler (scale 65536: a few skipped steps), so it is not reported.
"""

from __future__ import annotations

import pytest
import torch
from damage import cut
from torch import nn

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect

KEYS = ("model", "optimizer", "scheduler")


def _setup(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    return model, opt, sched, torch.amp.GradScaler("cpu")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model, opt, sched, scaler = _setup()
    for _ in range(3):
        opt.zero_grad()
        scaler.scale(model(torch.randn(2, 4)).pow(2).mean()).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    path = tmp_path_factory.mktemp("torch_resume") / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "scaler": scaler.state_dict(), "step": 3}, path)
    return path


def _resume(path, *, only_present):
    """A training loop's resume: the exception it raises, or what it restored."""
    model, opt, sched, scaler = _setup(seed=1)
    try:
        ckpt = torch.load(path, weights_only=True)
        for key, obj in (("model", model), ("optimizer", opt), ("scheduler", sched), ("scaler", scaler)):
            if not only_present or key in ckpt:
                obj.load_state_dict(ckpt[key])
    except Exception as exc:  # noqa: BLE001 (what the loop raises is the measurement)
        return type(exc).__name__, str(exc)
    return "ok", {"moments": len(opt.state_dict()["state"]), "last_epoch": sched.last_epoch,
                  "weights": model[0].weight.detach().clone()}


def _without(saved, tmp_path, key):
    tree = torch.load(saved, weights_only=True)
    del tree[key]
    path = tmp_path / "cut.pt"
    torch.save(tree, path)
    return path


def test_healthy_checkpoint_has_no_finding(saved, tmp_path):
    assert not [f for f in inspect(str(saved)).findings if f.code == "CKF318"]
    outcome, restored = _resume(saved, only_present=False)
    assert outcome == "ok" and restored["moments"] == 4 and restored["last_epoch"] == 3
    bare = tmp_path / "weights.pt"  # weights files, not training checkpoints: nothing to say
    torch.save(torch.load(saved, weights_only=True)["model"], bare)
    assert not [f for f in inspect(str(bare)).findings if f.code == "CKF318"]
    torch.save({"epoch": 90, "state_dict": torch.load(saved, weights_only=True)["model"]}, bare)
    assert not [f for f in inspect(str(bare)).findings if f.code == "CKF318"]
    torch.save(torch.load(saved, weights_only=True)["optimizer"], bare)  # a folder's lone optimizer.pt
    assert not [f for f in inspect(str(bare)).findings if f.code == "CKF318"]


def test_a_loop_without_a_scheduler_object_is_not_reported(saved, tmp_path):
    """nanoGPT computes its lr from iter_num: no scheduler state, and its optimizer holds no initial_lr."""
    model, opt, _, _ = _setup()
    path = tmp_path / "nanogpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": torch.optim.AdamW(model.parameters()).state_dict(),
                "iter_num": 3}, path)
    assert not [f for f in inspect(str(path)).findings if f.code == "CKF318"]


@pytest.mark.parametrize("key", KEYS)
def test_missing_key_is_named_with_what_a_loop_does(saved, tmp_path, key):
    path = _without(saved, tmp_path, key)
    strict = _resume(path, only_present=False)
    lenient, restored = _resume(path, only_present=True)
    report = inspect(str(path))
    hits = [f for f in report.findings if f.code == "CKF318"]
    assert len(hits) == 1 and key in hits[0].message, [f.message for f in report.findings]
    hit = hits[0]
    assert (hit.severity, report.exit_code) == (("warning", 0) if key == "scheduler" else ("error", 1))
    assert strict == ("KeyError", repr(key)) and f"raises KeyError: {key!r}" in hit.pytorch
    assert lenient == "ok"
    if key == "optimizer":
        assert restored["moments"] == 0 and "fresh optimizer" in hit.pytorch
    elif key == "scheduler":
        assert restored["last_epoch"] == 0 and "last_epoch 0" in hit.pytorch
    else:
        fresh = _setup(seed=1)[0][0].weight
        assert torch.equal(restored["weights"], fresh) and "fresh initialisation" in hit.pytorch


@pytest.mark.parametrize("how", ["half", "zero"])
def test_torn_file_is_refused_with_what_torch_load_does(saved, tmp_path, how):
    path = tmp_path / "torn.pt"
    path.write_bytes(cut(saved.read_bytes(), how))
    outcome, message = _resume(path, only_present=False)
    with pytest.raises(CkptfixError) as refused:
        inspect(str(path))
    text = str(refused.value)
    assert "\n" not in text and "torn.pt" in text and f"torch.load dies on it with {outcome}" in text
    assert how == "zero" or message[:40] in text
