"""Repair round trip for `torch.distributed.checkpoint` folders, resumed with DCP's own loader.

A TinyLM + AdamW + LambdaLR is trained for real, `get_state_dict` + `dcp.save` write the folder (one
process, no process group), and the run switches to a tokenizer of another size. The repaired folder
is written by `dcp.save` itself (`write_dcp_folder`); it must load with `dcp.load` into the
`get_state_dict` template of a model and AdamW built for the new vocab, go in with `set_state_dict`,
and train on: old rows and moments bit-identical, Adam's step and the schedule continued.

Measured on torch 2.13: `dcp.load` refuses a template key the checkpoint lacks ("Missing key in
checkpoint state_dict: optim.state.<fqn>.step") and ignores checkpoint keys the template lacks;
`set_state_dict` with an optimizer state dict whose `state` is `{}` leaves the optimizer with no
state (a fresh Adam), while `get_state_dict` of a new optimizer initialises its state (step 1, zero
moments) by a zero-grad step. So after a fresh/reset repair the template's optimizer `state` is
emptied before `dcp.load`.
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_factory import lm_loss, make_batches, new_run, train, warmup_lambda
from test_repair_common import (
    LR,
    WARMUP,
    assert_trains,
    same_bits,
    snapshot,
)
from tokenizer_factory import train_bpe_tokenizer_json
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptfix
from ckptfix.errors import RepairError
from ckptfix.formats import read_checkpoint

OLD, STEPS = 48, 6
EMBED, HEAD = "text_embedding.weight", "text_head.weight"


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "step6"
    run = train(new_run(OLD), STEPS)
    msd, osd = get_state_dict(run.model, run.optimizer)
    _quiet(dcp.save, {"model": msd, "optim": osd, "sched": run.scheduler.state_dict(), "step": run.step},
           checkpoint_id=str(path))
    old = {"model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
           "state": {n: {k: v.clone() for k, v in run.optimizer.state[p].items()}
                     for n, p in run.model.named_parameters()},
           "lr": run.optimizer.param_groups[0]["lr"], "sched": run.scheduler.state_dict()}
    return path, snapshot(path), old


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return {n: train_bpe_tokenizer_json(folder, n, name=f"bpe{n}.json") for n in (40, 64)}


def resume(folder, vocab: int, *, optimizer_state: bool = True, scheduler: bool = True):
    """Model/AdamW/LambdaLR for `vocab`, loaded from `folder` the DCP way."""
    run = new_run(vocab, seed=123)
    msd, osd = get_state_dict(run.model, run.optimizer)
    if not optimizer_state:
        osd = {"state": {}, "param_groups": osd["param_groups"]}
    state = {"model": msd, "optim": osd, "step": 0}
    if scheduler:
        state["sched"] = run.scheduler.state_dict()
    _quiet(dcp.load, state, checkpoint_id=str(folder))
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if scheduler:
        run.scheduler.load_state_dict(state["sched"])
    run.step = state["step"]
    return run


def train_on(run, vocab: int, steps: int = 30) -> list[float]:
    losses = []
    for ids in make_batches(vocab, steps, seed=7):
        run.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run.model, ids)
        loss.backward()
        run.optimizer.step()
        run.scheduler.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("new_vocab", [64, 40], ids=["grow", "shrink"])
def test_remap_loads_with_dcp_and_trains(source, tokenizers, tmp_path, new_vocab):
    path, before, old = source
    out = tmp_path / "fixed"
    result = ckptfix.repair(path, tokenizers[new_vocab], out)
    assert snapshot(path) == before, "the input checkpoint was modified"
    assert result.plan.ckpt.format == "dcp" and result.to_json()["optimizer_state"] == "remapped"
    # the source's data file copied whole (reflink/copy_file_range), the changed tensors in a new one
    assert sorted(os.listdir(out)) == [".metadata", "__0_0.distcp", "__ckptfix0_0.distcp", "ckptfix.json"]
    rec = json.loads((out / "ckptfix.json").read_text())
    assert rec["format"] == "dcp" and rec["target_rows"] == new_vocab and rec["source_sha256"]
    assert {c["tensor"] for c in rec["changes"]} == {EMBED, HEAD} | {f"{n}:{k}" for n in (EMBED, HEAD)
                                                                      for k in ("exp_avg", "exp_avg_sq")}
    again = read_checkpoint(out)  # ckptfix reads its own output like any DCP folder
    assert again.format == "dcp" and again.model[EMBED].shape == (new_vocab, 16)

    run = resume(out, new_vocab)
    keep = min(OLD, new_vocab)
    assert run.step == STEPS and run.scheduler.last_epoch == STEPS
    assert run.optimizer.param_groups[0]["lr"] == old["lr"]
    for name, tensor in run.model.state_dict().items():
        if name in (EMBED, HEAD):
            assert tensor.shape == (new_vocab, 16) and same_bits(tensor[:keep], old["model"][name][:keep])
        else:
            assert same_bits(tensor, old["model"][name]), name
    for name, p in run.model.named_parameters():
        state, was = run.optimizer.state[p], old["state"][name]
        assert float(state["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            if name in (EMBED, HEAD):
                assert same_bits(state[key][:keep], was[key][:keep]), (name, key)
                if new_vocab > OLD and key == "exp_avg":
                    assert torch.count_nonzero(state[key][OLD:]) == 0
                elif new_vocab > OLD:
                    assert (state[key][OLD:] > 0).all()
            else:
                assert same_bits(state[key], was[key]), (name, key)

    losses = train_on(run, new_vocab)
    assert_trains(losses)
    assert float(run.optimizer.state[run.model.embedding.weight]["step"]) == STEPS + len(losses)


def test_fresh_keeps_param_groups_and_schedule_and_needs_a_stateless_template(source, tokenizers, tmp_path):
    path, _, old = source
    out = tmp_path / "fresh"
    result = ckptfix.repair(path, tokenizers[64], out, policy="fresh")
    rec = json.loads((out / "ckptfix.json").read_text())
    assert rec["optimizer_state"] == "dropped" and rec["rewarm"] is True
    assert any("empty the template's optimizer 'state'" in n for n in rec["notes"])
    assert rec["notes"] == result.to_json()["notes"]

    with pytest.raises(CheckpointException, match="Missing key in checkpoint state_dict: optim.state"):
        resume(out, 64)  # a full get_state_dict template: DCP reports the dropped state
    run = resume(out, 64, optimizer_state=False)
    assert not run.optimizer.state  # set_state_dict with state {}: a fresh Adam
    assert run.optimizer.param_groups[0]["lr"] == old["lr"] and run.scheduler.last_epoch == STEPS
    assert same_bits(run.model.embedding.weight.detach()[:OLD], old["model"][EMBED])
    losses = train_on(run, 64)
    assert_trains(losses)
    assert float(run.optimizer.state[run.model.embedding.weight]["step"]) == len(losses)  # Adam started over


def test_reset_removes_the_scheduler_and_restores_base_lr(source, tokenizers, tmp_path):
    path, _, _ = source
    out = tmp_path / "reset"
    ckptfix.repair(path, tokenizers[40], out, policy="reset")
    rec = json.loads((out / "ckptfix.json").read_text())
    assert rec["scheduler_state"] == "reset" and rec["optimizer_state"] == "dropped"
    assert read_checkpoint(out).scheduler is None

    run = resume(out, 40, optimizer_state=False, scheduler=False)  # no scheduler entry to load
    assert run.optimizer.param_groups[0]["lr"] == LR  # initial_lr: set_state_dict restored it
    run.scheduler = torch.optim.lr_scheduler.LambdaLR(run.optimizer, warmup_lambda(WARMUP))  # built after loading
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(LR * warmup_lambda(WARMUP)(0))  # warmup again
    assert_trains(train_on(run, 40))


def test_in_place_with_force_keeps_the_folder_as_backup(source, tokenizers, tmp_path):
    import shutil

    path, before, _ = source
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    with pytest.raises(RepairError, match="already exists"):
        ckptfix.repair(copy, tokenizers[64], copy)
    result = ckptfix.repair(copy, tokenizers[64], copy, force=True)
    assert result.backup == f"{copy}.bak" and snapshot(result.backup) == before
    assert read_checkpoint(copy).model[EMBED].shape == (64, 16)
    assert sorted(os.listdir(tmp_path)) == ["ckpt", "ckpt.bak"]  # no temp folder left behind


def test_bare_model_state_dict(tokenizers, tmp_path):
    """`dcp.save(model.state_dict())`: top-level tensors; the output keeps that shape."""
    model = new_run(OLD).model
    _quiet(dcp.save, model.state_dict(), checkpoint_id=str(tmp_path / "bare"))
    ckptfix.repair(tmp_path / "bare", tokenizers[64], tmp_path / "out")
    resized = new_run(64, seed=3).model
    sd = resized.state_dict()
    _quiet(dcp.load, sd, checkpoint_id=str(tmp_path / "out"))
    resized.load_state_dict(sd)
    assert same_bits(resized.embedding.weight.detach()[:OLD], model.embedding.weight.detach())


def test_an_item_that_is_not_plain_data_is_carried_unread_not_dropped(tokenizers, tmp_path):
    """An item the allowlist would not unpickle is never unpickled: repair carries its record byte for byte
    (behaviour change with issue 20: it used to be refused; unchanged items are no longer re-serialised)."""
    import pathlib

    model = new_run(OLD).model
    _quiet(dcp.save, {"model": model.state_dict(), "config": {"out_dir": pathlib.PurePosixPath("/runs/a")}},
           checkpoint_id=str(tmp_path / "src"))
    ckpt = read_checkpoint(tmp_path / "src")
    assert any("config.out_dir" in n and "pathlib" in n for n in ckpt.notes)
    ckptfix.repair(tmp_path / "src", tokenizers[64], tmp_path / "out")
    state = {"model": new_run(64, seed=3).model.state_dict(), "config": {"out_dir": None}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(tmp_path / "out"), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert state["model"][EMBED].shape == (64, 16)
    assert same_bits(state["model"][EMBED][:OLD], model.state_dict()[EMBED])


def test_tied_head_single_process_keeps_optimizer_state(tokenizers, tmp_path):
    """A tied head is saved by DCP under both names, with optimizer state for the embedding only: it is
    reported tied and its moments are remapped (it used to be repaired with all optimizer state dropped)."""
    run = train(new_run(OLD, tied=True), STEPS)
    msd, osd = get_state_dict(run.model, run.optimizer)
    _quiet(dcp.save, {"model": msd, "optim": osd, "sched": run.scheduler.state_dict()},
           checkpoint_id=str(tmp_path / "src"))
    assert read_checkpoint(tmp_path / "src").tied == {HEAD: EMBED}
    result = ckptfix.repair(tmp_path / "src", tokenizers[64], tmp_path / "out")
    assert result.to_json()["optimizer_state"] == "remapped"
    fresh = new_run(64, tied=True, seed=5)
    msd2, osd2 = get_state_dict(fresh.model, fresh.optimizer)
    state = {"model": msd2, "optim": osd2, "sched": fresh.scheduler.state_dict()}
    _quiet(dcp.load, state, checkpoint_id=str(tmp_path / "out"))
    set_state_dict(fresh.model, fresh.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    fresh.scheduler.load_state_dict(state["sched"])
    moments = fresh.optimizer.state[fresh.model.embedding.weight]
    was = run.optimizer.state[run.model.embedding.weight]
    assert float(moments["step"]) == STEPS
    assert same_bits(moments["exp_avg_sq"][:OLD], was["exp_avg_sq"]) and fresh.model.head.weight is fresh.model.embedding.weight
    assert_trains(train_on(fresh, 64))


def test_cli_in_place_and_restore(source, tokenizers, tmp_path, capsys):
    import shutil

    from ckptfix.cli import main

    path, before, _ = source
    copy = tmp_path / "ckpt"
    shutil.copytree(path, copy)
    with pytest.raises(SystemExit) as exc:
        main(["repair", str(copy), "-t", str(tokenizers[64]), "--in-place", "-o", str(tmp_path / "x")])
    assert exc.value.code == 2 and "drop -o" in capsys.readouterr().err
    main(["repair", str(copy), "-t", str(tokenizers[64]), "--in-place"])
    out = capsys.readouterr().out
    assert "ckptfix restore" in out and read_checkpoint(copy).model[EMBED].shape == (64, 16)
    main(["restore", str(copy)])
    assert "restored .metadata" in capsys.readouterr().out
    assert snapshot(copy) == snapshot(path)
    with pytest.raises(SystemExit) as exc:
        main(["restore", str(copy)])
    assert exc.value.code == 2  # nothing to undo: one line, exit 2


def test_progress_counts_the_changed_tensors_then_the_copied_files(source, tokenizers, tmp_path):
    """The DCP writer reports to a `progress` callable: the changed tensors (label "repair"), then, in a new
    folder, each copied data file as its copy ends (label "copy"); every total is the bytes it counts (for
    a copy, the records still referenced: the replaced ones are not copied)."""
    import shutil

    path, _, _ = source
    seen: list[tuple[str, int, int]] = []

    def progress(items, total, label):
        done = 0
        for item in items:
            yield item
            done += item.nbytes
        seen.append((label, total, done))

    _quiet(ckptfix.repair, path, tokenizers[64], tmp_path / "out", progress=progress)
    fixed = read_checkpoint(tmp_path / "out").raw.items
    replaced = {fqn for fqn, item in fixed.items() if item.blobs[0][0].endswith("__ckptfix0_0.distcp")}
    data = sum(blob[2] for fqn, item in read_checkpoint(path).raw.items.items() if fqn not in replaced
               for blob in item.blobs)
    assert len(replaced) == 6 and data < sum(os.path.getsize(p) for p in path.glob("*.distcp"))
    assert [label for label, _, _ in seen] == ["repair", "copy"]
    assert all(total == done > 0 for _, total, done in seen) and seen[1][1] == data
    copy, seen[:] = tmp_path / "inplace", []
    shutil.copytree(path, copy)
    _quiet(ckptfix.repair, copy, tokenizers[64], None, in_place=True, progress=progress)
    assert [label for label, _, _ in seen] == ["repair"]  # in place: nothing is copied
