"""`--init pieces`: a new token's rows start as the mean of the old rows of its text's pieces.

Tokenizers are trained at test time with the real `sentencepiece` and `tokenizers` libraries; the expected
pieces come from those libraries' own encoders, never from ckptfix's (which the cross-check tests compare
with them). Checkpoints are real TinyLM runs after real AdamW steps.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import corpus_lines, train_byte_level, train_sentencepiece, train_tokenizer_json

import ckptfix
from ckptfix.surgery.pieces import load_segmenter, spell
from ckptfix.surgery.rows import HEAD_SHRINK
from ckptfix.tokenizers import load_tokenizer

EMBED, HEAD = "text_embedding.weight", "text_head.weight"
WORDS = sorted({w for line in corpus_lines()[:60] for w in line.split()})[:150] + ["zzqx", "héllo", "naïve", "日本語"]


def _checkpoint(tmp_path, rows: int, tied: bool = False, used: int | None = None):
    run = train(new_run(rows, tied=tied), 25, vocab=used or rows)
    path = save_checkpoint(run, tmp_path / "ckpt.pth")
    return path, torch.load(path, weights_only=True)


def _mean_rows(weight: torch.Tensor, ids: list[int], pull: float = 1.0) -> torch.Tensor:
    """The pieces' mean row; rows that produce logits are pulled towards the old mean (HEAD_SHRINK)."""
    pieces, mean = weight[ids].double().mean(0), weight.double().mean(0)
    return (mean + pull * (pieces - mean)).float()


@pytest.mark.parametrize("model_type,options", [
    ("bpe", {}), ("unigram", {}), ("bpe", {"byte_fallback": True}), ("unigram", {"byte_fallback": True}),
    ("bpe", {"user_defined_symbols": ["abc", "<sep>"]}),
])
def test_sentencepiece_encoding_matches_the_library(tmp_path, model_type, options):
    import sentencepiece

    path = train_sentencepiece(tmp_path, 800 if model_type == "bpe" else 600, model_type, **options)
    real = sentencepiece.SentencePieceProcessor(model_file=str(path))
    ours = load_segmenter(load_tokenizer(path))
    for word in WORDS:  # " word" after a word: the ▁ word-start marker, as sentencepiece's dummy prefix adds it
        assert spell(ours, " " + word) == real.encode(word), word


@pytest.mark.parametrize("model", ["bpe", "unigram", "wordpiece"])
def test_tokenizer_json_encoding_matches_the_library(tmp_path, model):
    from tokenizers import Tokenizer

    path = train_tokenizer_json(tmp_path, 500, model)
    real = Tokenizer.from_file(str(path))
    ours = load_segmenter(load_tokenizer(path))
    for word in WORDS:
        assert ours.encode(word) == real.encode(word).ids, word


def _byte_level(tmp_path, added=(), special=()):
    from tokenizers import AddedToken, Tokenizer

    tok = train_byte_level(corpus_lines(), 400)
    old = tmp_path / "old.json"
    tok.save(str(old))
    tok.add_tokens([AddedToken(t, normalized=False) for t in added])
    tok.add_special_tokens(list(special))
    new = tmp_path / "new.json"
    tok.save(str(new))
    return old, new, Tokenizer.from_file(str(old))


def test_byte_level_encoding_matches_the_library(tmp_path):
    _, _, real = _byte_level(tmp_path)
    ours = load_segmenter(load_tokenizer(tmp_path / "old.json"))
    for word in WORDS + ["a.b(c)", "x_y 12"]:
        assert ours.encode(" " + word) == real.encode(" " + word).ids, word


def test_byte_level_bpe_new_rows_are_the_mean_of_their_pieces(tmp_path):
    added = [" " + w for w in WORDS[:40] if len(w) > 5][:12] + [" héllo日本"]  # multi-byte text: byte pieces
    old, new, real = _byte_level(tmp_path, added, special=["<|tool|>", "<|img|>"])
    old_size, new_tok = load_tokenizer(old).size, load_tokenizer(new)
    path, src = _checkpoint(tmp_path, old_size)
    out = tmp_path / "fixed.pth"
    result = ckptfix.repair(path, new, out, from_tokenizer=old)  # the old tokenizer is known: pieces by default
    assert result.plan.init == "pieces"
    sd = torch.load(out, weights_only=True)
    ids = new_tok.token_to_id()
    for text in added:
        pieces = real.encode(text).ids
        assert len(pieces) >= 2, text
        # untied: the embedding row is the pieces' mean; the head row is pulled towards the mean
        torch.testing.assert_close(sd["model"][EMBED][ids[text]], _mean_rows(src["model"][EMBED], pieces))
        torch.testing.assert_close(sd["model"][HEAD][ids[text]], _mean_rows(src["model"][HEAD], pieces, HEAD_SHRINK))
    state = sd["optimizer"]["state"]
    for index in (0, len(src["model"]) - 1):  # embedding and head moments: m = 0, v = old column mean
        assert torch.count_nonzero(state[index]["exp_avg"][old_size:]) == 0
        old_v = src["optimizer"]["state"][index]["exp_avg_sq"]
        torch.testing.assert_close(state[index]["exp_avg_sq"][old_size:],
                                   old_v.mean(0).expand(new_tok.size - old_size, -1), rtol=1e-6, atol=0)
    # new special tokens: no pieces; near the mean, but distinct from each other
    emb = sd["model"][EMBED]
    a, b = emb[ids["<|tool|>"]], emb[ids["<|img|>"]]
    assert not torch.equal(a, b)
    col_std = src["model"][EMBED].std(0)
    assert torch.all((a - src["model"][EMBED].mean(0)).abs() < 0.1 * col_std)


def test_sentencepiece_new_pieces_with_word_start_and_byte_fallback(tmp_path):
    import sentencepiece

    old = train_sentencepiece(tmp_path, 500, "bpe", name="old", byte_fallback=True)
    new = train_sentencepiece(tmp_path, 900, "bpe", name="new", byte_fallback=True, user_defined_symbols=["ü日"])
    real = sentencepiece.SentencePieceProcessor(model_file=str(old))
    old_tok, new_tok = load_tokenizer(old), load_tokenizer(new)
    path, src = _checkpoint(tmp_path, old_tok.size, tied=True)
    out = tmp_path / "fixed.pth"
    result = ckptfix.repair(path, new, out, from_tokenizer=old)
    sd = torch.load(out, weights_only=True)
    source = result.plan.weights[EMBED].plan.source
    old_ids, emb = old_tok.token_to_id(), src["model"][EMBED]
    checked = {"word-start": 0, "byte": 0}
    for j, token in enumerate(new_tok.id_to_token()):
        if source[j] >= 0 or token is None:
            continue
        if token.startswith("\u2581") and len(token) > 1:  # "▁word": the library spells " word" as "word"
            pieces = real.encode(token[1:])
            checked["word-start"] += 1
        elif token == "ü日":  # not in the old vocabulary: bytes <0xC3><0xBC><0xE6><0x97><0xA5>
            pieces = real.encode(token)
            pieces = pieces[1:] if real.id_to_piece(pieces[0]) == "\u2581" else pieces
            assert [real.id_to_piece(i) for i in pieces] == ["<0xC3>", "<0xBC>", "<0xE6>", "<0x97>", "<0xA5>"]
            checked["byte"] += 1
        else:
            continue
        assert pieces and all(real.id_to_piece(i) in old_ids for i in pieces)
        torch.testing.assert_close(sd["model"][EMBED][j], _mean_rows(emb, pieces, HEAD_SHRINK))  # tied: logits
        torch.testing.assert_close(sd["model"][HEAD][j], sd["model"][EMBED][j])
    assert checked["word-start"] >= 20 and checked["byte"] == 1


def test_default_init_follows_whether_the_old_tokenizer_is_known(tmp_path):
    old, new, _ = _byte_level(tmp_path, [" zzqx"])
    path, _ = _checkpoint(tmp_path, load_tokenizer(old).size)
    assert ckptfix.repair(path, new, dry_run=True).plan.init == "mean"
    assert ckptfix.repair(path, new, dry_run=True, from_tokenizer=old).plan.init == "pieces"
    assert ckptfix.repair(path, new, dry_run=True, from_tokenizer=old, init="zeros").plan.init == "zeros"


def test_an_old_tokenizer_with_no_segmenter_is_named_in_the_plan(tmp_path):
    """A tiktoken rank file of no known family (its pre-tokenizer pattern unknown) spells nothing: every new
    row gets the fallback and the plan says why, never a silent mean."""
    import base64
    import json

    from ckptfix.tokenizer_formats import BYTE_ALPHABET

    old, new, _ = _byte_level(tmp_path, [" zzqx", " héllo"])
    back = {c: b for b, c in enumerate(BYTE_ALPHABET)}
    vocab = json.loads(old.read_text())["model"]["vocab"]
    ranks = tmp_path / "old.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes(back[c] for c in t)).decode()} {i}\n"
                             for t, i in sorted(vocab.items(), key=lambda kv: kv[1])))
    info = load_tokenizer(ranks)
    assert info.kind == "tiktoken:tiktoken" and load_segmenter(info) is None
    path, _ = _checkpoint(tmp_path, info.size)
    plan = ckptfix.repair(path, new, dry_run=True, from_tokenizer=ranks).plan
    assert plan.init == "pieces"
    assert any("no new row has pieces (a tiktoken file of no known family" in n for n in plan.notes), plan.notes
