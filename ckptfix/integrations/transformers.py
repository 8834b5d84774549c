"""`ResumeGuardCallback`: the resume guard for a Hugging Face `transformers.Trainer`.

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[ResumeGuardCallback(steps=3)])

At `on_train_begin` it compares the Trainer's `processing_class` (or `tokenizer`) with the model's
embedding rows (CKF824: more tokens than rows dies with `IndexError: index out of range in self` at
the first batch holding a new token), runs `check_training_setup` (this catches e.g. an SFTTrainer/peft run
with 0 trainable parameters before the first cryptic "does not require grad" error) and checks the
optimizer state the Trainer restored from `resume_from_checkpoint` against the parameters (CKF822:
wrong-shaped moments, which the fused AdamW would turn into NaN or a heap crash), warns when a resume
changes the samples per optimizer step (CKF314: the Trainer then skips to the wrong sample and an epoch-driven
schedule is rebuilt; `ckptfix.data_position`), then probes the first `steps` optimizer steps with a `StepProbe`. Hooks used, in the order the
Trainer loop calls them (checked against transformers 5.23; on a version without
`on_pre_optimizer_step` only the setup checks run):

    backward + grad clipping -> on_pre_optimizer_step  (gradients are there: check + snapshot)
    optimizer.step()         -> on_optimizer_step      (weights should have changed)
    model.zero_grad()        -> on_step_end

Importing this module needs transformers; `ckptfix` itself never imports it.
"""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Iterable
from typing import Any

try:
    from transformers import TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "ckptfix.integrations.transformers needs the 'transformers' package, which is not "
        "installed. Install it with `pip install transformers` (or `pip install ckptfix[test]`); "
        "without it, use ckptfix.guard.check_training_setup and StepProbe in your own loop."
    ) from exc

from ckptfix.guard import ResumeError, StepProbe, TrainingSetupError, TrainingSetupWarning, check_training_setup
from ckptfix.guard.continuity import Baseline, baseline, jump
from ckptfix.guard.new_tokens import frozen_new_rows
from ckptfix.guard.problems import Problem, raise_or_warn
from ckptfix.guard.setup import check_live_state, unwrap_optimizer
from ckptfix.guard.whole import instead

__all__ = ["ResumeGuardCallback"]


class ResumeGuardCallback(TrainerCallback):
    """Fail fast when a Trainer run is set up to learn nothing.

    `steps`: how many optimizer steps to probe (0 disables the probe, keeping the setup check).
    `unused_ok`: name substrings of trainable parameters allowed to get no gradient.
    Raises `ckptfix.guard.TrainingSetupError` out of `trainer.train()` on an error-level finding.
    """

    def __init__(self, steps: int = 3, *, unused_ok: Iterable[str] = (), rewarm_steps: int = 100,
                 checkpoint: str | os.PathLike | None = None):
        self.steps = steps
        # the folder resumed from, for the data position (CKF314); else args.resume_from_checkpoint, else the
        # output_dir's checkpoint-<global_step> (the Trainer does not tell callbacks which folder it resumed from)
        self.checkpoint = os.fspath(checkpoint) if checkpoint is not None else None
        self.data_position: Any = None  # ckptfix.data_position.Position of this resume, when one was computed
        self.resume_findings: list[Any] = []  # CKF314 `Finding`s of this resume (warned, or logged when info)
        self.unused_ok = tuple(unused_ok)
        self.rewarm_steps = rewarm_steps
        self.probe: StepProbe | None = None
        self.setup_problems: list[Problem] = []  # what the setup check found and let through (warnings, info)
        self.rewarm_done = 0  # steps re-warmed so far (see `_start_rewarm`)
        self._rewarming = False
        self._setup_checked_with_optimizer = False
        self._continuity: Baseline | None = None  # where the loss stood at the checkpoint (a resumed run)
        self.continuity_problems: list[Problem] = []  # CKF830 when the first loss after resuming jumped

    def on_train_begin(self, args, state, control, model=None, optimizer=None,
                       lr_scheduler=None, **kwargs):
        """Setup checks. Some versions/configs (delayed optimizer creation, e.g. FSDP) have no
        optimizer yet here: then only the model is checked now and the optimizer at its first
        step."""
        self.probe = None
        self._setup_checked_with_optimizer = optimizer is not None
        if model is not None:
            _check_tokenizer(model, kwargs.get("processing_class") or kwargs.get("tokenizer"))
            _check_loaded_state(model, optimizer)
            self.setup_problems = check_training_setup(model, optimizer, scheduler=lr_scheduler)
        _refuse_restarted_schedule(self.checkpoint, args, state, lr_scheduler)
        self._check_data_position(args, state, lr_scheduler, kwargs.get("train_dataloader"))
        self._start_rewarm(state, optimizer)
        step = getattr(state, "global_step", 0) or 0
        self._continuity = baseline(list(getattr(state, "log_history", None) or []), step) if step > 0 else None

    def on_log(self, args, state, control, logs=None, **kwargs):
        """The first loss logged after a resume, against where the run stood (CKF830, a warning)."""
        base, loss = self._continuity, (logs or {}).get("loss")
        if base is None or not isinstance(loss, (int, float)) or state.global_step <= base.step:
            return
        self._continuity = None
        problem = jump(base, state.global_step, float(loss))
        if problem is not None:
            self.continuity_problems.append(problem)
            raise_or_warn([problem], TrainingSetupError)

    def on_pre_optimizer_step(self, args, state, control, model=None, optimizer=None,
                              lr_scheduler=None, **kwargs):
        """Gradients of this step are ready (after clipping): check them, snapshot weights; scale the
        LR while re-warming (the scheduler recomputes it from its base LRs at its next step)."""
        if self._rewarming and optimizer is not None:
            self.rewarm_done += 1
            factor = self.rewarm_done / self.rewarm_steps
            for group in unwrap_optimizer(optimizer).param_groups:
                group["lr"] = float(group["lr"]) * factor
            self._rewarming = self.rewarm_done < self.rewarm_steps
        probe = self._probe_for(model, optimizer, lr_scheduler)
        if probe is not None:
            probe.before_step()  # runs after_backward's gradient checks first

    def on_optimizer_step(self, args, state, control, **kwargs):
        """The optimizer has stepped: the weights must have changed (unless the step was
        skipped by a GradScaler)."""
        if self.probe is not None:
            self.probe.after_step()

    def _start_rewarm(self, state: Any, optimizer: Any) -> None:
        """A resumed run (global_step > 0) whose optimizer has no state: `ckptfix repair --policy fresh`
        dropped it (or optimizer.pt was lost). Adam restarting its moments at full LR takes huge first
        steps, so the LR is re-warmed linearly over `rewarm_steps`, on top of the Trainer's schedule."""
        if optimizer is None or self.rewarm_steps <= 0 or getattr(state, "global_step", 0) <= 0:
            return
        if any(unwrap_optimizer(optimizer).state.values()):
            return
        self._rewarming, self.rewarm_done = True, 0
        warnings.warn(f"resumed at step {state.global_step} with empty optimizer state (a `ckptfix repair "
                      f"--policy fresh` output?): re-warming the LR linearly over {self.rewarm_steps} steps",
                      TrainingSetupWarning, stacklevel=3)

    def _check_data_position(self, args: Any, state: Any, lr_scheduler: Any, dataloader: Any) -> None:
        """A resumed run (global_step > 0) with other samples per optimizer step than the checkpoint's: the
        Trainer has already decided which batches to skip; CKF314 says what that does to the data position and
        the LR, before the first step (warned; logged when the checkpoint records too little)."""
        from ckptfix.checks.data_position import position_finding
        from ckptfix.data_position import Layout, position, saved_layout

        step = getattr(state, "global_step", 0) or 0
        if step <= 0:
            return
        folder = _resumed_folder(self.checkpoint, args, step)
        if folder is None:
            logging.getLogger("ckptfix").info(
                "CKF314: the checkpoint folder resumed from was not found (pass ResumeGuardCallback(checkpoint=...)): "
                "the data position was not compared")
            return
        from ckptfix.errors import CkptfixError
        from ckptfix.formats import read_checkpoint

        try:
            saved = saved_layout(read_checkpoint(folder))
        except CkptfixError as exc:
            logging.getLogger("ckptfix").info("CKF314: %s unreadable (%s): the data position was not compared",
                                              folder, exc)
            return
        if saved is None:
            return
        batch = args.train_batch_size
        if getattr(args, "auto_find_batch_size", False) and saved.layout.batch_size:
            batch = saved.layout.batch_size  # the Trainer restores the checkpoint's train_batch_size then
        new = Layout(batch, args.gradient_accumulation_steps, args.world_size)
        dataset = getattr(dataloader, "dataset", None)
        try:
            length = len(dataset) if dataset is not None else None
        except TypeError:  # an IterableDataset
            length = None
        pos = position(saved, new, length, ignore_data_skip=args.ignore_data_skip, args_max_steps=args.max_steps,
                       args_epochs=args.num_train_epochs)
        lambdas = getattr(lr_scheduler, "lr_lambdas", None)
        if pos.lr_resumed is not None and lambdas and getattr(lr_scheduler, "base_lrs", None):
            live = lr_scheduler.base_lrs[0] * lambdas[0](step + 1)  # the rebuilt schedule itself
            pos.lr_resumed = (live, live)
        self.data_position = pos
        made = position_finding(pos, f"the Trainer's settings ({new.describe()})", fix_prefix="Train with ")
        if made is None:
            return
        self.resume_findings = [made]
        text = f"{made.code} {made.severity}: {made.message}. {made.pytorch} Fix: {made.fix}"
        if made.severity == "info":
            logging.getLogger("ckptfix").info("%s", text)
        else:
            warnings.warn(text, TrainingSetupWarning, stacklevel=3)

    def _probe_for(self, model: Any, optimizer: Any, lr_scheduler: Any) -> StepProbe | None:
        """The probe, created on the first step (the optimizer surely exists by then)."""
        if model is None or optimizer is None or self.steps <= 0:
            return None
        if not self._setup_checked_with_optimizer:
            self._setup_checked_with_optimizer = True
            _check_loaded_state(model, optimizer)
            self.setup_problems = check_training_setup(model, optimizer, scheduler=lr_scheduler)
        if self.probe is None:
            # An accelerate-wrapped optimizer carries its GradScaler; StepProbe picks it up.
            self.probe = StepProbe(model, optimizer, steps=self.steps, unused_ok=self.unused_ok)
        return self.probe if self.probe.active else None


def _resumed_folder(given: str | None, args: Any, step: int) -> str | None:
    """The checkpoint folder this run resumed from at `step`: the one given, args.resume_from_checkpoint, or the
    output_dir's checkpoint-<step> (what resume_from_checkpoint=True picks), when its trainer_state.json says
    global_step `step`."""
    from ckptfix.errors import CkptfixError
    from ckptfix.untrusted import load_json_file

    resumed = getattr(args, "resume_from_checkpoint", None)
    for folder in (given, resumed if isinstance(resumed, str) else None,
                   os.path.join(args.output_dir, f"checkpoint-{step}")):
        if folder is None or not os.path.isfile(os.path.join(folder, "trainer_state.json")):
            continue
        if given is not None and folder == given:
            return folder
        try:
            state = load_json_file(os.path.join(folder, "trainer_state.json"))
        except CkptfixError:
            continue
        if isinstance(state, dict) and state.get("global_step") == step:
            return folder
    return None


def _refuse_restarted_schedule(given: str | None, args: Any, state: Any, lr_scheduler: Any) -> None:
    """A resumed run (global_step > 0) whose scheduler is at step 0: the Trainer loads optimizer.pt and
    scheduler.pt only when both exist (Trainer._load_optimizer_and_scheduler), so the checkpoint lacked one of
    them and the run would go on with empty Adam moments and a schedule back at its warm-up (inspect: CKF310).
    `ckptfix repair --policy fresh` keeps scheduler.pt, so its outputs pass. Refused naming the newest whole
    checkpoint in the output folder."""
    step = getattr(state, "global_step", 0) or 0
    if step <= 0 or lr_scheduler is None or getattr(lr_scheduler, "last_epoch", None) != 0:
        return
    checkpoint = _resumed_folder(given, args, step)  # the Trainer does not tell callbacks which folder it was
    message = (f"resumed at step {step} with the LR schedule back at step 0 and a fresh optimizer: the checkpoint "
               "lacked optimizer.pt or scheduler.pt (the Trainer loads them only when both exist; inspect: CKF310)")
    if checkpoint is None:
        warnings.warn(f"CKF829 warning: {message}, unless `ckptfix repair --policy reset` removed them on "
                      f"purpose (the folder resumed from was not found to read its record: pass "
                      f"ResumeGuardCallback(checkpoint=...))", TrainingSetupWarning, stacklevel=3)
        return
    if _reset_on_purpose(checkpoint):
        return
    raise ResumeError([Problem("CKF829", "error", f"{message}. {instead(checkpoint)}")], checkpoint)


def _reset_on_purpose(folder: str) -> bool:
    """Its ckptfix record says `repair --policy reset` dropped the optimizer and schedule (metadata only)."""
    from ckptfix.errors import CkptfixError
    from ckptfix.formats import read_checkpoint

    try:
        record = read_checkpoint(folder).record
    except CkptfixError:
        return False
    return record is not None and record.scheduler_state == "reset"


def _check_tokenizer(model: Any, processing_class: Any) -> None:
    """The Trainer's `processing_class` (or its `.tokenizer`, for a multimodal processor) against the model's
    embedding rows (CKF824, as ResumeGuard checks it): more tokens than rows is an `IndexError: index out of
    range in self` at the first batch holding a new token, or a device-side assert on GPU."""
    from ckptfix.guard.live import Live
    from ckptfix.guard.resume_plan import check_tokenizer

    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    try:
        size = len(tokenizer) if tokenizer is not None else None
    except TypeError:  # an image or audio processor: nothing to count
        size = None
    if size is not None:
        problems = check_tokenizer(Live.capture(model, tokenizer_size=size))
        frozen = frozen_new_rows(model, tokenizer)
        raise_or_warn(problems + ([frozen] if frozen is not None else []), lambda found: ResumeError(found),
                      stacklevel=4)


def _check_loaded_state(model: Any, optimizer: Any) -> None:
    """The Trainer has loaded optimizer.pt (resume_from_checkpoint) before on_train_begin: every moment
    must have its parameter's shape (CKF822) and dtype/device (CKF823). PyTorch checks neither, and the
    fused AdamW the Trainer uses by default corrupts memory on the first step instead of raising."""
    if optimizer is not None:
        problems = check_live_state(model, optimizer)
        raise_or_warn(problems, lambda found: ResumeError(found), stacklevel=4)
