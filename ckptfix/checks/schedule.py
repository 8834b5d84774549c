"""Scheduler position and learning rates."""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks import Context, Finding, check, finding


def optimizer_step(ctx: Context) -> float | None:
    """The optimizer's step count (the most common per-parameter `step`)."""
    opt = ctx.ckpt.optimizer
    steps = [ps.step for ps in opt.state.values() if ps.step is not None] if opt else []
    return max(set(steps), key=steps.count) if steps else None


@check("CKF301", "warning", "scheduler position differs from the optimizer step",
       "The LR scheduler's last_epoch is not the optimizer's step count.")
def scheduler_vs_step(ctx: Context) -> Iterator[Finding]:
    sched = ctx.ckpt.scheduler
    step = optimizer_step(ctx)
    last = sched.get("last_epoch") if isinstance(sched, dict) else None
    if step is None or not isinstance(last, int) or last == step:
        return
    skipped = last - step
    if ctx.ckpt.scaler and 0 < skipped <= max(20, step * 0.01):
        yield finding(
            "CKF301", f"scheduler last_epoch={last}, optimizer step={step:g}: {skipped:g} more scheduler steps, "
            "consistent with GradScaler skipping steps on inf/NaN gradients", severity="info",
            pytorch="Normal with AMP: scaler.step skips optimizer.step but the loop still steps the scheduler.")
        return
    yield finding(
        "CKF301", f"scheduler last_epoch={last} but the optimizer has taken {step:g} steps",
        pytorch="The schedule resumes at last_epoch: a per-epoch scheduler, gradient accumulation, or a scheduler "
        "restored from another run explain a difference; otherwise the LR after resume is not the one you expect.",
        fix="Check the scheduler is stepped once per optimizer step; `--policy reset` restarts the schedule.")


@check("CKF302", "error", "learning rate is 0",
       "A param group's current LR is 0 after the schedule started: the next steps change nothing.")
def zero_lr(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None:
        return
    zero = [i for i, g in enumerate(opt.groups) if g.lr == 0.0]
    if not zero:
        return
    last = (ctx.ckpt.scheduler or {}).get("last_epoch")
    at_start = last == 0 or optimizer_step(ctx) in (None, 0)
    yield finding(
        "CKF302", f"param group(s) {zero} have lr=0" + (" at the first schedule step (warmup from 0)" if at_start else
                                                        f" at scheduler step {last}"),
        severity="info" if at_start else "error",
        pytorch="optimizer.step() multiplies every update by lr: the weights do not move. A schedule that ended "
        "(cosine to 0) or a LambdaLR whose lambda returns 0 does this.",
        fix="Resume with a schedule that continues, or `ckptfix repair ... --policy reset` to restart it.")
