"""Write a repaired Megatron-Core `torch_dist` checkpoint: the DCP writer (`write_dcp`) with Megatron's items.

What changes, nothing else: the vocab tensors (`embedding.word_embeddings.weight`, `output_layer.weight`),
their moments (`optimizer.state.exp_avg.<fqn>`, `...exp_avg_sq.<fqn>`) and the distributed optimizer's
fp32 master copy (`optimizer.state.param.<fqn>`: old rows kept exactly, new rows the new weight's rows), each
one piece covering the whole tensor (Megatron's loader reshards it to any TP size); the `.metadata` (DCP's own
`Metadata`, without Megatron's cached save plans, which describe the old shapes: Megatron makes new ones on its
next save); and `common.pt`, rewritten by the torch writer with `args.padded_vocab_size` (and `args.vocab_size`)
set, every other entry as read.

A save folder (with `latest_checkpointed_iteration.txt`) is written as one: OUT/<iteration>/ and OUT's tracker
file, so Megatron-LM's `--load OUT` finds it; other iterations in the save folder are not copied. In place,
the iteration folder is changed (`write_dcp`'s in-place transaction, `common.pt` among its backups).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any, BinaryIO

import numpy as np

from ckptfix.errors import RepairError
from ckptfix.formats.megatron_folder import (
    COMMON,
    DISTRIBUTED_PREFIX,
    STATE_PREFIX,
    TRACKER,
    MegatronLayout,
    flat_bucket_problem,
)
from ckptfix.formats.pickle_records import OpaqueObject
from ckptfix.io import atomic_folder, write_new
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.rows import apply_plan
from ckptfix.surgery.write_dcp import DcpEdits, _Produce, write_dcp_folder
from ckptfix.untrusted import read_bounded


def write_megatron_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                          in_place: bool, progress: Any = None, incremental: bool = False) -> str | None:
    layout = _layout(plan)
    edits = plan_edits(plan, layout, rng)
    rewrites = {COMMON: _common_writer(plan, rng)}
    plan = replace(plan, ckpt=replace(plan.ckpt, path=layout.iteration_dir))  # what write_dcp reads and changes
    if incremental or layout.parent is None:
        return write_dcp_folder(plan, out, record_fn, rng=rng, in_place=in_place, progress=progress,
                                incremental=incremental, edits=edits, rewrites=rewrites)
    # a save folder: OUT/<iteration>/ plus OUT's tracker file, appearing together
    tracker = read_bounded(os.path.join(layout.parent, TRACKER), 64, error=RepairError)
    with atomic_folder(out, backup=in_place) as tmp:
        write_dcp_folder(plan, os.path.join(tmp, os.path.basename(layout.iteration_dir)), record_fn, rng=rng,
                         in_place=False, progress=progress, edits=edits, rewrites=rewrites)
        write_new(os.path.join(tmp, TRACKER), tracker)
    return None


def plan_notes(plan: RepairPlan) -> list[str]:
    """What a Megatron repair does beyond the common plan (shown by --dry-run), and its refusals."""
    layout = _layout(plan)
    problem = flat_bucket_problem(plan.ckpt)
    if problem and not plan.drop_optimizer_state:
        raise RepairError(f"{plan.ckpt.path}: {problem}")
    if plan.reset_scheduler:
        raise RepairError(f"{plan.ckpt.path}: Megatron keeps the schedule in {COMMON}'s opt_param_scheduler, "
                          "which --policy reset does not rewrite; use --policy fresh and start the schedule again "
                          "with Megatron-LM's --override-opt_param-scheduler")
    parts = ["the vocab tensors"] + (["their moments"] if plan.moments else []) + (
        ["their fp32 master copies"] if layout.master_items and not plan.drop_optimizer_state else [])
    notes = [f"Megatron: {', '.join(parts[:-1]) + ' and ' + parts[-1] if len(parts) > 1 else parts[0]} "
             f"are written as one piece each (loads at any TP size); {COMMON} args updated; the cached save plans "
             "are left out of .metadata (Megatron makes new ones on its next save)"]
    if plan.drop_optimizer_state:
        notes.append("Megatron: optimizer state dropped (optimizer.state.* and optimizer.distributed.* items "
                     "removed): resume with --no-load-optim (Megatron-LM), the optimizer starts fresh")
    return notes


def _layout(plan: RepairPlan) -> MegatronLayout:
    layout = plan.ckpt.raw
    if not isinstance(layout, MegatronLayout):
        raise RepairError(f"{plan.ckpt.path}: not read as a Megatron checkpoint; nothing written")
    return layout


def plan_edits(plan: RepairPlan, layout: MegatronLayout, rng: np.random.Generator) -> DcpEdits:
    """Weights, their moments and master copies to rewrite (flat FQN paths), or the optimizer items to drop."""
    edits = DcpEdits()
    for name, edit in plan.weights.items():
        fqn = layout.model_items.get(name)
        if fqn is None:
            raise RepairError(f"{plan.ckpt.path}: cannot find the item of {name}; nothing written")
        weight = _Produce(edit, plan, rng)
        edits.writes[fqn] = ((fqn,), weight)
        master = layout.master_items.get(name)
        if master is not None and not plan.drop_optimizer_state:
            edits.writes[master] = ((master,), _Master(plan.ckpt.model[name], master, weight, layout, plan, rng))
    if plan.drop_optimizer_state:
        edits.removes.update(f for f in layout.items if f.startswith((STATE_PREFIX, DISTRIBUTED_PREFIX)))
        return edits
    problem = flat_bucket_problem(plan.ckpt)
    if problem:
        raise RepairError(f"{plan.ckpt.path}: {problem}")
    for key, edit in plan.moments.items():
        fqn = layout.moment_items.get(key)
        if fqn is None:
            raise RepairError(f"{plan.ckpt.path}: cannot find the item of {edit.name}; nothing written")
        edits.writes[fqn] = ((fqn,), _Produce(edit, plan, rng))
    return edits


class _Master(_Produce):
    """The fp32 master copy of a resized weight: its own old rows, in its own dtype, moved by the weight's row
    plan; the new rows are the new weight's (widened from the weight's dtype where that is narrower)."""

    def __init__(self, weight_info: Any, fqn: str, weight: _Produce, layout: MegatronLayout, plan: RepairPlan,
                 rng: np.random.Generator):
        from ckptfix.formats.dcp_folder import tensor_info

        source = tensor_info(layout.iteration_dir, layout.items[fqn], [])
        super().__init__(replace(weight.edit, name=fqn, source=source), plan, rng)
        self.weight = weight

    def __call__(self) -> np.ndarray:
        if self.value is None:
            from ckptfix.checkpoint import widen_stored

            new = self.weight()[self.edit.plan.source < 0]
            fill = widen_stored(np.asarray(new), self.weight.edit.source.dtype).astype(
                self.edit.source.read_dtype(), copy=False)
            self.value = apply_plan(self.edit.source.read_stored(), self.edit.plan, fill)
        return self.value


def _common_writer(plan: RepairPlan, rng: np.random.Generator) -> Callable[[BinaryIO], None]:
    """common.pt with the recorded sizes the plan changes in `args` (a Namespace: its fields replaced)."""
    from ckptfix.surgery.write_hf import rewrite_torch_file

    changes = {path[1]: value for path, value in plan.recorded.items() if len(path) == 2 and path[0] == "args"}
    others = [p for p in plan.recorded if not (len(p) == 2 and p[0] == "args")]
    if others:
        raise RepairError(f"{plan.ckpt.path}: recorded vocab size at {'.'.join(map(str, others[0]))} is not in "
                          f"{COMMON}'s args; nothing written")

    def edit(tree: Any, table: Any) -> Any:
        args = tree.get("args")
        if isinstance(args, OpaqueObject) and isinstance(args.state, dict):
            edited = copy.copy(args)  # an inert record of its class: the copy pickles as the original did
            edited.__setstate__({**args.state, **changes})
            return {**tree, "args": edited}
        if isinstance(args, dict):
            return {**tree, "args": {**args, **changes}}
        if changes:
            raise RepairError(f"{plan.ckpt.path}: {COMMON} has no args to record the new vocab size in")
        return tree

    source = plan.ckpt.files["common"]
    return lambda f: rewrite_torch_file(source, f, plan, rng, edit)
