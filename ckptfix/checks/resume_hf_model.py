"""What a `save_pretrained` model folder lacks for transformers' `from_pretrained` (issue 42): the files
`hf_folder.read` recorded as missing, judged by what transformers 5.24 does without them (measured in
tests/test_resume_hf_model.py). A torn config.json, index or weights file and a missing weights file or shard are the
reader's one-line refusals, which say what from_pretrained does."""

from __future__ import annotations

from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding


@check("CKF320", "warning", "model folder without config.json",
       "A save_pretrained model folder holds weights but no config.json: AutoModel*.from_pretrained raises ValueError "
       "('Unrecognized model ... Should have a `model_type` key in its config.json'), and a model class's own "
       "from_pretrained builds the class's default config, which the saved shapes do not fit.")
def model_config_missing(ctx: Context) -> Iterator[Finding]:
    files = ctx.ckpt.extras.get("model_files") if ctx.ckpt.format == "hf-model" else None
    if not isinstance(files, dict) or "config.json" not in files.get("missing", []):
        return
    folder = ctx.ckpt.path.rstrip("/") or ctx.ckpt.path
    yield finding("CKF320", f"no config.json in {folder} (save_pretrained writes it beside the weights)",
                  pytorch="transformers' AutoModelForCausalLM.from_pretrained raises ValueError: 'Unrecognized model "
                  "in ... Should have a `model_type` key in its config.json'; GPT2LMHeadModel.from_pretrained builds "
                  "GPT2Config() and raises RuntimeError on the mismatched sizes (transformers 5.24). The vocab checks "
                  "have no recorded vocab_size to compare either.",
                  fix="Copy config.json from the run or the base model the weights were trained from (the same "
                  "architecture and sizes).")
