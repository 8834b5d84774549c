"""`repair --in-place` of a Hugging Face folder: rewrite only the weight shards holding a vocab tensor.

Each such shard is written beside the others under a new name (`<shard>.ckptfix<N>.safetensors`) and the
sharded index, the one file `from_pretrained` follows, is swapped with one rename to point at it; the old
shard stays, unreferenced. Small files that must change under their own name (`config.json`, tokenizer
files, `optimizer.pt`/`scaler.pt` of a Trainer folder) are moved aside as backups and written anew. All of
it is listed for `ckptfix restore FOLDER`. Cost: the vocab shards (plus the optimizer file of a Trainer
folder when its moments change), never the other shards.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import numpy as np

from ckptfix.errors import RepairError
from ckptfix.io import atomic_write
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.undo import InPlace
from ckptfix.surgery.write_hf import (
    TOKENIZER_FILES,
    _copy_tokenizer,
    _nbytes,
    _rewrite_training_file,
    _rewrite_weights,
)

INDEX_SUFFIX = ".safetensors.index.json"
RECORD_FILE = "ckptfix.json"


def write_hf_in_place(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                      in_place: bool, progress: Any = None, incremental: bool = True) -> str:
    folder = plan.ckpt.path
    index_name = _index(folder)
    undo = InPlace(folder, index_name)
    shards = {os.path.basename(file) for name in plan.weights for file in plan.ckpt.model[name].files()}
    with undo:
        renamed = {shard: _new_shard_name(folder, shard) for shard in sorted(shards)}
        for shard, new in renamed.items():
            _rewrite_weights(plan, undo.path(shard), undo.add(new), rng, progress)
        _rewrite_fixed_files(plan, undo, rng, progress)
        index = _new_index(plan, undo.path(index_name), renamed)
        undo.keep(RECORD_FILE)
        atomic_write(undo.path(RECORD_FILE), _record(record_fn))
        undo.keep(index_name)
        undo.switch_over(lambda path: atomic_write(path, index))
    plan.notes.append(f"HF in place: {', '.join(f'{a} -> {b}' for a, b in renamed.items())}; the other shards "
                      f"untouched; previous index kept as {index_name}.ckptfix-bak (undo: ckptfix restore {folder})")
    return undo.path(undo.backups[index_name])


def _index(folder: str) -> str:
    names = [n for n in os.listdir(folder) if n.endswith(INDEX_SUFFIX)]
    if len(names) != 1:
        raise RepairError(f"{folder}: --in-place needs a sharded safetensors folder (one *{INDEX_SUFFIX}); "
                          "repair into a new folder with -o")
    return names[0]


def _new_shard_name(folder: str, shard: str) -> str:
    stem = shard[:-len(".safetensors")] if shard.endswith(".safetensors") else shard
    stem = stem.split(".ckptfix", 1)[0]
    n = 0
    while os.path.lexists(os.path.join(folder, f"{stem}.ckptfix{n}.safetensors")):
        n += 1
    return f"{stem}.ckptfix{n}.safetensors"


def _rewrite_fixed_files(plan: RepairPlan, undo: InPlace, rng: np.random.Generator, progress: Any) -> None:
    """config.json, optimizer.pt, scaler.pt, scheduler.pt as the policy requires; the new tokenizer's files.
    Each is written in the scratch folder, reading the current file where it is (the plan's tensors point
    there), then installed with one rename; the old one stays whole as its backup."""
    def rewriter(name: str) -> Callable[[str], bool]:
        return lambda new: _rewrite_training_file(plan, name, undo.path(name), new, rng, progress)

    for name in ("config.json", "optimizer.pt", "scaler.pt", "scheduler.pt"):
        if os.path.exists(undo.path(name)):
            undo.rewrite(name, rewriter(name))
    staged = os.path.join(undo.scratch(), "tokenizer")
    os.mkdir(staged)
    _copy_tokenizer(plan.tokenizer, staged)
    new_names = sorted(os.listdir(staged))
    for name in TOKENIZER_FILES:  # the old tokenizer's files go: the new tokenizer's replace them
        if name not in new_names and os.path.lexists(undo.path(name)):
            undo.remove(name)
    for name in new_names:
        undo.install(name, os.path.join(staged, name))


def _new_index(plan: RepairPlan, path: str, renamed: dict[str, str]) -> bytes:
    with open(path, "rb") as f:
        index = json.loads(f.read().decode("utf-8"))
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise RepairError(f"{path}: index without a weight_map")
    for name, shard in weight_map.items():
        if shard in renamed:
            weight_map[name] = renamed[shard]
    meta = index.get("metadata")
    if isinstance(meta, dict) and isinstance(meta.get("total_size"), int):
        meta["total_size"] += sum(_nbytes(e.new_shape, e.source.dtype) - e.source.nbytes for e in plan.weights.values())
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def _record(record_fn: Callable[[], dict]) -> bytes:
    return record_json(record_fn())
