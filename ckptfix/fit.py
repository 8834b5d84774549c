"""The fit rule: do a checkpoint's vocab rows fit a tokenizer's tokens?

One pure function, used by inspect (CKF101/102/103/105), repair (the target row count) and the guard:

- rows < tokens: an error (ids past the last row cannot be looked up);
- rows == tokens: clean;
- rows > tokens: padding/reserved rows (info, with the count of rows no token id reaches) when
  * the rows are the tokens rounded up to the next multiple of 8..256 ("padded": pad_to_multiple_of,
    Megatron's make_vocab_size_divisible_by, T5's 32100 -> 32128), or
  * the rows are a round multiple of 64 (or more) a little above the tokens ("reserved": Qwen2/3's 151936
    rows for 151643 base + 3..26 special tokens, DeepSeek-V3's 129280 for 128815, DeepSeek-V2's 102400 for
    100015), or
  * the checkpoint's own config records the rows as its `vocab_size` (GPT-J's 50400 for GPT-2's 50257);
  otherwise an error (seed 001: 1001 rows for 1000 tokens, a model built for another tokenizer).

"A little above" is at most RESERVED_FRACTION of the rows: a tokenizer that leaves more rows unreached is far
more likely the wrong tokenizer (GPT-2's 50257 tokens against Llama 3's 128256 rows) than a reserve.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Fit", "config_vocab_size", "fit_rows", "padded_size", "row_multiple", "target_rows"]

PADDING_MULTIPLES = (8, 16, 32, 64, 128, 256)  # next-multiple padding, smallest first
ROUND_MULTIPLES = (1024, 512, 256, 128, 64)  # "round" row counts, largest first
RESERVED_FRACTION = 16  # reserved rows may be up to rows/16 (6.25%); DeepSeek-V2 has 2.3%, Qwen2.5-7B 0.3%


@dataclass(frozen=True)
class Fit:
    """How `rows` embedding rows fit `tokens` token ids."""

    verdict: str  # "clean" | "padded" | "reserved" | "too-few" | "too-many"
    rows: int
    tokens: int
    multiple: int | None = None  # padded: the multiple rounded up to; reserved: the largest round multiple
    by_config: bool = False  # reserved because the checkpoint records `rows` as its vocab size

    @property
    def ok(self) -> bool:
        """True when a model built with `rows` rows can look up every id of the tokenizer."""
        return self.verdict in ("clean", "padded", "reserved")

    @property
    def unused(self) -> int:
        """Rows no token id reaches (0 unless padded/reserved)."""
        return max(self.rows - self.tokens, 0) if self.ok else 0

    def describe(self) -> str:
        """One phrase for reports: why the rows fit (or not)."""
        if self.verdict == "padded":
            return f"padded to a multiple of {self.multiple}"
        if self.verdict == "reserved":
            why = "the recorded vocab size" if self.by_config else f"a multiple of {self.multiple}"
            return f"rows reserved above the tokenizer ({why})"
        if self.verdict == "too-many":
            return "not padding to a multiple of 8..256"
        return {"clean": "one row per token", "too-few": "ids past the last row"}[self.verdict]


def padded_size(size: int, multiple: int) -> int:
    """`size` rounded up to a multiple of `multiple`."""
    return -(-size // multiple) * multiple


def row_multiple(rows: int) -> int | None:
    """The largest round multiple (64..1024) that `rows` is a multiple of; None for other counts."""
    return next((m for m in ROUND_MULTIPLES if rows > 0 and rows % m == 0), None)


def fit_rows(rows: int, tokens: int, config_vocab: int | None = None, multiple: int | None = None) -> Fit:
    """Decide how `rows` vocab rows fit a tokenizer of `tokens` ids; `config_vocab` is the checkpoint
    config's recorded `vocab_size` (None when there is no config); `multiple` the padding multiple the
    checkpoint records (Megatron's make_vocab_size_divisible_by x TP), named when it gives the rows."""
    if rows < tokens:
        return Fit("too-few", rows, tokens)
    if rows == tokens:
        return Fit("clean", rows, tokens)
    if multiple and padded_size(tokens, multiple) == rows:
        return Fit("padded", rows, tokens, multiple)
    padded = next((m for m in PADDING_MULTIPLES if padded_size(tokens, m) == rows), None)
    if padded is not None:
        return Fit("padded", rows, tokens, padded)
    if rows - tokens <= rows // RESERVED_FRACTION:
        if row_multiple(rows) is not None:
            return Fit("reserved", rows, tokens, row_multiple(rows))
        if config_vocab == rows:
            return Fit("reserved", rows, tokens, by_config=True)
    return Fit("too-many", rows, tokens)


def config_vocab_size(config: Any) -> int | None:
    """The `vocab_size` a model config (config.json as a dict) records, also under `text_config`
    (multimodal models: Llava, Qwen2-VL, Gemma 3 keep the language model's config there)."""
    if not isinstance(config, dict):
        return None
    for where in (config, config.get("text_config")):
        value = where.get("vocab_size") if isinstance(where, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def target_rows(tokens: int, rows: int, *, pad_to: int | None = None, config_vocab: int | None = None,
                old_tokens: int | None = None, exact: bool = False) -> tuple[int, str]:
    """Row count for a repair of a checkpoint with `rows` rows to a `tokens`-id tokenizer, and a note naming
    the padding rule used (repair prints it). The first rule that applies:

    1. `exact` (the guard): `tokens` is the live model's row count, which the rows must match.
    2. `pad_to` (--pad-to N): the tokens rounded up to a multiple of N (1: exactly one row per token).
    3. The rows already fit the tokenizer as the model's own size: its config records them as `vocab_size`
       (`config_vocab`), or they are a round reserve, or a padding to a multiple of 64+ (fit_rows): kept.
    4. The padding multiple the checkpoint already has against the tokenizer its rows were trained with
       (`old_tokens`: --from-tokenizer, a ckptfix record's, an HF folder's own): the tokens rounded up to it.
    5. One row per token, as a model built from `len(tokenizer)` (resize_token_embeddings) expects: the
       checkpoint's multiple is not known without its old tokenizer (Llama 2's 32000 rows are one per token,
       though 32000 is a multiple of 256), so the note says how to keep one (--pad-to N).
    """
    target, rule = _target_rule(tokens, rows, pad_to, config_vocab, old_tokens, exact)
    head = f"kept the checkpoint's {rows}" if target == rows else str(target)
    return target, f"rows: {head} for {tokens} tokens (padding rule: {rule})"


def _target_rule(tokens: int, rows: int, pad_to: int | None, config_vocab: int | None, old_tokens: int | None,
                 exact: bool) -> tuple[int, str]:
    if exact:
        return tokens, "the live model's row count"
    if pad_to is not None:
        return padded_size(tokens, pad_to), f"--pad-to {pad_to}"
    now = fit_rows(rows, tokens, config_vocab)
    # Rows one per token of an old tokenizer look like a small padding of a smaller new one (48 rows "pad"
    # 40 tokens to 16): only the config's vocab_size, a round reserve or a padding to a multiple of 64+ shows
    # the model was built with more rows than tokens.
    if now.ok and rows > tokens:
        if config_vocab == rows:
            return rows, f"the model's size, its config's vocab_size {rows} ({now.describe()})"
        if now.verdict == "reserved" or rows % 64 == 0:
            return rows, f"the model's size ({now.describe()})"
    before = fit_rows(rows, old_tokens, config_vocab) if old_tokens is not None else None
    if before is not None and before.verdict in ("padded", "reserved") and before.multiple:
        # "Padded" names the smallest multiple that gives the rows; 1024 rows for 1000 tokens may be 32..256:
        # take 64 (HF's usual pad_to_multiple_of) when the rows allow it, never more than 256.
        multiple = min(max(before.multiple, 64 if rows % 64 == 0 else 1), 256)
        return padded_size(tokens, multiple), (f"the checkpoint's multiple of {multiple}: its {rows} rows were "
                                               f"for {old_tokens} tokens; --pad-to 1 for one row per token")
    if before is not None:
        why = f"the checkpoint's {rows} rows show no padding multiple against its {old_tokens}-token tokenizer"
    else:
        why = "no padding multiple is known without the tokenizer the rows were trained with (--from-tokenizer)"
    multiple = min(row_multiple(rows) or 0, 256)
    hint = f"; its {rows} rows are a multiple of {multiple}: --pad-to {multiple} keeps it" if multiple else ""
    return tokens, f"one row per token: {why}{hint}"
