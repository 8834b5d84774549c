"""load_tokenizer against real sentencepiece / tokenizers / transformers tokenizers built at test time."""

from __future__ import annotations

import json
import random
import shutil
import warnings
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizer_factory import (
    extend_tokenizer_json,
    make_hf_tokenizer_folder,
    reorder_tokenizer_json,
    train_bpe_tokenizer_json,
    train_sentencepiece,
    train_tokenizer,
    train_tokenizer_json,
)

from ckptfix.errors import TokenizerError
from ckptfix.tokenizers import TokenizerInfo, load_tokenizer

ADDED = ("zzfoo", "zzbar")
SPECIAL = ("<|tool|>", "<|end|>")


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    return train_sentencepiece(tmp_path_factory.mktemp("sp"), vocab_size=1000)


@pytest.fixture(scope="module")
def bpe_json(tmp_path_factory) -> Path:
    return train_bpe_tokenizer_json(tmp_path_factory.mktemp("bpe"), 300, added=ADDED, special=SPECIAL)


def transformers_or_skip():
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers


def auto_tokenizer(folder: Path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers_or_skip().AutoTokenizer.from_pretrained(str(folder))


def assert_matches_hf(info: TokenizerInfo, hf) -> None:
    """Same size as len(hf) and the same token behind every id."""
    assert info.size == len(hf)
    assert info.base_size == hf.vocab_size
    assert info.id_to_token() == hf.convert_ids_to_tokens(list(range(len(hf))))


def assert_one_line_error(path, match: str | None = None) -> TokenizerError:
    with pytest.raises(TokenizerError) as caught:
        load_tokenizer(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message
    if match:
        assert match in message
    return caught.value


# --- sentencepiece -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type,vocab_size", [("bpe", 1000), ("bpe", 257), ("unigram", 1000)])
def test_sentencepiece_size_is_exact_and_pieces_match(tmp_path, model_type, vocab_size):
    import sentencepiece

    path = train_sentencepiece(tmp_path, vocab_size, model_type)
    info = load_tokenizer(path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    assert (info.kind, info.source, info.path) == ("sentencepiece", str(path), str(path))
    assert info.base_size == info.size == vocab_size == sp.get_piece_size()
    assert info.added_tokens == ()
    assert info.id_to_token() == [sp.id_to_piece(i) for i in range(vocab_size)]
    assert info.token_to_id()["<unk>"] == sp.unk_id()
    assert set(info.special_tokens) == {"<unk>", "<s>", "</s>"}


def test_sentencepiece_training_is_deterministic(tmp_path):
    import sentencepiece

    def pieces(path: Path) -> list[tuple[str, float]]:
        sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
        return [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]

    # Not byte-identical: the model records its model_prefix, i.e. the directory it was trained in.
    assert pieces(train_sentencepiece(tmp_path / "a", 500)) == pieces(train_sentencepiece(tmp_path / "b", 500))


def test_sentencepiece_detected_by_content_not_extension(tmp_path, sp_model):
    renamed = tmp_path / "weights.bin"
    shutil.copy(sp_model, renamed)
    assert load_tokenizer(renamed).kind == "sentencepiece"
    assert load_tokenizer(renamed).id_to_token() == load_tokenizer(sp_model).id_to_token()


def test_sentencepiece_user_defined_symbols_are_pieces(tmp_path):
    info = load_tokenizer(train_sentencepiece(tmp_path, 400, user_defined_symbols=["<tool>"], pad_id=3))
    assert info.size == 400
    assert info.id_to_token()[3] == "<pad>"
    assert "<tool>" in info.token_to_id() and "<pad>" in info.special_tokens


# --- tokenizer.json ----------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["bpe", "wordpiece", "unigram", "wordlevel"])
def test_tokenizer_json_matches_tokenizers_library(tmp_path, model):
    from tokenizers import Tokenizer

    path = train_tokenizer_json(tmp_path, 300, model, added=ADDED, special=SPECIAL)
    info = load_tokenizer(path)
    lib = Tokenizer.from_file(str(path))
    assert info.kind == "tokenizer.json"
    assert info.base_size == lib.get_vocab_size(with_added_tokens=False)
    assert info.size == lib.get_vocab_size(with_added_tokens=True) == info.base_size + len(ADDED + SPECIAL)
    assert info.id_to_token() == [lib.id_to_token(i) for i in range(info.size)]
    assert info.token_to_id() == lib.get_vocab(with_added_tokens=True)
    beyond = [(i, c, s) for i, c, s in info.added_tokens if i >= info.base_size]
    assert beyond == [(info.base_size + k, c, c in SPECIAL) for k, c in enumerate(ADDED + SPECIAL)]
    assert {"[UNK]", "[PAD]", *SPECIAL} <= set(info.special_tokens)


@pytest.mark.transformers
def test_tokenizer_json_size_equals_len_of_transformers(bpe_json):
    transformers = transformers_or_skip()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(bpe_json))
    assert_matches_hf(load_tokenizer(bpe_json), hf)


def test_added_token_already_in_vocab_keeps_its_id_and_adds_no_row(tmp_path):
    from tokenizers import Tokenizer

    tokenizer = train_tokenizer(300)
    existing = tokenizer.id_to_token(150)
    tokenizer.add_tokens([existing, "brandnew"])
    path = tmp_path / "tokenizer.json"
    tokenizer.save(str(path))
    info = load_tokenizer(path)
    assert (150, existing, False) in info.added_tokens
    assert info.size == 301 == Tokenizer.from_file(str(path)).get_vocab_size()
    assert info.token_to_id()["brandnew"] == 300


@pytest.mark.parametrize(
    "declared",
    [[("far_away", 350)], [("collider", 5)], [("a1", 320), ("a2", 310), ("a3", 0)]],
    ids=["gap", "inside-base", "out-of-order"],
)
def test_declared_ids_that_tokenizers_would_reassign(tmp_path, bpe_json, declared):
    """Hand-edited ids: we report the ids the tokenizer really emits, not the ones the file claims."""
    from tokenizers import Tokenizer

    doc = json.loads(bpe_json.read_text())
    doc["added_tokens"] += [dict(doc["added_tokens"][-1], content=c, id=i, special=False) for c, i in declared]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(doc))
    lib = Tokenizer.from_file(str(path))
    info = load_tokenizer(path)
    assert info.size == lib.get_vocab_size(with_added_tokens=True)
    assert info.token_to_id() == lib.get_vocab(with_added_tokens=True)


def test_to_json_summary(bpe_json):
    info = load_tokenizer(bpe_json)
    summary = info.to_json()
    assert summary == {
        "path": str(bpe_json),
        "kind": "tokenizer.json",
        "source": str(bpe_json),
        "base_size": 300,
        "added": len(info.added_tokens),
        "special_tokens": list(info.special_tokens),
        "size": 304,
    }
    json.dumps(summary)


# --- Hugging Face folders ----------------------------------------------------------------------------


@pytest.mark.transformers
def test_hf_folder_from_save_pretrained_matches_auto_tokenizer(tmp_path):
    transformers_or_skip()
    folder = make_hf_tokenizer_folder(tmp_path, 300, added=ADDED, special=SPECIAL)
    info = load_tokenizer(folder)
    assert (info.kind, info.source) == ("hf-folder", str(folder / "tokenizer.json"))
    assert info.size == 300 + len(ADDED + SPECIAL)
    assert_matches_hf(info, auto_tokenizer(folder))
    assert set(SPECIAL) <= set(info.special_tokens)


@pytest.mark.transformers
def test_hf_sentencepiece_folder_matches_auto_tokenizer(tmp_path):
    transformers_or_skip()
    folder = make_hf_tokenizer_folder(tmp_path, 500, added=ADDED, special=SPECIAL, backend="sentencepiece")
    info = load_tokenizer(folder)
    assert info.source == str(folder / "tokenizer.model")
    assert (info.base_size, info.size) == (500, 500 + len(ADDED + SPECIAL))
    assert_matches_hf(info, auto_tokenizer(folder))


@pytest.mark.transformers
def test_folder_config_added_and_named_special_tokens_append_like_transformers(tmp_path, bpe_json):
    """added_tokens_decoder is applied in id order, then named special tokens missing from the vocab."""
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(bpe_json, folder / "tokenizer.json")
    decoder = {str(i): {"content": c, "special": s} for i, c, s in [(330, "[Z]", False), (304, "[A]", True)]}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": decoder,
        "mask_token": "<mask>",
        "pad_token": "[PAD]",  # already in the vocabulary: no new row
        "bos_token": {"__type": "AddedToken", "content": "<bos>", "special": True},
        "extra_special_tokens": {"image_token": "<img>"},
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    info = load_tokenizer(folder)
    ids = info.token_to_id()
    assert [ids[t] for t in ["[A]", "[Z]", "<bos>", "<mask>", "<img>"]] == list(range(304, 309))
    assert info.size == 309
    assert {"<bos>", "<mask>", "<img>", "[PAD]"} <= set(info.special_tokens)
    assert_matches_hf(info, auto_tokenizer(folder))


@pytest.mark.transformers
def test_legacy_added_tokens_json_and_special_tokens_map(tmp_path, bpe_json):
    folder = tmp_path / "tok"
    folder.mkdir()
    shutil.copy(bpe_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "added_tokens.json").write_text(json.dumps({"[Z]": 305, "[A]": 304}))
    special_map = {"pad_token": "<pad2>", "additional_special_tokens": ["<x>"]}
    (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    info = load_tokenizer(folder)
    assert [info.token_to_id()[t] for t in ["[A]", "[Z]", "<pad2>", "<x>"]] == [304, 305, 306, 307]
    assert_matches_hf(info, auto_tokenizer(folder))


@pytest.mark.transformers
def test_bert_vocab_txt_folder(tmp_path):
    tokenizer = train_tokenizer(200, "wordpiece")
    folder = tmp_path / "bert"
    folder.mkdir()
    tokenizer.model.save(str(folder))  # writes vocab.txt
    names = {f"{n}_token": f"[{n.upper()}]" for n in ["unk", "sep", "pad", "cls", "mask"]}
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer", **names}))
    # Lower case: BertTokenizer lower-cases non-special added tokens (do_lower_case), which we do not model.
    (folder / "added_tokens.json").write_text(json.dumps({"[new]": 200}))
    info = load_tokenizer(folder)
    assert info.source == str(folder / "vocab.txt")
    # [SEP], [CLS], [MASK] are not in the trained vocabulary: transformers appends them after [new].
    assert (info.base_size, info.size) == (200, 204)
    assert info.id_to_token() == [tokenizer.id_to_token(i) for i in range(200)] + ["[new]", "[SEP]", "[CLS]", "[MASK]"]
    assert_matches_hf(info, auto_tokenizer(folder))


@pytest.mark.transformers
def test_vocab_txt_lines_are_read_like_transformers(tmp_path):
    """Split on \\n only, trailing Unicode whitespace trimmed (Rust trim_end), a repeated token keeps its last id."""
    lines = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", "hello\r", "x\u2028", "a\x1c", "b\rc", " e ", "\t", "hello"]
    (tmp_path / "vocab.txt").write_text("\n".join(lines) + "\n", encoding="utf-8", newline="")
    info = load_tokenizer(tmp_path)
    expected = ["[UNK]", "[PAD]", "[CLS]", "[SEP]", "[MASK]", None, "x", "a\x1c", "b\rc", " e", "", "hello"]
    assert info.id_to_token() == expected
    assert (info.base_size, info.size) == (11, 12)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "BertTokenizer"}))
    hf = auto_tokenizer(tmp_path)
    assert info.token_to_id() == hf.get_vocab()
    assert info.base_size == hf.vocab_size
    assert len(hf) == info.size - 1  # len() counts tokens, not rows: it misses the hole at id 5


@pytest.mark.transformers
def test_gpt2_vocab_json_folder(tmp_path):
    tokenizer = train_tokenizer(200, "bpe")
    folder = tmp_path / "gpt2"
    folder.mkdir()
    tokenizer.model.save(str(folder))  # writes vocab.json + merges.txt
    config = {"tokenizer_class": "GPT2Tokenizer", "unk_token": "[UNK]", "bos_token": "[UNK]", "eos_token": "[UNK]"}
    config["added_tokens_decoder"] = {"200": {"content": "<|im_end|>", "special": True}}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    info = load_tokenizer(folder)
    assert info.source == str(folder / "vocab.json")
    assert (info.base_size, info.size) == (200, 201)
    assert info.added_tokens[-1] == (200, "<|im_end|>", True)
    hf = auto_tokenizer(folder)
    assert len(hf) == info.size
    assert info.id_to_token() == hf.convert_ids_to_tokens(list(range(len(hf))))


def test_folder_prefers_tokenizer_json_over_sentencepiece(tmp_path, bpe_json, sp_model):
    shutil.copy(bpe_json, tmp_path / "tokenizer.json")
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    assert load_tokenizer(tmp_path).source == str(tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer.json").unlink()
    info = load_tokenizer(tmp_path)
    assert (info.kind, info.source, info.size) == ("hf-folder", str(tmp_path / "tokenizer.model"), 1000)


def test_spiece_model_folder(tmp_path, sp_model):
    shutil.copy(sp_model, tmp_path / "spiece.model")
    assert load_tokenizer(tmp_path).id_to_token() == load_tokenizer(sp_model).id_to_token()


# --- bad input ---------------------------------------------------------------------------------------


def _write(tmp_path: Path, name: str, data: bytes | str) -> Path:
    path = tmp_path / name
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


BAD_FILES = {
    "empty.json": (b"", "empty"),
    "random.model": (random.Random(1).randbytes(4096), "not a tokenizer"),
    "broken.json": (b'{"model": {"vocab": ', "invalid JSON"),
    "list.json": (b"[1, 2, 3]", "not a tokenizer.json"),
    "other.json": (b'{"hello": "world"}', "not a tokenizer.json"),
    "tokenizer_config.json": (b'{"tokenizer_class": "LlamaTokenizer"}', "pass its folder"),
    "latin1.json": (b'{"model": {"vocab": {"caf\xe9": 0}}}', "not UTF-8"),
    "badids.json": (b'{"model": {"type": "BPE", "vocab": {"a": "zero"}}}', "not a token id"),
    "negative.json": (b'{"model": {"vocab": {"a": -1}}}', "not a token id"),
    "huge.json": (b'{"model": {"vocab": {"a": 99999999999}}}', "not a token id"),
    "badunigram.json": (b'{"model": {"type": "Unigram", "vocab": [[1, 2]]}}', "Unigram"),
    "badadded.json": (b'{"model": {"vocab": {"a": 0}}, "added_tokens": [{"id": 1}]}', "added_tokens"),
    "deep.json": (b"[" * 100000, "invalid JSON"),
    "text.txt": (b"hello world\n", "not a tokenizer"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_bad_files_give_one_line_tokenizer_error(tmp_path, name):
    data, match = BAD_FILES[name]
    assert_one_line_error(_write(tmp_path, name, data), match)


def test_missing_path(tmp_path):
    assert_one_line_error(tmp_path / "nope.model", "no such file")
    assert_one_line_error(tmp_path / ("x" * 5000), "cannot access")


def test_empty_folder_and_folder_without_tokenizer_files(tmp_path):
    assert_one_line_error(tmp_path, "no tokenizer files")
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    assert_one_line_error(tmp_path, "no tokenizer files")


def test_corrupt_files_inside_folder_name_the_file(tmp_path, bpe_json):
    shutil.copy(bpe_json, tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    error = assert_one_line_error(tmp_path)
    assert "tokenizer_config.json" in str(error)
    (tmp_path / "tokenizer_config.json").write_text('{"added_tokens_decoder": {"x": {"content": "a"}}}')
    assert "added_tokens_decoder" in str(assert_one_line_error(tmp_path))
    (tmp_path / "tokenizer.json").write_bytes(b"\x00\x01garbage")
    assert "tokenizer.json" in str(assert_one_line_error(tmp_path))


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_torch_checkpoint_is_not_a_tokenizer(tmp_path, legacy):
    torch = pytest.importorskip("torch")
    path = tmp_path / "model.pt"
    torch.save({"weight": torch.zeros(3)}, path, _use_new_zipfile_serialization=not legacy)
    assert_one_line_error(path, "pickle" if legacy else "zip archive")


def test_safetensors_is_not_a_tokenizer(tmp_path):
    torch = pytest.importorskip("torch")
    save_file = pytest.importorskip("safetensors.torch").save_file
    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.zeros(3)}, str(path))
    assert_one_line_error(path, "safetensors")


@pytest.mark.parametrize("cut", [1, 2, 10, 100, -1000, -1])
def test_truncated_sentencepiece_model(tmp_path, sp_model, cut):
    data = sp_model.read_bytes()
    assert_one_line_error(_write(tmp_path, "cut.model", data[:cut]))


def test_truncated_sentencepiece_model_is_named_as_such(tmp_path, sp_model):
    assert_one_line_error(_write(tmp_path, "cut.model", sp_model.read_bytes()[:-5]), "sentencepiece")


def test_sentencepiece_folder_with_corrupt_model(tmp_path, sp_model):
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes()[:-7])
    assert "tokenizer.model" in str(assert_one_line_error(tmp_path, "sentencepiece"))


def test_unrelated_protobuf_is_rejected(tmp_path):
    # A valid protobuf whose field 1 is a varint, not a piece message: sentencepiece must never see it.
    assert_one_line_error(_write(tmp_path, "other.pb", bytes([0x08, 0x96, 0x01, 0x12, 0x02, 0x68, 0x69])))


def _load_or_error(path: Path) -> None:
    try:
        info = load_tokenizer(path)
    except TokenizerError as error:
        assert "\n" not in str(error)
    else:
        assert len(info.id_to_token()) == info.size


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@FUZZ
@given(data=st.binary(max_size=512))
def test_fuzz_random_bytes(tmp_path, data):
    _load_or_error(_write(tmp_path, "fuzz.bin", data))


@FUZZ
@given(position=st.integers(0, 10**6), byte=st.integers(0, 255), truncate=st.booleans())
def test_fuzz_mutated_sentencepiece(tmp_path, sp_model, position, byte, truncate):
    data = bytearray(sp_model.read_bytes())
    position %= len(data)
    data = data[:position] if truncate else data[:position] + bytes([byte]) + data[position + 1 :]
    _load_or_error(_write(tmp_path, "mutated.model", bytes(data)))


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 400) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4),
    max_leaves=12,
)


CONFIG_KEYS = ["added_tokens_decoder", "bos_token", "pad_token", "image_token", "extra_special_tokens",
               "additional_special_tokens"]


@FUZZ
@given(vocab=JSON_VALUES, added=JSON_VALUES)
def test_fuzz_tokenizer_json_shapes(tmp_path, vocab, added):
    doc = {"model": {"type": "BPE", "vocab": vocab}, "added_tokens": added}
    _load_or_error(_write(tmp_path, "fuzz.json", json.dumps(doc)))


@FUZZ
@given(config=st.dictionaries(st.sampled_from(CONFIG_KEYS), JSON_VALUES, max_size=5), added=JSON_VALUES)
def test_fuzz_folder_side_files(tmp_path, bpe_json, config, added):
    folder = tmp_path / "fuzz_folder"
    folder.mkdir(exist_ok=True)
    shutil.copy(bpe_json, folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "added_tokens.json").write_text(json.dumps(added))
    (folder / "special_tokens_map.json").write_text(json.dumps(config))
    _load_or_error(folder)


# --- factory helpers used by repair tests --------------------------------------------------------------


@pytest.mark.parametrize("model", ["bpe", "unigram", "wordpiece"])
def test_reorder_keeps_tokens_and_tokenization_but_moves_ids(tmp_path, model):
    from tokenizers import Tokenizer

    src = train_tokenizer_json(tmp_path, 300, model, added=ADDED, special=SPECIAL)
    dst = reorder_tokenizer_json(src, tmp_path / "reordered.json", seed=3)
    before, after = load_tokenizer(src), load_tokenizer(dst)
    assert (after.size, after.base_size) == (before.size, before.base_size)
    assert set(after.token_to_id()) == set(before.token_to_id())
    moved = sum(before.token_to_id()[t] != i for t, i in after.token_to_id().items())
    assert moved > before.size // 2
    text = "zzfoo abc <|tool|> hello world"
    lib_before, lib_after = Tokenizer.from_file(str(src)), Tokenizer.from_file(str(dst))
    assert lib_after.encode(text).tokens == lib_before.encode(text).tokens
    assert lib_after.get_vocab(True) == after.token_to_id()


@pytest.mark.parametrize("model", ["bpe", "unigram", "wordlevel"])
def test_extend_appends_base_tokens_and_shifts_added_ones(tmp_path, model):
    from tokenizers import Tokenizer

    src = train_tokenizer_json(tmp_path, 300, model, added=ADDED)
    dst = extend_tokenizer_json(src, tmp_path / "extended.json", ["newtok1", "newtok2", "newtok3"])
    before, after = load_tokenizer(src), load_tokenizer(dst)
    assert after.base_size == before.base_size + 3 and after.size == before.size + 3
    ids = after.token_to_id()
    assert [ids[t] for t in ["newtok1", "newtok2", "newtok3"]] == [before.base_size + k for k in range(3)]
    assert after.id_to_token()[: before.base_size] == before.id_to_token()[: before.base_size]
    assert [ids[t] for t in ADDED] == [before.token_to_id()[t] + 3 for t in ADDED]
    assert Tokenizer.from_file(str(dst)).get_vocab(True) == ids
    with pytest.raises(ValueError):
        extend_tokenizer_json(src, tmp_path / "again.json", ["zzfoo"])
