"""What a plain `torch.save` training checkpoint (a dict of model/optimizer/scheduler/scaler state) lacks for a
training loop's resume (issue 42). There is no one loader: a loop either indexes each key (nanoGPT's train.py, the
PyTorch tutorials: KeyError when it is absent) or loads it only when present (a fresh optimizer or a restarted
schedule, without a word). Both are run in tests/test_resume_torch_dict.py. Only what the dict itself shows is judged:
the optimizer is expected beside a saved scheduler or GradScaler, the model beside an optimizer, the scheduler where
the optimizer's groups hold the initial_lr an LR scheduler adds. A bare `model.state_dict()`, or weights saved with
their epoch, get nothing. A torn file is the reader's one-line refusal, which says what torch.load does with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.formats.common import is_state_dict

_LOOP = ("No one loader reads a torch.save dict: a resume that indexes ckpt[{key!r}] (nanoGPT's train.py, the PyTorch "
         "tutorials' `{call}`) raises KeyError: {key!r}; one that loads it only when present resumes {fresh}, "
         "without a warning.")
_FIX = "Resume from a checkpoint of the run saved with it, or accept the fresh state knowingly."


@check("CKF318", "error", "torch.save training checkpoint without its optimizer, model or scheduler state",
       "A torch.save dict holding training state lacks the optimizer (beside a saved scheduler or GradScaler) or the "
       "model state_dict (beside an optimizer): a loop indexing the key raises KeyError, one loading it only when "
       "present silently resumes with a fresh optimizer (Adam's moments at zero) or fresh weights. A warning for a "
       "missing scheduler where the optimizer's groups hold initial_lr (an LR scheduler was attached): rebuilt at "
       "its default last_epoch, the schedule restarts.")
def torch_dict_gaps(ctx: Context) -> Iterator[Finding]:
    ckpt = ctx.ckpt
    if ckpt.format != "torch" or not isinstance(ckpt.raw, Mapping) or ckpt.record is not None:
        return
    if "" in (ckpt.sections.get("model"), ckpt.sections.get("optimizer")):
        return  # a bare state_dict or a lone optimizer.state_dict() (a folder's optimizer.pt): one part, not the dict
    where = ckpt.path
    if ckpt.optimizer is None and (ckpt.scheduler is not None or ckpt.scaler is not None):
        kept = " and ".join(p for p in ("model", "scheduler", "scaler") if getattr(ckpt, p))
        yield finding("CKF318", f"{where} has no optimizer state (no optimizer/optimizer_state_dict key) beside its "
                      f"{kept} state", fix=_FIX,
                      pytorch=_LOOP.format(key="optimizer", call="optimizer.load_state_dict(ckpt['optimizer'])",
                                           fresh="with a fresh optimizer: Adam's moments start from zero and its "
                                           "step from 0 (the bias correction warms up again)"))
    if ckpt.optimizer is not None and not ckpt.model and not any(is_state_dict(v) for v in ckpt.extras.values()):
        yield finding("CKF318", f"{where} has no model state_dict (no model/state_dict/model_state_dict key) beside "
                      "its optimizer state", fix=_FIX,
                      pytorch=_LOOP.format(key="model", call="model.load_state_dict(ckpt['model'])",
                                           fresh="from the model's fresh initialisation, the optimizer state then "
                                           "belonging to other weights"))
    if ckpt.scheduler is None and ckpt.optimizer is not None and any(
            "initial_lr" in g.options for g in ckpt.optimizer.groups):
        yield finding("CKF318", f"{where} has no scheduler state, but its optimizer's param groups hold initial_lr "
                      "(an LR scheduler was attached)", severity="warning", fix=_FIX,
                      pytorch=_LOOP.format(key="scheduler", call="scheduler.load_state_dict(ckpt['scheduler'])",
                                           fresh="with the schedule rebuilt at its first step (last_epoch 0: "
                                           "warm-up again from the next scheduler.step()), unless the loop builds "
                                           "it with last_epoch=<the saved step>"))
