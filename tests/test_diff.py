"""`ckptfix diff` on checkpoints of real training runs (tests/ckpt_factory.py).

A run whose weights move must say so (exit 0); a run whose every parameter is frozen
(`requires_grad=False`: the loop still steps optimizer and scheduler, but nothing has a gradient)
must say nothing is moving (exit 1).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
import torch
from ckpt_factory import lm_loss, make_batches, new_run, save_checkpoint, train

from ckptfix.cli import main
from ckptfix.compare import SCHEMA, diff
from ckptfix.render import render_diff

VOCAB = 32


@pytest.fixture(scope="module")
def moving(tmp_path_factory):
    root = tmp_path_factory.mktemp("moving")
    run = train(new_run(VOCAB), 5)
    a = save_checkpoint(run, root / "a.pth")
    train(run, 5, seed=2)
    b = save_checkpoint(run, root / "b.pth")
    return a, b, run


def _frozen_steps(run, steps: int) -> None:
    """What a loop does with a fully frozen model: the loss has no grad, optimizer.step() finds no grads."""
    for ids in make_batches(VOCAB, steps, seed=3):
        run.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run.model, ids)
        if loss.requires_grad:
            loss.backward()
        run.optimizer.step()
        with warnings.catch_warnings():  # "scheduler.step() before optimizer.step()": no step really happened
            warnings.simplefilter("ignore")
            run.scheduler.step()
        run.step += 1


@pytest.fixture(scope="module")
def frozen(tmp_path_factory):
    root = tmp_path_factory.mktemp("frozen")
    run = new_run(VOCAB)
    run.model.requires_grad_(False)
    _frozen_steps(run, 5)
    a = save_checkpoint(run, root / "a.pth")
    _frozen_steps(run, 5)
    b = save_checkpoint(run, root / "b.pth")
    return a, b


def test_weights_moving(moving):
    a, b, run = moving
    report = diff(a, b)
    n = len(list(run.model.parameters()))
    assert report.moving and report.exit_code == 0
    assert report.trainable_from == "optimizer state"
    assert report.summary_line == f"{n} of {n} trainable tensors changed between step 5 and step 10"
    assert report.verdict == "weights are moving: every trainable tensor changed"
    assert not report.with_status("added", "removed", "reshaped", "unreadable")


def test_values_match_numpy(moving):
    a, b, _ = moving
    sa, sb = torch.load(a)["model"], torch.load(b)["model"]
    report = diff(a, b)
    for t in report.tensors:
        xa, xb = sa[t.name].double().numpy(), sb[t.name].double().numpy()
        assert t.max_abs == pytest.approx(np.abs(xb - xa).max())
        assert t.rel_change == pytest.approx(np.linalg.norm(xb - xa) / np.linalg.norm(xa))


def test_nothing_moving_when_every_parameter_is_frozen(frozen):
    report = diff(*frozen)
    assert not report.moving and report.exit_code == 1
    assert report.verdict == "no trainable tensor changed: training is not updating weights"
    assert report.trainable_from == "float parameters"  # AdamW never created state
    assert report.summary_line.startswith("0 of ") and "step 5 and step 10" in report.summary_line
    assert any("no per-parameter state" in n for n in report.notes)


def test_atol_hides_small_moves(moving):
    a, b, _ = moving
    report = diff(a, b, atol=1e6)
    assert not report.moving and not report.with_status("changed")


def test_added_removed_reshaped(moving, tmp_path):
    a, _, run = moving
    state = torch.load(a)
    model = dict(state["model"])
    model["text_embedding.weight"] = torch.cat([model["text_embedding.weight"], torch.zeros(4, 16)])
    model["norm.weight"] = model["norm.weight"].to(torch.bfloat16)
    model["extra.bias"] = torch.zeros(3)
    del model["norm.bias"]
    torch.save({"model": model}, tmp_path / "edited.pth")
    report = diff(a, tmp_path / "edited.pth")
    status = {t.name: t.status for t in report.tensors}
    assert status["text_embedding.weight"] == "reshaped" and status["norm.weight"] == "reshaped"
    assert status["extra.bias"] == "added" and status["norm.bias"] == "removed"
    assert status["text_head.weight"] == "unchanged"


def test_bfloat16_and_views_compare_in_chunks(tmp_path, monkeypatch):
    import ckptfix.compare as diff_module

    monkeypatch.setattr(diff_module, "CHUNK_ELEMENTS", 7)  # force many chunks, including strided rows
    base = torch.randn(12, 10)
    a = {"w": base.to(torch.bfloat16), "t": base.t()}
    b = {"w": (base + 1).to(torch.bfloat16), "t": base.t().clone()}
    torch.save(a, tmp_path / "a.pth")
    torch.save(b, tmp_path / "b.pth")
    report = diff(tmp_path / "a.pth", tmp_path / "b.pth")
    by = {t.name: t for t in report.tensors}
    want = (b["w"].double() - a["w"].double()).abs().max().item()
    assert by["w"].status == "changed" and by["w"].max_abs == pytest.approx(want)
    assert by["t"].status == "unchanged" and by["t"].max_abs == 0.0


def test_same_weights_across_formats(moving, tmp_path):
    """A .pth and a DCP folder of the same state: nothing changed, whatever the container."""
    import torch.distributed.checkpoint as dcp

    a, _, _ = moving
    state = torch.load(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": state["model"], "step": state["step"]}, checkpoint_id=str(tmp_path / "dcp"))
    report = diff(a, tmp_path / "dcp")
    assert report.with_status("changed", "added", "removed", "reshaped") == []
    assert report.a.step == report.b.step == 5.0


def test_json_and_text(moving):
    a, b, _ = moving
    report = diff(a, b)
    data = json.loads(json.dumps(report.to_json()))
    assert data["schema"] == SCHEMA and data["moving"] is True
    assert data["summary"]["trainable_changed"] == data["summary"]["trainable"] > 0
    assert {"name", "status", "max_abs", "rel_change", "shape_a", "dtype_b"} <= set(data["tensors"][0])
    text = render_diff(report)
    assert report.summary_line in text and report.verdict in text


def _cli(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr().out


def test_cli_exit_codes(moving, frozen, tmp_path, capsys):
    a, b, _ = moving
    code, out = _cli(["diff", str(a), str(b)], capsys)
    assert code == 0 and "weights are moving" in out
    code, out = _cli(["diff", str(frozen[0]), str(frozen[1]), "--json"], capsys)
    assert code == 1 and json.loads(out)["verdict"].startswith("no trainable tensor changed")
    code, _ = _cli(["diff", str(a), str(tmp_path / "missing.pth")], capsys)
    assert code == 2
    code, _ = _cli(["diff", str(a), str(b), "--atol", "-1"], capsys)
    assert code == 2


@pytest.mark.transformers
def test_trainer_folders_trainable_set_from_entry_shapes(tmp_path, capsys):
    """Two HF Trainer checkpoints (issue 46, 45 item 3): model.safetensors has sorted keys and optimizer.pt holds
    state by index, so the entries are not all named one by one. Their shapes are exactly the 28 parameters'
    (GPT-2 ties its head: not stored): every parameter is trained, said from optimizer state. With one parameter
    frozen (wpe: 27 entries) the set is not certain from shapes: diff still says trainable is not known and
    counts every float tensor, never the few it could name as "2 of 2 trainable tensors"."""
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 64, (16, 12), generator=torch.Generator().manual_seed(0))

    def run(out, freeze=()):
        torch.manual_seed(0)
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64,
                                                                     n_positions=32))
        for name in freeze:
            model.get_parameter(name).requires_grad_(False)
        args = transformers.TrainingArguments(output_dir=str(out), max_steps=6, save_steps=3, report_to=[],
                                              use_cpu=True, per_device_train_batch_size=4, disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]).train()
        return out / "checkpoint-3", out / "checkpoint-6"

    a, b = run(tmp_path / "out")
    report = diff(a, b)
    n = len(report.tensors)
    entries = len(torch.load(a / "optimizer.pt", weights_only=True)["state"])
    assert n == entries == 28 and report.trainable_from == "optimizer state" and report.known
    assert report.summary_line == f"{n} of {n} trainable tensors changed between step 3 and step 6"
    assert report.verdict == "weights are moving: every trainable tensor changed" and report.exit_code == 0
    assert any(f"the {n} tensors it trains are certain: entry shapes = every parameter's" in x for x in report.notes)
    code, out = _cli(["diff", str(a), str(b)], capsys)
    assert code == 0 and f"trainable  {report.summary_line} (from optimizer state)\n" in out

    a, b = run(tmp_path / "frozen", freeze=["transformer.wpe.weight"])
    report = diff(a, b)
    entries = len(torch.load(a / "optimizer.pt", weights_only=True)["state"])
    assert entries == 27 and report.trainable_from == "not known" and not report.known
    missing = int(report.unmapped.split()[0])
    assert 0 < missing <= entries and report.unmapped == f"{missing} of {entries} optimizer entries have no name"
    assert report.summary_line.startswith("not known — the optimizer's entries are not mapped to names")
    assert json.loads(json.dumps(report.to_json()))["summary"]["trainable_unmapped"] == report.unmapped
