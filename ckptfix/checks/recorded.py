"""Vocab sizes the checkpoint records (configs, model_args, hyper_parameters) against its own rows."""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.checks.vocab import rows_past_recorded
from ckptfix.recorded import disagreeing, find_recorded


@check("CKF115", "error", "recorded vocab size disagrees with the rows",
       "A vocab_size recorded in the checkpoint (config.json, nanoGPT model_args, Lightning hyper_parameters, "
       "litgpt padded_vocab_size) is not the rows of its vocab tensors: the model rebuilt from it cannot load them.")
def recorded_size(ctx: Context) -> Iterator[Finding]:
    rows = {v.token_rows for v in ctx.vocab if v.role in ("embedding", "head")}
    if not rows or rows_past_recorded(ctx) is not None:  # CKF107 says it, as a warning
        return
    wrong = disagreeing(find_recorded(ctx.ckpt.extras), rows)
    if not wrong:
        return
    shown = ", ".join(f"{r.where} = {r.value}" for r in wrong[:4])
    fix = ctx.repair_command() if ctx.tokenizer is not None else \
        f"Set it to {max(rows)} (or repair to a tokenizer: ckptfix repair updates it)."
    yield finding(
        "CKF115", f"the checkpoint records {shown}, but its vocab tensors have {'/'.join(map(str, sorted(rows)))} rows",
        pytorch="Code that builds the model from the recorded size (from_pretrained, nanoGPT init_from='resume', "
        "LightningModule.load_from_checkpoint, litgpt) then raises 'size mismatch' in load_state_dict.",
        fix=fix, tensors=[v.name for v in ctx.vocab if v.tied_to is None and v.role in ("embedding", "head")])
