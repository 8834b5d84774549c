"""Write a repaired `torch.distributed.checkpoint` (DCP) folder with DCP itself, in one process.

The state dict is rebuilt as the reader describes it (`dcp_folder`: the nested structure from the
`.metadata` planner paths, tensors lazy, small objects unpickled with the allowlist): unchanged tensors
are copy-on-write maps of the source records, edited ones are produced by the plan, and the whole tree
goes through `dcp.save` (single process, `no_dist`) into a temp folder that atomically becomes `out`. No
home-made shard format: the output is whatever this torch's DCP writes, so `dcp.load` reads it.
Memory: DCP's `FileSystemWriter` (torch 2.13) keeps every tensor of a data file referenced until the
file is closed, so the edited tensors (vocab weights and their moments) are held together; the others
are file-backed maps. A sharded (multi-rank) source is refused by the reader's `to_torch()`.

Measured on torch 2.13, single process: `dcp.load` with the default planner requires every key of
the state dict it fills to be in the checkpoint ("Missing key in checkpoint state_dict: optim.state.
<fqn>.step"), while keys of the checkpoint absent from the state dict are ignored. `set_state_dict`
accepts an optimizer state dict with `state == {}` (FQN `params` in `param_groups`) and leaves the
optimizer with no state at all, i.e. fresh. So when the policy drops optimizer state the folder keeps
the optimizer entry with `param_groups` only (the schedule position's lr stays) and the record says how
to load it: a template from `get_state_dict` must have its optimizer `state` emptied first.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Callable

import numpy as np

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.errors import RepairError
from ckptfix.formats import dcp_folder
from ckptfix.formats.pickle_safe import OpaqueObject, TorchDevice, TorchDtype, _Record
from ckptfix.io import atomic_folder, backup_path
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.torch_tree import edit_optimizer


def write_dcp_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                     in_place: bool, progress: Any = None) -> str | None:
    """Save the repaired state dict with `dcp.save` into `out` (atomically) plus a `ckptfix.json` sidecar."""
    import torch.distributed.checkpoint as dcp

    from ckptfix.surgery import record_json

    state = repaired_state(plan, rng)
    backup = backup_path(out) if in_place and os.path.exists(out) else None
    # One process even inside a distributed job: never a collective with ranks that are not saving.
    single = {"no_dist": True} if "no_dist" in inspect.signature(dcp.save).parameters else {}
    with atomic_folder(out, backup=in_place) as tmp:
        with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process"
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=tmp, **single)
        with open(os.path.join(tmp, "ckptfix.json"), "wb") as f:
            f.write(record_json(record_fn()))
    return backup


def repaired_state(plan: RepairPlan, rng: np.random.Generator) -> dict:
    """The state dict to save: the source's tree with the plan applied, as torch objects."""
    ckpt = plan.ckpt
    items, _ = dcp_folder.read_metadata(ckpt.path)
    # Opaque mode imports nothing; anything that is not plain data is refused below, by name.
    tree = dcp_folder._tree(ckpt.path, items, Checkpoint(path=ckpt.path, format="dcp"), trust_pickle=True)
    optim_key, sched_key = ckpt.sections.get("optimizer"), ckpt.sections.get("scheduler")
    if optim_key is not None and isinstance(tree.get(optim_key), dict):
        tree[optim_key] = edit_optimizer(tree[optim_key], plan, None)  # type: ignore[arg-type]  # groups per policy; state dropped if so
        if plan.drop_optimizer_state:
            plan.notes.append(
                f"DCP: the optimizer entry {optim_key!r} keeps param_groups but no state; dcp.load of a "
                "get_state_dict template reports its state keys missing: empty the template's optimizer "
                "'state' before dcp.load, then set_state_dict leaves the optimizer fresh")
    if plan.reset_scheduler and sched_key is not None:
        del tree[sched_key]
        plan.notes.append(f"DCP: the scheduler entry {sched_key!r} was removed; do not load it (a new schedule starts)")
    builder = _Builder(plan, rng)
    return {key: builder.convert(value, (key,)) for key, value in tree.items()}


class _Builder:
    """Reader values -> what dcp.save takes: tensors mapped (or edited per plan), records to torch."""

    def __init__(self, plan: RepairPlan, rng: np.random.Generator):
        self.plan, self.rng = plan, rng
        self.model_key = plan.ckpt.sections.get("model")
        self.optim_key = plan.ckpt.sections.get("optimizer")

    def convert(self, node: Any, path: tuple) -> Any:
        if isinstance(node, TensorInfo):
            return self.tensor(node, path)
        if isinstance(node, dict):
            if set(node) == {"unread"} and isinstance(node["unread"], str):
                raise RepairError(f"{self.plan.ckpt.path}: item {_fqn(path)} was not read ({node['unread']}); "
                                  "ckptfix cannot write it back")
            return {k: self.convert(v, path + (k,)) for k, v in node.items()}
        if isinstance(node, list):
            return [self.convert(v, path + (i,)) for i, v in enumerate(node)]
        if isinstance(node, tuple):
            return tuple(self.convert(v, path + (i,)) for i, v in enumerate(node))
        if isinstance(node, TorchDtype):
            import torch

            return getattr(torch, node.name)
        if isinstance(node, TorchDevice):
            import torch

            return torch.device(node.spec)
        if isinstance(node, (OpaqueObject, _Record)):
            what = node.cls if isinstance(node, OpaqueObject) else type(node).__name__
            raise RepairError(f"{self.plan.ckpt.path}: item {_fqn(path)} holds a pickled {what}; "
                              "ckptfix writes back only tensors and plain data")
        return node

    def tensor(self, info: TensorInfo, path: tuple) -> Any:
        plan, edit = self.plan, None
        if (self.model_key == "" and len(path) == 1) or path[0] == self.model_key:
            name = _fqn(path[1:] if self.model_key else path)  # the name dcp_folder gives it in the model
            edit = plan.weights.get(plan.ckpt.tied.get(name, name))
        elif path[0] == self.optim_key and len(path) == 4 and path[1] == "state":
            edit = plan.moments.get((path[2], path[3]))
        if edit is None:
            return info.to_torch()  # a copy-on-write map of the source record
        return edit.produce_torch(plan.init, plan.std, self.rng)


def _fqn(path: tuple) -> str:
    return ".".join(map(str, path))
