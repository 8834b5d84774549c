"""What a DeepSpeed `engine.save_checkpoint` folder lacks for `engine.load_checkpoint` (issue 42): the files
`deepspeed_folder.resume_files` recorded, judged by what DeepSpeed 0.19.8 does without them (measured in
tests/test_resume_deepspeed.py). A torn model- or optim-states file, a torn `latest` and a tag folder without its
model states are the reader's one-line refusals, which say what load_checkpoint does."""

from __future__ import annotations

from typing import Any, Iterator

from ckptfix.checks.codes import Context, Finding, check, finding

_NO_LATEST = ("engine.load_checkpoint(save_dir) without a tag reads the tag from `latest`; without it, it logs a "
              "warning ('Unable to find latest file ...') and returns (None, None): nothing is loaded and training "
              "starts from scratch at step 0 unless the script checks the returned path.")
_PARTITION = ("engine.load_checkpoint (load_optimizer_states=True, the default) raises FileNotFoundError on it after "
              "loading the module: every data-parallel rank reads its own partition; training does not start.")


def _files(ctx: Context) -> dict[str, Any] | None:
    files = ctx.ckpt.extras.get("deepspeed_files") if ctx.ckpt.format in ("deepspeed", "deepspeed-universal") \
        else None
    return files if isinstance(files, dict) else None


@check("CKF319", "error", "DeepSpeed checkpoint without a file load_checkpoint reads",
       "A DeepSpeed save folder without its `latest` tag file (engine.load_checkpoint(save_dir) then loads nothing "
       "and returns (None, None) with a warning: training silently starts from scratch), or a tag folder missing a "
       "ZeRO optim-states partition (one per data-parallel rank of the save; at stage 3 also a model-states file): "
       "load_checkpoint raises FileNotFoundError; or a universal folder missing a parameter's file (without "
       "fp32.pt, load_universal silently keeps that parameter's fresh initialisation; without a moment or step.pt "
       "it raises).")
def deepspeed_missing(ctx: Context) -> Iterator[Finding]:
    files = _files(ctx)
    if files is None:
        return
    folder = ctx.ckpt.path.rstrip("/") or ctx.ckpt.path
    tag = files.get("no_latest")
    if tag:
        yield finding("CKF319", f"no `latest` file in {folder} (ckptfix read {tag}, the newest global_step folder)",
                      pytorch=_NO_LATEST,
                      fix=f"Write the tag into it (`echo {tag} > {folder}/latest`), or call "
                      f"engine.load_checkpoint(save_dir, tag='{tag}').")
    if ctx.ckpt.format == "deepspeed-universal":
        for name, why in sorted(files.get("missing", {}).items()):
            yield finding("CKF319", f"{name} is missing from {folder} (the other parameters' folders hold it)",
                          pytorch=why + " (load_universal).",
                          fix="Convert the source save again with ds_to_universal, or resume from another save.")
        return
    for name, why in sorted(files.get("missing", {}).items()):
        yield finding("CKF319", f"{name} is missing from {folder}/{files.get('tag', '')} ({why})",
                      pytorch=_PARTITION,
                      fix="Resume from an earlier tag whose partitions are all there (`ckptfix latest SAVE_DIR`), or "
                      "with load_optimizer_states=False to accept a fresh optimizer knowingly.")
