"""Rows belong to tokens, not ids: which tokenizer a checkpoint's rows were trained with, and which ids moved.

A checkpoint stores one embedding row per id. When the tokenizer changes, a row is right for the new run
only if its token kept its id. Appending tokens keeps every old id; retraining (sentencepiece with
`user_defined_symbols`, a new BPE merge table) moves almost all of them, and nothing in the shapes shows it.

The old tokenizer (the one the rows belong to) is found, best evidence first: the one the user names
(`--from-tokenizer`); the one a ckptfix record names, when its fingerprint still matches the file; a
Hugging Face folder's own tokenizer files (the Trainer saves the tokenizer it trained with). Without it,
`data_evidence` looks for what the new tokenizer alone proves.

Only `TokenizerInfo`'s id -> token table is used here; reading tokenizer formats is `tokenizers.py`'s job.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from dataclasses import dataclass
from typing import Any

from ckptfix.errors import CkptfixError
from ckptfix.protobuf import fields as _fields

FINGERPRINT_PREFIX = "sha256:"
_HF_FOLDER_FORMATS = ("hf-trainer", "hf-model")
_USER_DEFINED = 4  # sentencepiece ModelProto.SentencePiece.Type.USER_DEFINED


def fingerprint(tokenizer: Any) -> str:
    """A hash of the id -> token table and its size: equal exactly when every id means the same token."""
    h = hashlib.sha256(f"ckptfix.tokens/1 {tokenizer.size}\n".encode())
    for token in tokenizer.id_to_token():
        data = token.encode("utf-8", "surrogatepass") if isinstance(token, str) else b"\xff"
        h.update(len(data).to_bytes(4, "little") + data)
    return FINGERPRINT_PREFIX + h.hexdigest()


@dataclass(frozen=True)
class OldTokenizer:
    """The tokenizer a checkpoint's rows belong to, and how that is known (for messages)."""

    info: Any  # TokenizerInfo
    origin: str  # "given" | "record" | "folder"

    @property
    def path(self) -> str:
        return self.info.path

    def describe(self) -> str:
        where = {"given": "given with --from-tokenizer", "record": "named by the checkpoint's ckptfix record",
                 "folder": "saved in the checkpoint folder"}[self.origin]
        return f"{self.info.path} ({where})"


@dataclass(frozen=True)
class IdMoves:
    """How the tokens of `old` sit in `new`: which shared tokens changed id, and whether new only appends."""

    shared: int
    moved: tuple[tuple[str, int, int], ...]  # (token, old id, new id)
    removed: int  # tokens of old that new lacks
    appends: bool  # new keeps every old id and only adds ids after them

    def examples(self, limit: int = 5) -> str:
        return ", ".join(f"{tok!r} {a}->{b}" for tok, a, b in self.moved[:limit])


def id_moves(old: Any, new: Any, rows: int | None = None) -> IdMoves:
    """Compare two tokenizers by token string, for the ids that have rows (`rows`: the checkpoint's)."""
    old_tokens = [t if isinstance(t, str) else None for t in old.id_to_token()[: rows if rows is not None else None]]
    new_tokens = [t if isinstance(t, str) else None for t in new.id_to_token()]
    new_index: dict[str, int] = {}
    for i, tok in enumerate(new_tokens):
        if tok is not None:
            new_index.setdefault(tok, i)
    moved, shared, removed = [], 0, 0
    for i, tok in enumerate(old_tokens):
        if tok is None:
            continue
        j = new_index.get(tok)
        if j is None:
            removed += 1
        else:
            shared += 1
            if j != i:
                moved.append((tok, i, j))
    appends = not moved and not removed and new_tokens[: len(old_tokens)] == old_tokens
    return IdMoves(shared, tuple(moved), removed, appends)


def known_old_tokenizer(ckpt: Any, rows: int | None, from_tokenizer: Any = None) -> tuple[OldTokenizer | None, list[str]]:
    """The tokenizer the checkpoint's rows belong to, if known, plus notes on candidates passed over."""
    if from_tokenizer is not None:
        return OldTokenizer(from_tokenizer, "given"), []
    notes: list[str] = []
    recorded = _from_record(ckpt, notes)
    if recorded is not None:
        return recorded, notes
    if ckpt.format in _HF_FOLDER_FORMATS and os.path.isdir(ckpt.path):
        found = _from_folder(ckpt.path, rows, notes)
        if found is not None:
            return found, notes
    return None, notes


def identity_notes(ckpt: Any, new: Any, old: OldTokenizer | None, rows: int | None) -> list[str]:
    """What inspect says about token identity beyond its findings: which tokenizer the rows belong to, or
    that nobody knows and rows will be matched by id."""
    if new is None or rows is None:
        return []
    if old is not None:
        return [f"the checkpoint's rows belong to the tokenizer {old.describe()}"]
    if not ids_unchecked(ckpt, new, old, rows):
        return []
    return [f"the tokenizer the checkpoint's {rows} rows were trained with is not known (no ckptfix record, no "
            f"tokenizer files in the folder): repair keeps rows by id, which is right only if {new.path} keeps "
            "the old ids and appends new tokens after them; otherwise pass --from-tokenizer OLD_TOKENIZER (the "
            "fix names it)"]


def ids_unchecked(ckpt: Any, new: Any, old: Any, rows: int | None) -> bool:
    """Whether repair would keep rows by id with nothing to check the ids against: the row count changes
    (not padding), the old tokenizer is not known, and the new one alone shows no retrain (that is CKF122).
    Then inspect's fix names `--from-tokenizer OLD_TOKENIZER`: a tokenizer retrained to the same base size
    moves ids with no sign in the shapes."""
    from ckptfix.vocab import padding_multiple

    if new is None or old is not None or rows is None or new.id_to_token() is None:
        return False
    if new.size == rows or padding_multiple(rows, new.size) is not None:
        return False
    return not data_evidence(new, rows, ckpt.extras.get("config"))


def _from_record(ckpt: Any, notes: list[str]) -> OldTokenizer | None:
    ref = ckpt.record.tokenizer if ckpt.record is not None else None
    if ref is None or ref.fingerprint is None or not ref.path:
        return None
    info = _try_load(ref.path)
    if info is None:
        notes.append(f"the ckptfix record names tokenizer {ref.path}, which cannot be read now")
        return None
    if fingerprint(info) != ref.fingerprint:
        notes.append(f"the ckptfix record names tokenizer {ref.path}, but that file has changed since "
                     "(its fingerprint differs): not used as the old tokenizer")
        return None
    return OldTokenizer(info, "record")


def _from_folder(folder: str, rows: int | None, notes: list[str]) -> OldTokenizer | None:
    info = _try_load(folder)
    if info is None:
        return None
    if rows is not None and info.size > rows:
        notes.append(f"the tokenizer saved in {folder} has {info.size} tokens for {rows} rows: it is not the one "
                     "the rows were trained with, so it is not used as the old tokenizer")
        return None
    return OldTokenizer(info, "folder")


def _try_load(path: str) -> Any:
    from ckptfix.tokenizers import load_tokenizer

    try:
        return load_tokenizer(path)
    except CkptfixError:
        return None


def record_fingerprint_mismatch(ckpt: Any, old: Any) -> str | None:
    """A message when the checkpoint's record fingerprints another tokenizer than `old` (the user's)."""
    ref = ckpt.record.tokenizer if ckpt.record is not None else None
    if ref is None or ref.fingerprint is None or old is None or fingerprint(old) == ref.fingerprint:
        return None
    return (f"the checkpoint's ckptfix record says its rows belong to a tokenizer of {ref.size} tokens with "
            f"fingerprint {ref.fingerprint[:19]}..., but {old.path} ({old.size} tokens) has another")


# ---------------------------------------------------------------------------------------------
# What the new tokenizer alone proves
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Evidence:
    """A sign, read from the new tokenizer (and the checkpoint's config), that ids below `rows` moved."""

    message: str


def data_evidence(new: Any, rows: int, config: Any = None) -> list[Evidence]:
    """Signs that the new tokenizer was retrained rather than appended to, when the old one is unknown."""
    out: list[Evidence] = []
    inside = [(i, p) for i, p in _user_defined_pieces(new) if i < rows]
    if inside and new.size > rows:
        ids = f"{inside[0][0]}-{inside[-1][0]}" if len(inside) > 1 else str(inside[0][0])
        out.append(Evidence(
            f"{new.path} holds {len(inside)} user-defined piece(s) ({', '.join(repr(p) for _, p in inside[:3])}) at "
            f"ids {ids}, inside the checkpoint's {rows} rows: sentencepiece's trainer puts user-defined symbols right "
            "after the control pieces, so this model was retrained with them and every later id has moved "
            "(a tokenizer grown by appending puts new pieces after the old ids)"))
    out.extend(_config_special_ids(new, rows, config))
    return out


def _config_special_ids(new: Any, rows: int, config: Any) -> list[Evidence]:
    """The checkpoint's config.json names its special token ids; in the new tokenizer those ids must still
    be special tokens (a retrained BPE puts ordinary merges there). Only for a tokenizer that has special
    tokens: configs carry default ids (Llama's 1/2) that a tokenizer without specials never matched."""
    if not isinstance(config, dict) or not new.special_tokens:
        return []
    table = new.id_to_token()
    specials = {t for t in new.special_tokens if isinstance(t, str)}
    wrong = []
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < min(rows, len(table)):
            token = table[value]
            # An empty token is a placeholder no text encodes to, not a merge a retrained BPE put there:
            # Whisper's multilingual.tiktoken has b"" at 50256, the id its converted configs name as pad/eos.
            if isinstance(token, str) and token and token not in specials:
                wrong.append(f"{key}={value} is {token!r}")
    if not wrong:
        return []
    return [Evidence(f"the checkpoint's config.json names special ids that are ordinary tokens in {new.path} "
                     f"({'; '.join(wrong[:3])}): the ids have moved since the checkpoint was trained")]


def _user_defined_pieces(tok: Any) -> list[tuple[int, str]]:
    """(id, piece) of a sentencepiece model's USER_DEFINED pieces; [] for other tokenizers. Read once per
    file version: inspect's notes, CKF122 and repair's plan all ask (the file was read three times)."""
    source = getattr(tok, "source", "")
    if not isinstance(source, str) or not source.endswith(".model") or not os.path.isfile(source):
        return []
    try:
        st = os.stat(source)
    except OSError:
        return []
    return list(_user_defined_in(source, st.st_ino, st.st_size, st.st_mtime_ns))


@functools.lru_cache(maxsize=8)
def _user_defined_in(source: str, inode: int, size: int, mtime_ns: int) -> tuple[tuple[int, str], ...]:
    try:
        remote = sys.modules.get("ckptfix.remote")
        if remote is not None:  # a tokenizer in object storage: its bytes fetched before this plain read
            remote.ensure_file(source)
        with open(source, "rb") as f:  # read(n) allocates n bytes up front: never more than the file holds
            data = f.read(min(os.fstat(f.fileno()).st_size, 1 << 28))
        return tuple((i, piece) for i, (piece, kind) in enumerate(_sentencepiece_pieces(data)) if kind == _USER_DEFINED)
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return ()  # tokenizers.py already vouched for the file; a read failure here only loses a hint


def _sentencepiece_pieces(data: bytes) -> list[tuple[str, int]]:
    """(piece, type) for each ModelProto.pieces entry (field 1: piece=1 string, score=2 float, type=3 enum)."""
    out = []
    for number, value in _fields(data):
        if number == 1 and isinstance(value, bytes):
            piece, kind = "", 1  # type NORMAL when absent
            for sub, sub_value in _fields(value):
                if sub == 1 and isinstance(sub_value, bytes):
                    piece = sub_value.decode("utf-8")
                elif sub == 3 and isinstance(sub_value, int):
                    kind = sub_value
            out.append((piece, kind))
    return out




