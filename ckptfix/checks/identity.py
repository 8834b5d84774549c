"""Token identity: do the checkpoint's rows still belong to the tokens the new tokenizer gives those ids?"""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.identity import data_evidence, id_moves, record_fingerprint_mismatch
from ckptfix.vocab import vocab_rows

_WRONG_ROWS = ("load_state_dict succeeds whenever the row counts fit; every moved token then reads another "
               "token's trained row (and Adam moments), so the resumed loss starts near or above a random init's.")


@check("CKF120", "error", "tokens changed id since the checkpoint was trained",
       "The tokenizer the rows were trained with is known and some shared tokens have other ids in the new one: "
       "rows kept by id would belong to other tokens. repair moves them by token string.")
def tokens_moved(ctx: Context) -> Iterator[Finding]:
    rows = vocab_rows(ctx.vocab)
    if ctx.tokenizer is None or ctx.old_tokenizer is None or rows is None:
        return
    moves = id_moves(ctx.old_tokenizer.info, ctx.tokenizer, rows)
    if not moves.moved:
        return
    yield finding(
        "CKF120", f"{len(moves.moved)} of {moves.shared} tokens shared with the old tokenizer "
        f"{ctx.old_tokenizer.describe()} have another id in {ctx.tokenizer.path}, e.g. {moves.examples()}",
        pytorch=_WRONG_ROWS, fix=ctx.repair_command() + "  (rows and their moments move by token string)",
        tensors=[v.name for v in ctx.vocab if v.tied_to is None])


@check("CKF122", "error", "the new tokenizer was retrained: ids inside the checkpoint's rows moved",
       "Without the old tokenizer, the new one alone shows that ids below the checkpoint's row count hold other "
       "tokens (sentencepiece user-defined pieces inside the old id range; config special ids that are now "
       "ordinary tokens).")
def retrained_tokenizer(ctx: Context) -> Iterator[Finding]:
    rows = vocab_rows(ctx.vocab)
    if ctx.tokenizer is None or ctx.old_tokenizer is not None or rows is None:
        return
    evidence = _evidence(ctx, rows)
    if not evidence:
        return
    yield finding(
        "CKF122", evidence[0].message, pytorch=_WRONG_ROWS,
        fix=ctx.repair_command("--from-tokenizer", "OLD_TOKENIZER") + "  (OLD_TOKENIZER: the one the checkpoint "
        "was trained with; repair refuses to keep rows by id here unless --keep-ids)",
        tensors=[v.name for v in ctx.vocab if v.tied_to is None])


@check("CKF123", "warning", "--from-tokenizer is not the tokenizer the record names",
       "The checkpoint's ckptfix record fingerprints the tokenizer its rows belong to; the one given differs.")
def from_tokenizer_disagrees(ctx: Context) -> Iterator[Finding]:
    old = ctx.old_tokenizer
    message = record_fingerprint_mismatch(ctx.ckpt, old.info) if old is not None and old.origin == "given" else None
    if message:
        yield finding("CKF123", message,
                      pytorch="Rows would be moved from the wrong tokenizer's ids, with no error from PyTorch.",
                      fix="Pass the tokenizer the record names, or leave --from-tokenizer out to use it.")


def _evidence(ctx: Context, rows: int) -> list:
    return data_evidence(ctx.tokenizer, rows, ctx.ckpt.extras.get("config"))
