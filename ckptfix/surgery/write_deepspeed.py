"""Write a repaired DeepSpeed universal checkpoint folder (the layout `ds_to_universal` writes).

Every parameter is whole in its own files (`zero/<name>/{fp32,exp_avg,exp_avg_sq,step}.pt`), so a
vocab change rewrites the vocab parameters' fp32/moment files with the plan's rows (grow, shrink or
remap by token string, the moments moving with their rows) and the model-states file's `module`
tensors and `param_shapes` (DeepSpeed loads `module` with the model's new shapes first). Every other
file is copied as it is (reflink or copy_file_range). DeepSpeed re-partitions the folder at whatever
world size loads it with `"checkpoint": {"load_universal": true}`.

The new rows of `module` are the new fp32 rows in the module's dtype (DeepSpeed's low-precision
weights are its fp32 master weights cast), so the two never disagree.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ckptfix.errors import RepairError
from ckptfix.formats import torch_file, torch_save
from ckptfix.formats.deepspeed_folder import _MODEL_STATES
from ckptfix.formats.deepspeed_universal import WEIGHTS, ZERO, param_folders
from ckptfix.formats.pickle_records import TensorRef
from ckptfix.io import atomic_folder, backup_path, copy_input_entry, create_file
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan, TensorEdit
from ckptfix.surgery.rows import narrow_to_stored
from ckptfix.surgery.torch_tree import StorageTable

RECORD_FILE = "ckptfix.json"


def plan_notes(plan: RepairPlan) -> list[str]:
    """Refuse, before anything is written (so --dry-run says the same), what this writer cannot do."""
    if plan.drop_optimizer_state or plan.reset_scheduler:
        raise RepairError(f"{plan.ckpt.path}: a DeepSpeed universal checkpoint is repaired with its optimizer state "
                          "and schedule (--policy remap): load_universal needs every parameter's moments")
    return [f"DeepSpeed universal: rewrites zero/<name>/ of {', '.join(sorted(plan.weights))} and the model "
            "states' module; load it with \"checkpoint\": {\"load_universal\": true}"]


def write_universal_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                           in_place: bool, progress: Any = None) -> str | None:
    src = plan.ckpt.path
    produce = _Produced(plan, rng)
    rewrites = _rewrites(plan, src)
    model_files = {os.path.join(src, n) for n in os.listdir(src) if _MODEL_STATES.match(n)}  # one per rank at ZeRO-3
    backup = backup_path(out) if in_place and os.path.exists(out) else None
    copied: dict[str, int] = {}
    with atomic_folder(out, backup=in_place) as tmp:
        for root, dirs, files in os.walk(src):
            dirs.sort()
            rel = os.path.relpath(root, src)
            target = tmp if rel == "." else os.path.join(tmp, rel)
            if rel != ".":
                os.makedirs(target, exist_ok=True)
            for name in sorted(files):
                path, dst = os.path.join(root, name), os.path.join(target, name)
                if rel == "." and name == RECORD_FILE:
                    continue
                if path in model_files:
                    _rewrite(path, dst, lambda tree, table: _edit_model_states(tree, plan, table, produce), produce,
                             progress)
                elif path in rewrites:
                    edit = rewrites[path]
                    _rewrite(path, dst, lambda tree, table, e=edit: _edit_param_file(tree, e, table), produce,
                             progress)
                else:
                    for method in copy_input_entry(path, dst, src):
                        copied[method] = copied.get(method, 0) + 1
        plan.notes.append(f"DeepSpeed universal: {len(rewrites) + len(model_files)} file(s) rewritten, the others copied ("
                          + ", ".join(f"{m} x{n}" for m, n in copied.items()) + ")")
        with create_file(os.path.join(tmp, RECORD_FILE), replace=True) as f:
            f.write(record_json(record_fn()))
    return backup


class _Produced:
    """Each edit's rows computed once (numpy, as stored): the fp32 file and `module` share the weights'."""

    def __init__(self, plan: RepairPlan, rng: np.random.Generator):
        self.plan, self.rng = plan, rng
        self.done: dict[str, np.ndarray] = {}

    def __call__(self, edit: TensorEdit, dtype: str | None = None) -> Any:
        if edit.name not in self.done:
            self.done[edit.name] = edit.produce(self.plan.init, self.plan.std, self.rng)
        values = self.done[edit.name]
        if dtype is None or dtype == edit.source.dtype:
            return values
        if edit.source.dtype != "float32":
            raise RepairError(f"{edit.name}: fp32.pt holds {edit.source.dtype}, expected float32")
        return narrow_to_stored(values, dtype)


def _rewrites(plan: RepairPlan, src: str) -> dict[str, TensorEdit]:
    """Source file -> the edit whose output replaces its 'param' tensor."""
    folders = param_folders(src)
    out: dict[str, TensorEdit] = {}
    for name, edit in plan.weights.items():
        out[os.path.join(folders[name], f"{WEIGHTS}.pt")] = edit
    for (name, key), edit in plan.moments.items():
        if name not in folders:
            raise RepairError(f"{src}: no {ZERO}/{name}/ for the moment {key}; nothing written")
        out[os.path.join(folders[name], f"{key}.pt")] = edit
    missing = [p for p in out if not os.path.isfile(p)]
    if missing:
        raise RepairError(f"{missing[0]}: missing; nothing written")
    return out


def _rewrite(src: str, dst: str, edit: Callable, produce: _Produced, progress: Any) -> None:
    tree, locate_for, archive = torch_file.load(src, opaque=True)
    table = StorageTable(tree, locate_for, archive, lambda e: produce(e))
    prefix = archive.prefix if archive is not None else "archive"
    with create_file(dst, replace=True) as f:
        torch_save.write(f, edit(tree, table), table.source_for, prefix=prefix, progress=progress)


def _edit_param_file(tree: Any, edit: TensorEdit, table: StorageTable) -> Any:
    """{"param": tensor, ...} with the new tensor; a flat tensor (ZeRO-3) stays flat."""
    if isinstance(tree, TensorRef) and len(tree.shape) == 1:
        new = table.new_tensor(tree, edit)
        return TensorRef(new.storage, 0, (new.numel,), (1,), new.dtype, new.requires_grad, new.is_parameter)
    if not isinstance(tree, dict) or not isinstance(tree.get("param"), TensorRef):
        raise RepairError(f"{edit.name}: the universal file holds no 'param' tensor")
    return {**tree, "param": table.new_tensor(tree["param"], edit)}


def _edit_model_states(tree: Any, plan: RepairPlan, table: StorageTable, produce: _Produced) -> Any:
    """`module` tensors of the edited weights (in their own dtype) and `param_shapes` with the new shapes
    (torch.Size values, as DeepSpeed saved them)."""
    module = tree.get("module") if isinstance(tree, dict) else None
    if not isinstance(module, dict):
        raise RepairError(f"{plan.ckpt.path}: model states without a module state dict")
    new_module = type(module)()
    for key, value in module.items():
        edit = _weight_edit(plan, key)
        if edit is not None and isinstance(value, TensorRef) and value.shape == edit.source.shape:  # not a ZeRO-3 placeholder
            new_module[key] = _cast_tensor(table, value, edit, produce)
        else:
            new_module[key] = value
    out = {**tree, "module": new_module}
    if isinstance(tree.get("param_shapes"), list):
        out["param_shapes"] = [_sizes(group, plan) for group in tree["param_shapes"]]
    return out


def _weight_edit(plan: RepairPlan, name: Any) -> TensorEdit | None:
    return plan.weights.get(plan.ckpt.tied.get(name, name)) if isinstance(name, str) else None


def _cast_tensor(table: StorageTable, old: TensorRef, edit: TensorEdit, produce: _Produced) -> TensorRef:
    """A new `module` tensor: the edit's fp32 output in `old`'s dtype."""
    ref = table.new_tensor(old, edit)
    table.new[ref.storage.key] = torch_save.StorageSource(produce=lambda: produce(edit, old.dtype))
    return ref


def _sizes(group: Any, plan: RepairPlan) -> Any:
    if not isinstance(group, dict):
        return group
    out = type(group)()
    for name, shape in group.items():
        edit = _weight_edit(plan, name)
        dims = list(edit.new_shape) if edit is not None else list(shape)
        out[name] = torch_save._Reduce(torch_save._global("torch", "Size"), (tuple(dims),))
    return out
