"""Apply a repair plan to an unpickled `torch.save` tree: a new tree plus where each storage's bytes come from.

The source tree is never mutated. Unchanged tensors keep their storage (copied raw at write time);
edited tensors get a fresh storage whose bytes are produced while its record is written.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any, Callable

from ckptfix.dtypes import contiguous_stride
from ckptfix.formats.common import iter_tensor_refs
from ckptfix.formats.pickle_records import StorageRef, TensorRef
from ckptfix.formats.torch_save import Spliced, StorageSource
from ckptfix.optim_state import state_path
from ckptfix.surgery.plan import DEFAULT_SCALE, RepairPlan, TensorEdit


class StorageTable:
    """Output storages: copied from the source archive, or produced by a tensor edit."""

    def __init__(self, tree: Any, locate_for: Callable, archive: Any, produce: Callable[[TensorEdit], Any]):
        self.locate_for, self.archive, self.produce = locate_for, archive, produce
        keys = [r.storage.key for r in iter_tensor_refs(tree)]
        self.next_key = max((int(k) for k in keys if k.isdigit()), default=-1) + 1
        self.new: dict[str, StorageSource] = {}
        self.derived_from: dict[str, str] = {}  # an edited tensor's storage key -> its source storage key

    def new_tensor(self, old: TensorRef, edit: TensorEdit) -> TensorRef:
        key = str(self.next_key)
        self.next_key += 1
        shape = edit.new_shape
        numel = math.prod(shape)
        storage = StorageRef(key, old.dtype, old.storage.location, numel)
        self.new[key] = StorageSource(produce=lambda: self._produced(edit, old))
        self.derived_from[key] = old.storage.key
        stride = contiguous_stride(tuple(shape))
        return TensorRef(storage, 0, tuple(shape), stride, old.dtype, old.requires_grad, old.is_parameter)

    def _produced(self, edit: TensorEdit, old: TensorRef) -> Any:
        out = self.produce(edit)
        if isinstance(out, Spliced) and out.prefix_crc is None and self.archive is not None:
            # The copied prefix is the whole source record: its CRC-32 is in the central directory.
            info = self.archive.members.get(f"{self.archive.prefix}/data/{old.storage.key}")
            where = self.locate_for(old.storage)()
            if info is not None and (out.prefix.file, out.prefix.start, out.prefix.length) == (
                    where.file, where.start, where.length) and info.file_size == where.length:
                out.prefix_crc = info.CRC
        return out

    def source_for(self, storage: StorageRef) -> StorageSource:
        if storage.key in self.new:
            return self.new[storage.key]
        crc = None
        if self.archive is not None:
            info = self.archive.members.get(f"{self.archive.prefix}/data/{storage.key}")
            crc = info.CRC if info is not None else None
        return StorageSource(copy_from=self.locate_for(storage), crc=crc)


def edit_model(state: Any, plan: RepairPlan, table: StorageTable, prefix: str = "") -> Any:
    """A copy of a model state_dict with edited tensors replaced; tied aliases share the new tensor."""
    replaced: dict[str, TensorRef] = {}
    out: Any = type(state)() if isinstance(state, collections.OrderedDict) else {}
    for key, value in state.items():
        name = f"{prefix}{key}"
        owner = plan.ckpt.tied.get(name, name)
        if owner in plan.weights and isinstance(value, TensorRef):
            if owner not in replaced:
                replaced[owner] = table.new_tensor(value, plan.weights[owner])
            out[key] = replaced[owner]
        else:
            out[key] = value
    if hasattr(state, "_metadata"):
        out._metadata = state._metadata
    return out


def edit_optimizer(sd: dict, plan: RepairPlan, table: StorageTable, part: int | None = None) -> dict:
    """A copy of an optimizer state_dict: moments remapped, or state dropped (param_groups kept).
    `part`: which of several optimizers in the checkpoint this is (plan entries are `(part, index)`)."""
    groups = [dict(g) for g in sd["param_groups"]]
    if plan.reset_scheduler:
        for g in groups:  # the schedule starts again from its base LR
            if "initial_lr" in g:
                g["lr"] = g["initial_lr"]
    if plan.drop_optimizer_state:
        return {**sd, "state": {}, "param_groups": groups}
    state = {}
    edits: dict[Any, list[tuple[str, TensorEdit]]] = {}
    for (index, key), edit in plan.moments.items():
        if part is None or (isinstance(index, tuple) and index[0] == part):
            edits.setdefault(index[1] if part is not None else index, []).append((key, edit))
    for index, entries in sd["state"].items():
        for path, edit in edits.get(index, []):
            entries = _replaced(entries, state_path(path), functools.partial(_new_tensor, table, edit))
        state[index] = entries
    return {**sd, "state": state, "param_groups": groups}


def _new_tensor(table: StorageTable, edit: TensorEdit, old: TensorRef) -> TensorRef:
    return table.new_tensor(old, edit)


def _replaced(node: Any, path: list[Any], make: Callable[[TensorRef], TensorRef]) -> Any:
    """A copy of `node` with the tensor at `path` replaced by `make(old)` (containers on the path copied,
    the source never mutated); `node` itself when the path does not lead to a tensor."""
    if not path:
        return make(node) if isinstance(node, TensorRef) else node
    head, rest = path[0], path[1:]
    if isinstance(node, dict) and head in node:
        out = type(node)(node) if isinstance(node, collections.OrderedDict) else dict(node)
        out[head] = _replaced(node[head], rest, make)
        return out
    if isinstance(node, (list, tuple)) and isinstance(head, int) and 0 <= head < len(node):
        items = list(node)
        items[head] = _replaced(node[head], rest, make)
        return type(node)(items) if isinstance(node, tuple) and not hasattr(node, "_fields") else items
    return node


def edit_scaler(scaler: dict, plan: RepairPlan) -> dict:
    if not plan.reset_scaler:
        return scaler
    out = dict(scaler)
    out["scale"] = DEFAULT_SCALE
    if "_growth_tracker" in out:
        out["_growth_tracker"] = 0
    return out
