"""Read a tokenizer's vocabulary (sentencepiece model, tokenizer.json or a Hugging Face folder) without transformers.

The point is to know, for every token id a model will be fed, which token it stands for and how many
embedding rows are needed, so that checkpoints can be checked and repaired against a tokenizer.

Ids follow the rules the `tokenizers` library (the backend of transformers 5.x) applies on load: an added
token whose content is already in the vocabulary keeps that id, and any other added token gets the next id
after the base vocabulary and the earlier added tokens, whatever id the file declares. For files written by
the libraries the declared ids are exactly these; for hand-edited ones they are what the tokenizer really emits.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import ckptfix.tokenizer_formats as formats
from ckptfix.errors import TokenizerError
from ckptfix.protobuf import varint as _varint
from ckptfix.tokenizer_info import (
    MAX_VOCAB,
    TokenizerInfo,
    decode_text,
    require,
    require_dense,
    tokenizer_error,
)
from ckptfix.untrusted import MAX_TOKENIZER_BYTES, input_root, parse_json, read_bounded

__all__ = ["TokenizerInfo", "load_tokenizer"]

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in the order it appends missing ones to the vocabulary.
_NAMED_SPECIALS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

# Unicode White_Space as Rust's str::trim_end sees it (Python's str.isspace adds \x1c-\x1f).
_RUST_WHITESPACE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000" + "".join(
    map(chr, range(0x2000, 0x200B))
)

_FOLDER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt")
# Tokenizer files of raw (non-Hugging Face) release folders, in preference order.
_OTHER_FOLDER_FILES = ("tekken.json", "encoder.json", "vocab.bpe")


def _names(folder: Path) -> set[str]:
    return {n for n in _OTHER_FOLDER_FILES if (folder / n).is_file()}


def load_tokenizer(path: str | os.PathLike) -> TokenizerInfo:
    """Read a sentencepiece model, a tokenizer.json or a Hugging Face tokenizer folder.

    Raises TokenizerError (one line, naming the path) for anything that is not a readable tokenizer.
    """
    if "://" in str(os.fspath(path)):  # a URL: read through its sparse local mirror (ckptfix.remote)
        from ckptfix.remote import local_path

        path = local_path(path)
    p = Path(os.fspath(path))
    try:
        is_dir, exists = p.is_dir(), p.exists()
    except OSError as exc:  # e.g. a name too long for the file system
        raise tokenizer_error(p, f"cannot access: {exc.strerror or exc}") from None
    if is_dir:
        input_root(p)
        return _load_folder(p)
    if not exists:
        raise tokenizer_error(p, "no such file or folder")
    data = _read_bytes(p)
    if _looks_like_json(data) and not re.match(rb"\[[A-Za-z0-9_]+\]\r?\n", data):  # "[PAD]\n": a vocab.txt
        doc = _parse_json(p, data)
        if formats.is_tekken(doc):
            return formats.load_tekken(p, doc)
        if formats.is_flat_vocab(doc):  # GPT-2's encoder.json, a vocab.json
            return _VocabBuilder(_base_from_dict(p, doc, "vocab.json"), []).finish(p, "vocab.json", p, ())
        vocab = _VocabBuilder(*_parse_tokenizer_json(p, doc))
        return vocab.finish(p, "tokenizer.json", p, ())
    if _is_sentencepiece_proto(data):
        base, specials = _parse_sentencepiece(p, data)
        return _VocabBuilder(base, []).finish(p, "sentencepiece", p, specials)
    found = _load_by_content(p, data)
    if found is not None:
        return found
    raise tokenizer_error(p, f"{_describe_non_tokenizer(data)}; expected a tokenizer file ({SUPPORTED}) or a folder")


# transformers' BertTokenizer defaults, in SPECIAL_TOKENS_ATTRIBUTES order (unk, sep, pad, cls, mask).
_BERT_SPECIALS = ("[UNK]", "[SEP]", "[PAD]", "[CLS]", "[MASK]")

SUPPORTED = ("sentencepiece model, tokenizer.json, tiktoken BPE ranks, tekken.json, encoder.json/vocab.json, "
             "vocab.bpe, WordPiece vocab.txt, CLIP bpe .txt.gz, RWKV vocab")


def _load_by_content(p: Path, data: bytes) -> TokenizerInfo | None:
    """The text formats (and CLIP's gzip'd merges), told apart by their first line."""
    if data[:2] == b"\x1f\x8b":
        return formats.load_clip_bpe(p, data)
    if formats.looks_like_tiktoken(data):
        return formats.load_tiktoken(p, data)
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError:
        return None
    if formats.looks_like_merges(text):
        return formats.load_merges(p, text)
    if formats.looks_like_rwkv(text):
        return formats.load_rwkv(p, text)
    if formats.looks_like_wordpiece(text):
        vocab = _VocabBuilder(_parse_vocab_txt(p), [])
        for token in _BERT_SPECIALS:  # BertTokenizer(vocab.txt) appends its named specials missing from the file
            vocab.add(token, True)
        return vocab.finish(p, "wordpiece", p, ())
    return None


def _shown(key: str) -> str:
    return repr(key[:40] + ("..." if len(key) > 40 else ""))


class _VocabBuilder:
    """Assigns ids to added tokens the way `tokenizers.AddedVocabulary` does."""

    def __init__(self, base: list[str | None], added: list[tuple[str, bool]]):
        self.base = base
        self.base_ids = {token: i for i, token in enumerate(base) if token is not None}
        self.base_size = sum(token is not None for token in base)
        self.added: dict[str, tuple[int, bool]] = {}
        self.highest = -1  # the highest added id so far (a running max: 30k added tokens once took 10 s)
        for content, special in added:
            self.add(content, special)

    def add(self, content: str, special: bool) -> None:
        if not content or content in self.added:  # `tokenizers` skips empty tokens too
            return
        if content in self.base_ids:
            token_id = self.base_ids[content]
        else:  # `tokenizers` uses the model's token count, not its highest id, as the first free id.
            token_id = max(self.base_size, self.highest + 1)
        self.added[content] = (token_id, special)
        self.highest = max(self.highest, token_id)

    def finish(self, path: Path, kind: str, source: Path, specials: tuple[str, ...]) -> TokenizerInfo:
        added = tuple(sorted((token_id, content, special) for content, (token_id, special) in self.added.items()))
        ids = [len(self.base)] + [token_id + 1 for token_id, _, _ in added]
        flagged = tuple(content for _, content, special in added if special)
        return TokenizerInfo(
            path=str(path),
            kind=kind,
            source=str(source),
            base_size=self.base_size,
            added_tokens=added,
            size=max(ids),
            special_tokens=tuple(dict.fromkeys(specials + flagged)),
            base_tokens=tuple(self.base),
        )


def _load_folder(folder: Path) -> TokenizerInfo:
    found = {name: folder / name for name in _FOLDER_FILES if (folder / name).is_file()}
    if not found or "tokenizer.json" not in found and "encoder.json" in _names(folder):
        # Not a Hugging Face folder: a raw release folder (Llama's original/, Mistral's, Whisper's assets,
        # GPT-2's encoder.json + vocab.bpe) holds one tokenizer file of another format.
        other = next((folder / n for n in _OTHER_FOLDER_FILES if (folder / n).is_file()), None)
        other = other or next(iter(sorted(folder.glob("*.tiktoken")) + sorted(folder.glob("tokenizer.model.v*"))), None)
        if other is not None:
            return load_tokenizer(other)
        if not found:
            raise tokenizer_error(folder, f"folder has no tokenizer files (looked for {', '.join(_FOLDER_FILES)})")
    source = found[next(iter(found))]  # first in preference order
    if source.name == "tokenizer.model" and not _is_sentencepiece_proto(_read_bytes(source)):
        return load_tokenizer(source)  # Llama 3/4's tokenizer.model is a tiktoken rank file
    specials: tuple[str, ...] = ()
    added: list[tuple[str, bool]] = []
    if source.name == "tokenizer.json":
        base, added = _parse_tokenizer_json(source, _read_json(source))
    elif source.suffix == ".model":
        base, specials = _parse_sentencepiece(source, _read_bytes(source))
    elif source.name == "vocab.json":
        base = _base_from_dict(source, _read_json(source), "vocab.json")
    else:
        base = _parse_vocab_txt(source)
    vocab = _VocabBuilder(base, added)
    config = _read_optional_json(folder / "tokenizer_config.json")
    legacy = "added_tokens_decoder" not in config  # transformers reads the older files only then
    for content, special in _config_added_tokens(folder, config, legacy):
        vocab.add(content, special)
    named = _named_special_tokens(config, _read_optional_json(folder / "special_tokens_map.json") if legacy else {})
    for content in named:
        vocab.add(content, True)  # transformers appends named special tokens missing from the vocabulary
    if source.name == "vocab.json":  # Whisper's own HF assets folders: the 1607 rows its code adds
        for content in formats.whisper_code_specials(_read_bytes(source), set(vocab.added) | set(vocab.base_ids)):
            vocab.add(content, True)
    return vocab.finish(folder, "hf-folder", source, tuple(named) + specials)


def _config_added_tokens(folder: Path, config: dict, legacy: bool) -> list[tuple[str, bool]]:
    """Added tokens from tokenizer_config.json, else added_tokens.json, in declared-id order."""
    entries: list[tuple[int, str, bool]] = []
    if not legacy:
        decoder = config["added_tokens_decoder"]
        where = folder / "tokenizer_config.json"
        require(isinstance(decoder, dict), where, "'added_tokens_decoder' is not an object")
        for key, token in decoder.items():
            content = _token_content(token)
            # at most 8 digits (MAX_VOCAB is 2**24): never convert a 5000-digit key (int() refuses past 4300)
            ok = key.isascii() and key.isdigit() and len(key) <= 8 and content is not None
            require(ok, where, f"bad added_tokens_decoder entry {_shown(key)}")
            special = bool(token.get("special", False)) if isinstance(token, dict) else False
            entries.append((int(key), str(content), special))
    else:
        table = _read_optional_json(folder / "added_tokens.json")
        for content, token_id in table.items():
            require(_is_id(token_id), folder / "added_tokens.json", f"id of {content!r} is not a token id")
            entries.append((token_id, content, False))
    return [(content, special) for _, content, special in sorted(entries)]


def _named_special_tokens(config: dict, special_map: dict) -> list[str]:
    """Special tokens named in tokenizer_config.json / special_tokens_map.json, merged as transformers 5 does."""
    merged = dict(config)
    # transformers renames the v4 key before and after merging the legacy map; the map overrides the config.
    if "additional_special_tokens" in merged and not merged.get("extra_special_tokens"):
        merged["extra_special_tokens"] = merged.pop("additional_special_tokens")
    for key, value in special_map.items():
        existing = merged.get("extra_special_tokens")
        if key == "extra_special_tokens" and isinstance(value, list) and isinstance(existing, list):
            value = existing + value
        merged[key] = value
    if "additional_special_tokens" in merged and "extra_special_tokens" not in merged:
        merged["extra_special_tokens"] = merged.pop("additional_special_tokens")
    extra = merged.get("extra_special_tokens") or []
    values = [merged.get(name) for name in _NAMED_SPECIALS]
    values += list(extra.values()) if isinstance(extra, dict) else list(extra) if isinstance(extra, list) else []
    values += [v for k, v in merged.items() if k.endswith("_token") and k not in _NAMED_SPECIALS]
    contents = (_token_content(v) for v in values)
    return list(dict.fromkeys(c for c in contents if c))


def _parse_tokenizer_json(path: Path, doc: Any) -> tuple[list[str | None], list[tuple[str, bool]]]:
    """Base vocabulary (index = id) and the added tokens, in file order, of a tokenizer.json document."""
    model = doc.get("model") if isinstance(doc, dict) else None
    if not isinstance(model, dict) or "vocab" not in model:
        is_config = isinstance(doc, dict) and "tokenizer_class" in doc
        hint = " (a tokenizer_config.json? pass its folder)" if is_config else ""
        raise tokenizer_error(path, f"JSON is not a tokenizer.json: no 'model.vocab'{hint}")
    vocab = model["vocab"]
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...], id = position
        require(all(isinstance(e, list) and e and isinstance(e[0], str) for e in vocab), path, "bad Unigram vocab")
        require(len(vocab) <= MAX_VOCAB, path, f"implausible vocabulary size {len(vocab)}")
        base: list[str | None] = [entry[0] for entry in vocab]
    else:
        base = _base_from_dict(path, vocab, "model.vocab")
    added_list = doc.get("added_tokens") or []
    require(isinstance(added_list, list), path, "'added_tokens' is not a list")
    added = []
    for entry in added_list:
        ok = isinstance(entry, dict) and isinstance(entry.get("content"), str)
        require(ok, path, f"bad added_tokens entry {str(entry)[:60]!r}")
        added.append((entry["content"], bool(entry.get("special", False))))
    return base, added


def _base_from_dict(path: Path, vocab: Any, what: str) -> list[str | None]:
    """{token: id} -> list indexed by id, None for ids no token uses."""
    require(isinstance(vocab, dict), path, f"{what} is not an object of token: id")
    bad = next((t for t, i in vocab.items() if not _is_id(i)), None)
    require(bad is None, path, f"{what}: id of {bad!r} is not a token id")
    size = max(vocab.values(), default=-1) + 1
    require(size <= MAX_VOCAB, path, f"{what}: implausible token id {size - 1}")
    require_dense(path, what, size, len(vocab))
    base: list[str | None] = [None] * size
    for token, token_id in vocab.items():
        base[token_id] = token
    return base


def _parse_vocab_txt(path: Path) -> list[str | None]:
    """One token per line, id = line number, read the way `tokenizers`' WordPiece reads vocab.txt."""
    lines = decode_text(path, _read_bytes(path)).split("\n")  # not splitlines(): \x85, \u2028 are not line breaks
    if lines[-1] == "":
        lines.pop()
    # Rust's trim_end(); a repeated token keeps its last line, leaving a hole at the earlier id.
    return _base_from_dict(path, {line.rstrip(_RUST_WHITESPACE): i for i, line in enumerate(lines)}, "vocab.txt")


def _parse_sentencepiece(path: Path, data: bytes) -> tuple[list[str | None], tuple[str, ...]]:
    """Pieces (index = id) and control/unknown pieces of a serialized sentencepiece ModelProto."""
    if not _is_sentencepiece_proto(data):
        raise tokenizer_error(path, "corrupt sentencepiece model (not a valid ModelProto; truncated?)")
    import sentencepiece  # deferred: only needed for .model files

    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(data)
        names = [processor.id_to_piece(i) for i in range(processor.get_piece_size())]
        specials = tuple(p for i, p in enumerate(names) if processor.is_control(i) or processor.is_unknown(i))
    except Exception as exc:  # the C++ library reports bad models with assorted types (a non-UTF-8 piece too)
        raise tokenizer_error(path, f"corrupt sentencepiece model: {exc}") from None
    if not names:
        raise tokenizer_error(path, "sentencepiece model has no pieces")
    return list(names), specials


def _is_sentencepiece_proto(data: bytes) -> bool:
    """Walk the protobuf wire format: ModelProto fields 1-5 are messages and field 1 (pieces) must occur.

    Done before handing bytes to sentencepiece, which would otherwise parse some unrelated protobufs or garbage.
    """
    pos, pieces = 0, 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if number == 0 or (number <= 5 and wire != 2):
                return False
            if wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 2:
                length, pos = _varint(data, pos)
                pos += length
            elif wire in (1, 5):
                pos += 8 if wire == 1 else 4
            else:
                return False
            pieces += number == 1
    except (IndexError, ValueError):  # truncated or overlong varint
        return False
    return pos == len(data) and pieces > 0




def _describe_non_tokenizer(data: bytes) -> str:
    if data.startswith(b"PK\x03\x04"):
        return "this is a zip archive (a PyTorch checkpoint?), not a tokenizer"
    if data[:1] == b"\x80":
        return "this is a pickle (a PyTorch checkpoint?), not a tokenizer"
    if len(data) > 10 and data[8:10] == b'{"':
        return "this looks like a safetensors file, not a tokenizer"
    if data[:1] == b"\n":  # how a sentencepiece model starts (field 1, a piece)
        return "not a valid sentencepiece model (corrupt or truncated protobuf)"
    return "not a tokenizer (unrecognised content)"


def _read_bytes(path: Path) -> bytes:
    # The one read of every tokenizer file: regular files only (a FIFO or /dev/urandom is refused
    # without blocking), bounded (a sparse 6 GB file is refused before anything is allocated).
    data = read_bounded(path, MAX_TOKENIZER_BYTES, what="tokenizer file", error=TokenizerError)
    if not data:
        raise tokenizer_error(path, "file is empty")
    return data


def _looks_like_json(data: bytes) -> bool:
    return data.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] in (b"{", b"[")


def _parse_json(path: Path, data: bytes) -> Any:
    return parse_json(data, str(path), error=TokenizerError, bad="invalid JSON")  # bounded digits and nesting


def _read_json(path: Path) -> Any:
    return _parse_json(path, _read_bytes(path))


def _read_optional_json(path: Path) -> dict:
    """A side file (config, map) as a dict; absent means empty."""
    if not path.is_file():
        return {}
    doc = _read_json(path)
    require(isinstance(doc, dict), path, "expected a JSON object")
    return doc


def _token_content(token: Any) -> str | None:
    """Content of a token given as a string or as a serialized AddedToken dict."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) and token else None


def _is_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < MAX_VOCAB
