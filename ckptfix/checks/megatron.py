"""Megatron-Core torch_dist checkpoints: what Megatron's own loader does with them (formats/megatron_folder.py)."""

from __future__ import annotations

from collections.abc import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.fit import padded_size
from ckptfix.recorded import megatron_padding


def _layout(ctx: Context):
    from ckptfix.formats.megatron_folder import MegatronLayout

    raw = ctx.ckpt.raw
    return raw if ctx.ckpt.format == "megatron" and isinstance(raw, MegatronLayout) else None


@check("CKF160", "warning", "Megatron distributed optimizer state in unnamed flat buffers",
       "The distributed optimizer's dp_reshardable layout (Megatron-LM's default) saves the moments as flat "
       "bucket buffers with no parameter names: ckptfix does not map them, so no moment check sees them and repair "
       "keeps them only by re-saving with --dist-ckpt-optim-fully-reshardable (or drops them: --policy fresh).")
def flat_optimizer_buffers(ctx: Context) -> Iterator[Finding]:
    from ckptfix.formats.megatron_folder import RESHARDABLE_FLAG

    layout = _layout(ctx)
    if layout is None or not layout.flat_buckets:
        return
    yield finding(
        "CKF160", f"optimizer state in the {layout.sharding_type or 'dp_reshardable'} layout: "
        f"{len(layout.flat_buckets)} flat bucket buffer(s) ({layout.flat_buckets[0]}, ...) hold every parameter's "
        "moments in reverse parameter order with no names; the vocab tensors' moments are not checked",
        pytorch="Megatron loads them only into a model whose buckets have the same sizes: at another vocab size "
        "dist_checkpointing.load stops with 'Global shape mismatch'.",
        fix=f"Load it in Megatron-LM and save again with {RESHARDABLE_FLAG} (per-parameter state), then repair; "
        f"or {ctx.repair_command('--policy', 'fresh')} and resume with --no-load-optim.")


@check("CKF161", "error", "Megatron would load the vocab rows silently resized",
       "Megatron marks the embedding and output layer allow_shape_mismatch: a model built for the tokenizer "
       "(its size padded to make_vocab_size_divisible_by x TP) loads a checkpoint with other row counts without an "
       "error, zero-filling the missing rows of the weights and Adam moments under the inherited step, or dropping "
       "rows.")
def megatron_silent_resize(ctx: Context) -> Iterator[Finding]:
    layout = _layout(ctx)
    if layout is None or ctx.tokenizer is None:
        return
    vocab = [v for v in ctx.vocab if v.tied_to is None and v.role in ("embedding", "head")]
    if not vocab:
        return
    rows = max(v.rows for v in vocab)
    rule = megatron_padding(ctx.ckpt.extras, rows)
    if rule is None:
        return
    built = padded_size(ctx.tokenizer.size, rule[0])
    if built == rows:
        return
    what = (f"rows {rows}..{built - 1} of the weights and exp_avg_sq start at zero under the inherited step"
            if built > rows else f"rows {built}..{rows - 1} are dropped")
    yield finding(
        "CKF161", f"a Megatron model built for {ctx.tokenizer.size} tokens has {built} vocab rows ({rule[1]}), "
        f"the checkpoint {rows}: Megatron's dist_checkpointing.load loads it without an error and {what}",
        pytorch="Megatron-LM's --load succeeds (allow_shape_mismatch on the vocab tensors); the new ids train from "
        "zero rows with Adam's bias correction already spent.",
        fix=ctx.repair_command(), tensors=[v.name for v in vocab])
