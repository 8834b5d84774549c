"""Write a repaired litgpt folder: `lit_model.pth` streamed with the plan's edits, `model_config.yaml` with
its new `padded_vocab_size`/`vocab_size` (only those lines changed), the new tokenizer's files, every other
file copied; the record goes to the folder's `ckptfix.json` (litgpt's `fabric.load` ignores extra keys,
but the pickle stays what litgpt wrote)."""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any, Callable

import numpy as np

from ckptfix.formats.litgpt_folder import CONFIG, WEIGHTS, rewrite_config
from ckptfix.io import atomic_folder, backup_path, copy_input_entry, create_file
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.write_hf import TOKENIZER_FILES, _copy_tokenizer, _rewrite_training_file, rewrite_torch_file
from ckptfix.surgery.write_torch import edited_tree


def write_litgpt_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                        in_place: bool, progress: Any = None) -> str | None:
    source = plan.ckpt.path
    in_yaml = {path[1]: value for path, value in plan.recorded.items() if path[0] == CONFIG}
    in_pickle = dataclasses.replace(plan, recorded={p: v for p, v in plan.recorded.items() if p[0] != CONFIG})
    backup = backup_path(out) if in_place and os.path.exists(out) else None
    with atomic_folder(out, backup=in_place) as tmp:
        for name in sorted(os.listdir(source)):
            src, dst = os.path.join(source, name), os.path.join(tmp, name)
            if name in TOKENIZER_FILES or name == "ckptfix.json":
                continue
            if name == WEIGHTS:
                with create_file(dst, replace=True) as f:
                    rewrite_torch_file(src, f, plan, rng, lambda tree, table: edited_tree(in_pickle, tree, table),
                                       progress)
            elif name == CONFIG:
                rewrite_config(src, dst, in_yaml)
            elif not (name == "config.json" and _rewrite_training_file(plan, name, src, dst, rng)):
                copy_input_entry(src, dst, source)
            if os.path.isfile(dst) and not os.path.islink(dst):
                shutil.copymode(src, dst)
        _copy_tokenizer(plan.tokenizer, tmp)
        with create_file(os.path.join(tmp, "ckptfix.json"), replace=True) as f:
            f.write(record_json(record_fn()))
    return backup
