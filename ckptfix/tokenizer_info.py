"""What a tokenizer is to ckptfix (`TokenizerInfo`: id <-> token, base and added sizes) and the helpers every
tokenizer reader shares (the bounds on a vocabulary, the one-line `TokenizerError`).

Its own module so that `tokenizers.py` (sentencepiece, tokenizer.json, HF folders, and the dispatch by content)
and `tokenizer_formats.py` (the other formats, which it dispatches to) share them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckptfix.errors import TokenizerError

# A vocabulary this large means a corrupt id, not a real tokenizer; refuse before allocating id tables.
MAX_VOCAB = 1 << 24


@dataclass(frozen=True)
class TokenizerInfo:
    """The id <-> token mapping of a tokenizer, as the model sees it."""

    path: str
    kind: str  # "sentencepiece" | "tokenizer.json" | "hf-folder" | "tiktoken:<family>" | "tekken" | "vocab.json"
    # | "gpt2-bpe" | "clip-bpe" | "rwkv" | "wordpiece"
    source: str  # the file the base vocabulary was read from
    base_size: int  # tokens in the base vocabulary (transformers' `vocab_size`)
    added_tokens: tuple[tuple[int, str, bool], ...]  # (id, content, special), sorted by id
    size: int  # embedding rows needed: highest id + 1 (== len(tokenizer) when ids have no holes)
    special_tokens: tuple[str, ...]
    base_tokens: tuple[str | None, ...] = field(default=(), repr=False, compare=False)  # index = id

    def id_to_token(self) -> list[str | None]:
        """Token string for each id in range(size); None where no token has that id."""
        table: list[str | None] = list(self.base_tokens) + [None] * (self.size - len(self.base_tokens))
        for token_id, content, _ in self.added_tokens:
            table[token_id] = content  # as in `tokenizers`, an added token wins over the model's token
        return table

    def token_to_id(self) -> dict[str, int]:
        """Id of each token string."""
        mapping = {token: i for i, token in enumerate(self.base_tokens) if token is not None}
        mapping.update((content, token_id) for token_id, content, _ in self.added_tokens)
        return mapping

    def to_json(self) -> dict[str, Any]:
        """Summary for reports: counts, not the whole vocabulary."""
        return {
            "path": self.path,
            "kind": self.kind,
            "source": self.source,
            "base_size": self.base_size,
            "added": len(self.added_tokens),
            "special_tokens": list(self.special_tokens),
            "size": self.size,
        }


# Ids a vocabulary may leave unused: every table is sized by its highest id, so a file naming id 16,777,215
# among a handful of tokens would cost gigabytes. Real vocabularies are dense (a few reserved holes at most).
SPARSE_IDS_ALLOWED = 1 << 16


def require_dense(path: Path, what: str, size: int, present: int) -> None:
    """Refuse, before anything is allocated, a vocabulary whose highest id leaves most ids unused."""
    require(size <= 2 * present + SPARSE_IDS_ALLOWED, path,
            f"{what}: {present:,} tokens but ids up to {size - 1:,}; not a vocabulary (ids must be nearly dense)")


def decode_text(path: Path, data: bytes) -> str:
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise tokenizer_error(path, f"not UTF-8 text (byte {exc.start})") from None


def require(ok: bool, path: Path, problem: str) -> None:
    if not ok:
        raise tokenizer_error(path, problem)


def tokenizer_error(path: Path, problem: str) -> TokenizerError:
    return TokenizerError(" ".join(f"{path}: {problem}".splitlines()))  # callers print it as one line
