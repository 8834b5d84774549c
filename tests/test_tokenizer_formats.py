"""Tokenizer formats read by content (ckptfix/tokenizer_formats.py): the parts that need no download.

The real files of every format are in tests/test_tokenizer_corpus.py.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from tokenizer_factory import train_tokenizer

from ckptfix.errors import TokenizerError
from ckptfix.tokenizers import load_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import tokenizer_corpus as corpus  # noqa: E402


def _one_line_error(path: Path, match: str) -> str:
    with pytest.raises(TokenizerError) as caught:
        load_tokenizer(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message and match in message, message
    return message


def test_wordpiece_vocab_txt_given_as_a_file(tmp_path):
    """A vocab.txt that `tokenizers`' WordPiece trainer wrote, passed as a file, not a folder."""
    from transformers import BertTokenizer

    trained = train_tokenizer(300, "wordpiece", special=["[CLS]", "[SEP]", "[MASK]"])
    trained.model.save(str(tmp_path))  # writes vocab.txt (base vocabulary, specials included)
    vocab = tmp_path / "vocab.txt"
    info = load_tokenizer(vocab)
    bert = BertTokenizer(vocab=str(vocab))
    assert (info.kind, info.size) == ("wordpiece", len(bert))
    assert info.id_to_token() == bert.convert_ids_to_tokens(list(range(len(bert))))


@pytest.mark.parametrize("text, match", [
    ("IQ== 0\nnot base64!! 1\n", "line 2"),  # a tiktoken file with a broken line
    ("#version: 0.2\na b c\n", "two symbols"),  # merges with three symbols
    ("1 '\\x00' 1\n2 __import__('os') 2\n", "line 2"),  # RWKV: a token that is code, never evaluated
    ("1 'ab' 3\n", "length"),  # RWKV: the byte length disagrees
])
def test_broken_text_formats_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "tok.txt"
    path.write_text(text)
    _one_line_error(path, match)


def test_gzip_bomb_is_refused(tmp_path):
    import gzip

    path = tmp_path / "bpe.txt.gz"
    path.write_bytes(gzip.compress(b"#version: 0.2\n" + b"a" * (65 << 20)))
    _one_line_error(path, "decompresses past")


def test_tekken_with_too_few_ranks(tmp_path):
    import json

    doc = {"config": {"default_vocab_size": 40, "default_num_special_tokens": 30, "pattern": ".", "version": "v3"},
           "vocab": [{"rank": i, "token_bytes": "QQ==", "token_str": "A"} for i in range(3)]}
    path = tmp_path / "tekken.json"
    path.write_text(json.dumps(doc))
    _one_line_error(path, "fewer ranks")


def _slice_file(name: str) -> Path:
    entry = next(e for e in corpus.ENTRIES if e.name == name)
    path = corpus.cached(entry)
    if path is None:
        pytest.skip(f"{name} not cached: python fixtures/tokenizer_corpus.py --slice")
    return path


def test_a_folder_holding_a_tiktoken_file(tmp_path):
    """Whisper's assets folder (or Llama's original/): the folder is read through its tokenizer file."""
    source = _slice_file("whisper-multilingual")
    shutil.copy(source, tmp_path / source.name)  # a link out of the folder would be refused (issue 28)
    info = load_tokenizer(tmp_path)
    assert (info.kind, info.size) == ("tiktoken:whisper-multilingual", 51865)


def test_gpt2_folder_reads_encoder_json(tmp_path):
    for name in ("gpt2-encoder", "gpt2-vocab-bpe"):
        source = _slice_file(name)
        shutil.copy(source, tmp_path / source.name)
    info = load_tokenizer(tmp_path)
    assert (info.kind, info.size, info.id_to_token()[50256]) == ("vocab.json", 50257, "<|endoftext|>")


def test_tiktoken_tokens_are_spelled_like_tokenizer_json():
    """Byte-level tokens in GPT-2's alphabet: GPT-2's r50k ranks agree with its encoder.json token by token."""
    ranks = load_tokenizer(_slice_file("whisper-gpt2")).id_to_token()[:50256]
    encoder = load_tokenizer(_slice_file("gpt2-encoder")).id_to_token()[:50256]
    assert ranks == encoder
