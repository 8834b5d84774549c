"""`Accelerator.save_state` folders written by real accelerate on CPU.

accelerate keeps no GradScaler on CPU (fp16 autocast there has no scaler), so the scaler test
hands the Accelerator a real `torch.amp.GradScaler("cpu")`; `save_state` then writes `scaler.pt`
exactly as it does on GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from ckptfix.formats import detect, read_checkpoint
from ckptfix.inspect import inspect

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.accelerate

STEPS = 3


def _train(acc, model, opt, sched=None, steps=STEPS, dim=4):
    for _ in range(steps):
        opt.zero_grad()
        acc.backward(model(torch.randn(2, dim)).pow(2).mean())
        opt.step()
        if sched is not None:
            sched.step()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One folder with a model/AdamW/LambdaLR, one with a second model and SGD optimizer, one as .bin."""
    root = tmp_path_factory.mktemp("accelerate")
    torch.manual_seed(0)
    acc = accelerate.Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    model, opt, sched = acc.prepare(model, opt, sched)
    _train(acc, model, opt, sched)
    acc.save_state(root / "one")
    second = nn.Linear(3, 3)
    second_opt = torch.optim.SGD(second.parameters(), lr=0.1, momentum=0.9)
    second, second_opt = acc.prepare(second, second_opt)
    _train(acc, second, second_opt, steps=1, dim=3)
    acc.save_state(root / "two")
    acc.save_state(root / "bin", safe_serialization=False)
    return root, acc, model, opt, sched


def test_file_layout(saved):
    root = saved[0]
    assert sorted(p.name for p in (root / "one").iterdir()) == [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "scheduler.bin"]
    assert {"model_1.safetensors", "optimizer_1.bin"} <= {p.name for p in (root / "two").iterdir()}
    assert {"pytorch_model.bin", "pytorch_model_1.bin"} <= {p.name for p in (root / "bin").iterdir()}
    assert detect(str(root / "one")) == "accelerate"


@pytest.mark.parametrize("folder", ["one", "two", "bin"])
def test_model_optimizer_scheduler_and_values(saved, folder):
    root, _, model, opt, sched = saved
    ckpt = read_checkpoint(root / folder)
    assert ckpt.format == "accelerate"
    want = model.state_dict()
    assert {n: t.shape for n, t in ckpt.model.items()} == {n: tuple(t.shape) for n, t in want.items()}
    if folder == "one":  # later folders were saved after the same model was saved again: same values
        for name, tensor in want.items():
            np.testing.assert_array_equal(ckpt.model[name].read(), tensor.numpy())
    o = ckpt.optimizer
    assert o.kind == "AdamW" and len(o.state) == 4 and {ps.step for ps in o.state.values()} == {float(STEPS)}
    live = opt.state_dict()["state"]
    for index, ps in o.state.items():
        np.testing.assert_array_equal(ps.tensors["exp_avg"].read(), live[index]["exp_avg"].numpy())
    assert ckpt.scheduler["last_epoch"] == sched.scheduler.last_epoch == STEPS
    assert "1 random_states file(s) read as data (RNG state only)" in ckpt.notes  # the allowlist, never pickle.load


def test_further_models_and_optimizers_are_noted(saved):
    ckpt = read_checkpoint(saved[0] / "two")
    assert ckpt.extras["accelerate"]["models"] == ["model.safetensors", "model_1.safetensors"]
    assert ckpt.extras["accelerate"]["optimizers"] == ["optimizer.bin", "optimizer_1.bin"]
    assert any("2 models saved" in n for n in ckpt.notes)
    assert any("2 optimizers saved" in n for n in ckpt.notes)


def test_scaler_pt(saved, tmp_path):
    _, acc, model, opt, _ = saved
    acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    try:
        acc.save_state(tmp_path / "scaled")
    finally:
        acc.scaler = None
    ckpt = read_checkpoint(tmp_path / "scaled")
    assert ckpt.scaler["scale"] == 1024.0 and ckpt.sections["scaler"] == "scaler.pt"


def test_inspect_has_no_error(saved):
    report = inspect(saved[0] / "bin")
    assert report.exit_code == 0 and report.to_json()["optimizer"]["mapping"] == "position"
