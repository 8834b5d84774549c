"""Vocab-sized tensors against the tokenizer, and against each other."""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks import Context, Finding, check, finding
from ckptfix.vocab import padding_multiple

_LOAD_RAISES = ("model.load_state_dict raises RuntimeError 'size mismatch for {name}' for a model built for "
                "{tokens} tokens, even with strict=False; Optimizer.load_state_dict would accept the "
                "{rows}-row moments silently and step() then fails with 'The size of tensor a ... must match'.")


def _mismatched(ctx: Context, smaller: bool):
    if ctx.tokenizer is None:
        return []
    size = ctx.tokenizer.size
    return [v for v in ctx.vocab if (v.rows < size if smaller else v.rows > size)]


@check("CKF101", "error", "vocab rows fewer than the tokenizer",
       "Embedding/head rows < tokenizer size: token ids past the last row cannot be looked up.")
def rows_below_tokenizer(ctx: Context) -> Iterator[Finding]:
    short = _mismatched(ctx, smaller=True)
    if not short:
        return
    size, rows = ctx.tokenizer.size, min(v.rows for v in short)
    lost = [f"{tid}:{tok!r}" for tid, tok, _ in ctx.tokenizer.added_tokens if tid >= rows][:5]
    extra = f"; added tokens past the end include {', '.join(lost)}" if lost else ""
    yield finding(
        "CKF101", f"{len(short)} vocab tensor(s) have {rows} rows but the tokenizer has {size} tokens "
        f"(ids {rows}..{size - 1} have no row){extra}",
        pytorch=_LOAD_RAISES.format(name=short[0].name, tokens=size, rows=rows) +
        " Used as is, the first id >= rows raises IndexError (a device-side assert on CUDA).",
        fix=ctx.repair_command(), tensors=[v.name for v in short])


@check("CKF102", "error", "vocab rows more than the tokenizer",
       "Embedding/head rows > tokenizer size and not a padding multiple: the model code and checkpoint disagree.")
def rows_above_tokenizer(ctx: Context) -> Iterator[Finding]:
    size = ctx.tokenizer.size if ctx.tokenizer else 0
    extra = [v for v in _mismatched(ctx, smaller=False) if padding_multiple(v.rows, size) is None]
    if not extra:
        return
    rows = max(v.rows for v in extra)
    yield finding(
        "CKF102", f"{len(extra)} vocab tensor(s) have {rows} rows but the tokenizer has {size} tokens "
        f"({rows - size} extra row(s), not padding to a multiple of 8..256)",
        pytorch=_LOAD_RAISES.format(name=extra[0].name, tokens=size, rows=rows),
        fix=ctx.repair_command(), tensors=[v.name for v in extra])


@check("CKF103", "info", "vocab rows padded above the tokenizer",
       "Rows rounded up to a multiple of 8/64/128 above the tokenizer size: normal, not an error.")
def rows_padded(ctx: Context) -> Iterator[Finding]:
    size = ctx.tokenizer.size if ctx.tokenizer else 0
    padded = [v for v in _mismatched(ctx, smaller=False) if padding_multiple(v.rows, size) is not None]
    if not padded:
        return
    rows = padded[0].rows
    yield finding(
        "CKF103", f"{rows} rows for {size} tokens: padded to a multiple of {padding_multiple(rows, size)} "
        f"({rows - size} unused row(s))",
        pytorch="Loads into a model built with the padded size (e.g. pad_to_multiple_of); the extra rows are never indexed.",
        fix="Nothing to do; build the model with the padded size.", tensors=[v.name for v in padded])


@check("CKF104", "error", "embedding and head row counts differ",
       "The input embedding and the LM head have different numbers of rows.")
def embedding_head_disagree(ctx: Context) -> Iterator[Finding]:
    embeds = [v for v in ctx.vocab if v.role == "embedding"]
    heads = [v for v in ctx.vocab if v.role in ("head", "head-bias") and v.tied_to is None]
    for head in heads:
        for embed in embeds:
            if head.rows != embed.rows and embed.rows > 0 and abs(head.rows - embed.rows) < embed.rows // 2:
                yield finding(
                    "CKF104", f"{embed.name} has {embed.rows} rows but {head.name} has {head.rows}",
                    pytorch="A model builds both from one vocab size, so load_state_dict raises a size mismatch "
                    "for one of them.", fix=ctx.repair_command(), tensors=[embed.name, head.name])
                return
