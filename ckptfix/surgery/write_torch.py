"""Write a repaired `torch.save` checkpoint (plain dict, bare state_dict, or Lightning `.ckpt`)."""

from __future__ import annotations

import collections
import math
import os
from typing import Any, Callable

import numpy as np

from ckptfix.errors import RepairError
from ckptfix.formats import torch_file, torch_save
from ckptfix.io import atomic_file, backup_path
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.torch_tree import StorageTable, edit_model, edit_optimizer, edit_scaler


def _get(tree: Any, section: str) -> tuple[Any, Any, Any]:
    """(container, key, value) for a section path like "optimizer", "optimizer_states[0]" or, nested,
    "state/optimizers/AdamW" (Composer)."""
    if section.endswith("]"):
        key, index = section[:-1].split("[")
        container = tree[key]
        return container, int(index), container[int(index)]
    *parents, key = section.split("/")
    for part in parents:
        tree = tree[part]
    return tree, key, tree[key]


_DELETE = object()


def _set_nested(root: Any, section: str, value: Any) -> None:
    """Set (or with _DELETE remove) a nested section, copying each dict on its path (never the source's)."""
    *parents, key = section.split("/")
    node = root
    for part in parents:
        child = node[part]
        node[part] = type(child)(child) if type(child) in (dict, collections.OrderedDict) else dict(child)
        node = node[part]
    if value is _DELETE:
        del node[key]
    else:
        node[key] = value


def edited_tree(plan: RepairPlan, tree: Any, table: StorageTable) -> Any:
    """The output tree: sections edited per the plan, every other entry kept verbatim."""
    ckpt = plan.ckpt
    if ckpt.sections.get("model") == "":  # a bare state_dict: the record goes to a sidecar
        return edit_model(tree, plan, table)
    out = type(tree)(tree)
    copies: dict[str, Any] = {}  # list sections (Lightning) are copied once, then edited in place

    def put(section: str, value: Any) -> None:
        if "/" in section:
            _set_nested(out, section, value)
            return
        container, key, _ = _get(out, section)
        if isinstance(key, int):
            name = section.split("[")[0]
            container = copies.setdefault(name, list(container))
            out[name] = container
        container[key] = value

    if "model" in ckpt.sections:
        put(ckpt.sections["model"], edit_model(_get(tree, ckpt.sections["model"])[2], plan, table))
    if ckpt.optimizer is not None and ckpt.optimizer.parts:  # several optimizers: each under its own key
        for k, part in enumerate(ckpt.optimizer.parts):
            put(part.section, edit_optimizer(_get(tree, part.section)[2], plan, table, part=k))
    elif "optimizer" in ckpt.sections:
        put(ckpt.sections["optimizer"], edit_optimizer(_get(tree, ckpt.sections["optimizer"])[2], plan, table))
    if "scaler" in ckpt.sections:
        put(ckpt.sections["scaler"], edit_scaler(_get(tree, ckpt.sections["scaler"])[2], plan))
    if plan.recorded:
        from ckptfix.recorded import apply

        out = apply(out, plan.recorded)
    if plan.reset_scheduler and "scheduler" in ckpt.sections:
        section = ckpt.sections["scheduler"]
        if section.endswith("]"):
            out[section.split("[")[0]] = []  # Lightning restores no scheduler state from an empty list
        elif "/" in section:
            _set_nested(out, section, _DELETE)  # Composer skips a scheduler missing from its dict
        else:
            del out[section]
    return out


def write_torch_checkpoint(plan: RepairPlan, out: str, record_fn: Callable[..., dict], *, rng: np.random.Generator,
                           in_place: bool, progress: Any = None) -> str | None:
    """Stream the repaired checkpoint to `out` atomically. Returns the backup path when writing in place."""
    source = plan.ckpt.path
    # Opaque mode imports nothing either; an inert record (--trust-pickle) is then refused by name when
    # written ("cannot be written back"), not reported as an unsafe pickle the user already allowed.
    tree, locate_for, archive = torch_file.load(source, opaque=True)
    produce = lambda edit: edit.output(plan.init, plan.std, rng)  # noqa: E731
    table = StorageTable(tree, locate_for, archive, produce)
    bare = plan.ckpt.sections.get("model") == ""
    new_tree = edited_tree(plan, tree, table)

    def finish(t: Any, final: bool) -> Any:  # the record needs the source hash, computed while records are copied
        return t if bare else {**t, "ckptfix": record_fn(final)}

    prefix = archive.prefix if archive is not None else "archive"
    version = archive.read_member("version") if archive is not None else None
    backup = backup_path(out) if in_place else None
    with atomic_file(out, mode_like=source, backup=in_place) as f:
        torch_save.write(f, new_tree, table.source_for, prefix=prefix, version=version, finish=finish,
                         progress=progress)
    if bare:
        with atomic_file(out + ".ckptfix.json") as f:
            f.write(record_json(record_fn()))
    if in_place and not os.path.exists(backup or ""):
        raise RepairError(f"{out}: backup was not created")
    return backup


def write_torch_from_safetensors(plan: RepairPlan, out: str, record_fn: Callable[..., dict], *,
                                 rng: np.random.Generator, in_place: bool, progress: Any = None) -> str | None:
    """A repaired `.safetensors` written as the bare state_dict `torch.save(model.state_dict(), out)` gives
    (the user named OUT .pth/.pt/.bin): one storage per tensor, untouched ones copied byte for byte from
    the safetensors data, edited ones produced; tied names share one tensor, as in the model. The
    record goes to `OUT.ckptfix.json`, as for a bare state_dict."""
    from ckptfix.dtypes import contiguous_stride
    from ckptfix.formats import safetensors_file
    from ckptfix.formats.pickle_records import StorageRef, TensorRef
    from ckptfix.formats.torch_save import StorageSource
    tensors, _ = safetensors_file.tensors(plan.ckpt.path)
    tree: collections.OrderedDict[str, TensorRef] = collections.OrderedDict()
    sources: dict[str, StorageSource] = {}
    by_owner: dict[str, TensorRef] = {}
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].locate().start):
        owner = plan.ckpt.tied.get(name, name)
        if owner in by_owner:
            tree[name] = by_owner[owner]
            continue
        edit = plan.weights.get(owner)
        shape = tuple(edit.new_shape) if edit is not None else tuple(t.shape)
        storage = StorageRef(str(len(sources)), t.dtype, "cpu", math.prod(shape))
        sources[storage.key] = (StorageSource(produce=lambda e=edit: e.output(plan.init, plan.std, rng))  # type: ignore[misc]
                                if edit is not None else StorageSource(copy_from=t.locate))
        tree[name] = by_owner[owner] = TensorRef(storage, 0, shape, contiguous_stride(shape), t.dtype)
    backup = backup_path(out) if in_place else None
    with atomic_file(out, mode_like=plan.ckpt.path, backup=in_place) as f:
        torch_save.write(f, tree, lambda s: sources[s.key], progress=progress)
    with atomic_file(out + ".ckptfix.json") as f:
        f.write(record_json(record_fn()))
    return backup
