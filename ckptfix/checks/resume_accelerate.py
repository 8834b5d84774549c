"""What an `Accelerator.save_state` folder lacks for `Accelerator.load_state` (issue 42): the files
`accelerate_folder.resume_files` recorded, judged by what accelerate 1.15 does without them
(`Accelerator.load_state`, `checkpointing.load_accelerator_state`, measured in tests/test_resume_accelerate.py).
A torn weights, optimizer, scheduler or scaler file is the reader's one-line refusal, which says the same."""

from __future__ import annotations

from typing import Any, Iterator

from ckptfix.checks.codes import Context, Finding, check, finding

_RAISES = ("Accelerator.load_state raises FileNotFoundError on {name} (load_accelerator_state opens it "
           "unconditionally for each prepared {what}); training does not start.")
_MODEL = ("Accelerator.load_state falls back to pytorch_model.bin when model.safetensors is absent and raises "
          "FileNotFoundError naming pytorch_model.bin; training does not start.")
_SCHEDULER = ("With the scheduler prepared, Accelerator.load_state raises FileNotFoundError on scheduler.bin; a "
              "scheduler never passed to accelerator.prepare is neither saved nor restored, so the LR schedule "
              "silently starts again from its first step.")
_CUSTOM_MISSING = ("Accelerator.load_state counts the custom_checkpoint_N.pkl files against the objects registered "
                   "with register_for_checkpointing and raises RuntimeError ('Number of custom checkpoints ... does "
                   "not match') when they differ, naming no file.")
_CUSTOM_TORN = ("Accelerator.load_state loads it last, with torch.load(weights_only=False), after the weights, "
                "optimizer, scheduler and RNGs, and dies naming no file (RuntimeError 'PytorchStreamReader failed "
                "reading zip archive' for a cut file, EOFError for an empty one); training does not start.")
_RNG = ("load_accelerator_state reads random_states_<process>.pkl inside a bare `except Exception` and logs \"Could "
        "not load random states\" at info level only: the python/numpy/torch RNGs keep the new run's seed (data "
        "order and dropout differ from an uninterrupted run) and Accelerator.step, the gradient-accumulation "
        "counter saved in the same file, is not restored; the weights, optimizer and schedule resume.")


def _files(ctx: Context) -> dict[str, Any] | None:
    files = ctx.ckpt.extras.get("accelerate_files") if ctx.ckpt.format == "accelerate" else None
    return files if isinstance(files, dict) else None


def _folder(ctx: Context) -> str:
    return ctx.ckpt.path.rstrip("/") or ctx.ckpt.path


def _what(name: str) -> str:
    return next((w for w in ("optimizer", "scheduler", "custom_checkpoint", "random_states") if name.startswith(w)),
                "model")


@check("CKF315", "error", "accelerate save_state folder without a file load_state reads",
       "An Accelerator.save_state folder lacks a file Accelerator.load_state reads (the weights, optimizer.bin "
       "beside scheduler.bin, scheduler.bin where the optimizer records an LR scheduler, a numbered file below "
       "the highest one), or holds a torn custom_checkpoint_N.pkl: load_state raises, naming no file or the wrong "
       "one, or (a scheduler never prepared) the schedule silently restarts. A warning for a save that holds no "
       "optimizer at all.")
def accelerate_missing(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None:
        return
    fix = "Resume from an earlier whole save_state folder, or copy the file from the same save if it still exists."
    for name, why in sorted(files.get("missing", {}).items()):
        what = _what(name)
        if what == "random_states":
            continue  # CKF316
        if name == "model.safetensors":
            pytorch = _MODEL
        elif name == "scheduler.bin":
            pytorch = _SCHEDULER
        elif what == "custom_checkpoint":
            pytorch = _CUSTOM_MISSING
        else:
            pytorch = _RAISES.format(name=name, what=what)
        yield finding("CKF315", f"{name} is missing from {_folder(ctx)} ({why})", pytorch=pytorch, fix=fix)
    for name, why in sorted(files.get("torn", {}).items()):
        if _what(name) == "custom_checkpoint":
            yield finding("CKF315", f"{name} in {_folder(ctx)} is not whole: {why}", pytorch=_CUSTOM_TORN,
                          fix=fix)
    if files.get("no_optimizer"):
        yield finding("CKF315", f"no optimizer.bin nor scheduler.bin in {_folder(ctx)}: saved with no optimizer "
                      "prepared, or both lost", severity="warning",
                      pytorch=_RAISES.format(name="optimizer.bin", what="optimizer") + " Without an optimizer "
                      "prepared, load_state restores the weights and RNGs only.",
                      fix="Fine for a weights-only resume; to keep the optimizer, resume from a save_state taken "
                      "with the optimizer prepared.")


@check("CKF316", "warning", "accelerate random_states file missing or torn",
       "An Accelerator.save_state folder without its random_states_<process>.pkl, or with one that is torn or "
       "lacks an RNG: load_state swallows the error (an info-level log line), so the RNGs are not restored and "
       "Accelerator.step (the gradient-accumulation counter) restarts at 0.")
def accelerate_rng(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None:
        return
    fix = ("Acceptable when exact reproducibility does not matter; else resume from a save_state folder whose "
           "random_states files are whole.")
    if not files.get("rng"):
        yield finding("CKF316", f"no random_states_0.pkl (nor random_states_N.pkl) in {_folder(ctx)}",
                      pytorch=_RNG, fix=fix)
    for name, why in sorted(files.get("missing", {}).items()):
        if _what(name) == "random_states":
            yield finding("CKF316", f"{name} is missing from {_folder(ctx)} ({why})", pytorch=_RNG, fix=fix)
    for name, why in sorted(files.get("torn", {}).items()):
        if _what(name) == "random_states":
            yield finding("CKF316", f"{name} in {_folder(ctx)} is not whole: {why}", pytorch=_RNG, fix=fix)
