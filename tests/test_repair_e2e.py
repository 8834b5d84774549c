"""`ckptfix.repair` end to end on the seed-001 situation.

A TinyLM is trained for real (AdamW, warmup LambdaLR, GradScaler), saved with `torch.save`, and the
run then switches to a sentencepiece tokenizer of another size. The repaired file must load with
plain `torch.load(weights_only=True)` + `load_state_dict(strict=True)` into a model built for the new
tokenizer, train on with a falling loss, and keep every trained bit that it did not have to change.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, new_run, save_checkpoint, train
from test_repair_common import (
    LR,
    assert_trains,
    resume,
    same_bits,
    sha256,
    snapshot,
    train_steps,
)
from tokenizer_factory import train_sentencepiece

import ckptfix
import ckptfix.io
from ckptfix.errors import RepairError
from ckptfix.identity import fingerprint
from ckptfix.tokenizers import load_tokenizer

OLD_VOCAB, STEPS = 1000, 200
EMBED, HEAD = "text_embedding.weight", "text_head.weight"
VOCAB_PARAMS = (EMBED, HEAD)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """The checkpoint of the interrupted run: 200 real AMP-style AdamW steps on a 1000-token vocab."""
    folder = tmp_path_factory.mktemp("src")
    run = train(new_run(OLD_VOCAB), STEPS)
    path = save_checkpoint(run, folder / "step200.pth")
    return path, sha256(path), torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return {n: train_sentencepiece(folder, n, name=f"sp{n}") for n in (800, 1200)}


def param_names(sd_model) -> list[str]:
    """Names in optimizer-index order: the order of model.parameters() (ties once)."""
    seen, out = set(), []
    for name, t in sd_model.items():
        if t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            out.append(name)
    return out


def opt_index(sd_model, name: str) -> int:
    return param_names(sd_model).index(name)


def do_repair(source, tok, out, **kw):
    path, digest, _ = source
    result = ckptfix.repair(path, tok, out, **kw)
    assert sha256(path) == digest, "the input checkpoint was modified"
    return result


# -- remap (the default for AdamW) ---------------------------------------------------------------------


@pytest.mark.parametrize("new_vocab", [800, 1200], ids=["shrink", "grow"])
def test_remap_loads_strictly_trains_and_keeps_every_trained_bit(source, tokenizers, tmp_path, new_vocab):
    path, digest, src = source
    out = tmp_path / "fixed.pth"
    result = do_repair(source, tokenizers[new_vocab], out)
    assert result.output == str(out) and not result.dry_run and result.backup is None

    sd = torch.load(out, weights_only=True)  # plain torch, allowlisted globals only
    assert set(sd) == set(src) | {"ckptfix"}
    assert sd["epoch"] == src["epoch"] and sd["step"] == src["step"] == STEPS
    keep = min(OLD_VOCAB, new_vocab)

    # Model: vocab tensors resized, old rows bit-identical; every other tensor bit-identical.
    for name, t in src["model"].items():
        new = sd["model"][name]
        if name in VOCAB_PARAMS:
            assert new.shape == (new_vocab, t.shape[1])
            assert same_bits(new[:keep], t[:keep]), name
        else:
            assert same_bits(new, t), name

    # Optimizer: moments follow their rows; step and every other state tensor untouched.
    names = param_names(src["model"])
    assert len(sd["optimizer"]["state"]) == len(src["optimizer"]["state"]) == len(names)
    assert sd["optimizer"]["param_groups"] == src["optimizer"]["param_groups"]
    for index, entries in src["optimizer"]["state"].items():
        new_entries = sd["optimizer"]["state"][index]
        assert set(new_entries) == set(entries) == {"step", "exp_avg", "exp_avg_sq"}
        assert same_bits(new_entries["step"], entries["step"]) and float(entries["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            old, new = entries[key], new_entries[key]
            if names[index] in VOCAB_PARAMS:
                assert new.shape[0] == new_vocab
                assert same_bits(new[:keep], old[:keep]), (names[index], key)
                if new_vocab > OLD_VOCAB:
                    if key == "exp_avg":
                        assert torch.count_nonzero(new[keep:]) == 0
                    else:  # the per-column mean of the old rows' second moments
                        col_mean = old.mean(dim=0).expand(new_vocab - keep, -1)
                        torch.testing.assert_close(new[keep:], col_mean, rtol=1e-6, atol=0)
                        assert (new[keep:] > 0).all()
            else:
                assert same_bits(new, old), (names[index], key)
    if new_vocab > OLD_VOCAB:  # mean init: new weight rows sit at the old rows' mean
        for name in VOCAB_PARAMS:
            old = src["model"][name]
            torch.testing.assert_close(sd["model"][name][keep:], old.mean(0).expand(new_vocab - keep, -1),
                                       atol=1e-3, rtol=0)
    assert sd["scheduler"] == src["scheduler"]
    assert sd["scaler"] == src["scaler"]

    # The record.
    rec = sd["ckptfix"]
    assert rec["source_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest() == digest
    assert rec["source"] == os.path.abspath(path)
    assert rec["policy"] == "remap" and rec["init"] == "mean" and rec["rewarm"] is False
    assert rec["optimizer_state"] == "remapped" and rec["scheduler_state"] == "kept"
    assert rec["tokenizer"] == {"path": os.path.abspath(tokenizers[new_vocab]), "size": new_vocab,  # issue 18:
                                "fingerprint": fingerprint(load_tokenizer(tokenizers[new_vocab]))}  # + fingerprint
    assert rec["target_rows"] == new_vocab
    assert rec["param_names"] == names  # optimizer-index order
    changed = {c["tensor"]: c for c in rec["changes"]}
    assert set(changed) == {EMBED, HEAD} | {f"{n}:{k}" for n in VOCAB_PARAMS for k in ("exp_avg", "exp_avg_sq")}
    for c in changed.values():
        assert (c["old_rows"], c["new_rows"], c["kept"], c["moved"]) == (OLD_VOCAB, new_vocab, keep, 0)
        assert c["new"] == max(0, new_vocab - OLD_VOCAB) and c["dropped"] == max(0, OLD_VOCAB - new_vocab)
    if new_vocab < OLD_VOCAB:
        assert changed[EMBED]["dropped_ids"] == [f"{new_vocab}-{OLD_VOCAB - 1}"]
        assert any("800-999" in n for n in rec["notes"])
    assert rec == result.record | {"created": rec["created"]}

    # Resume exactly as the training script does, and train on.
    model, opt, sched, scaler = resume(sd, new_vocab)
    assert sched.last_epoch == STEPS and opt.param_groups[0]["lr"] == LR
    assert float(opt.state[model.embedding.weight]["step"]) == STEPS
    with torch.no_grad():  # the resumed model is still the trained one: loss near where training stopped
        first = lm_loss(model, make_batches(new_vocab, 1, seed=99)[0]).item()
    losses = train_steps(model, opt, sched, scaler, new_vocab, 40)
    assert_trains(losses)
    if new_vocab < OLD_VOCAB:
        assert first < 5.0  # vs ln(800) = 6.7 for an untrained head


# -- fresh / reset --------------------------------------------------------------------------------------


def test_fresh_drops_optimizer_state_keeps_groups_and_schedule(source, tokenizers, tmp_path):
    path, digest, src = source
    out = tmp_path / "fresh.pth"
    result = do_repair(source, tokenizers[1200], out, policy="fresh")
    sd = torch.load(out, weights_only=True)
    assert sd["optimizer"]["state"] == {}
    assert sd["optimizer"]["param_groups"] == src["optimizer"]["param_groups"]
    for g in sd["optimizer"]["param_groups"]:
        assert g["lr"] == LR and g["initial_lr"] == LR
    assert sd["scheduler"] == src["scheduler"] and sd["scaler"] == src["scaler"]
    rec = sd["ckptfix"]
    assert rec["policy"] == "fresh" and rec["rewarm"] is True and rec["optimizer_state"] == "dropped"
    assert rec["scheduler_state"] == "kept" and rec["source_sha256"] == digest
    assert result.to_json()["rewarm"] is True
    for name in VOCAB_PARAMS:
        assert same_bits(sd["model"][name][:OLD_VOCAB], src["model"][name])
    assert not any(":" in c["tensor"] for c in rec["changes"])  # no moments edited: there are none

    model, opt, sched, scaler = resume(sd, 1200)
    assert opt.state == {} or all(not s for s in opt.state.values())
    assert sched.last_epoch == STEPS
    assert_trains(train_steps(model, opt, sched, scaler, 1200, 40))
    assert float(opt.state[model.embedding.weight]["step"]) == 40  # Adam started over


def test_reset_drops_scheduler_and_restores_base_lr(source, tokenizers, tmp_path):
    path, digest, src = source
    out = tmp_path / "reset.pth"
    do_repair(source, tokenizers[800], out, policy="reset")
    sd = torch.load(out, weights_only=True)
    assert "scheduler" not in sd and "scheduler" in src
    assert sd["optimizer"]["state"] == {}
    for g in sd["optimizer"]["param_groups"]:
        assert g["lr"] == g["initial_lr"] == LR
    rec = sd["ckptfix"]
    assert rec["policy"] == "reset" and rec["scheduler_state"] == "reset" and rec["rewarm"] is True

    model, opt, sched, scaler = resume(sd, 800, scheduler=False)  # a fresh schedule: warmup again
    assert sched.last_epoch == 0 and opt.param_groups[0]["lr"] == pytest.approx(LR / 10)
    assert_trains(train_steps(model, opt, sched, scaler, 800, 40))


# -- safety: input untouched, dry run, existing output, in place -------------------------------------


def test_dry_run_writes_nothing(source, tokenizers, tmp_path):
    path, digest, _ = source
    out = tmp_path / "out" / "never.pth"
    before = snapshot(path.parent), snapshot(tmp_path)
    result = do_repair(source, tokenizers[1200], out, dry_run=True)
    assert result.dry_run and result.record["source_sha256"] is None
    assert [c["new_rows"] for c in result.plan.changes] == [1200] * 6
    assert (snapshot(path.parent), snapshot(tmp_path)) == before
    assert not out.exists()
    assert ckptfix.repair(path, tokenizers[1200], None, dry_run=True).output is None


def test_existing_output_needs_force(source, tokenizers, tmp_path):
    out = tmp_path / "taken.pth"
    out.write_bytes(b"someone else's file")
    with pytest.raises(RepairError, match="already exists"):
        do_repair(source, tokenizers[1200], out)
    assert out.read_bytes() == b"someone else's file"
    assert sorted(os.listdir(tmp_path)) == ["taken.pth"]  # no temp file left behind
    do_repair(source, tokenizers[1200], out, force=True)
    assert torch.load(out, weights_only=True)["model"][EMBED].shape[0] == 1200
    assert sorted(os.listdir(tmp_path)) == ["taken.pth"]  # replaced, no backup of a non-input


def test_in_place_with_force_keeps_a_hard_linked_backup(source, tokenizers, tmp_path):
    path = tmp_path / "ckpt.pth"
    shutil.copyfile(source[0], path)
    original, inode = path.read_bytes(), os.stat(path).st_ino
    with pytest.raises(RepairError, match="already exists"):
        ckptfix.repair(path, tokenizers[1200], path)
    assert path.read_bytes() == original
    result = ckptfix.repair(path, tokenizers[1200], path, force=True)
    backup = tmp_path / "ckpt.pth.bak"
    assert result.backup == str(backup)
    assert os.stat(backup).st_ino == inode  # the original file itself, linked, not a copy
    assert backup.read_bytes() == original
    sd = torch.load(path, weights_only=True)
    assert sd["model"][EMBED].shape[0] == 1200
    assert sd["ckptfix"]["source_sha256"] == hashlib.sha256(original).hexdigest()
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pth", "ckpt.pth.bak"]
    resume(sd, 1200)


# -- the exp_avg_sq claim ------------------------------------------------------------------------------


def balanced_batch(vocab: int) -> torch.Tensor:
    """16 counting sequences, half starting among the old ids and half among the new ones, so new and
    old tokens are fed (embedding rows) and predicted (head rows) equally often."""
    starts = torch.tensor([0, 120, 240, 360, 480, 600, 720, 840, 1000, 1016, 1032, 1048, 1064, 1080, 1100, 1150])
    return (starts[:, None] + torch.arange(16)) % vocab


def first_update(sd: dict, vocab: int, zero_new_sq: bool, step: float | None = None) -> dict[str, float]:
    """One AdamW step on the repaired state: |delta| / lr of new and old rows that the batch uses
    (embedding rows of input tokens, head rows of target tokens)."""
    model, opt, _, _ = resume(sd, vocab)
    for p in (model.embedding.weight, model.head.weight):
        state = opt.state[p]
        if zero_new_sq:
            state["exp_avg_sq"][OLD_VOCAB:] = 0  # what a naive resize (zeros) leaves
        if step is not None:
            state["step"].fill_(step)
    ids = balanced_batch(vocab)
    new = torch.arange(vocab) >= OLD_VOCAB
    fed, predicted = torch.zeros(vocab, dtype=torch.bool), torch.zeros(vocab, dtype=torch.bool)
    fed[ids[:, :-1].reshape(-1)] = True
    predicted[ids[:, 1:].reshape(-1)] = True
    before = model.embedding.weight.detach().clone(), model.head.weight.detach().clone()
    opt.zero_grad()
    lm_loss(model, ids).backward()
    opt.step()
    lr = opt.param_groups[0]["lr"]
    d_emb = (model.embedding.weight.detach() - before[0]).abs() / lr
    d_head = (model.head.weight.detach() - before[1]).abs() / lr
    return {"max_new": max(d_emb[new].max().item(), d_head[new].max().item()),
            "emb_new": d_emb[new & fed].mean().item(), "emb_old": d_emb[~new & fed].mean().item(),
            "head_new": d_head[new & predicted].mean().item(), "head_old": d_head[~new & predicted].mean().item()}


@pytest.mark.parametrize("step", [None, 10_000], ids=["step200", "step10000"])
def test_zero_second_moments_give_new_rows_oversized_updates_mean_init_does_not(source, tokenizers,
                                                                               tmp_path, step):
    """Zero exp_avg_sq under an inherited step: Adam's first update of a new row is
    lr * 0.1 g / sqrt(0.001 g^2 / (1 - 0.999^step)) -- ~1.35 lr at step 200, ~3.16 lr at step 10000 --
    for every coordinate whatever its gradient, ~4x what trained rows fed the same way move.
    ckptfix's mean init keeps new rows' updates in line with the old rows'."""
    out = tmp_path / "grown.pth"
    do_repair(source, tokenizers[1200], out)
    sd = torch.load(out, weights_only=True)
    expect = 0.1 / (0.001 / (1 - 0.999 ** (step or STEPS))) ** 0.5

    zeros = first_update(sd, 1200, zero_new_sq=True, step=step)
    mean = first_update(sd, 1200, zero_new_sq=False, step=step)
    ratios = {name: {part: u[f"{part}_new"] / u[f"{part}_old"] for part in ("emb", "head")}
              for name, u in (("zeros", zeros), ("mean", mean))}
    print(f"\nstep {step or STEPS}: zeros {zeros} ratios {ratios['zeros']}\n           mean  {mean} "
          f"ratios {ratios['mean']}")
    assert zeros["max_new"] == pytest.approx(expect, rel=0.01)  # the sign-like first step
    assert zeros["max_new"] > 1.3
    assert min(ratios["zeros"].values()) > 3
    assert mean["max_new"] < zeros["max_new"] / 1.5
    for part, ratio in ratios["mean"].items():
        assert 0.3 < ratio < 3, (part, ratio)


def test_in_place_record_hashes_the_original_even_if_the_hash_thread_starts_late(tmp_path, tokenizers,
                                                                                 monkeypatch):
    """A bare state_dict's record (the sidecar) is written after the new file took the name. The
    background hash must still be of the original bytes, however late its thread gets going."""
    path = tmp_path / "weights.pth"
    torch.save(TinyLM(OLD_VOCAB).state_dict(), path)
    original = sha256(path)
    real_sha256 = hashlib.sha256

    class SlowStart:  # the thread is scheduled only after the main thread has finished writing
        def __init__(self):
            time.sleep(0.3)
            self.h = real_sha256()

        def update(self, block):
            self.h.update(block)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(ckptfix.io, "hashlib", type("slow_hashlib", (), {"sha256": SlowStart}))
    result = ckptfix.repair(path, tokenizers[1200], path, force=True)
    record = json.loads((tmp_path / "weights.pth.ckptfix.json").read_text())
    assert record["source_sha256"] == result.record["source_sha256"] == original
    assert sha256(tmp_path / "weights.pth.bak") == original != sha256(path)
    assert torch.load(path, weights_only=True)[EMBED].shape == (1200, 16)
