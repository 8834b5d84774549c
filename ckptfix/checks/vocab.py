"""Vocab-sized tensors against the tokenizer, and against each other."""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.fit import Fit, fit_rows
from ckptfix.recorded import megatron_padding, model_token_ids, recorded_rows
from ckptfix.vocab import VocabTensor, split_table
from ckptfix.vocab import rows_past_recorded as past_recorded

_LOAD_RAISES = ("model.load_state_dict raises RuntimeError 'size mismatch for {name}' for a model built for "
                "{tokens} tokens, even with strict=False; Optimizer.load_state_dict would accept the "
                "{rows}-row moments silently and step() then fails with 'The size of tensor a ... must match'.")


def loaded_name(v: VocabTensor) -> str:
    """The name a load error quotes for a vocab tensor: its own, or for a table saved in parts (a `JoinedTensor`)
    the tensor the loader joins them into, whose name the file does not hold."""
    return f"<the table joined from {' and '.join(v.parts)}>" if v.parts else v.name


def rows_past_recorded(ctx: Context) -> tuple[VocabTensor, int] | None:
    """`vocab.rows_past_recorded`, when the tokenizer (if given) has exactly the recorded size: then the rows
    past it are a warning (CKF107), not a mismatch."""
    found = past_recorded(ctx.ckpt, ctx.vocab)
    if found is None or (ctx.tokenizer is not None and ctx.tokenizer.size != found[1]):
        return None
    return found


@check("CKF107", "warning", "rows past the recorded vocab size, no head to tell whose",
       "An embedding a few rows above the vocab_size its config records, in a model with no head (a base "
       "model): rows the model class adds past its vocab (MllamaModel's 8 image rows) or a config left at an "
       "old size. The tokenizer matches the recorded size.")
def rows_past_recorded_size(ctx: Context) -> Iterator[Finding]:
    found = rows_past_recorded(ctx)
    if found is None:
        return
    v, lm = found
    yield finding(
        "CKF107", f"{v.name} has {v.rows} rows, {v.rows - lm} past the recorded vocab size {lm}"
        f"{' (the tokenizer has ' + str(lm) + ' tokens)' if ctx.tokenizer is not None else ''}; with no head, "
        "ckptfix cannot tell the model's own rows from a config left at an old size",
        pytorch=f"from_pretrained builds the class from vocab_size={lm}: it loads if the class adds those rows "
        f"itself (MllamaModel: vocab_size + 8), and raises 'size mismatch for {loaded_name(v)}' if it does not.",
        fix=f"If the class adds them, nothing to do (to grow the vocab: repair with --own-rows {v.rows - lm}); if "
        f"not, set the recorded vocab size to {v.rows}.", tensors=[v.name])


def _mismatched(ctx: Context, smaller: bool):
    if ctx.tokenizer is None or (not smaller and rows_past_recorded(ctx) is not None) \
            or (smaller and own_token_rows(ctx) is not None):
        return []
    size = ctx.tokenizer.size
    return [v for v in ctx.vocab if (v.token_rows < size if smaller else v.token_rows > size)]


def own_token_rows(ctx: Context) -> tuple[VocabTensor, list[int]] | None:
    """(embedding, ids) when the tokenizer's ids past the LM's rows are all tokens the config names as the
    model's own (Mllama's `<|image|>`: image_token_index = vocab_size) and fall in the rows the embedding adds
    past the vocab: looked up there, never predicted by the head. Then they are not missing rows."""
    if ctx.tokenizer is None:
        return None
    size = ctx.tokenizer.size
    for e in ctx.vocab:
        if e.role == "embedding" and e.offset and e.token_rows < size <= e.rows:
            ids = list(range(e.token_rows, size))
            if set(ids) <= model_token_ids(ctx.ckpt.extras) and all(
                    v.token_rows == e.token_rows for v in ctx.vocab if v.role in ("embedding", "head")):
                return e, ids
    return None


@check("CKF108", "info", "the model's own tokens in the embedding's own rows",
       "Tokenizer ids past the LM's vocab size that the config names as the model's own (Mllama's <|image|> at "
       "id vocab_size) and that index the rows the embedding adds past the vocab: not missing rows.")
def own_tokens_in_model_rows(ctx: Context) -> Iterator[Finding]:
    found = own_token_rows(ctx)
    if found is None:
        return
    e, ids = found
    yield finding(
        "CKF108", f"id(s) {', '.join(map(str, ids))} of the tokenizer are past the LM's {e.token_rows} rows; the "
        f"config names them as the model's own tokens and {e.name} has {e.offset} row(s) of its own past the vocab, "
        "where they are looked up",
        pytorch="The embedding looks them up in its own rows; the head has no row for them and never predicts "
        "them (they are placeholders, not labels).", fix="Nothing to do.", tensors=[e.name])


@check("CKF109", "warning", "no vocab tensor found to compare with the tokenizer",
       "A tokenizer was given but no tensor of the model was recognised as its vocabulary's (a layout ckptfix does "
       "not know, e.g. an embedding saved split in two): nothing was compared, which is not a clean result.")
def no_vocab_tensor(ctx: Context) -> Iterator[Finding]:
    if ctx.tokenizer is None or ctx.vocab or not ctx.ckpt.model:
        return
    recorded = sorted(recorded_rows(ctx.ckpt.extras))
    said = f"; the checkpoint records a vocab size of {'/'.join(map(str, recorded))}" if recorded else ""
    split = split_table(ctx.ckpt)
    if split is not None:
        said += (f"; the embedding is saved in two parts its loader concatenates, {split[0].name} ({split[0].shape[0]} "
                 f"rows) and {split[1].name} ({split[1].shape[0]}), which ckptfix does not compare")
    yield finding(
        "CKF109", f"no tensor of the model's {len(ctx.ckpt.model)} was recognised as a vocab tensor: the "
        f"tokenizer's {ctx.tokenizer.size} tokens were compared with nothing{said}",
        pytorch="Unknown: ckptfix did not find which tensors the token ids index.",
        fix="Check the embedding's rows with the model's own loader; repair refuses (exit 2) a checkpoint "
        "whose vocab tensors it cannot find.", tensors=[])


@check("CKF113", "error", "the tokenizer has more tokens than the recorded vocab size",
       "No vocab tensor was recognised, and every vocab size the checkpoint records is below the tokenizer's "
       "size: a model built from the recorded size has no row for the last ids.")
def tokens_past_recorded_size(ctx: Context) -> Iterator[Finding]:
    if ctx.tokenizer is None or ctx.vocab or not ctx.ckpt.model:
        return
    recorded = recorded_rows(ctx.ckpt.extras)
    if not recorded or max(recorded) >= ctx.tokenizer.size:
        return
    size, rows = ctx.tokenizer.size, max(recorded)
    yield finding(
        "CKF113", f"the checkpoint records a vocab size of {rows} and the tokenizer has {size} tokens: ids "
        f"{rows}..{size - 1} have no row in a model built from the recorded size",
        pytorch="from_pretrained (or the framework's own builder) makes the embedding from the recorded size: an "
        "id past it raises IndexError, or reads a row the model keeps for something else.",
        fix="Grow the vocab with the model's own code (ckptfix found no vocab tensor to resize).", tensors=[])


@check("CKF101", "error", "vocab rows fewer than the tokenizer",
       "Embedding/head rows < tokenizer size: token ids past the last row cannot be looked up.")
def rows_below_tokenizer(ctx: Context) -> Iterator[Finding]:
    short = _mismatched(ctx, smaller=True)
    if not short:
        return
    size, rows = ctx.tokenizer.size, min(v.token_rows for v in short)
    lost = [f"{tid}:{tok!r}" for tid, tok, _ in ctx.tokenizer.added_tokens if tid >= rows][:5]
    extra = f"; added tokens past the end include {', '.join(lost)}" if lost else ""
    yield finding(
        "CKF101", f"{len(short)} vocab tensor(s) have {rows} rows but the tokenizer has {size} tokens "
        f"(ids {rows}..{size - 1} have no row){extra}",
        pytorch=(_MEGATRON_LOADS if ctx.ckpt.format == "megatron" else
                 _LOAD_RAISES.format(name=loaded_name(short[0]), tokens=size, rows=rows) +
                 " Used as is, the first id >= rows raises IndexError (a device-side assert on CUDA)."),
        fix=ctx.repair_command(), tensors=[v.name for v in short])


_MEGATRON_LOADS = ("Megatron's own dist_checkpointing.load does not raise: it loads the rows into a model built "
                   "for the tokenizer and leaves the rest at zero (CKF161).")


def _fits(ctx: Context, verdicts: tuple[str, ...]) -> list[tuple[VocabTensor, Fit]]:
    """Vocab tensors with more rows than the tokenizer whose fit is one of `verdicts`."""
    recorded = recorded_rows(ctx.ckpt.extras)
    fits = [(v, fit_rows(v.token_rows, ctx.tokenizer.size, v.token_rows if v.token_rows in recorded else None,
                         (megatron_padding(ctx.ckpt.extras, v.token_rows) or (None,))[0]))
            for v in _mismatched(ctx, smaller=False)]
    return [(v, f) for v, f in fits if f.verdict in verdicts]


@check("CKF102", "error", "vocab rows more than the tokenizer",
       "Embedding/head rows > tokenizer size, neither padding to the next multiple of 8..256, nor a round "
       "multiple of 64 a little above it, nor the config's vocab_size: the model code and checkpoint disagree.")
def rows_above_tokenizer(ctx: Context) -> Iterator[Finding]:
    extra = [v for v, _ in _fits(ctx, ("too-many",))]
    if not extra:
        return
    size, rows = ctx.tokenizer.size, max(v.token_rows for v in extra)
    yield finding(
        "CKF102", f"{len(extra)} vocab tensor(s) have {rows} rows but the tokenizer has {size} tokens "
        f"({rows - size} extra row(s), not padding to a multiple of 8..256)",
        pytorch=_LOAD_RAISES.format(name=loaded_name(extra[0]), tokens=size, rows=rows),
        fix=ctx.repair_command(), tensors=[v.name for v in extra])


@check("CKF103", "info", "vocab rows padded above the tokenizer",
       "Rows rounded up to the next multiple of 8..256 above the tokenizer size: normal, not an error.")
def rows_padded(ctx: Context) -> Iterator[Finding]:
    padded = _fits(ctx, ("padded",))
    if not padded:
        return
    _, fit = padded[0]
    yield finding(
        "CKF103", f"{fit.rows} rows for {fit.tokens} tokens: padded to a multiple of {fit.multiple} "
        f"({fit.unused} unused row(s))",
        pytorch="Loads into a model built with the padded size (e.g. pad_to_multiple_of); the extra rows are never indexed.",
        fix="Nothing to do; build the model with the padded size.", tensors=[v.name for v, _ in padded])


@check("CKF105", "info", "vocab rows reserved above the tokenizer",
       "Rows a round multiple of 64+ a little (<= 1/16) above the tokenizer (Qwen2/3's 151936, DeepSeek-V3's "
       "129280): the model's own size, not an error.")
def rows_reserved(ctx: Context) -> Iterator[Finding]:
    reserved = [(v, f) for v, f in _fits(ctx, ("reserved",)) if not f.by_config]
    if not reserved:
        return
    _, fit = reserved[0]
    yield finding(
        "CKF105", f"{fit.rows} rows for {fit.tokens} tokens: {fit.unused} row(s) reserved above the tokenizer "
        f"(a multiple of {fit.multiple}); no token id reaches them",
        pytorch=f"Loads into the model built with vocab_size={fit.rows}; ids stay below {fit.tokens}, so the "
        "reserved rows are never indexed (they may be trained in later by added tokens without a resize).",
        fix="Nothing to do.", tensors=[v.name for v, _ in reserved])


@check("CKF106", "warning", "vocab rows reserved at an odd count",
       "Rows a little above the tokenizer, recorded as the config's vocab_size but not a round multiple (1003 for "
       "1000 tokens, GPT-J's 50400): right for a model built from its config, a size mismatch for a script that "
       "calls resize_token_embeddings(len(tokenizer)) before resuming.")
def rows_reserved_odd(ctx: Context) -> Iterator[Finding]:
    odd = [(v, f) for v, f in _fits(ctx, ("reserved",)) if f.by_config]
    if not odd:
        return
    vocab, fit = odd[0]
    yield finding(
        "CKF106", f"{fit.rows} rows for {fit.tokens} tokens: the checkpoint records vocab_size {fit.rows}, "
        f"{fit.unused} row(s) above the tokenizer and not a round multiple (a reserve is usually a multiple of 64+)",
        pytorch=f"A model built from the checkpoint's config (from_pretrained, or vocab_size={fit.rows}) loads it "
        f"and ids stay below {fit.tokens}: fine. A script that calls model.resize_token_embeddings(len(tokenizer)) "
        f"before trainer.train(resume_from_checkpoint=...) builds {fit.tokens} rows, and loading raises "
        f"'size mismatch for {loaded_name(vocab)}' ({fit.rows} rows in the checkpoint).",
        fix="Build the model from the checkpoint's config and do not resize it to len(tokenizer); or, for one row "
        f"per token, {ctx.repair_command('--pad-to', '1')} and resume from that.",
        tensors=[v.name for v, _ in odd])


@check("CKF104", "error", "embedding and head row counts differ",
       "The input embedding and the LM head have different numbers of rows.")
def embedding_head_disagree(ctx: Context) -> Iterator[Finding]:
    embeds = [v for v in ctx.vocab if v.role == "embedding"]
    heads = [v for v in ctx.vocab if v.role in ("head", "head-bias") and v.tied_to is None]
    for head in heads:
        for embed in embeds:
            if head.token_rows != embed.token_rows and embed.rows > 0 and abs(head.rows - embed.rows) < embed.rows // 2:
                yield finding(
                    "CKF104", f"{embed.name} has {embed.rows} rows but {head.name} has {head.rows}",
                    pytorch="A model builds both from one vocab size, so load_state_dict raises a size mismatch "
                    "for one of them.", fix=ctx.repair_command(), tensors=[embed.name, head.name])
                return
