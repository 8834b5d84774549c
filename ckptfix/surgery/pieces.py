"""Encode a new token's text with the old tokenizer, so its new rows can start from what the model knows.

`--init pieces` gives a new token the mean of the rows of the old pieces its text is made of: "▁return"
added to a sentencepiece vocabulary that spelled it "▁ret" + "urn" starts as the mean of those two rows.

Encoding reimplements the tokenizer algorithms on the vocabulary files themselves (no tokenizer library
at repair time, no torch), and the tests cross-check them against `sentencepiece` and `tokenizers`:
  sentencepiece .model   BPE by piece score, unigram by Viterbi over scores; user-defined symbols,
                         byte fallback (<0xNN>), the ▁ word-start marker;
  tokenizer.json         BPE by merge rank (byte-level Ġ or ▁/plain, byte_fallback, ignore_merges),
                         Unigram by Viterbi, WordPiece by greedy longest match (its real algorithm).
A token is encoded as it occurs in text: the piece "▁return" as " return", "Ġx" as " x", an added token
as its content. Where the algorithm is not one of these, or a text only gives unknown pieces, the token
has no pieces and gets the fallback init.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ckptfix.protobuf import fields as _fields
from ckptfix.tokenizer_formats import BYTE_ALPHABET

META = "\u2581"  # sentencepiece's word-start marker
_BYTE_PIECE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# GPT-2's pre-tokenizer with Python's `re` (no \p classes): letters are [^\W\d_], "_" is punctuation there.
_GPT2_SPLIT = re.compile(r"""'(?:[sdmt]|ll|ve|re)| ?[^\W\d_]+| ?\d+| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+""")
_UNK_PENALTY = 10.0  # both libraries score an unknown character at min(score) - 10


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (`bytes_to_unicode`): bytes that print stay."""
    return dict(enumerate(BYTE_ALPHABET))


@dataclass
class Segmenter:
    """One tokenizer's segmentation model: enough to encode a short text into its ids."""

    algorithm: str  # "bpe-scores" (sentencepiece BPE) | "bpe-merges" | "unigram" | "wordpiece"
    vocab: dict[str, int]  # pieces the algorithm may produce
    space: str  # "meta": spaces are ▁; "byte": GPT-2 byte-level; "plain"
    scores: dict[int, float] = field(default_factory=dict)
    merges: dict[tuple[str, str], int] = field(default_factory=dict)
    byte_ids: dict[int, int] = field(default_factory=dict)  # byte value -> id of its <0xNN> piece
    user_defined: tuple[str, ...] = ()  # matched whole before the algorithm runs (longest first)
    unk_id: int | None = None
    ignore_merges: bool = False
    prefix: str = "##"  # WordPiece continuation marker
    unusable: frozenset[int] = frozenset()  # unknown/control ids: never a useful piece
    fuse_unk: bool = True  # consecutive unknown characters make one unknown piece

    def encode(self, text: str) -> list[int]:
        """Ids of `text` as this tokenizer segments it where it occurs inside a longer text (no dummy
        prefix, no normalisation beyond the space convention)."""
        out: list[int] = []
        for word in self._words(text):
            out.extend(self._encode_word(word))
        return out

    def _words(self, text: str) -> list[str]:
        if self.space == "byte":
            table = byte_to_unicode()
            return ["".join(table[b] for b in w.encode()) for w in _GPT2_SPLIT.findall(text)]
        if self.space == "meta":
            text = text.replace(" ", META)
            chunks = re.split(f"(?={META})", text)  # sentencepiece splits before every word-start marker
        elif self.algorithm == "wordpiece":  # BERT's pre-tokenizer: whitespace and each punctuation mark
            chunks = re.findall(r"\w+|[^\w\s]", text)
        else:
            chunks = text.split()
        words: list[str] = []
        for chunk in filter(None, chunks):
            words.extend(self._split_user_defined(chunk))
        return words

    def _split_user_defined(self, chunk: str) -> list[str]:
        if not self.user_defined:
            return [chunk]
        parts, pos, start = [], 0, 0
        while pos < len(chunk):
            hit = next((u for u in self.user_defined if chunk.startswith(u, pos)), None)
            if hit is None:
                pos += 1
                continue
            parts += [chunk[start:pos], hit] if pos > start else [hit]
            pos = start = pos + len(hit)
        if start < len(chunk):
            parts.append(chunk[start:])
        return parts

    def _encode_word(self, word: str) -> list[int]:
        if word in self.user_defined:
            return [self.vocab[word]]
        if self.algorithm == "wordpiece":
            return self._wordpiece(word)
        if self.algorithm == "unigram":
            symbols = self._viterbi(word)
        elif self.ignore_merges and word in self.vocab:
            symbols = [word]
        else:
            symbols = self._bpe(word)
        out: list[int] = []
        for s in symbols:
            if s in self.vocab:
                out.append(self.vocab[s])
            elif self.byte_ids:
                out.extend(self.byte_ids[b] for b in s.encode())
            elif self.unk_id is not None and not (self.fuse_unk and out[-1:] == [self.unk_id]):
                out.append(self.unk_id)
        return out

    def _bpe(self, word: str) -> list[str]:
        """Merge adjacent symbols, best first (highest score / lowest rank), leftmost on ties."""
        symbols = list(word)
        while len(symbols) > 1:
            best, where = None, -1
            for i in range(len(symbols) - 1):
                rank = self._pair_rank(symbols[i], symbols[i + 1])
                if rank is not None and (best is None or rank < best):
                    best, where = rank, i
            if best is None:
                break
            symbols[where:where + 2] = [symbols[where] + symbols[where + 1]]
        return symbols

    def _pair_rank(self, a: str, b: str) -> float | None:
        if self.algorithm == "bpe-merges":
            return self.merges.get((a, b))
        merged = self.vocab.get(a + b)
        return None if merged is None else -self.scores[merged]

    def _viterbi(self, word: str) -> list[str]:
        """Best-scoring segmentation; an unknown character costs min(score) - 10, as both libraries do."""
        unk_score = min(self.scores.values(), default=0.0) - _UNK_PENALTY
        longest = max(map(len, self.vocab), default=1)
        best: list[tuple[float, int]] = [(0.0, 0)] + [(-math.inf, 0)] * len(word)
        for end in range(1, len(word) + 1):
            for start in range(max(0, end - longest), end):
                piece = word[start:end]
                token_id = self.vocab.get(piece)
                if token_id is not None:
                    score = self.scores.get(token_id, 0.0)
                elif end - start == 1:
                    score = unk_score
                else:
                    continue
                if best[start][0] + score > best[end][0]:
                    best[end] = (best[start][0] + score, start)
        pieces, end = [], len(word)
        while end > 0:
            start = best[end][1]
            pieces.append(word[start:end])
            end = start
        return pieces[::-1]

    def _wordpiece(self, word: str) -> list[int]:
        out, start = [], 0
        while start < len(word):
            for end in range(len(word), start, -1):
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if piece in self.vocab:
                    out.append(self.vocab[piece])
                    start = end
                    break
            else:
                return [self.unk_id] if self.unk_id is not None else []
        return out

    def token_text(self, token: str) -> str | None:
        """The text a piece of this tokenizer stands for (None: a byte piece that is not a whole character)."""
        if self.space == "byte":
            back = {c: b for b, c in byte_to_unicode().items()}
            if all(c in back for c in token):
                return bytes(back[c] for c in token).decode("utf-8", errors="replace")
            return token
        if _BYTE_PIECE.match(token):
            value = int(token[3:5], 16)
            return chr(value) if value < 0x80 else None
        if self.algorithm == "wordpiece" and token.startswith(self.prefix):
            return token[len(self.prefix):]
        return token.replace(META, " ") if self.space == "meta" else token


def load_segmenter(info: Any) -> Segmenter | None:
    """The segmentation model of a `TokenizerInfo` (read from its source file), or None where the file's
    algorithm is one this module does not implement (WordLevel, unusual BPE options)."""
    from ckptfix.errors import CkptfixError
    from ckptfix.untrusted import MAX_TOKENIZER_BYTES, parse_json, read_bounded

    source = Path(info.source)
    try:  # the input boundary's reads: regular file, bounded size, digits and nesting
        data = read_bounded(source, MAX_TOKENIZER_BYTES, what="tokenizer file")
        if info.kind == "sentencepiece" or source.suffix == ".model":
            return _sentencepiece(data)
        doc = parse_json(data, str(source))
    except CkptfixError:
        return None
    if source.name == "vocab.json":
        merges = source.with_name("merges.txt")
        try:
            return _gpt2_files(doc, merges) if merges.is_file() else None
        except CkptfixError:
            return None
    return _tokenizer_json(_checked_tokenizer_json(doc, str(source))) if isinstance(doc, dict) else None


def _checked_tokenizer_json(doc: dict, origin: str) -> dict:
    """The fields `_tokenizer_json` takes, checked where they are taken in (the vocabulary reader checked
    the vocab and ids; merges, unk settings and added-token flags are read only here)."""
    from ckptfix.errors import TokenizerError

    def bad(field: str, expected: str, value: Any) -> TokenizerError:
        return TokenizerError(str(fail(origin, field, expected, value)))

    from ckptfix.untrusted import fail

    model = doc.get("model") or {}
    if not isinstance(model, dict):
        raise bad("model", "a JSON object", model)
    merges = model.get("merges") or []
    if not isinstance(merges, list) or not all(
            isinstance(m, str) or isinstance(m, list) and len(m) == 2 and all(isinstance(x, str) for x in m)
            for m in merges):
        raise bad("model.merges", "a list of 'a b' strings or [a, b] pairs", merges)
    for key in ("unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key) is not None and not isinstance(model[key], str):
            raise bad(f"model.{key}", "a string", model[key])
    if model.get("unk_id") is not None and (isinstance(model["unk_id"], bool) or not isinstance(model["unk_id"], int)):
        raise bad("model.unk_id", "an integer", model["unk_id"])
    vocab = model.get("vocab")
    if model.get("type") == "Unigram" and isinstance(vocab, list) and not all(
            isinstance(e, list) and len(e) >= 2 and isinstance(e[0], str) and isinstance(e[1], (int, float))
            and not isinstance(e[1], bool) for e in vocab):
        raise bad("model.vocab", "[piece, score] entries", vocab)
    added = doc.get("added_tokens") or []
    if not isinstance(added, list) or not all(
            isinstance(t, dict) and (not t.get("special") or isinstance(t.get("id"), int)) for t in added):
        raise bad("added_tokens", "a list of token objects with integer ids", added)
    return doc


def _tokenizer_json(doc: dict) -> Segmenter | None:
    model = doc.get("model") or {}
    kind, vocab = model.get("type"), model.get("vocab")
    space = _space_convention(doc)
    if kind == "BPE" and isinstance(vocab, dict):
        if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("dropout"):
            return None
        merges: dict[Any, int] = {}
        for rank, m in enumerate(model.get("merges") or []):
            pair = tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) if isinstance(m, list) else ()
            if len(pair) == 2 and all(isinstance(p, str) for p in pair):  # a merge is two strings; skip damage
                merges.setdefault(pair, rank)
        seg = Segmenter("bpe-merges", dict(vocab), space, merges=merges, ignore_merges=bool(model.get("ignore_merges")))
        if model.get("byte_fallback"):
            seg.byte_ids = _byte_ids(vocab)
        seg.unk_id = vocab.get(model.get("unk_token")) if model.get("unk_token") else None
        seg.fuse_unk = bool(model.get("fuse_unk"))
    elif kind == "Unigram" and isinstance(vocab, list):
        pieces = {entry[0]: i for i, entry in enumerate(vocab)}
        seg = Segmenter("unigram", pieces, space, scores={i: float(e[1]) for i, e in enumerate(vocab)})
        seg.unk_id = model.get("unk_id")
        if model.get("byte_fallback"):
            seg.byte_ids = _byte_ids(pieces)
        if seg.unk_id is not None:
            seg.vocab = {p: i for p, i in pieces.items() if i != seg.unk_id}
    elif kind == "WordPiece" and isinstance(vocab, dict):
        seg = Segmenter("wordpiece", dict(vocab), "plain", prefix=model.get("continuing_subword_prefix") or "##")
        seg.unk_id = vocab.get(model.get("unk_token"))
    else:
        return None
    specials = {t["id"] for t in doc.get("added_tokens") or [] if isinstance(t, dict) and t.get("special")}
    seg.unusable = frozenset(specials | ({seg.unk_id} if seg.unk_id is not None else set()))
    return seg


def _space_convention(doc: dict) -> str:
    text = json.dumps([doc.get("pre_tokenizer"), doc.get("normalizer"), doc.get("decoder")])
    if '"ByteLevel"' in text:
        return "byte"
    return "meta" if '"Metaspace"' in text or META in text else "plain"


def _byte_ids(vocab: dict[str, int]) -> dict[int, int]:
    return {int(p[3:5], 16): i for p, i in vocab.items() if _BYTE_PIECE.match(p)}


def _gpt2_files(vocab: dict, merges_path: Path) -> Segmenter:
    from ckptfix.untrusted import MAX_TOKENIZER_BYTES, read_bounded

    lines = read_bounded(merges_path, MAX_TOKENIZER_BYTES, what="merges file").decode("utf-8", "replace").splitlines()
    merges: dict[tuple[str, str], int] = {}
    for rank, line in enumerate(x for x in lines if x and not x.startswith("#version")):
        pair = tuple(line.split(" "))
        if len(pair) == 2:
            merges.setdefault(pair, rank)
    return Segmenter("bpe-merges", dict(vocab), "byte", merges=merges)


# sentencepiece ModelProto: 1 pieces {1 piece, 2 score, 3 type}, 2 trainer_spec {3 model_type, 35 byte_fallback}
_SP_NORMAL, _SP_UNKNOWN, _SP_CONTROL, _SP_USER, _SP_UNUSED, _SP_BYTE = 1, 2, 3, 4, 5, 6


def _sentencepiece(data: bytes) -> Segmenter | None:
    pieces: list[tuple[str, float, int]] = []
    model_type = 1
    try:
        for number, value in _fields(data):
            if number in (1, 2) and not isinstance(value, bytes):
                return None  # a damaged file: pieces and trainer_spec are messages
            if number == 1:
                entry = dict(_fields(value))  # type: ignore[arg-type]
                piece, score, kind = entry.get(1, b""), entry.get(2, 0.0), entry.get(3, _SP_NORMAL)
                if not (isinstance(piece, bytes) and isinstance(score, float) and isinstance(kind, int)):
                    return None
                pieces.append((piece.decode(), score, kind))
            elif number == 2:
                spec_type = dict(_fields(value)).get(3, 1)  # type: ignore[arg-type]
                model_type = spec_type if isinstance(spec_type, int) else -1
    except (ValueError, IndexError, UnicodeDecodeError, struct.error):
        return None
    if model_type not in (1, 2):  # WORD and CHAR models: not worth a segmenter of their own
        return None
    vocab = {p: i for i, (p, _, t) in enumerate(pieces) if t in (_SP_NORMAL, _SP_USER)}
    seg = Segmenter("unigram" if model_type == 1 else "bpe-scores", vocab, "meta",
                    scores={i: s for i, (_, s, t) in enumerate(pieces) if t == _SP_NORMAL})
    for i, (p, _, t) in enumerate(pieces):
        if t == _SP_USER:
            seg.scores[i] = len(p) * max(seg.scores.values(), default=0.0) - 0.1  # as unigram_model.cc does
    seg.user_defined = tuple(sorted((p for p, _, t in pieces if t == _SP_USER), key=len, reverse=True))
    seg.byte_ids = {int(p[3:5], 16): i for i, (p, _, t) in enumerate(pieces) if t == _SP_BYTE}
    seg.unk_id = next((i for i, (_, _, t) in enumerate(pieces) if t == _SP_UNKNOWN), None)
    seg.unusable = frozenset(i for i, (_, _, t) in enumerate(pieces) if t in (_SP_UNKNOWN, _SP_CONTROL))
    return seg






def piece_rows(source: np.ndarray, new_tok: Any, old_tok: Any, old_rows: int) -> dict[int, tuple[int, ...]]:
    """For every new row (source == -1) whose token's text the old tokenizer can spell: the old rows of
    those pieces. `old_tok` None: the new tokenizer's own base model spells it, with only rows kept by id
    (a tokenizer grown by `add_tokens`: its base model is the old tokenizer)."""
    new_seg = load_segmenter(new_tok)
    old_seg = load_segmenter(old_tok) if old_tok is not None else new_seg
    if old_seg is None:
        return {}
    new_table = new_tok.id_to_token()
    added = {token_id for token_id, _, _ in new_tok.added_tokens}
    out: dict[int, tuple[int, ...]] = {}
    for j in np.flatnonzero(source < 0).tolist():
        token = new_table[j] if j < len(new_table) else None
        if token is None or token in new_tok.special_tokens:
            continue
        text = token if j in added or new_seg is None else new_seg.token_text(token)
        if not text:
            continue
        ids = [i for i in old_seg.encode(text) if i not in old_seg.unusable and 0 <= i < old_rows
               and (old_tok is not None or source[i] == i)]
        if ids:
            out[j] = tuple(ids)
    return out
