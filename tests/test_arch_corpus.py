"""Vocab tensors found by structure in every architecture `transformers` builds (tests/arch_corpus.py).

The whole corpus (60+ architectures: causal LM, masked LM, seq2seq, state-space, RWKV; tied and untied)
runs under `pytest -m long`; a representative slice runs by default.
"""

from __future__ import annotations

import pytest
import torch
from arch_corpus import ARCHITECTURES, FAST, arch_id, build, check_architecture, word_level_tokenizer

import ckptfix
from ckptfix.errors import CkptfixError

pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

FAST_ARCHS = [a for a in ARCHITECTURES if a[0] in FAST and not a[2] and (a[0], a[1]) != ("bart", "causal")]


@pytest.mark.parametrize("arch", FAST_ARCHS, ids=arch_id)
def test_architecture(arch, tmp_path):
    outcome = check_architecture(arch, tmp_path)
    assert outcome.inspect_ok and outcome.repair_ok, outcome.problem


@pytest.mark.long
@pytest.mark.parametrize("arch", [a for a in ARCHITECTURES if a not in FAST_ARCHS], ids=arch_id)
def test_architecture_long(arch, tmp_path):
    outcome = check_architecture(arch, tmp_path)
    assert outcome.inspect_ok and outcome.repair_ok, outcome.problem


class _Custom(torch.nn.Module):
    """Seed 001's situation under names no list knows: `tbl` and `proj_out`."""

    def __init__(self, vocab: int, width: int = 16):
        super().__init__()
        self.tbl = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, width)
        self.proj_out = torch.nn.Linear(width, vocab)


def test_vocab_tensors_found_by_structure_not_names(tmp_path):
    model = _Custom(1001)
    opt = torch.optim.AdamW(model.parameters())
    model.proj_out(model.mix(model.tbl(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    tok = word_level_tokenizer(tmp_path / "tok.json", 1000)
    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert report.exit_code == 1
    assert {v.name: v.role for v in report.vocab} == {"tbl.weight": "embedding", "proj_out.weight": "head",
                                                     "proj_out.bias": "head-bias"}
    out = tmp_path / "fixed.pt"
    ckptfix.repair(str(src), str(tok), str(out))
    fixed = _Custom(1000)
    fixed.load_state_dict(torch.load(out, weights_only=True)["model"], strict=True)


def test_a_square_projection_the_size_of_the_vocab_is_not_resized(tmp_path):
    """RWKV-like: a (width, width) `attention.output` when the width equals the vocab is never a vocab tensor."""
    model = build(("rwkv", "causal", {}), 203)
    state = model.state_dict()
    state["rwkv.blocks.0.attention.output.weight"] = torch.zeros(203, 203)  # a size that matches by accident
    src = tmp_path / "ckpt.pt"
    torch.save({"model": state}, src)
    report = ckptfix.inspect(str(src), tokenizer=str(word_level_tokenizer(tmp_path / "tok.json", 210)))
    assert "rwkv.blocks.0.attention.output.weight" not in {v.name for v in report.vocab}
    assert {"rwkv.embeddings.weight", "head.weight"} <= {v.name for v in report.vocab}


def _custom_with_lost_order(tmp_path, stale_rows: int | None = None):
    """`_Custom` after one AdamW step, its state under indices no parameter order explains and proj_out.weight's
    entry deleted: one (1000, 16) entry for two (1000, 16) vocab tensors; `stale_rows`: that entry's moments left
    at another row count (as after a resize that forgot the optimizer)."""
    model = _Custom(1000)
    opt = torch.optim.AdamW(model.parameters())
    model.proj_out(model.mix(model.tbl(torch.tensor([1, 2])))).sum().backward()
    opt.step()
    sd = opt.state_dict()
    sd["state"] = {k + 10: v for k, v in sd["state"].items()}  # indices no parameter order explains
    sd["param_groups"][0]["params"] = [i + 10 for i in sd["param_groups"][0]["params"]]
    del sd["state"][13]  # proj_out.weight's: one (1000, 16) entry left for two (1000, 16) tensors
    if stale_rows is not None:
        sd["state"][10] = {k: v[:stale_rows] if v.dim() else v for k, v in sd["state"][10].items()}
    src = tmp_path / "ckpt.pt"
    torch.save({"model": {k: v for k, v in reversed(model.state_dict().items())}, "optimizer": sd}, src)
    return src, sd


def test_one_entry_for_two_same_shape_vocab_tensors_moves_the_same_rows_either_way(tmp_path):
    """Which of two (1000, 16) vocab tensors holds the one (1000, 16) entry is not recorded, but both get the same
    row plan: the entry is resized by it (whoever's it is) and the note says which is not known; nothing dropped."""
    src, sd = _custom_with_lost_order(tmp_path)
    tok = word_level_tokenizer(tmp_path / "tok.json", 1010)
    result = ckptfix.repair(str(src), str(tok), str(tmp_path / "fixed.pt"))
    out = torch.load(tmp_path / "fixed.pt", weights_only=True)["optimizer"]["state"]
    assert out.keys() == sd["state"].keys()
    assert out[10]["exp_avg"].shape == (1010, 16) and torch.equal(out[10]["exp_avg"][:1000], sd["state"][10]["exp_avg"])
    assert any("which of them is not recorded" in n for n in result.to_json()["notes"])


def test_unmatched_moments_stop_repair_and_name_the_policy(tmp_path):
    """Moments that cannot be told apart are never dropped or guessed: a (995, 16) entry may be either vocab
    tensor's moments left at the rows before a resize: exit 2 naming --policy fresh."""
    src, _ = _custom_with_lost_order(tmp_path, stale_rows=995)
    tok = word_level_tokenizer(tmp_path / "tok.json", 1010)
    with pytest.raises(CkptfixError, match="--policy fresh"):
        ckptfix.repair(str(src), str(tok), str(tmp_path / "fixed.pt"))


def test_a_per_layer_token_lookup_table_grows_and_a_wide_one_is_refused(tmp_path):
    """DeepSeek-V4's hash routing keeps `tid2eid` (token id -> expert ids, int64 (vocab, top_k)) in every
    hash-MoE layer: a lookup by token id (integer, the vocab's rows first, a few ids per token), so inspect names
    it and repair grows it with the tokens (new rows: ids drawn from those the table holds). An integer table
    with the vocab's rows that is not such a lookup (256 wide) is still named (CKF130) and refused (exit 2)."""
    state = _Custom(1000).state_dict()
    state["layers.0.gate.tid2eid"] = torch.randint(0, 8, (1000, 2))
    src = tmp_path / "ckpt.pt"
    torch.save({"model": state}, src)
    tok = word_level_tokenizer(tmp_path / "tok.json", 1010)
    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert "layers.0.gate.tid2eid" in {v.name for v in report.vocab if v.role == "lookup"}
    ckptfix.repair(str(src), str(tok), str(tmp_path / "fixed.pt"))
    table = torch.load(tmp_path / "fixed.pt", weights_only=True)["model"]["layers.0.gate.tid2eid"]
    assert table.shape == (1010, 2) and torch.equal(table[:1000], state["layers.0.gate.tid2eid"])
    assert int(table[1000:].max()) < 8

    state["layers.0.gate.tid2eid"] = torch.zeros(1000, 256, dtype=torch.long)
    torch.save({"model": state}, src)
    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert any(f.code == "CKF130" and "tid2eid" in f.message for f in report.findings)
    with pytest.raises(CkptfixError, match="tid2eid"):
        ckptfix.repair(str(src), str(tok), str(tmp_path / "fixed2.pt"))
