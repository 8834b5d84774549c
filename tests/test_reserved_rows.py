"""Reserved rows that never trained (CKF110): a real run whose embedding has more rows than ids it ever saw.

The TinyLM below has 320 rows but trains (real AdamW + GradScaler steps) only on ids < 300, like Qwen's
rows reserved above its tokenizer: rows 300..319 never get a gradient, so their exp_avg_sq is exactly 0.
A tokenizer that then adds tokens at ids 300..309 needs no resize, and those rows are still random.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix
from ckptfix.tokenizers import load_tokenizer

EMBED, HEAD = "text_embedding.weight", "text_head.weight"
ROWS, USED = 320, 300
NEW = ["zzqx", "qqzz", "xxyzz", "<tool>", "<think>", "abcxyz", "mmqq", "kkzz", "yyqq", "wwzz"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("reserved")
    old = train_bpe_tokenizer_json(d, USED, name="old.json")
    new = train_bpe_tokenizer_json(d, USED, added=NEW, name="new.json")
    ckpt = save_checkpoint(train(new_run(ROWS), 30, vocab=USED), d / "ckpt.pth")
    return {"old": old, "new": new, "ckpt": ckpt, "src": torch.load(ckpt, weights_only=True)}


def test_the_fixture_is_what_it_claims(setup):
    v = setup["src"]["optimizer"]["state"][0]["exp_avg_sq"]
    assert v.shape[0] == ROWS and torch.count_nonzero(v[USED:]) == 0 and bool((v[:USED] > 0).any(1).all())
    assert load_tokenizer(setup["new"]).size == USED + len(NEW)


def test_inspect_reports_ids_on_never_trained_rows(setup):
    report = ckptfix.inspect(setup["ckpt"], setup["new"])
    found = [f for f in report.findings if f.code == "CKF110"]
    assert len(found) == 1 and found[0].severity == "warning"
    assert f"rows {USED}..{ROWS - 1} never received a gradient" in found[0].message
    assert f"ids {USED}..{USED + len(NEW) - 1}" in found[0].message
    assert not [f for f in ckptfix.inspect(setup["ckpt"], setup["old"]).findings if f.code == "CKF110"]
    assert not [f for f in ckptfix.inspect(setup["ckpt"]).findings if f.code == "CKF110"]


def test_tied_embedding_is_not_judged(tmp_path, setup):
    """A tied head gives every row a gradient through the softmax: no zero second moments to go by."""
    ckpt = save_checkpoint(train(new_run(ROWS, tied=True), 10, vocab=USED), tmp_path / "tied.pth")
    assert not [f for f in ckptfix.inspect(ckpt, setup["new"]).findings if f.code == "CKF110"]


@pytest.mark.parametrize("init", ["mean", "pieces"])
def test_repair_initialises_them_like_new_rows(setup, tmp_path, init):
    from tokenizers import Tokenizer

    out = tmp_path / "fixed.pth"
    result = ckptfix.repair(setup["ckpt"], setup["new"], out, init=init, pad_to_multiple_of=64)  # keep 320 rows
    assert any("never trained" in n for n in result.plan.notes)
    src, sd = setup["src"], torch.load(out, weights_only=True)
    renewed = range(USED, USED + len(NEW))
    for index, name in ((0, EMBED), (len(src["model"]) - 1, HEAD)):
        old_w, new_w = src["model"][name], sd["model"][name]
        assert new_w.shape == old_w.shape  # no resize needed
        assert torch.equal(new_w[:USED], old_w[:USED]) and torch.equal(new_w[USED + len(NEW):], old_w[USED + len(NEW):])
        if init == "mean":
            torch.testing.assert_close(new_w[USED], old_w.mean(0), rtol=0, atol=1e-3)
        state, old_state = sd["optimizer"]["state"][index], src["optimizer"]["state"][index]
        assert torch.count_nonzero(state["exp_avg"][list(renewed)]) == 0
        assert torch.equal(state["exp_avg_sq"][:USED], old_state["exp_avg_sq"][:USED])
        assert bool((state["exp_avg_sq"][list(renewed)] > 0).all())
    if init == "pieces":  # the new tokenizer's base model is the old one: it spells the added tokens
        real = Tokenizer.from_file(str(setup["old"]))
        ids = real.encode("zzqx").ids
        expected = src["model"][EMBED][ids].double().mean(0).float()
        torch.testing.assert_close(sd["model"][EMBED][USED], expected)


def test_with_the_old_tokenizer_the_new_tokens_are_new_anyway(setup, tmp_path):
    result = ckptfix.repair(setup["ckpt"], setup["new"], tmp_path / "f.pth", from_tokenizer=setup["old"],
                            pad_to_multiple_of=64)
    assert result.plan.weights[EMBED].plan.new == ROWS - USED  # by token string: every row no old token had
    assert not any("never trained" in n for n in result.plan.notes)
