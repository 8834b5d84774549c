"""AMP GradScaler state, and fp16 parameters under a scaler."""

from __future__ import annotations

import math
from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding

FP16_SMALLEST_SUBNORMAL = 2.0 ** -24


def scaler_scale(ctx: Context) -> float | None:
    scale = (ctx.ckpt.scaler or {}).get("scale")
    if hasattr(scale, "read"):  # a tensor scale (some wrappers save it as one)
        from ckptfix.checkpoint import read_scalar

        scale = read_scalar(scale)  # type: ignore[arg-type]  # a TensorInfo: it has .read
    return float(scale) if isinstance(scale, (int, float)) and not isinstance(scale, bool) else None


@check("CKF401", "error", "GradScaler scale collapsed or not finite",
       "The loss scale is inf/NaN or has backed off so far that fp16 gradients underflow.")
def scale_collapsed(ctx: Context) -> Iterator[Finding]:
    scale = scaler_scale(ctx)
    if scale is None:
        return
    fix = ctx.repair_command() + "  (repair resets a collapsed scale to 65536)"
    if not math.isfinite(scale):
        yield finding("CKF401", f"GradScaler scale is {scale}",
                      pytorch="Every scaled gradient is inf/NaN, so scaler.step skips every optimizer step; "
                      "backoff cannot recover from inf/NaN.", fix=fix)
    elif scale < FP16_SMALLEST_SUBNORMAL:
        yield finding("CKF401", f"GradScaler scale is {scale:g} (below fp16's smallest subnormal 2^-24)",
                      pytorch="Scaled fp16 gradients underflow to zero; the run stopped learning when the scale "
                      "collapsed, usually from a NaN loss repeated every step.", fix=fix)
    elif scale < 1.0:
        yield finding("CKF401", f"GradScaler scale is {scale:g} (< 1): it has backed off many times",
                      severity="warning", pytorch="Each inf/NaN step halves the scale; this many means most recent "
                      "steps were skipped. Look for a NaN source before resuming.", fix=fix)


@check("CKF402", "error", "fp16 parameters saved with GradScaler state",
       "Model weights (or moments) are float16 and a GradScaler was in use: the scaler cannot unscale fp16 grads.")
def fp16_with_scaler(ctx: Context) -> Iterator[Finding]:
    if not ctx.ckpt.scaler or scaler_scale(ctx) is None:
        return
    fp16 = [n for n in ctx.ckpt.parameters() if ctx.ckpt.model[n].dtype == "float16"]
    if not fp16:
        return
    yield finding(
        "CKF402", f"{len(fp16)} float16 parameter tensor(s) alongside GradScaler state (e.g. {fp16[0]})",
        pytorch="GradScaler.unscale_ raises ValueError 'Attempting to unscale FP16 gradients.' for fp16 grads. "
        "Disabling the scaler instead trains in pure fp16, where small updates round to zero.",
        fix="Keep fp32 master weights and use torch.autocast(dtype=torch.float16) with the scaler, or bf16 "
        "autocast without a scaler.", tensors=fp16[:20])
