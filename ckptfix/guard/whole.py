"""The guard refuses a checkpoint that is not one whole save (issue 42): a run folder given instead of one
checkpoint, or a Trainer checkpoint whose save did not finish (inspect's CKF311: trainer_state.json, written
last, missing or torn). Either way the refusal names the newest whole checkpoint of the run, as `ckptfix latest`
finds it, before anything is loaded. (A missing optimizer.pt or scheduler.pt, CKF310, is the Trainer's
both-or-neither rule; ResumeGuard loads what is there and says what is not, CKF827.)"""

from __future__ import annotations

import os
from typing import Any

from ckptfix.guard.problems import Problem
from ckptfix.latest import latest_checkpoint, run_folder_message

# inspect's findings that mean "this save did not finish"
NOT_WHOLE = ("CKF311",)


def run_folder_problem(path: str) -> Problem | None:
    """CKF829 for a run's output folder handed to the guard as if it were one checkpoint."""
    message = run_folder_message(path)
    return None if message is None else Problem("CKF829", "error", message)


def not_whole_problems(ckpt: Any, findings: list[Any]) -> list[Problem]:
    """CKF829 for a save that did not finish, naming the run's newest whole checkpoint."""
    found = [f for f in findings if f.code in NOT_WHOLE and f.severity == "error"]
    if not found:
        return []
    return [Problem("CKF829", "error", f"{f.message} ({f.code}): {f.pytorch} {instead(ckpt.path)}")
            for f in found]


def instead(path: str) -> str:
    """The sentence naming the newest whole checkpoint beside `path` (in its parent, the run folder)."""
    run_dir = os.path.dirname(os.path.abspath(path.rstrip("/")))
    try:
        newest = latest_checkpoint(run_dir).path
    except Exception:  # noqa: BLE001 - an unreadable parent folder only loses the suggestion
        newest = None
    if newest is None or os.path.abspath(newest) == os.path.abspath(path.rstrip("/")):
        return "No whole checkpoint beside it to resume from instead."
    return f"Resume from {newest} instead (the newest whole checkpoint in {run_dir})."
