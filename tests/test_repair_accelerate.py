"""Repair round trip for `Accelerator.save_state` folders, resumed with `Accelerator.load_state`.

A TinyLM + AdamW + warmup LambdaLR is prepared and trained by a real `accelerate.Accelerator` on CPU
and saved with `save_state`; the run switches to a tokenizer of another size. The repaired folder
(`write_accelerate_folder`: weights and `optimizer.bin` rewritten, `random_states_*.pkl` copied as
bytes) must load with `load_state` into a model and optimizer built for the new vocab and train on.

Measured on accelerate 1.15: `load_state` loads the model with `strict=True`, one `optimizer*.bin`
and `scheduler*.bin` per prepared optimizer/scheduler (a missing one is a FileNotFoundError), and
`scaler.pt` when a GradScaler is in use. The default `model.safetensors` stores tensors sorted by
name, so the parameter order that `optimizer.bin`'s integer indices refer to is not in the folder;
the remap test uses `safe_serialization=False` (`pytorch_model.bin` keeps the module order).
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, warmup_lambda
from test_repair_common import (
    LR,
    WARMUP,
    WD,
    assert_trains,
    same_bits,
    sha256,
    snapshot,
)
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix

accelerate = pytest.importorskip("accelerate")
pytestmark = pytest.mark.accelerate

OLD, STEPS = 48, 6
EMBED, HEAD = "text_embedding.weight", "text_head.weight"


def build(vocab: int, *, seed: int = 0, scheduler: bool = True, scaler=None):
    torch.manual_seed(seed)
    acc = accelerate.Accelerator(cpu=True)
    model = TinyLM(vocab)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    model, opt = acc.prepare(model, opt)
    sched = None
    if scheduler:
        sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP)))
    acc.scaler = scaler
    return acc, model, opt, sched


def train_on(acc, model, opt, sched, vocab: int, steps: int, seed: int = 7) -> list[float]:
    losses = []
    for ids in make_batches(vocab, steps, seed=seed):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids)
        acc.backward(loss)
        opt.step()
        sched.step()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("acc")
    acc, model, opt, sched = build(OLD)
    train_on(acc, model, opt, sched, OLD, STEPS, seed=1)
    acc.save_state(root / "bin", safe_serialization=False)
    acc.save_state(root / "st")
    old = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
           "state": {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()},
           "lr": opt.param_groups[0]["lr"]}
    return root, {d: snapshot(root / d) for d in ("bin", "st")}, old


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return {n: train_bpe_tokenizer_json(folder, n, name=f"bpe{n}.json") for n in (40, 64)}


@pytest.mark.parametrize("new_vocab", [64, 40], ids=["grow", "shrink"])
def test_remap_loads_with_load_state_and_trains(source, tokenizers, tmp_path, new_vocab):
    root, before, old = source
    src, out = root / "bin", tmp_path / "fixed"
    result = ckptfix.repair(src, tokenizers[new_vocab], out)
    assert snapshot(src) == before["bin"], "the input checkpoint was modified"
    assert result.plan.ckpt.format == "accelerate" and result.to_json()["optimizer_state"] == "remapped"
    assert sorted(os.listdir(out)) == sorted(os.listdir(src) + ["ckptfix.json"])
    for name in ("random_states_0.pkl", "scheduler.bin"):  # copied as bytes, never unpickled
        assert sha256(out / name) == sha256(src / name)
    rec = json.loads((out / "ckptfix.json").read_text())
    assert rec["format"] == "accelerate" and rec["policy"] == "remap" and rec["source_sha256"]
    assert rec["param_names"][0] == EMBED  # position mapping: pytorch_model.bin keeps the module order

    acc, model, opt, sched = build(new_vocab, seed=123)
    acc.load_state(out)
    keep = min(OLD, new_vocab)
    assert sched.scheduler.last_epoch == STEPS and opt.param_groups[0]["lr"] == old["lr"]
    for name, tensor in model.state_dict().items():
        if name in (EMBED, HEAD):
            assert tensor.shape == (new_vocab, 16) and same_bits(tensor[:keep], old["model"][name][:keep])
        else:
            assert same_bits(tensor, old["model"][name]), name
    for name, p in model.named_parameters():
        state, was = opt.state[p], old["state"][name]
        assert float(state["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            if name in (EMBED, HEAD):
                assert same_bits(state[key][:keep], was[key][:keep]), (name, key)
            else:
                assert same_bits(state[key], was[key]), (name, key)

    losses = train_on(acc, model, opt, sched, new_vocab, 30)
    assert_trains(losses)
    assert float(opt.state[model.embedding.weight]["step"]) == STEPS + 30


def test_safetensors_folder_with_fresh_optimizer(source, tokenizers, tmp_path):
    root, before, old = source
    src, out = root / "st", tmp_path / "fresh"
    ckptfix.repair(src, tokenizers[64], out, policy="fresh")
    assert snapshot(src) == before["st"]
    assert sorted(os.listdir(out)) == sorted(os.listdir(src) + ["ckptfix.json"])
    assert torch.load(out / "optimizer.bin", weights_only=True)["state"] == {}

    acc, model, opt, sched = build(64, seed=123)
    acc.load_state(out)
    assert not opt.state and opt.param_groups[0]["lr"] == old["lr"] and sched.scheduler.last_epoch == STEPS
    assert same_bits(model.embedding.weight.detach()[:OLD], old["model"][EMBED])
    losses = train_on(acc, model, opt, sched, 64, 30)
    assert_trains(losses)
    assert float(opt.state[model.embedding.weight]["step"]) == 30  # Adam started over


def test_reset_drops_scheduler_bin(source, tokenizers, tmp_path):
    root, _, _ = source
    out = tmp_path / "reset"
    result = ckptfix.repair(root / "bin", tokenizers[40], out, policy="reset")
    assert "scheduler.bin" not in os.listdir(out)
    assert any("prepare the scheduler after accelerator.load_state" in n for n in result.to_json()["notes"])

    acc, *_ = build(40, seed=123)  # a scheduler prepared before load_state looks for scheduler.bin
    with pytest.raises(FileNotFoundError, match="scheduler.bin"):
        acc.load_state(out)
    acc, model, opt, _ = build(40, seed=123, scheduler=False)
    acc.load_state(out)
    assert not opt.state and opt.param_groups[0]["lr"] == LR  # initial_lr
    sched = acc.prepare(torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP)))
    assert opt.param_groups[0]["lr"] == pytest.approx(LR * warmup_lambda(WARMUP)(0))  # the warmup starts again
    assert_trains(train_on(acc, model, opt, sched, 40, 30))


def test_collapsed_scaler_is_reset(source, tokenizers, tmp_path):
    root, _, _ = source
    acc, model, opt, sched = build(OLD, scaler=torch.amp.GradScaler("cpu", init_scale=1e-30))
    acc.save_state(tmp_path / "src", safe_serialization=False)
    ckptfix.repair(tmp_path / "src", tokenizers[64], tmp_path / "out")
    assert torch.load(tmp_path / "out" / "scaler.pt", weights_only=True)["scale"] == 65536.0

    scaler = torch.amp.GradScaler("cpu")
    acc, model, opt, sched = build(64, seed=123, scaler=scaler)
    acc.load_state(tmp_path / "out")
    assert scaler.get_scale() == 65536.0


def test_safetensors_folder_remaps_moments_of_same_shape_embedding_and_head(source, tokenizers, tmp_path):
    """model.safetensors loses the parameter order, and the untied embedding and head share a shape, so
    names cannot be recovered; both follow one row plan, so their moments are still remapped exactly."""
    root, before, old = source
    src, out = root / "st", tmp_path / "remap"
    result = ckptfix.repair(src, tokenizers[64], out)
    assert snapshot(src) == before["st"]
    assert result.to_json()["optimizer_state"] == "remapped"

    acc, model, opt, sched = build(64, seed=123)
    acc.load_state(out)
    for name, p in model.named_parameters():
        state, was = opt.state[p], old["state"][name]
        assert float(state["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            rows = slice(0, OLD) if name in (EMBED, HEAD) else slice(None)
            assert same_bits(state[key][rows], was[key][rows]), (name, key)
    assert_trains(train_on(acc, model, opt, sched, 64, 30))
