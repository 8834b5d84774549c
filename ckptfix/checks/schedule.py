"""Step counters (loop, optimizer, scheduler), and learning rates."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding


def optimizer_step(ctx: Context) -> float | None:
    """The optimizer's step count (the most common per-parameter `step`)."""
    opt = ctx.ckpt.optimizer
    steps = Counter(ps.step for ps in opt.state.values() if ps.step is not None) if opt else Counter()
    return steps.most_common(1)[0][0] if steps else None  # linear: 150k distinct steps stay fast


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


def loop_step(ctx: Context) -> tuple[float, str] | None:
    """The step the training loop saved and resumes from, and where: a Trainer's trainer_state.json
    global_step, a Lightning checkpoint's global_step. Other formats' counters are not read here (their
    meaning against the optimizer's step is not established)."""
    ckpt = ctx.ckpt
    if ckpt.format == "hf-trainer":
        state = ckpt.extras.get("trainer_state")
        value, where = (state.get("global_step") if isinstance(state, dict) else None), "trainer_state.json global_step"
    elif ckpt.format == "lightning":
        value, where = ckpt.extras.get("global_step"), "global_step"
    else:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < 1 << 53:
        return None
    return float(value), where


@check("CKF303", "warning", "the loop's step differs from the optimizer's",
       "The step the training loop saved (a Trainer's global_step, Lightning's global_step) is not the step count "
       "of the optimizer saved with it: optimizer state from another save (a copy mixing two checkpoints), or a "
       "loop stepping the optimizer differently. Information when a GradScaler explains it (skipped steps).")
def loop_vs_optimizer(ctx: Context) -> Iterator[Finding]:
    saved, step = loop_step(ctx), optimizer_step(ctx)
    parts = ctx.ckpt.optimizer.parts if ctx.ckpt.optimizer is not None else None
    if saved is None or step is None or saved[0] == step or len(parts or ()) > 1:
        return  # several optimizers (a GAN's): Lightning's global_step counts the steps of all of them
    loop, where = saved
    skipped = loop - step
    message = f"{where} is {loop:g} but the optimizer has taken {step:g} steps"
    if ctx.ckpt.scaler and 0 < skipped <= max(20, loop * 0.01):
        yield finding("CKF303", message + f": {skipped:g} steps skipped by the GradScaler (inf/NaN gradients)",
                      severity="info", pytorch="Normal with AMP: the loop counts a step whose optimizer.step the "
                      "scaler skipped.")
        return
    yield finding(
        "CKF303", message, pytorch="On resume the loop continues from its own step (data position, schedule) and "
        "Adam from its saved step (bias correction): the framework loads both as saved and says nothing. A "
        "difference with no GradScaler means the optimizer state was not saved with these weights, or the "
        "loop does not step the optimizer once per step.",
        fix="Check the optimizer file comes from the same save as the weights (`ckptfix latest RUN_DIR` finds "
        "the newest whole one); if the loop steps it differently on purpose, ignore this.")


_HF_FINISHED = ("transformers.Trainer rebuilds the schedule from the TrainingArguments of the resumed run (the "
                "LambdaLR's lambda is not saved, only its step): resumed with a larger max_steps/num_train_epochs "
                "the LR continues above 0 from step {step}; resumed with the same ones there is nothing left to "
                "train and train() returns at once.")
_PLAIN = ("In a plain loop or Lightning, scheduler.load_state_dict restores the step (and for CosineAnnealingLR/"
          "OneCycleLR their T_max/total_steps): a LambdaLR then uses the lambda your code builds, so a longer "
          "schedule there gives lr > 0; any other scheduler keeps lr=0 and optimizer.step() moves nothing.")


@check("CKF302", "error", "learning rate is 0",
       "A param group's current LR is 0 after the schedule started and the run's schedule is not known to have "
       "finished: the next steps change nothing. Information only at the first warm-up step, or at the end of a "
       "Hugging Face Trainer run whose schedule finished (the Trainer rebuilds the schedule on resume).")
def zero_lr(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None:
        return
    zero = [i for i, g in enumerate(opt.groups) if g.lr == 0.0]
    if not zero:
        return
    last = (ctx.ckpt.scheduler or {}).get("last_epoch")
    at_start = last == 0 or optimizer_step(ctx) in (None, 0)
    finished = _hf_finished_at(ctx)
    if at_start:
        yield finding("CKF302", f"param group(s) {zero} have lr=0 at the first schedule step (warmup from 0)",
                      severity="info", pytorch="The first optimizer.step() runs with lr=0 (a no-op update); the "
                      "scheduler then raises the LR. Normal for a warm-up that starts at 0 (Hugging Face, most "
                      "plain loops).")
    elif finished is not None:
        yield finding("CKF302", f"param group(s) {zero} have lr=0 at step {finished}: the Trainer run's schedule "
                      f"finished (global_step {finished} = max_steps)", severity="info",
                      pytorch=_HF_FINISHED.format(step=finished),
                      fix="Resume with a larger max_steps (or num_train_epochs) to train further.")
    else:
        yield finding(
            "CKF302", f"param group(s) {zero} have lr=0 at scheduler step {last}", pytorch=_PLAIN,
            fix="Resume with a schedule that continues, or `ckptfix repair ... --policy reset` to restart it.")


def _hf_finished_at(ctx: Context) -> int | None:
    """The step a Trainer checkpoint was saved at, when it is the end of its schedule (trainer_state.json):
    any folder whose trainer_state.json the reader kept, a full model's or a PEFT adapter's."""
    from ckptfix.formats.hf_folder import TRAINER_STATE_FORMATS

    state = ctx.ckpt.extras.get("trainer_state") if ctx.ckpt.format in TRAINER_STATE_FORMATS else None
    if not isinstance(state, dict):
        return None
    step, total = state.get("global_step"), state.get("max_steps")
    if not isinstance(step, int) or not isinstance(total, int) or isinstance(step, bool) or total <= 0:
        return None
    return step if step >= total else None
