"""Write a repaired `accelerate.Accelerator.save_state` folder: a new folder with the same files.

The weights file of model 0 (`model.safetensors` or `pytorch_model.bin`) is rewritten (streamed) when
a tensor in it is edited; `optimizer.bin` (a `torch.save` zip of optimizer 0) when moments are remapped
or state is dropped; `scaler.pt` when the scale is reset. Under policy reset `scheduler.bin` is left
out. Every other file (further models/optimizers/schedulers, `random_states_*.pkl`, sampler and custom
state, sub-folders) is copied as bytes, never unpickled. The record goes to `ckptfix.json`.

Measured on accelerate 1.15: `load_state` loads one `scheduler{,_i}.bin` per *prepared* scheduler and
fails (FileNotFoundError) when it is missing, while files nobody registered are ignored; so after a
reset repair the scheduler must be prepared after `load_state` (a fresh schedule then starts from the
groups' `initial_lr`, as in a new run). The record's notes say so.
"""

from __future__ import annotations

import os
import shutil
from typing import Any, Callable

import numpy as np

from ckptfix.io import atomic_folder, backup_path, copy_input_entry, create_file
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.torch_tree import edit_model, edit_optimizer, edit_scaler
from ckptfix.surgery.write_hf import rewrite_torch_file, write_safetensors


def plan_notes(plan: RepairPlan) -> list[str]:
    """What this writer does beyond the common plan (`make_plan` adds it, so --dry-run shows it)."""
    files = plan.ckpt.files
    if plan.reset_scheduler and "scheduler" in files:
        return [f"{os.path.basename(files['scheduler'])} removed (policy reset): prepare the "
                "scheduler after accelerator.load_state, which otherwise looks for its file"]
    return []


def write_accelerate_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                            in_place: bool, progress: Any = None) -> str | None:
    ckpt, source = plan.ckpt, plan.ckpt.path
    part = {os.path.basename(f): p for p, f in ckpt.files.items() if p in ("model", "optimizer", "scheduler", "scaler")}
    backup = backup_path(out) if in_place and os.path.exists(out) else None
    with atomic_folder(out, backup=in_place) as tmp:
        for name in sorted(os.listdir(source)):
            src, dst = os.path.join(source, name), os.path.join(tmp, name)
            role = part.get(name)
            if name == "ckptfix.json":
                continue  # a previous repair's record: replaced below
            if os.path.isdir(src) or os.path.islink(src):
                copy_input_entry(src, dst, source)  # links stay links, never followed out of the folder
            elif role == "model" and plan.weights:
                with create_file(dst, replace=True) as f:
                    if name.endswith(".safetensors"):
                        write_safetensors(plan, src, f, rng, progress)
                    else:
                        rewrite_torch_file(src, f, plan, rng, lambda tree, table: edit_model(tree, plan, table), progress)
            elif role == "optimizer" and (plan.moments or plan.drop_optimizer_state or plan.reset_scheduler):
                with create_file(dst, replace=True) as f:
                    rewrite_torch_file(src, f, plan, rng, lambda tree, table: edit_optimizer(tree, plan, table),
                                       progress)
            elif role == "scheduler" and plan.reset_scheduler:
                continue
            elif role == "scaler" and plan.reset_scaler:
                with create_file(dst, replace=True) as f:
                    rewrite_torch_file(src, f, plan, rng, lambda tree, table: edit_scaler(tree, plan))
            else:
                copy_input_entry(src, dst, source)  # RNG states, samplers, further models: bytes, never unpickled
            if os.path.isfile(dst) and not os.path.islink(dst):  # rewritten files keep the source's mode
                shutil.copymode(src, dst)
        with create_file(os.path.join(tmp, "ckptfix.json"), replace=True) as f:
            f.write(record_json(record_fn()))
    return backup

