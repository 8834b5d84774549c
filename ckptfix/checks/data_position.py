"""CKF314: a Trainer checkpoint resumed with other samples per optimizer step (`inspect --batch-size/--grad-accum/
--world-size`, or the `ResumeGuardCallback` comparing the live Trainer): where the resumed run starts in the data
and in its LR schedule, computed by `ckptfix.data_position`. One text for both (`position_finding`)."""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.data_position import Position, resume_position

_TRAINER = ("transformers.Trainer counts the resume position in optimizer steps, not samples "
            "(Trainer._init_training_state): it starts at epoch global_step // U and skips (global_step % U) x "
            "gradient_accumulation_steps batches of the new per-process size (skip_first_batches), U being the new "
            "run's update steps per epoch. It logs at most `per_device_train_batch_size: N (from args) != M (from "
            "trainer_state.json)`, and nothing when only gradient_accumulation_steps or the number of processes "
            "change.")
_REBUILT = (" With max_steps unset the LR schedule is rebuilt over ceil(num_train_epochs x U) steps; scheduler.pt "
            "restores only its step, and the first resumed step runs at the lr optimizer.pt holds.")


def _span(r: tuple[int, int] | tuple[float, float] | None, fmt: str = "{}") -> str:
    if r is None:
        return "?"
    return fmt.format(r[0]) if r[0] == r[1] else f"{fmt.format(r[0])} to {fmt.format(r[1])}"


def position_finding(pos: Position, settings: str, fix_prefix: str = "Resume with ") -> Finding | None:
    """The CKF314 finding for `pos` (None when the resume keeps samples per step); `settings` names the
    resumed run's settings as the caller took them (flags, or the live Trainer)."""
    saved = pos.saved
    if pos.unknown:
        return finding("CKF314", f"cannot compute where a resume with {settings} starts in the data: not recorded: "
                       f"{pos.unknown}", severity="info", pytorch=_TRAINER)
    if not pos.changed:
        return None
    assert pos.difference is not None and pos.batches_skipped is not None
    step = saved.global_step
    lo, hi = pos.difference
    if lo > 0:
        outcome = f"{_span(pos.difference)} samples are never trained"
    elif hi < 0:
        outcome = f"{_span((-hi, -lo))} samples are trained a second time"
    elif lo == hi == 0:
        outcome = "the data position happens to be kept"
    else:
        outcome = f"between {-lo} samples trained twice and {hi} never trained"
    where = (f"{_span(pos.epochs_skipped)} epoch(s) and {_span(pos.batches_skipped)} batches of "
             f"{pos.new.batch_size} per process")
    skips = (f"the resumed Trainer skips {_span(pos.skipped)} ({where})" if not pos.ends_before_start else
             f"the resumed Trainer would skip {where}, past the end of its rebuilt run at sample {_span(pos.skipped)}, "
             "and trains nothing more")
    message = (f"samples per optimizer step change from {saved.layout.describe()} to {pos.new.describe()}: at "
               f"global_step {step} the saved run had drawn {_span(pos.seen)} samples; {skips}: {outcome}")
    if pos.dataset_length is not None and pos.dataset_length[0] != pos.dataset_length[1]:
        message += (f" (the dataset length is known only to lie in {_span(pos.dataset_length)}: give it for one "
                    "number)")
    elif pos.dataset_length is not None:
        message += f" (dataset of {pos.dataset_length[0]} samples)"
    total0, totals = pos.total_steps
    if pos.schedule_rebuilt and totals is not None:
        message += (f"; the LR schedule is rebuilt over {_span(totals)} steps instead of {total0} "
                    f"({_span(pos.steps_per_epoch[1] if pos.steps_per_epoch else None)} steps per epoch instead of "
                    f"{_span(pos.steps_per_epoch[0] if pos.steps_per_epoch else None)})")
        if totals[1] <= (step or 0):
            message += ": nothing is left to train, train() returns at once"
        elif pos.lr_original is not None and pos.lr_resumed is not None:
            first = f"the saved lr {saved.saved_lr:.4g}" if saved.saved_lr is not None else "the lr optimizer.pt holds"
            message += (f": the first resumed step runs at {first}, then step {(step or 0) + 2} at "
                        f"{_span(pos.lr_resumed, '{:.4g}')} where the original run had {pos.lr_original:.4g}")
        elif pos.lr_note:
            message += f" ({pos.lr_note})"
    if pos.notes:
        message += f" ({'; '.join(pos.notes)})"
    samples = saved.layout.samples_per_step
    fix = (f"{fix_prefix}{pos.fix} to resume at the sample and LR the saved run stood at." if pos.fix else
           f"No integer gradient_accumulation_steps or batch size gives {samples} samples per step with the new "
           "setting; choose batch x grad accumulation x processes = " + str(samples) + ".")
    fix += " A deliberate change keeps the gap or repeat above: the Trainer has no sample-based resume."
    return finding("CKF314", message, pytorch=_TRAINER + (_REBUILT if pos.schedule_rebuilt else ""), fix=fix)


@check("CKF314", "warning", "Trainer resume with other samples per optimizer step",
       "A Hugging Face Trainer checkpoint resumed with another per-device batch size, gradient accumulation or "
       "number of processes (`inspect --batch-size/--grad-accum/--world-size`, or `ResumeGuardCallback` at train "
       "begin): the Trainer skips global_step x the new samples per step, so samples are never trained or trained "
       "twice, and an epoch-driven schedule is rebuilt over the new steps per epoch. Info when the checkpoint "
       "records too little to compute it.")
def data_position(ctx: Context) -> Iterator[Finding]:
    resume = ctx.resume
    if resume is None:
        return
    pos = resume_position(ctx.ckpt, resume)
    if pos is None:
        yield finding("CKF314", f"the data position is computed for Hugging Face Trainer checkpoint-N/ folders "
                      f"only; this is a {ctx.ckpt.format} checkpoint: a resume with {resume.describe()} was not "
                      "compared", severity="info")
        return
    made = position_finding(pos, resume.describe())
    if made is not None:
        yield made
