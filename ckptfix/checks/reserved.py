"""Reserved rows that never trained: token ids that land on rows no gradient ever reached.

Models reserve rows above their tokenizer (Qwen: 151936 rows for ~151650 tokens; Llama 3's 250
`<|reserved_special_token_N|>`). A tokenizer that later puts new tokens there needs no resize, so HF's
`resize_token_embeddings` does nothing for them, yet their rows are still the random init. The evidence
that a row never trained in this run: its input-embedding `exp_avg_sq` row is exactly zero (Adam's second
moment of a row that only ever saw zero gradients; any real gradient makes it positive for good). A tied
head gets a gradient for every row through the softmax, so this evidence exists for untied embeddings only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.checkpoint import read_last_row
from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.errors import CkptfixError

_BLOCK = 256  # rows read at a time, from the end: only the reserved block and one trained row are read


def never_trained_from(vocab_tensor: Any) -> int | None:
    """First row of the block of rows at the end of an embedding whose `exp_avg_sq` rows are all exactly
    zero, or None (no such rows, no second moment, a moment that cannot be read as one array)."""
    moment = vocab_tensor.moments.get("exp_avg_sq") if vocab_tensor.role == "embedding" else None
    if moment is None or vocab_tensor.tied_to is not None or len(moment.shape) != 2:
        return None
    last = read_last_row(moment)  # the common case, decided without numpy: the last row trained
    if last is not None and any((int(v) & 0x7FFF) != 0 if moment.dtype == "bfloat16" else v != 0 for v in last):
        return None
    try:
        values = moment.read_stored()
    except (CkptfixError, OSError, ValueError):
        return None
    rows = values.shape[0]
    end = rows
    while end > 0:
        block = np.asarray(values[max(0, end - _BLOCK):end])
        nonzero = np.flatnonzero(_nonzero_rows(block, moment.dtype))
        if len(nonzero):
            start = end - block.shape[0] + int(nonzero[-1]) + 1
            return start if start < rows and _trained_below(values, start, moment.dtype) else None
        end -= block.shape[0]
    return None  # every row zero: an optimizer that never stepped, not reserved rows


def _nonzero_rows(block: np.ndarray, dtype: str) -> np.ndarray:
    block = block.reshape(block.shape[0], -1)
    # bfloat16 comes as its bits: zero is 0x0000 or 0x8000 (-0.0); NaN counts as not zero
    return ((block & 0x7FFF) != 0 if dtype == "bfloat16" else block != 0).any(axis=1)


def _trained_below(values: np.ndarray, start: int, dtype: str) -> bool:
    """Rows below the block trained (at most 1% zero in a sample of up to 4096 rows): the block is rows
    the run reserved, not the tail of a run too short to have seen most tokens (where zero rows are
    scattered everywhere and "never trained" says nothing about reservation)."""
    sample = np.asarray(values[0:start:max(1, start // 4096)])
    return float(np.mean(~_nonzero_rows(sample, dtype))) <= 0.01


def row_norms(tensor: Any, start: int, stop: int) -> np.ndarray:
    from ckptfix.checkpoint import widen_stored

    rows = widen_stored(np.asarray(tensor.read_stored()[start:stop]), tensor.dtype)
    return np.linalg.norm(rows.reshape(rows.shape[0], -1).astype(np.float64), axis=1)


@check("CKF110", "warning", "token ids on never-trained rows",
       "Tokenizer ids land on embedding rows no gradient ever reached (exp_avg_sq exactly 0): reserved rows; "
       "repair initialises them like new rows.")
def ids_on_untrained_rows(ctx: Context) -> Iterator[Finding]:
    if ctx.tokenizer is None:
        return
    for v in ctx.vocab:
        start = never_trained_from(v)
        if start is None or start >= min(ctx.tokenizer.size, v.rows):
            continue
        stop = min(ctx.tokenizer.size, v.rows)
        weight = ctx.ckpt.model.get(v.name)
        norms = ""
        if weight is not None:
            try:
                lo = max(0, start - 4 * (stop - start))
                trained, untrained = row_norms(weight, lo, start), row_norms(weight, start, stop)
                norms = (f"; their norms (median {np.median(untrained):.3g}) against trained rows' "
                         f"(median {np.median(trained):.3g})") if len(trained) else ""
            except (CkptfixError, OSError, ValueError):
                pass
        yield finding(
            "CKF110", f"{v.name}: rows {start}..{v.rows - 1} never received a gradient (exp_avg_sq exactly 0), "
            f"and the tokenizer uses ids {start}..{stop - 1} in them{norms}",
            pytorch="Loads and trains without an error: those tokens start from their random initial rows, "
            "and resizing does nothing for them (the rows exist).",
            fix=ctx.repair_command() + "   (re-initialises those rows like new ones; --init applies)",
            tensors=[v.name])
        return


@check("CKF114", "warning", "added tokens whose embedding rows never received a gradient",
       "Tokens the tokenizer adds past its base vocabulary have input-embedding rows whose exp_avg_sq is exactly 0 "
       "after the optimizer stepped, while the table's other rows are not: the table trains, but no batch held "
       "those tokens (absent from the data, or split into pieces by the data pipeline's tokenizer).")
def added_tokens_never_trained(ctx: Context) -> Iterator[Finding]:
    from ckptfix.token_learning import embedding_moment, zero_rows

    tok, opt = ctx.tokenizer, ctx.ckpt.optimizer
    if tok is None or opt is None or not any((ps.step or 0) > 0 for ps in opt.state.values()):
        return
    found = embedding_moment(ctx.ckpt)
    if found is None:
        return
    name, moment, ids = found
    added = [i for i, _, _ in tok.added_tokens if i >= tok.base_size]
    try:
        zero, nonzero_elsewhere = zero_rows(moment, ids, added)
    except (CkptfixError, OSError, ValueError):
        return
    if not zero or not nonzero_elsewhere:
        return
    names = tok.id_to_token()
    shown = ", ".join(f"{names[i]!r} ({i})" if i < len(names) else f"id {i}" for i in zero[:8])
    more = f" and {len(zero) - 8} more" if len(zero) > 8 else ""
    step = max(ps.step or 0 for ps in opt.state.values())
    yield finding(
        "CKF114", f"{name}: {len(zero)} of {len(added)} added token(s) have embedding rows whose exp_avg_sq is "
        f"exactly 0 at step {step:g} while the table's other rows are not: {shown}{more}",
        pytorch="Training goes on without an error: these rows get weight decay only, so the tokens keep their "
        "initial embeddings until a batch holds them.",
        fix="add text with these tokens to the training data (or check the data pipeline tokenizes with this "
        "tokenizer); `ckptfix diff EARLIER THIS --tokenizer TOKENIZER` shows each token's rows",
        tensors=[name])
