"""The fit rule (ckptfix.fit): rows against tokens, table-driven, with the shapes real models ship."""

from __future__ import annotations

import pytest

from ckptfix.fit import config_vocab_size, fit_rows, target_rows

# rows, tokens, config vocab_size, verdict, multiple, unused.  Sources for the real shapes: each model's
# config.json `vocab_size` (rows) and `len(tokenizer)` of its tokenizer (tokens).
FIT_TABLE = [
    # seed 001: a model built for another tokenizer, either way round
    (1001, 1000, None, "too-many", None, 0),
    (1000, 1001, None, "too-few", None, 0),
    (1001, 1000, 1001, "reserved", None, 1),  # ... unless the checkpoint's own config builds the model with 1001
    (1000, 1000, None, "clean", None, 0),
    # next-multiple padding (pad_to_multiple_of, Megatron's make_vocab_size_divisible_by)
    (1008, 1001, None, "padded", 8, 7),
    (1024, 1000, None, "padded", 32, 24),
    (32128, 32100, None, "padded", 32, 28),  # T5: 32100 sentencepiece + extra ids, config 32128
    (50304, 50277, None, "padded", 32, 27),  # OLMo-1 / Pythia-style GPT-NeoX tokenizer, 50304 rows
    (50280, 50277, None, "padded", 8, 3),  # Mamba: pad_vocab_size_multiple=8
    # reserved: a round multiple a little above the tokenizer
    (151936, 151646, None, "reserved", 128, 290),  # Qwen2 / Qwen2.5 <= 3B
    (151936, 151669, None, "reserved", 128, 267),  # Qwen3
    (152064, 151646, None, "reserved", 512, 418),  # Qwen2.5-7B
    (129280, 128815, None, "reserved", 256, 465),  # DeepSeek-V3
    (102400, 100015, None, "reserved", 1024, 2385),  # DeepSeek-V2
    (32064, 32011, None, "padded", 64, 53),  # Phi-3-mini
    (50400, 50257, 50400, "reserved", None, 143),  # GPT-J: 50400 is not round; its config records it
    (50400, 50257, None, "too-many", None, 0),  # ... without the config, nothing says so
    # exact: the tokenizer counts its reserved/special tokens itself
    (128256, 128256, None, "clean", None, 0),  # Llama 3: 128000 + 256 reserved specials
    (51865, 51865, None, "clean", None, 0),  # Whisper multilingual
    (51866, 51866, None, "clean", None, 0),  # Whisper large-v3
    (50257, 50257, None, "clean", None, 0),  # GPT-2
    (30522, 30522, None, "clean", None, 0),  # BERT base uncased
    (32768, 32768, None, "clean", None, 0),  # Mistral v3 (sentencepiece)
    (131072, 131072, None, "clean", None, 0),  # Mistral tekken
    # far above: the wrong tokenizer, not a reserve, even when the rows are round or recorded
    (128256, 50257, None, "too-many", None, 0),
    (128256, 50257, 128256, "too-many", None, 0),
    (2048, 1000, None, "too-many", None, 0),
    (1088, 1000, None, "too-many", None, 0),  # a multiple of 64, but 88 > 1088/16 and not the next multiple
]


@pytest.mark.parametrize("rows, tokens, config, verdict, multiple, unused", FIT_TABLE)
def test_fit_table(rows, tokens, config, verdict, multiple, unused):
    fit = fit_rows(rows, tokens, config)
    assert (fit.verdict, fit.multiple, fit.unused) == (verdict, multiple, unused)
    assert fit.ok == (verdict in ("clean", "padded", "reserved"))
    assert fit.by_config == (verdict == "reserved" and multiple is None)


@pytest.mark.parametrize("config, expected", [
    ({"vocab_size": 151936}, 151936),
    ({"text_config": {"vocab_size": 128256}}, 128256),  # Llava / Qwen2-VL style
    ({"vocab_size": True}, None), ({"vocab_size": "1"}, None), ({"vocab_size": 0}, None),
    ([], None), (None, None), ({}, None),
])
def test_config_vocab_size(config, expected):
    assert config_vocab_size(config) == expected


# tokens, rows, pad_to, config, old tokens -> target rows, the padding rule the note names
SIZE, MULTIPLE, ONE, PAD = "the model's size", "the checkpoint's multiple", "one row per token", "--pad-to"
TARGET_TABLE = [
    (1003, 1000, None, None, None, 1003, ONE),  # what resize_token_embeddings(len(tok)) builds
    (1000, 1001, None, None, None, 1000, ONE),  # seed 001's repair
    (40, 48, None, None, None, 40, ONE),  # 48 rows "pad" 40 tokens to 16: more likely one per token of an old one
    (40, 48, None, None, 48, 40, ONE),  # ... as the old tokenizer shows
    (1000, 1024, None, None, None, 1024, SIZE),  # padded to 64+ (the fixtures' pad_to_multiple_of=64): kept
    (1030, 1024, None, None, 1000, 1088, MULTIPLE),  # padded to 64 against its old tokenizer: the multiple kept
    (1030, 1024, None, None, None, 1030, ONE),  # no old tokenizer: nothing shows the 1024 rows were padding
    (1030, 1024, None, 1024, None, 1030, ONE),  # past the config's vocab_size: it cannot be kept
    (1030, 1024, 64, None, None, 1088, PAD),  # --pad-to 64
    (1030, 1024, 1, None, 1000, 1030, PAD),  # --pad-to 1: exactly one row per token
    (151700, 151936, None, None, None, 151936, SIZE),  # Qwen: new tokens land in the reserved rows, no resize
    (151700, 151936, None, 151936, None, 151936, SIZE),
    (152000, 151936, None, 151936, 151669, 152064, MULTIPLE),  # Qwen3 past its reserve: the next multiple of 128
    (50400, 50304, None, 50304, 50257, 50432, MULTIPLE),  # nanoGPT's 50304 (64 x 786 = 128 x 393) grown
    # the config's vocab_size is the model's size (issue #16: "or its config's vocab_size"), whatever its shape
    (192, 203, None, 203, None, 203, SIZE),  # nanoGPT's model_args
    (50257, 50400, None, 50400, None, 50400, SIZE),  # GPT-J's config records its 50400
    (40, 48, None, 48, None, 48, SIZE),
    (50257, 50400, None, None, None, 50257, ONE),  # ... without a config nothing says 50400 is the model's
    (50300, 50400, None, 50400, 50257, 50400, SIZE),
    (50500, 50400, None, 50400, 50257, 50500, ONE),  # past it: 50400 for 50257 is no multiple
    (32001, 32000, None, 32000, 32000, 32001, ONE),  # Llama 2 + a pad token: it had one row per token
    (32001, 32000, None, 32000, None, 32001, ONE),  # ... its 32000 rows are a multiple of 256 all the same
]


@pytest.mark.parametrize("tokens, rows, pad_to, config, old, expected, rule", TARGET_TABLE)
def test_target_rows(tokens, rows, pad_to, config, old, expected, rule):
    target, note = target_rows(tokens, rows, pad_to=pad_to, config_vocab=config, old_tokens=old)
    assert target == expected
    assert note.startswith(f"rows: {'kept the checkpoint' if target == rows else target}")
    assert f"(padding rule: {rule}" in note


def test_target_rows_hints_at_the_multiple_it_did_not_assume():
    _, note = target_rows(32001, 32000)
    assert note.endswith("its 32000 rows are a multiple of 256: --pad-to 256 keeps it)")


def test_the_guard_resizes_to_the_live_model_exactly():
    """The guard's target is the live model's row count: a checkpoint padded to 1024 rows loads into a model
    built with 1000 (the rows the fit rule would keep for a repair are not the model's)."""
    assert target_rows(1000, 1024, exact=True) == (1000, "rows: 1000 for 1000 tokens (padding rule: the live model's row count)")
