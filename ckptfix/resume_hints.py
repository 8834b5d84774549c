"""Where a repair goes and how training resumes from it, per format: the last lines of `ckptfix repair`
and the output path inspect's `fix:` suggests.

- `suggested_output(path)`: the `-o` inspect suggests. A Trainer `checkpoint-N/` (or accelerate's
  `checkpoint_N/`) gets a name *beside the run's output folder*, never inside it: the Trainer's
  rotation (`save_total_limit`) and `resume_from_checkpoint=True` glob `checkpoint-*` there and read
  `checkpoint-30-fixed` as step 30; accelerate's `total_limit` likewise.
- `repair_target(path)`: the checkpoint a repair must be given. A weights file inside a checkpoint folder
  (`checkpoint-30/model.safetensors`) is half of it: repairing it alone leaves `optimizer.pt`,
  `config.json` and the tokenizer files stale, so the folder is named instead.
- `resume_lines(format, out, rows, tokens, rewarm)`: what the training code must do to resume from OUT.
  The model must be *built with the new row count* before the state is loaded: the same
  model-building code as before the repair gives `size mismatch for ...wte.weight`.
"""

from __future__ import annotations

import os
import re

# folder names a framework's own rotation or auto-resume counts as a step: HF Trainer, accelerate
_STEP_FOLDER = re.compile(r"checkpoint[-_]\d+")


def suggested_output(path: str) -> str:
    """The output path to suggest for a repair of `path` (a file: beside it; a step folder: beside the run)."""
    src = path.rstrip("/") or path
    if os.path.isdir(src):
        name = os.path.basename(os.path.abspath(src))
        if _STEP_FOLDER.fullmatch(name):
            run = os.path.dirname(os.path.abspath(src))
            beside_run = os.path.join(os.path.dirname(run), f"{os.path.basename(run)}-{name}-fixed")
            return os.path.relpath(beside_run) if not os.path.isabs(src) else beside_run
        return f"{src}-fixed"
    root, ext = os.path.splitext(src)
    return f"{root}.fixed{ext}"


# the Trainer's own patterns (transformers.trainer_utils): get_last_checkpoint, which resume_from_checkpoint=True
# uses, takes the folder with the highest N among `^checkpoint-(\d+)$`; its rotation (save_total_limit) globs
# `checkpoint-*` folders and reads N from the last `checkpoint-(\d+)` in the name
_TRAINER_LAST = re.compile(r"checkpoint-(\d+)")
_TRAINER_ROTATION = re.compile(r".*checkpoint-(\d+)")


def inside_trainer_output(out: str) -> str | None:
    """A one-line note when the folder `out` lands among a Hugging Face Trainer's `checkpoint-N` folders with a
    name the Trainer reads as a step (README: write it beside the run's `output_dir`, not inside); else None."""
    if "://" in out:
        return None
    path = os.path.abspath(out.rstrip("/") or out)
    run, name = os.path.split(path)
    try:
        steps = [e for e in os.listdir(run) if e != name and _TRAINER_LAST.fullmatch(e)
                 and os.path.isdir(os.path.join(run, e))]
    except OSError:
        return None
    counted = _TRAINER_ROTATION.match(name) if name.startswith("checkpoint-") else None
    if not steps or counted is None:
        return None
    step = counted.group(1)
    picked = (f"resume_from_checkpoint=True takes it when {step} is the highest step there, and its " if
              _TRAINER_LAST.fullmatch(name) else "")
    beside = os.path.join(os.path.dirname(run), f"{os.path.basename(run)}-{name}")
    shown = os.path.relpath(beside) if not os.path.isabs(out) else beside
    return (f"{out} is inside the Trainer output_dir {os.path.dirname(out.rstrip('/')) or '.'} (beside "
            f"{sorted(steps)[0]}): the Trainer's {picked}rotation (save_total_limit) counts it as step {step} and "
            f"may delete it; write it beside the output_dir instead (-o {shown})")


def repair_target(path: str) -> tuple[str, str | None]:
    """(what to repair, the folder format when `path` is a file inside a checkpoint folder, else None)."""
    from ckptfix.errors import CkptfixError
    from ckptfix.formats import detect

    if os.path.isdir(path):
        return path, None
    folder = os.path.dirname(path) or "."
    try:
        kind = detect(folder)
    except (CkptfixError, OSError):
        return path, None
    return folder, kind


# the loaders that take an object-storage URL themselves: Lightning's ckpt_path (fsspec), DCP (FsspecReader)
_URL_LOADERS = ("lightning", "dcp")


def resume_lines(fmt: str, out: str, rows: int, tokens: int, rewarm: bool = False) -> list[str]:
    """How to resume from the repaired `out` (`rows` vocab rows, a `tokens`-token tokenizer), one line each.
    An `out` in object storage whose format's loader reads local paths only is named as its local copy."""
    if "://" in out and fmt not in _URL_LOADERS:
        local = os.path.basename(out.rstrip("/")) or "checkpoint"
        return [f"copy {out} to a local {local} first (this format's loader reads local paths only; e.g. "
                f"fsspec's get(..., recursive=True) or the store's CLI), then:",
                *resume_lines(fmt, local, rows, tokens, rewarm)]
    size = "len(tokenizer)" if rows == tokens else str(rows)
    build = f"build the model with {rows} vocab rows " + (
        "(len(tokenizer))" if rows == tokens else f"({tokens} tokens + {rows - tokens} padding)")
    lines = {
        "hf-trainer": [f"build the model from {out} (AutoModelForCausalLM.from_pretrained: its config.json says "
                       f"vocab_size {rows}), or call model.resize_token_embeddings({size}) before creating the Trainer; "
                       f"then trainer.train(resume_from_checkpoint={out!r}) with the new tokenizer as "
                       "processing_class (the model code of the old run gives 'size mismatch')"],
        "hf-model": [f"AutoModel*.from_pretrained({out!r}) (config.json says vocab_size {rows}) with the new "
                     "tokenizer from the same folder"],
        "peft-adapter": [f"resize the base model first (base.resize_token_embeddings({size})), then "
                         f"PeftModel.from_pretrained(base, {out!r})"],
        "lightning": [f"{build} (its hyperparameters' vocab size), then trainer.fit(model, ckpt_path={out!r})"],
        "composer": [f"{build}, then Trainer(..., load_path={out!r})"],
        "accelerate": [f"{build}, accelerator.prepare(model, optimizer, ...), then accelerator.load_state({out!r})"],
        "dcp": [f"{build}; then dcp.load(state_dict, checkpoint_id={out!r}) and set_state_dict (torchtitan: point "
                "--checkpoint.folder at it), at any world size"],
        "deepspeed-universal": [f"{build}; with \"checkpoint\": {{\"load_universal\": true}} in the DeepSpeed config, "
                                f"engine.load_checkpoint({os.path.dirname(out) or '.'!r}, "
                                f"tag={os.path.basename(out)!r})"],
        "litgpt": [f"litgpt builds the model from {out}/model_config.yaml (padded_vocab_size {rows}): point the "
                   "run's checkpoint_dir at it"],
        "safetensors": [f"{build}, then model.load_state_dict(safetensors.torch.load_file({out!r}))"],
    }.get(fmt, [f"{build}, then ckpt = torch.load({out!r}, weights_only=True) and load_state_dict each entry "
                f"(model, optimizer, scheduler, scaler), or ResumeGuard(model, optimizer, ...).load({out!r})"])
    if rewarm:
        lines.append("the optimizer state was dropped: re-warm the LR (ResumeGuard and the HF callback do it)")
    return lines
