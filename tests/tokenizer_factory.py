"""Build real tokenizers at test time (sentencepiece, tokenizers, transformers folders), deterministically.

Shared by tokenizer, checkpoint-fixture and repair tests. Every builder writes under the directory it is
given and returns the path it wrote; the same arguments always give the same vocabulary.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable, Sequence

LETTERS = "abcdefghijklmnopqrstuvwxyz"


def corpus_lines(n_lines: int = 1500, n_words: int = 3000, seed: int = 0) -> list[str]:
    """Pseudo-words from a fixed seed: enough distinct character n-grams for vocabularies of a few thousand."""
    rng = random.Random(seed)
    words = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(2, 9))) for _ in range(n_words)]
    return [" ".join(rng.choice(words) for _ in range(12)) for _ in range(n_lines)]


def train_sentencepiece(
    tmp_dir: str | Path,
    vocab_size: int = 1000,
    model_type: str = "bpe",
    name: str = "sp",
    user_defined_symbols: Sequence[str] = (),
    **options: object,
) -> Path:
    """Train a sentencepiece model with exactly `vocab_size` pieces; returns the .model path.

    bpe reaches 8000+ pieces on the default corpus, unigram about 3000 (more raises). Extra trainer options
    (pad_id=3, byte_fallback=True, ...) pass through.
    """
    import sentencepiece

    prefix = Path(tmp_dir) / name
    prefix.parent.mkdir(parents=True, exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus_lines()),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        hard_vocab_limit=True,  # fail loudly rather than return a smaller vocabulary
        user_defined_symbols=list(user_defined_symbols),
        num_threads=1,  # single-threaded training is bit-for-bit reproducible
        minloglevel=2,
        **options,
    )
    return prefix.with_suffix(".model")


def train_tokenizer(
    vocab_size: int = 300,
    model: str = "bpe",
    added: Iterable[str] = (),
    special: Iterable[str] = (),
    base_special: Sequence[str] = ("[UNK]", "[PAD]"),
):
    """A trained `tokenizers.Tokenizer` (bpe, wordpiece, unigram or wordlevel) plus added/special tokens.
    `base_special` are trained in first (ids 0, 1, ...): more of them shift every learned token's id."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    base_special = list(base_special)
    kinds = {
        "bpe": (models.BPE(unk_token="[UNK]"), trainers.BpeTrainer),
        "wordpiece": (models.WordPiece(unk_token="[UNK]"), trainers.WordPieceTrainer),
        "wordlevel": (models.WordLevel(unk_token="[UNK]"), trainers.WordLevelTrainer),
        "unigram": (models.Unigram(), trainers.UnigramTrainer),
    }
    tok_model, trainer_cls = kinds[model]
    extra = {"unk_token": "[UNK]"} if model == "unigram" else {}
    trainer = trainer_cls(vocab_size=vocab_size, special_tokens=base_special, show_progress=False, **extra)
    tokenizer = Tokenizer(tok_model)
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.train_from_iterator(corpus_lines(), trainer)
    if added:
        tokenizer.add_tokens(list(added))
    if special:
        tokenizer.add_special_tokens(list(special))
    return tokenizer


def train_byte_level(texts: Iterable[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` as GPT-2/Llama 3 build theirs: every byte in the base
    alphabet (no unknown token), no prefix space, no special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    return tok


def train_tokenizer_json(
    tmp_dir: str | Path,
    vocab_size: int = 300,
    model: str = "bpe",
    added: Iterable[str] = (),
    special: Iterable[str] = (),
    name: str = "tokenizer.json",
) -> Path:
    """Train (see train_tokenizer) and save as a tokenizer.json; returns its path."""
    path = Path(tmp_dir) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    train_tokenizer(vocab_size, model, added, special).save(str(path))
    return path


def train_bpe_tokenizer_json(
    tmp_dir: str | Path,
    vocab_size: int = 300,
    added: Iterable[str] = (),
    special: Iterable[str] = (),
    name: str = "tokenizer.json",
) -> Path:
    """A BPE tokenizer.json with `vocab_size` base tokens ([UNK]=0, [PAD]=1) and the given added tokens."""
    return train_tokenizer_json(tmp_dir, vocab_size, "bpe", added, special, name)


def make_hf_tokenizer_folder(
    tmp_dir: str | Path,
    vocab_size: int = 300,
    added: Iterable[str] = (),
    special: Iterable[str] = (),
    name: str = "hf_tokenizer",
    backend: str = "tokenizers",
) -> Path:
    """A transformers `save_pretrained` folder; returns the folder.

    backend "tokenizers": PreTrainedTokenizerFast over a trained BPE (tokenizer.json + tokenizer_config.json).
    backend "sentencepiece": the slow sentencepiece tokenizer over a trained .model (tokenizer.model,
    tokenizer_config.json with added_tokens_decoder, added_tokens.json); vocab_size is then the piece count.
    Added tokens go through `add_tokens`, special ones through `add_special_tokens`, as users do.
    """
    folder = Path(tmp_dir) / name
    if backend == "tokenizers":
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(vocab_size), unk_token="[UNK]", pad_token="[PAD]")
    elif backend == "sentencepiece":
        from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

        model_dir = Path(tmp_dir) / f"{name}_sp"
        model_dir.mkdir(parents=True, exist_ok=True)
        hf = SentencePieceBackend(vocab_file=str(train_sentencepiece(model_dir, vocab_size)))
    else:
        raise ValueError(f"unknown backend {backend!r}")
    if added:
        hf.add_tokens(list(added))
    if special:
        hf.add_special_tokens({"additional_special_tokens": list(special)})
    hf.save_pretrained(str(folder))
    return folder


def reorder_tokenizer_json(src: str | Path, dst: str | Path, seed: int = 0) -> Path:
    """Write `dst`: the same tokens as `src` with the ids shuffled; returns `dst`.

    Base ids are permuted within the base range and the tokens added beyond it are shuffled among
    themselves (tokenizers assigns those by list order). Ids that refer to tokens elsewhere in the file
    (Unigram unk_id, added tokens inside the base range, post-processor and padding ids) follow.
    """
    doc = json.loads(Path(src).read_text(encoding="utf-8"))
    model = doc["model"]
    rng = random.Random(seed)
    base_size = len(model["vocab"])
    perm = list(range(base_size))
    rng.shuffle(perm)  # old id -> new id
    if isinstance(model["vocab"], list):
        new_vocab: list = [None] * base_size
        for old, entry in enumerate(model["vocab"]):
            new_vocab[perm[old]] = entry
        model["vocab"] = new_vocab
        if model.get("unk_id") is not None:
            model["unk_id"] = perm[model["unk_id"]]
    else:
        model["vocab"] = dict(sorted(((tok, perm[i]) for tok, i in model["vocab"].items()), key=lambda kv: kv[1]))
    inside = [t for t in doc.get("added_tokens") or [] if t["id"] < base_size]
    beyond = [t for t in doc.get("added_tokens") or [] if t["id"] >= base_size]
    old_beyond = sorted(t["id"] for t in beyond)
    rng.shuffle(beyond)
    mapping = {i: p for i, p in enumerate(perm)}
    mapping.update({t["id"]: new for t, new in zip(beyond, old_beyond)})
    for token in inside + beyond:
        token["id"] = mapping[token["id"]]
    doc["added_tokens"] = sorted(inside + beyond, key=lambda t: t["id"])
    _remap_referenced_ids(doc, mapping)
    return _write_json(dst, doc)


def extend_tokenizer_json(src: str | Path, dst: str | Path, new_tokens: Sequence[str]) -> Path:
    """Write `dst`: `src` with `new_tokens` appended to the base vocabulary (ids base_size, base_size+1, ...).

    Existing base ids do not move; tokens added beyond the base shift up by len(new_tokens), as they would
    if the tokenizer had been retrained with a larger vocabulary. Returns `dst`.
    """
    doc = json.loads(Path(src).read_text(encoding="utf-8"))
    model = doc["model"]
    vocab = model["vocab"]
    is_unigram = isinstance(vocab, list)
    existing = {entry[0] for entry in vocab} if is_unigram else set(vocab)
    existing |= {t["content"] for t in doc.get("added_tokens") or []}
    clash = [t for t in new_tokens if t in existing]
    if clash or len(set(new_tokens)) != len(new_tokens):
        raise ValueError(f"new tokens already present or repeated: {clash or list(new_tokens)}")
    base_size = len(vocab)
    if is_unigram:
        floor = min(score for _, score in vocab) - 1.0  # rarest: never preferred over the trained pieces
        vocab.extend([token, floor] for token in new_tokens)
    else:
        vocab.update((token, base_size + k) for k, token in enumerate(new_tokens))
    shift = len(new_tokens)
    mapping = {t["id"]: t["id"] + shift for t in doc.get("added_tokens") or [] if t["id"] >= base_size}
    for token in doc.get("added_tokens") or []:
        token["id"] = mapping.get(token["id"], token["id"])
    _remap_referenced_ids(doc, mapping)
    return _write_json(dst, doc)


def _remap_referenced_ids(doc: dict, mapping: dict[int, int]) -> None:
    """Post-processor special-token ids and the padding id live outside the vocab; keep them consistent."""
    stack = [doc.get("post_processor")]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
        elif isinstance(node, dict):
            for entry in (node.get("special_tokens") or {}).values():
                entry["ids"] = [mapping.get(i, i) for i in entry.get("ids", [])]
            for key in ("cls", "sep"):  # BertProcessing / RobertaProcessing: [token, id]
                if isinstance(node.get(key), list) and len(node[key]) == 2:
                    node[key][1] = mapping.get(node[key][1], node[key][1])
            stack.extend(node.get("processors") or [])  # a Sequence post-processor nests others
    padding = doc.get("padding")
    if isinstance(padding, dict) and "pad_id" in padding:
        padding["pad_id"] = mapping.get(padding["pad_id"], padding["pad_id"])


def _write_json(dst: str | Path, doc: dict) -> Path:
    path = Path(dst)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=2), encoding="utf-8")
    return path
