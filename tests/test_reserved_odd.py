"""Issue 33, item 6: rows recorded in config.json at an odd count above the tokenizer (1003 for 1000 tokens)
are a warning naming both outcomes (CKF106); a round reserve stays information (CKF105). Both outcomes are
shown with transformers itself: from the config it loads, resized to len(tokenizer) it does not."""

from __future__ import annotations

import pytest
import torch

import ckptfix

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


def _saved(tmp_path, rows, tokens=1000):
    from tokenizer_factory import make_hf_tokenizer_folder

    tok = make_hf_tokenizer_folder(tmp_path, tokens, name="tok")
    assert len(transformers.AutoTokenizer.from_pretrained(tok)) == tokens
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=rows,
                                                                 n_positions=32))
    model.save_pretrained(tmp_path / "model")
    return tmp_path / "model", tok


def test_odd_reserve_recorded_in_config_is_a_warning_naming_both_outcomes(tmp_path, monkeypatch):
    folder, tok = _saved(tmp_path, 1003)
    monkeypatch.chdir(tmp_path)
    report = ckptfix.inspect("model", "tok")
    assert report.exit_code == 0
    (f,) = [f for f in report.findings if f.code.startswith("CKF10")]
    assert (f.code, f.severity) == ("CKF106", "warning")
    assert f.message == ("1003 rows for 1000 tokens: the checkpoint records vocab_size 1003, 3 row(s) above the "
                         "tokenizer and not a round multiple (a reserve is usually a multiple of 64+)")
    assert f.pytorch == (
        "A model built from the checkpoint's config (from_pretrained, or vocab_size=1003) loads it and ids stay "
        "below 1000: fine. A script that calls model.resize_token_embeddings(len(tokenizer)) before "
        "trainer.train(resume_from_checkpoint=...) builds 1000 rows, and loading raises 'size mismatch for "
        "transformer.wte.weight' (1003 rows in the checkpoint).")
    assert f.fix == ("Build the model from the checkpoint's config and do not resize it to len(tokenizer); or, for "
                     "one row per token, ckptfix repair model --tokenizer tok --from-tokenizer OLD_TOKENIZER -o "
                     "model-fixed --pad-to 1  (OLD_TOKENIZER: the tokenizer the checkpoint was trained with; leave "
                     "--from-tokenizer out only if the new one kept its ids and appended tokens: rows are then kept "
                     "by id) and resume from that.")
    # Both outcomes, as transformers has them.
    state = transformers.GPT2LMHeadModel.from_pretrained(folder).state_dict()
    assert state["transformer.wte.weight"].shape[0] == 1003
    resized = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(folder))
    resized.resize_token_embeddings(1000)
    with pytest.raises(RuntimeError, match="size mismatch for transformer.wte.weight"):
        resized.load_state_dict(state)
    # The fix's repair gives one row per token, which the resized model loads.
    ckptfix.repair("model", "tok", "model-fixed", pad_to_multiple_of=1)
    resized.load_state_dict(transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "model-fixed").state_dict())


def test_round_reserve_stays_information(tmp_path):
    folder, tok = _saved(tmp_path, 2112, tokens=1990)  # 33 x 64 rows: no padding of 1990 gives it
    codes = [(f.code, f.severity) for f in ckptfix.inspect(folder, tok).findings if f.code.startswith("CKF10")]
    assert codes == [("CKF105", "info")]
