"""What a Lightning `.ckpt` lacks for `Trainer.fit(ckpt_path=...)` (issue 42): the keys
`common.lightning_resume_gaps` finds absent, judged by what Lightning 2.6's `_CheckpointConnector` does without them
(measured in tests/test_resume_lightning.py). A torn file is the reader's one-line refusal, which says what torch.load
and so fit(ckpt_path=...) do with it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.formats.common import LIGHTNING_WEIGHTS_ONLY, lightning_resume_gaps

_WEIGHTS_ONLY_ERROR = ("KeyError: 'Trying to restore optimizer state but checkpoint contains only the model. This is "
                       "probably due to `ModelCheckpoint.save_weights_only` being set to `True`.'")
_RAISES = {
    "optimizer_states": f"Lightning's fit(ckpt_path=...) restores the weights, then raises {_WEIGHTS_ONLY_ERROR}; "
                        "training does not start.",
    "lr_schedulers": "Lightning's fit(ckpt_path=...) restores the weights and optimizer, then raises KeyError: 'Trying "
                     "to restore learning rate scheduler state but checkpoint contains only the model ...'; training "
                     "does not start.",
    "state_dict": "Lightning's fit(ckpt_path=...) raises KeyError: 'state_dict' (naming no file); training does not "
                  "start.",
    "pytorch-lightning_version": "Lightning's fit(ckpt_path=...) raises KeyError: 'pytorch-lightning_version' while "
                                 "migrating the checkpoint (naming no file); training does not start.",
}
_FRESH = {
    "loops": "Lightning's fit(ckpt_path=...) restores the weights, optimizer and LR schedulers without a word and "
             "starts its loops at 0: current_epoch and global_step restart, so max_steps/max_epochs are trained again "
             "from the restored optimizer and schedule (the run trains longer than asked and its logs restart).",
    "callbacks": "Lightning's fit(ckpt_path=...) resumes without a word with every callback's state fresh: "
                 "ModelCheckpoint forgets its best and top-k checkpoints, EarlyStopping its patience count.",
}


@check("CKF317", "error", "Lightning checkpoint without a key fit(ckpt_path=) reads",
       "A Lightning .ckpt lacks a key Trainer.fit(ckpt_path=...) reads: without state_dict, "
       "pytorch-lightning_version, optimizer_states or lr_schedulers it raises KeyError; without loops it silently "
       "restarts epoch and global_step at 0 (max_steps trained again). A warning without callbacks (their state "
       "restarts) and for a checkpoint saved with save_weights_only=True (fit raises KeyError on it).")
def lightning_keys(ctx: Context) -> Iterator[Finding]:
    tree = ctx.ckpt.raw
    if ctx.ckpt.format != "lightning" or not isinstance(tree, Mapping):
        return
    gaps = lightning_resume_gaps(tree)
    where = ctx.ckpt.path
    if any(v == "weights-only" for v in gaps.values()):
        yield finding("CKF317", f"{where} holds the weights only (no {', '.join(LIGHTNING_WEIGHTS_ONLY)}): saved "
                      "with save_weights_only=True", severity="warning", pytorch=_RAISES["optimizer_states"],
                      fix="Fine for load_from_checkpoint or fine-tuning; to resume training, use a checkpoint saved "
                      "without save_weights_only (ModelCheckpoint's last.ckpt, when save_last=True).")
    fix = "Resume from another checkpoint of the run that holds the key (`ckptfix latest RUN_DIR`)."
    for key, what in gaps.items():
        if what == "raises":
            yield finding("CKF317", f"{where} has no '{key}' key", pytorch=_RAISES[key], fix=fix)
        elif what == "fresh":
            yield finding("CKF317", f"{where} has no '{key}' key", pytorch=_FRESH[key], fix=fix,
                          severity="error" if key == "loops" else "warning")
