"""What a Hugging Face Trainer `checkpoint-N/` folder lacks for `trainer.train(resume_from_checkpoint=...)`
(issue 42): the files `hf_folder.trainer_files` recorded, judged by what transformers' Trainer does without them
(`Trainer._load_optimizer_and_scheduler`, `_load_rng_state`, `train`)."""

from __future__ import annotations

from typing import Any, Iterator

from ckptfix.checks.codes import Context, Finding, check, finding

_PAIR = ("transformers.Trainer resumes with a fresh optimizer and a restarted schedule: both are loaded only when "
         "both files exist (Trainer._load_optimizer_and_scheduler checks optimizer.pt and scheduler.pt together), "
         "with no warning; the weights and global_step are restored, so Adam's moments start from zero and the "
         "LR schedule starts again at its warm-up.")


def _files(ctx: Context) -> dict[str, Any] | None:
    # a PEFT model's Trainer checkpoint-N/ is read as peft-adapter: its reader records trainer_files all the same
    files = ctx.ckpt.extras.get("trainer_files") if ctx.ckpt.format in ("hf-trainer", "peft-adapter") else None
    return files if isinstance(files, dict) else None


def _folder(ctx: Context) -> str:
    return ctx.ckpt.path.rstrip("/") or ctx.ckpt.path


@check("CKF310", "error", "Trainer checkpoint without both optimizer.pt and scheduler.pt",
       "A Hugging Face Trainer checkpoint-N/ folder lacks optimizer.pt or scheduler.pt (or both, beside "
       "trainer_state.json): the Trainer loads them only when both exist, so resume_from_checkpoint silently "
       "starts a fresh optimizer and restarts the LR schedule. A warning when training_args.bin records "
       "save_only_model=True (saved so on purpose).")
def optimizer_scheduler_pair(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None or files.get("optimizer_elsewhere") or _reset_by_repair(ctx):
        return
    missing = [n for n in ("optimizer.pt", "scheduler.pt") if n in files.get("missing", [])]
    if not missing:
        return
    if len(missing) == 1:
        other = "scheduler.pt" if missing[0] == "optimizer.pt" else "optimizer.pt"
        message = f"{missing[0]} is missing from {_folder(ctx)} ({other} is there)"
    elif "trainer_state.json" not in files.get("missing", []):
        message = f"optimizer.pt and scheduler.pt are missing from {_folder(ctx)} (trainer_state.json is there)"
    else:
        return  # neither the pair nor the state: not recognisably a Trainer checkpoint
    if files.get("save_only_model") and len(missing) == 2:
        yield finding("CKF310", message + ": training_args.bin records save_only_model=True", severity="warning",
                      pytorch=_PAIR, fix="Resume from a checkpoint saved without save_only_model to keep the "
                      "optimizer and schedule, or accept a fresh optimizer and a restarted schedule.")
        return
    yield finding("CKF310", message, pytorch=_PAIR,
                  fix=f"Resume from an earlier checkpoint-N that has both files (`ckptfix latest {_run(ctx)}`), "
                  "or copy the missing file from the same save if it still exists elsewhere.")


def _reset_by_repair(ctx: Context) -> bool:
    """`ckptfix repair --policy reset` removes both files on purpose (its record says so): the fresh optimizer
    and restarted schedule are what was asked for."""
    record = ctx.ckpt.record
    return record is not None and record.scheduler_state == "reset"


def _run(ctx: Context) -> str:
    import os
    import shlex

    return shlex.quote(os.path.dirname(os.path.abspath(_folder(ctx))))


@check("CKF311", "error", "Trainer checkpoint without a whole trainer_state.json",
       "A Trainer checkpoint-N/ folder with optimizer/scheduler state but no trainer_state.json, or one that is "
       "not whole JSON: the Trainer writes it last, so the save did not finish. "
       "trainer.train(resume_from_checkpoint=...) stops on it.")
def trainer_state(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None:
        return
    torn = files.get("torn", {}).get("trainer_state.json")
    has_state = not {"optimizer.pt", "scheduler.pt"} <= set(files.get("missing", [])) or files.get(
        "optimizer_elsewhere")
    if torn:
        message = f"trainer_state.json in {_folder(ctx)} is not whole: {torn}"
        pytorch = ("The Trainer writes trainer_state.json last (Trainer._save_checkpoint): the save was cut short. "
                   "resume_from_checkpoint stops in TrainerState.load_from_json with a json.JSONDecodeError "
                   "that names no file.")
    elif "trainer_state.json" in files.get("missing", []) and has_state:
        message = f"trainer_state.json is missing from {_folder(ctx)}"
        pytorch = ("The Trainer writes trainer_state.json last (Trainer._save_checkpoint): the save did not "
                   "finish. resume_from_checkpoint stops with FileNotFoundError on trainer_state.json, and "
                   "resume_from_checkpoint=True (get_last_checkpoint) still picks this folder.")
    else:
        return
    yield finding("CKF311", message, pytorch=pytorch,
                  fix=f"Resume from the newest whole checkpoint instead: `ckptfix latest {_run(ctx)}`.")


@check("CKF312", "warning", "Trainer checkpoint without rng_state.pth",
       "A Trainer checkpoint-N/ folder with optimizer/scheduler state but no rng_state*.pth: the Trainer resumes "
       "without restoring the RNGs (a logger.info line only), so the data order and dropout after the resume "
       "are not those of an uninterrupted run.")
def rng_missing(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None or files.get("rng") or {"optimizer.pt", "scheduler.pt"} & set(files.get("missing", [])):
        return  # with optimizer.pt or scheduler.pt missing CKF310 says more; save_only_model saves no RNG either
    yield finding("CKF312", f"no rng_state.pth (nor rng_state_N.pth) in {_folder(ctx)}",
                  pytorch="Trainer._load_rng_state logs \"Didn't find an RNG file ...\" at info level (not shown "
                  "by default) and returns: the python/numpy/torch RNGs keep the new run's seed, so the shuffled "
                  "data order and dropout masks differ from an uninterrupted run; the weights, optimizer and "
                  "schedule resume.",
                  fix="Acceptable when exact reproducibility does not matter; else resume from a checkpoint that "
                  "has its rng_state file.")


@check("CKF313", "error", "Trainer rng_state file torn",
       "An rng_state*.pth of a Trainer checkpoint-N/ folder is empty or not a whole torch.save file (a save cut "
       "short): resume_from_checkpoint dies in torch.load with an error that names no file.")
def rng_torn(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None:
        return
    for name, why in sorted(files.get("torn", {}).items()):
        if name == "trainer_state.json":
            continue
        yield finding("CKF313", f"{name} in {_folder(ctx)} is not whole: {why}",
                      pytorch="Trainer._load_rng_state calls torch.load on it after the weights, optimizer and "
                      "scheduler are loaded and dies naming no file: `EOFError` with no message for an empty file, "
                      "`OSError: [Errno 22] Invalid argument` for a truncated one (transformers 5.24, torch 2.13); "
                      "training does not start.",
                      fix=f"Delete {name} to resume without the RNG state (CKF312), or resume from an earlier "
                      "whole checkpoint.")
