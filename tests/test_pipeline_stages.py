"""The pipeline shows its stages (issue 27, item 5): `repair()` runs read, analyse, plan, audit, write, verify once
each and in that order, and the guard's `load` runs read, analyse, plan (with its audit), apply; what the caller
passes enters the plan once (one `make_plan` call) and every tokenizer file is loaded once per run (counted at
`ckptfix.tokenizers.load_tokenizer`, the one reader every tokenizer goes through).

Real checkpoints (TinyLM after real AdamW steps) and real sentencepiece / tokenizer.json files; the stages are
wrapped, never replaced: each call is recorded and then runs as it would.
"""

from __future__ import annotations

import collections
import importlib
import json
from pathlib import Path

import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json, train_sentencepiece

import ckptfix
import ckptfix.audit
import ckptfix.guard.resume
import ckptfix.surgery
import ckptfix.surgery.plan
import ckptfix.tokenizers

OLD, NEW = 301, 311
INSPECT = importlib.import_module("ckptfix.inspect")  # the attribute `ckptfix.inspect` is the function


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("stages")
    run = train(new_run(OLD), 4)
    src = save_checkpoint(run, folder / "src.pth", config={"vocab_size": OLD, "n_layer": 2})
    return src, train_sentencepiece(folder, OLD, name="old"), train_sentencepiece(folder, NEW, name="new")


class Calls:
    """Wraps functions where their callers look them up; records (stage, args) in call order."""

    def __init__(self, monkeypatch):
        self.monkeypatch, self.order, self.tokenizers = monkeypatch, [], collections.Counter()
        self.plans: list[dict] = []
        real = ckptfix.tokenizers.load_tokenizer

        def load(path):
            self.tokenizers[str(Path(path).resolve())] += 1
            return real(path)

        monkeypatch.setattr(ckptfix.tokenizers, "load_tokenizer", load)

    def stage(self, owner, name: str, label: str) -> None:
        real = getattr(owner, name)

        def wrapped(*args, **kwargs):
            self.order.append(label)
            if label == "plan":
                self.plans.append(kwargs)
            return real(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, wrapped)


def _repair_stages(calls: Calls) -> None:
    calls.stage(ckptfix.surgery, "read_checkpoint", "read")
    calls.stage(ckptfix.surgery, "analyse", "analyse")
    calls.stage(ckptfix.surgery, "make_plan", "plan")
    calls.stage(ckptfix.audit, "audit", "audit")
    calls.stage(ckptfix.surgery, "verify_output", "verify")
    real_writer_for = ckptfix.surgery._writer_for

    def writer_for(*args, **kwargs):
        writer = real_writer_for(*args, **kwargs)

        def write(*a, **kw):
            calls.order.append("write")
            return writer(*a, **kw)

        return write

    calls.monkeypatch.setattr(ckptfix.surgery, "_writer_for", writer_for)


def test_repair_runs_each_stage_once_in_order_and_reads_each_tokenizer_once(files, tmp_path, monkeypatch):
    src, old, new = files
    calls = Calls(monkeypatch)
    _repair_stages(calls)
    result = ckptfix.repair(src, new, tmp_path / "fixed.pth", from_tokenizer=old, policy="remap", init="mean",
                            keep=("nothing.here",))
    assert calls.order == ["read", "analyse", "plan", "audit", "write", "verify"]
    assert calls.tokenizers == {str(Path(new).resolve()): 1, str(Path(old).resolve()): 1}
    # what the caller passed reaches the plan in its one call, as passed
    assert len(calls.plans) == 1
    options = calls.plans[0]["options"]
    assert (options.policy, options.init, options.keep) == ("remap", "mean", ("nothing.here",))
    assert result.plan.target_rows == NEW and result.plan.rows_by == "token"


def test_a_folders_own_tokenizer_is_read_once(tmp_path, monkeypatch):
    """The old tokenizer found in an HF folder (no --from-tokenizer): analyse finds it, the plan reuses that
    answer (it was read twice before: once by the analysis, once by the plan)."""
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    old = train_bpe_tokenizer_json(folder, 64)  # folder/tokenizer.json: the folder's own tokenizer
    new = extend_tokenizer_json(old, tmp_path / "new.json", ["<a>", "<b>", "<c>"])
    save_file({"model.embed_tokens.weight": torch.randn(64, 8), "lm_head.weight": torch.randn(64, 8)},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 64}))
    calls = Calls(monkeypatch)
    _repair_stages(calls)
    result = ckptfix.repair(str(folder), str(new), str(tmp_path / "out"))
    assert calls.order == ["read", "analyse", "plan", "audit", "write", "verify"]
    assert calls.tokenizers == {str(Path(new).resolve()): 1, str(folder.resolve()): 1}
    assert result.plan.rows_by == "token"
    assert any("saved in the checkpoint folder" in n for n in result.plan.notes)
    calls.tokenizers.clear()  # inspect: its analysis and the plan it audits share the one read too
    report = ckptfix.inspect(str(folder), str(new))
    assert calls.tokenizers == {str(Path(new).resolve()): 1, str(folder.resolve()): 1}
    assert report.audit is not None and report.old_tokenizer.origin == "folder"


def test_the_guard_loads_through_the_same_stages_once(files, monkeypatch):
    src, old, new = files
    calls = Calls(monkeypatch)
    calls.stage(ckptfix.guard.resume, "_read", "read")
    calls.stage(INSPECT, "analyse", "analyse")
    calls.stage(ckptfix.surgery.plan, "make_plan", "plan")
    calls.stage(ckptfix.audit, "audit", "audit")
    calls.stage(ckptfix.guard.resume, "Apply", "apply")
    run = new_run(NEW, seed=3)
    guard = ckptfix.ResumeGuard(run.model, run.optimizer, run.scheduler, run.scaler, tokenizer=str(new),
                                from_tokenizer=str(old), policy="remap", probe_steps=0)
    guard.load(str(src))
    assert calls.order == ["read", "analyse", "plan", "audit", "apply"]
    assert calls.tokenizers == {str(Path(new).resolve()): 1, str(Path(old).resolve()): 1}
    assert run.model.embedding.weight.shape[0] == NEW
