"""Spell a new token's text in the old tokenizer's pieces, so its new rows can start from what the model knows.

`--init pieces` gives a new token the mean of the rows of the old pieces its text is made of: " return" added
to a tokenizer that spells it "Ġret" + "urn" starts as the mean of those two rows.

The pieces come from the tokenizer's own library, configured as users' code gets it, never from a
re-implementation:
  tokenizer.json, HF folders   `tokenizers` (normalizer, pre-tokenizer, model, added tokens); a folder without
                               tokenizer.json as transformers converts it (vocab.json + merges.txt: byte-level
                               BPE; vocab.txt: BERT's WordPiece), with the folder's added tokens;
  sentencepiece .model         `sentencepiece`;
  tiktoken rank files, tekken, `tiktoken` with the pattern the family's library passes (tokenizer_formats.
  GPT-2 vocab.bpe, GPT-2's     TIKTOKEN_PATTERNS; tekken's own "pattern"); without `tiktoken` installed, a
  own encoder.json             `tokenizers` BPE built from the same ranks and pattern (as transformers'
                               TikTokenConverter builds one).
  CLIP's merges (.txt.gz)      open_clip's / OpenAI CLIP's SimpleTokenizer, which imports torch and cannot be
                               a dependency: its own text cleaning (`ftfy`, html.unescape, whitespace, lower
                               case) here, then a `tokenizers` BPE with its pattern and "</w>" word ends (as
                               transformers' CLIPTokenizer builds one); no pieces without `ftfy`.
  RWKV's world vocab           the `rwkv` package's TRIE_TOKENIZER eval()s the file's lines, so it never sees
                               the file: its greedy longest match on bytes is `tokenizers`' WordPiece
                               algorithm, run on the tokens ckptfix read as literals.
Every library is handed only what ckptfix's own reader has already read and validated (bounded size, ids
and structure; `load_tokenizer` made the TokenizerInfo from the same file), and only texts of at most
MAX_TEXT characters. A format with no library here (a vocab.json without merges other than GPT-2's own, a
tiktoken file of no known family) has no segmenter: its new rows get the fallback init and the plan says why.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from ckptfix.tokenizer_formats import BYTE_ALPHABET, TIKTOKEN_PATTERNS

META = "\u2581"  # sentencepiece's word-start marker
MAX_TEXT = 256  # longer token texts get no pieces: bounded work per token whatever the tokenizer's patterns
_BYTE_VALUE = {c: b for b, c in enumerate(BYTE_ALPHABET)}
_BYTE_LEVEL_KINDS = ("tekken", "rwkv", "gpt2-bpe", "vocab.json", "clip-bpe")


@dataclass(frozen=True)
class Segmenter:
    """One tokenizer's encoder, as its library runs it: the seam the tests compare with the library."""

    encode: Callable[[str], list[int]]  # ids of a text, no BOS/EOS or other template tokens
    unusable: frozenset[int]  # special, control and unknown ids: never a useful piece
    library: str  # what encodes, for reports and the agreement table
    backend: Any = None  # the `tokenizers.Tokenizer` that encodes, where one does: the tests compare its pipeline


def load_segmenter(info: Any, without: frozenset[str] = frozenset()) -> Segmenter | None:
    """The encoder of a `TokenizerInfo`'s tokenizer, leaving out the added tokens in `without`; None where
    ckptfix has no library for its format (`why_no_segmenter` says why)."""
    return _load(_unwrap(info), without)


def why_no_segmenter(info: Any) -> str | None:
    """Why `load_segmenter(info)` is None (None when it is not)."""
    info = _unwrap(info)
    if _load(info, frozenset()) is not None:
        return None
    if info.kind == "clip-bpe":
        return "CLIP's tokenizer cleans and splits text with ftfy and regex; install both (pip install ftfy regex)"
    if info.kind == "rwkv":
        return "the RWKV vocab lacks some of the 256 single bytes: a greedy byte match cannot spell every text"
    if info.kind == "tiktoken:tiktoken":
        return "a tiktoken file of no known family: its pre-tokenizer pattern is unknown"
    if info.kind == "vocab.json":
        return ("a vocab.json without merges.txt / vocab.bpe beside it cannot be encoded (no library encodes "
                "one; GPT-2's own encoder.json is the exception: tiktoken's gpt2 encoding ranks by its ids)")
    return (f"the library built from {info.source} numbers its added tokens otherwise than the files declare, "
            "or a file it needs is malformed")


@lru_cache(maxsize=4)
def _load(info: Any, without: frozenset[str]) -> Segmenter | None:
    """A file its own library refuses is refused here too (exit 2, the library's words): users' code could
    not load it either, so its pieces are not something to guess around."""
    from ckptfix.errors import CkptfixError, TokenizerError

    problem: BaseException
    try:
        return _build(info, without)
    except CkptfixError:
        raise
    except Exception as exc:
        problem = exc
    except BaseException as exc:  # a Rust panic in `tokenizers` is a BaseException (pyo3's PanicException)
        if type(exc).__name__ != "PanicException":
            raise
        problem = exc
    words = " ".join(str(problem).split())[:300] or type(problem).__name__
    raise TokenizerError(f"{info.source}: its tokenizer library cannot load it for --init pieces: {words}")


def _build(info: Any, without: frozenset[str]) -> Segmenter | None:
    kind, source = info.kind, Path(info.source)
    if kind.startswith("tiktoken:") or kind in ("tekken", "gpt2-bpe"):
        return _tiktoken(info)
    if kind == "clip-bpe":
        return _clip(info, source)
    if kind == "rwkv":
        return _rwkv(info)
    if kind == "sentencepiece" or source.suffix == ".model" or ".model." in source.name:
        return _sentencepiece(info, source)
    if source.name.endswith(".json") and kind in ("tokenizer.json", "hf-folder") and source.name != "vocab.json":
        return _tokenizer_json(info, source, without)
    if kind == "wordpiece" or source.name == "vocab.txt":
        return _with_added(_wordpiece(info, source), info, without, "tokenizers (WordPiece, as BertTokenizer)")
    if source.name in ("vocab.json", "encoder.json") or kind == "vocab.json":
        merges = next((source.with_name(n) for n in ("merges.txt", "vocab.bpe") if source.with_name(n).is_file()), None)
        if merges is None:
            return _tiktoken(info) if _is_gpt2_encoder_json(source) else None
        return _with_added(_byte_level_bpe(info, source, merges), info, without, "tokenizers (byte-level BPE, as GPT2Tokenizer)")
    return None


# ------------------------------------------------------------------------------------------ the libraries


def _read(source: Path) -> bytes:
    from ckptfix.errors import TokenizerError
    from ckptfix.untrusted import MAX_TOKENIZER_BYTES, read_bounded

    return read_bounded(source, MAX_TOKENIZER_BYTES, what="tokenizer file", error=TokenizerError)


def _sentencepiece(info: Any, source: Path) -> Segmenter | None:
    import sentencepiece

    from ckptfix.tokenizers import _is_sentencepiece_proto

    data = _read(source)
    if not _is_sentencepiece_proto(data):  # the same walk load_tokenizer did before sentencepiece saw it
        return None
    sp = sentencepiece.SentencePieceProcessor()
    sp.LoadFromSerializedProto(data)
    unusable = frozenset(i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i))
    return Segmenter(lambda text: list(sp.encode(text)), unusable | _specials(info), "sentencepiece")


def _tokenizer_json(info: Any, source: Path, without: frozenset[str]) -> Segmenter | None:
    import json

    from tokenizers import Tokenizer

    from ckptfix.untrusted import parse_json

    data = _read(source)
    if without:  # the new tokenizer spelling its own new tokens: those tokens must not spell themselves
        doc = parse_json(data, str(source))
        doc["added_tokens"] = [t for t in doc.get("added_tokens") or [] if t.get("content") not in without]
        tok = Tokenizer.from_str(json.dumps(doc))
    else:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    library = "tokenizers"
    # transformers 5's AutoTokenizer builds a LlamaTokenizer for a folder that declares one, unless its
    # tokenizer.json is byte-level (Llama 3, DeepSeek-V3 declare it too): then the file's own pipeline.
    if (info.kind == "hf-folder" and _spelling(info) != "byte"
            and _folder_value(info, "tokenizer_class", "") in ("LlamaTokenizer", "LlamaTokenizerFast")):
        _as_transformers_llama(tok, info)
        library = "tokenizers (pipeline as transformers' LlamaTokenizer)"
    return _with_added(tok, info, without, library)


def _as_transformers_llama(tok: Any, info: Any) -> None:
    """transformers 5's LlamaTokenizer keeps the file's vocabulary and merges but sets its own pipeline
    (models/llama/tokenization_llama.py): no normalizer, a Metaspace pre-tokenizer prepending ▁ to every
    text ("always") when the config says legacy, to the first word only ("first") otherwise, never without
    add_prefix_space (tokenization_utils_base._get_prepend_scheme)."""
    from tokenizers import pre_tokenizers

    if not _folder_value(info, "add_prefix_space", True):
        scheme = "never"
    else:
        scheme = "always" if _folder_value(info, "legacy", False) else "first"
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement=META, prepend_scheme=scheme, split=False)


def _byte_level_bpe(info: Any, vocab_file: Path, merges_file: Path) -> Any:
    """GPT-2's vocab.json + merges.txt as transformers' GPT2Tokenizer builds its `tokenizers` backend."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from ckptfix.tokenizer_info import decode_text

    vocab = {t: i for i, t in enumerate(info.base_tokens) if t is not None}
    lines = decode_text(merges_file, _read(merges_file)).split("\n")
    pairs = [line.split(" ") for line in lines if line and not line.startswith("#version")]
    if not all(len(m) == 2 for m in pairs):
        return None
    merges = [(a, b) for a, b in pairs]
    tok = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=_folder_value(info, "add_prefix_space", False))
    tok.decoder = decoders.ByteLevel()
    return tok


def _wordpiece(info: Any, source: Path) -> Any:
    """A vocab.txt as transformers' BertTokenizer builds its `tokenizers` backend (lowercase unless the folder's
    config says do_lower_case false; Chinese characters split; [UNK] for unknown words)."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

    vocab = {t: i for i, t in enumerate(info.base_tokens) if t is not None}
    if "[UNK]" not in vocab:
        return None
    tok = Tokenizer(models.WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(clean_text=True, handle_chinese_chars=True, strip_accents=None,
                                                lowercase=_folder_value(info, "do_lower_case", True))
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    return tok


def _folder_value(info: Any, key: str, default: Any) -> Any:
    """A value of the folder's tokenizer_config.json (its reader's bounded JSON), of `default`'s type."""
    from ckptfix.tokenizers import _read_optional_json

    if info.kind != "hf-folder":
        return default
    value = _read_optional_json(Path(info.path) / "tokenizer_config.json").get(key, default)
    return value if isinstance(value, type(default)) else default


def _with_added(tok: Any, info: Any, without: frozenset[str], library: str) -> Segmenter | None:
    """A backend built from vocabulary files plus the added tokens ckptfix read beside them (the folder's
    config, named specials, tokens a family adds in code), at the ids ckptfix gave them."""
    if tok is None:
        return None
    from tokenizers import AddedToken

    for _, content, special in info.added_tokens:
        if content not in without and tok.token_to_id(content) is None:
            tok.add_tokens([AddedToken(content, special=special, normalized=not special)])
    return _finish(tok, info, without, library)


def _finish(tok: Any, info: Any, without: frozenset[str], library: str) -> Segmenter | None:
    # The library's ids must be ckptfix's: a folder whose config declares added tokens the library would
    # number otherwise gets no pieces rather than wrong rows.
    if any(tok.token_to_id(content) != token_id for token_id, content, _ in info.added_tokens if content not in without):
        return None
    unk = getattr(tok.model, "unk_token", None)
    unusable = _specials(info) | ({tok.token_to_id(unk)} if unk and tok.token_to_id(unk) is not None else set())
    return Segmenter(lambda text: tok.encode(text, add_special_tokens=False).ids, frozenset(unusable), library, tok)


def _specials(info: Any) -> frozenset[int]:
    return frozenset(token_id for token_id, _, special in info.added_tokens if special)


# open_clip/tokenizer.py SimpleTokenizer.pat (OpenAI CLIP's simple_tokenizer.py has the same), after its special
# tokens' alternatives.
CLIP_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""


def _clip(info: Any, source: Path) -> Segmenter | None:
    """CLIP's SimpleTokenizer (open_clip's default clean="lower"): ftfy.fix_text, html.unescape twice, runs of
    whitespace to one space, strip, lower case; then the words its pattern finds with `regex` (a special token
    only where a match starts: "&<end_of_text>" is punctuation), each a byte-level BPE word whose last symbol
    carries "</w>". Cleaning and matching are CLIP's own lines with the libraries CLIP calls (ftfy, regex:
    `tokenizers`' Oniguruma knows fewer Unicode letters); the BPE is `tokenizers`' (transformers'
    CLIPTokenizer builds that model)."""
    try:
        import ftfy
        import regex
    except ImportError:
        return None
    import html

    from tokenizers import Tokenizer, models, pre_tokenizers

    from ckptfix.tokenizer_formats import clip_merges

    vocab = {t: i for i, t in enumerate(info.base_tokens) if t is not None}
    bpe = Tokenizer(models.BPE(vocab, clip_merges(source, _read(source)), continuing_subword_prefix="",
                               end_of_word_suffix="</w>", fuse_unk=False))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    specials = {content: token_id for token_id, content, _ in info.added_tokens}
    words = regex.compile("|".join([*(regex.escape(s) for s in specials), CLIP_PATTERN]), regex.IGNORECASE)

    def encode(text: str) -> list[int]:
        text = " ".join(html.unescape(html.unescape(ftfy.fix_text(text))).split()).lower()
        ids: list[int] = []
        for word in words.findall(text):
            ids += [specials[word]] if word in specials else bpe.encode(word, add_special_tokens=False).ids
        return ids

    return Segmenter(encode, _specials(info), "CLIP's cleaning and pattern (ftfy, regex) + tokenizers (BPE with </w>)")


def _rwkv(info: Any) -> Segmenter | None:
    """RWKV's TRIE_TOKENIZER (rwkv/rwkv_tokenizer.py): the text's UTF-8 bytes, cut greedily into the longest
    token starting at each position. That is WordPiece's algorithm with no continuation prefix, here over the
    bytes spelled in GPT-2's byte alphabet (ckptfix's reader spells RWKV's tokens so). Id 0 (end of text) is not
    in the file: no text encodes to it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(info.base_tokens) if t is not None}
    missing = [b for b in range(256) if BYTE_ALPHABET[b] not in vocab]
    if missing:  # the trie finds no token there (rwkv asserts); WordPiece would make the whole text [UNK]
        return None
    tok = Tokenizer(models.WordPiece(vocab, unk_token=BYTE_ALPHABET[0], continuing_subword_prefix="",
                                     max_input_chars_per_word=8 * MAX_TEXT))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return Segmenter(lambda text: tok.encode(text, add_special_tokens=False).ids, _specials(info),
                     "tokenizers (WordPiece's greedy longest match, as RWKV's TRIE_TOKENIZER)")


# ------------------------------------------------------------------------------------------ tiktoken ranks


def _tiktoken(info: Any) -> Segmenter | None:
    pattern, nfc = _rank_pattern(info)
    if pattern is None:
        return None
    # GPT-2's encoder.json holds <|endoftext|> among its ids; tiktoken's gpt2 encoding drops it from the ranks
    ranks = {bytes(_BYTE_VALUE[c] for c in t): i for i, t in enumerate(info.base_tokens)
             if t and all(c in _BYTE_VALUE for c in t) and t not in ("<|endoftext|>", "<|startoftext|>")}
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:  # tiktoken panics (Rust: "no entry found for key") on a byte with no rank: a fuzz finding
        from ckptfix.errors import TokenizerError

        raise TokenizerError(f"{info.source}: its ranks lack {len(missing)} of the 256 single bytes (e.g. "
                             f"{missing[0]:#04x}); a byte-level BPE cannot encode text with them")
    try:
        import tiktoken
    except ImportError:
        encode, library = _bpe_from_ranks(ranks, pattern), "tokenizers (BPE from the tiktoken ranks)"
    else:
        enc = tiktoken.Encoding(f"ckptfix-{info.kind}", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        encode, library = enc.encode_ordinary, "tiktoken"
    if nfc:  # Qwen's tokenizers normalize to NFC before tiktoken sees the text
        inner = encode
        encode = lambda text: inner(unicodedata.normalize("NFC", text))  # noqa: E731
    return Segmenter(encode, _specials(info), library)


# tiktoken_ext/openai_public.py gpt2(): the sha256 tiktoken pins for GPT-2's encoder.json. tiktoken builds the
# gpt2 ranks from vocab.bpe and asserts they equal this file's ids ("tiktoken assumes that ranks are ordered the
# same as merge priority"), so this file alone is tiktoken's gpt2 encoding; another vocab.json's ids need not be.
GPT2_ENCODER_JSON_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"


def _is_gpt2_encoder_json(source: Path) -> bool:
    import hashlib

    return hashlib.sha256(_read(source)).hexdigest() == GPT2_ENCODER_JSON_SHA256


def _rank_pattern(info: Any) -> tuple[str | None, bool]:
    if info.kind in ("gpt2-bpe", "vocab.json"):  # tiktoken's gpt2 encoding: vocab.bpe's ranks, r50k's pattern
        return TIKTOKEN_PATTERNS["r50k_base"]
    if info.kind == "tekken":  # mistral_common's Tekkenizer passes the file's own config.pattern to tiktoken
        from ckptfix.untrusted import parse_json

        pattern = parse_json(_read(Path(info.source)), info.source).get("config", {}).get("pattern")
        return (pattern, False) if isinstance(pattern, str) else (None, False)
    return TIKTOKEN_PATTERNS.get(info.kind.split(":", 1)[1], (None, False))


def _bpe_from_ranks(ranks: dict[bytes, int], pattern: str) -> Callable[[str], list[int]]:
    """tiktoken's byte-pair merge as a `tokenizers` BPE: every split of a token into two tokens is a merge,
    ranked by the token's rank (tiktoken merges the adjacent pair whose concatenation ranks lowest); a whole
    pre-token that is a token is kept (ignore_merges), as tiktoken does."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    def text(raw: bytes) -> str:
        return "".join(BYTE_ALPHABET[b] for b in raw)

    merges = sorted((rank, ranks[raw[:i]], text(raw[:i]), text(raw[i:])) for raw, rank in ranks.items()
                    for i in range(1, len(raw)) if raw[:i] in ranks and raw[i:] in ranks)
    tok = Tokenizer(models.BPE({text(raw): rank for raw, rank in ranks.items()}, [(a, b) for *_, a, b in merges],
                               ignore_merges=True))
    # Oniguruma (tokenizers' regex engine) reads tiktoken's possessive `\p{N}{1,3}+` as `(\p{N}{1,3})+`, any
    # number of digits; greedy is the same match there (nothing follows it inside its alternative).
    pattern = re.sub(r"(\{[0-9]+(?:,[0-9]*)?\})\+", r"\1", pattern)
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), "isolated"),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return lambda s: tok.encode(s, add_special_tokens=False).ids


# ------------------------------------------------------------------------------------------ new rows


def token_text(info: Any, token: str) -> str | None:
    """The text a base-vocabulary token of `info` stands for, by its vocabulary's spelling convention:
    GPT-2's byte alphabet ("Ġreturn": " return"), sentencepiece's ▁ and <0xNN> pieces, WordPiece's ##."""
    spelling = _spelling(info)
    if spelling == "byte":
        suffix = _word_end(info)
        if suffix and token.endswith(suffix) and token != suffix:  # CLIP's word end: "return</w>" is "return"
            token = token[:-len(suffix)]
        if all(c in _BYTE_VALUE for c in token):
            return bytes(_BYTE_VALUE[c] for c in token).decode("utf-8", errors="replace")
        return token
    if spelling == "wordpiece" and token.startswith("##"):
        return token[2:]
    if token.startswith("<0x") and token.endswith(">") and len(token) == 6:  # a byte-fallback piece
        value = int(token[3:5], 16) if all(c in "0123456789abcdefABCDEF" for c in token[3:5]) else 0x80
        return chr(value) if value < 0x80 else None
    return token.replace(META, " ") if spelling == "meta" else token


@lru_cache(maxsize=4)
def _spelling(info: Any) -> str:
    kind, source = info.kind, Path(info.source)
    if kind.startswith("tiktoken:") or kind in _BYTE_LEVEL_KINDS or source.name in ("vocab.json", "encoder.json"):
        return "byte"
    if kind == "sentencepiece" or source.suffix == ".model":
        return "meta"
    if kind == "wordpiece" or source.name == "vocab.txt":
        return "wordpiece"
    from ckptfix.errors import CkptfixError
    from ckptfix.untrusted import parse_json

    try:  # a tokenizer.json: its decoder (or pre-tokenizer, normalizer) names the convention
        doc = parse_json(_read(source), str(source))
    except CkptfixError:
        return "plain"
    parts = str([doc.get(k) for k in ("decoder", "pre_tokenizer", "normalizer")] if isinstance(doc, dict) else "")
    if "'ByteLevel'" in parts:
        return "byte"
    if "'WordPiece'" in parts:
        return "wordpiece"
    return "meta" if "'Metaspace'" in parts or META in parts else "plain"


@lru_cache(maxsize=4)
def _word_end(info: Any) -> str:
    """The suffix a BPE puts on a word's last piece ("</w>": CLIP's merges file, a CLIPTokenizer's tokenizer.json);
    "" where none."""
    if info.kind == "clip-bpe":
        return "</w>"
    if not Path(info.source).name.endswith(".json") or info.kind not in ("tokenizer.json", "hf-folder"):
        return ""
    from ckptfix.errors import CkptfixError
    from ckptfix.untrusted import parse_json

    try:
        doc = parse_json(_read(Path(info.source)), info.source)
    except CkptfixError:
        return ""
    model = doc.get("model") if isinstance(doc, dict) else None
    suffix = model.get("end_of_word_suffix") if isinstance(model, dict) else None
    return suffix if isinstance(suffix, str) else ""


def spell(segmenter: Segmenter, text: str) -> list[int]:
    """Ids of `text` where it occurs after a word, not at the start of a document: a tokenizer that puts a
    word-start marker before the first word (sentencepiece's dummy prefix, a Metaspace prepend) would spell
    " return" there as "▁" + "▁return". Encoded after "a" and that prefix's ids dropped, as transformers'
    non-legacy Llama/T5 tokenizers drop theirs; the text alone where "a" merges into it."""
    head = _encode(segmenter, "a")
    ids = _encode(segmenter, "a" + text)
    if head and ids[:len(head)] == head:
        return ids[len(head):]
    return _encode(segmenter, text)


def _encode(segmenter: Segmenter, text: str) -> list[int]:
    """The library's encoding; a Rust panic in it (tiktoken over ranks that lack a single byte: "no entry found
    for key", a fuzz finding) is one line, exit 2, like a file the library refuses to load."""
    from ckptfix.errors import TokenizerError

    try:
        return segmenter.encode(text)
    except BaseException as exc:  # pyo3's PanicException is a BaseException
        if type(exc).__name__ != "PanicException":
            raise
        raise TokenizerError(f"{segmenter.library} panicked encoding a new token's text for --init pieces: "
                             f"{' '.join(str(exc).split())[:200]}") from None


def piece_rows(source: np.ndarray, new_tok: Any, old_tok: Any, old_rows: int) -> dict[int, tuple[int, ...]]:
    """For every new row (source == -1) whose token's text the old tokenizer can spell: the old rows of
    those pieces. `old_tok` None: the new tokenizer spells it without its new added tokens, with only rows
    kept by id (a tokenizer grown by `add_tokens`: its base model is the old tokenizer)."""
    new_rows = np.flatnonzero(source < 0).tolist()
    if not new_rows:
        return {}
    new_tok, old_tok = _unwrap(new_tok), _unwrap(old_tok)
    new_table = new_tok.id_to_token()
    added = {token_id: content for token_id, content, _ in new_tok.added_tokens}
    without = frozenset(added[j] for j in new_rows if j in added) if old_tok is None else frozenset()
    old_seg = load_segmenter(old_tok if old_tok is not None else new_tok, without)
    if old_seg is None:
        return {}
    out: dict[int, tuple[int, ...]] = {}
    for j in new_rows:
        token = new_table[j] if j < len(new_table) else None
        if token is None or token in new_tok.special_tokens:
            continue
        text = token if j in added else token_text(new_tok, token)
        if not text or len(text) > MAX_TEXT:
            continue
        ids = [i for i in spell(old_seg, text) if i not in old_seg.unusable and 0 <= i < old_rows
               and (old_tok is not None or source[i] == i)]
        if ids:
            out[j] = tuple(ids)
    return out


def _unwrap(tok: Any) -> Any:
    """The TokenizerInfo inside the guard's resize target (`resume_plan._Target.tokens`), else `tok` itself."""
    inner = getattr(tok, "tokens", None)
    return inner if inner is not None else tok
