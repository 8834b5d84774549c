"""Write repaired safetensors files and Hugging Face folders (Trainer `checkpoint-N/`, `save_pretrained`).

A folder becomes a new folder with the same files: weight files holding an edited tensor are
rewritten (streamed), the others copied; `optimizer.pt`/`scaler.pt` rewritten when the policy
changes them; `config.json` gets the new `vocab_size` (a composite config's in its text sub-config); tokenizer files come from the new tokenizer;
`training_args.bin`, `rng_state*.pth` and `trainer_state.json` are copied as bytes, never unpickled.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

import ckptfix.untrusted as untrusted
from ckptfix.dtypes import DTYPE_SIZES
from ckptfix.errors import RepairError
from ckptfix.formats import safetensors_file, safetensors_save, torch_file, torch_save
from ckptfix.io import atomic_file, atomic_folder, backup_path, copy_input_entry, create_file
from ckptfix.progress import Progress
from ckptfix.record import record_json
from ckptfix.surgery.plan import RepairPlan
from ckptfix.surgery.torch_tree import StorageTable, edit_model, edit_optimizer, edit_scaler
from ckptfix.untrusted import load_json_file

TRAINING_FILES = ("optimizer.pt", "scheduler.pt", "scaler.pt", "config.json")  # `_rewrite_training_file`'s
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "spiece.model", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json")
# The input's own, kept when the new tokenizer has none: the special tokens a processor (and the tokenizer) name.
# The processor's files (preprocessor_config.json, processor_config.json, chat_template.*) are copied as they are.
CARRIED_IF_ABSENT = ("special_tokens_map.json",)


def write_safetensors_file(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                           in_place: bool, progress: Any = None) -> str | None:
    """A single `.safetensors` (weights only); the record goes to `OUT.ckptfix.json`."""
    backup = backup_path(out) if in_place else None
    with atomic_file(out, mode_like=plan.ckpt.path, backup=in_place) as f:
        write_safetensors(plan, plan.ckpt.path, f, rng, progress)
    with atomic_file(out + ".ckptfix.json") as f:
        f.write(record_json(record_fn()))
    return backup


def write_safetensors(plan: RepairPlan, source: str, f: Any, rng: np.random.Generator,
                      progress: Progress | None = None) -> None:
    """The safetensors file `source` with the plan's weight edits, streamed to `f` (shared with accelerate)."""
    tensors, metadata = safetensors_file.tensors(source)
    parts = _edited_parts(plan, rng)
    entries = []
    for name, t in sorted(tensors.items(), key=lambda kv: kv[1].locate().start):
        edit = plan.weights.get(plan.ckpt.tied.get(name, name))
        if edit is not None:
            entries.append(safetensors_save.Entry(name, t.dtype, edit.new_shape,
                                                  produce=lambda e=edit: e.produce(plan.init, plan.std, rng)))  # type: ignore[misc]
        elif name in parts:
            entries.append(parts[name])
        else:
            entries.append(safetensors_save.Entry(name, t.dtype, t.shape, copy_from=t.locate()))
    safetensors_save.write(f, entries, metadata or None, progress)


def _edited_parts(plan: RepairPlan, rng: np.random.Generator) -> dict[str, safetensors_save.Entry]:
    """The entries of every part of an edited table saved in parts (`TensorEdit.parts`), by part name: a part
    whose rows the plan keeps in place is copied as it is, the others are sliced from the table computed once."""
    out = {}
    for edit in plan.weights.values():
        produced: list[np.ndarray] = []

        def rows(start: int, count: int, e=edit, produced=produced) -> np.ndarray:
            if not produced:
                produced.append(e.produce(plan.init, plan.std, rng))
            return produced[0][start:start + count]

        for part, start, count, same in edit.parts():
            shape = (count, *part.shape[1:])
            out[part.name] = safetensors_save.Entry(part.name, part.dtype, shape, copy_from=part.locate()) if same \
                else safetensors_save.Entry(part.name, part.dtype, shape,
                                            produce=lambda s=start, c=count, r=rows: r(s, c))  # type: ignore[misc]
    return out


def write_hf_folder(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *, rng: np.random.Generator,
                    in_place: bool, progress: Any = None) -> str | None:
    source = plan.ckpt.path
    edited_files = {file for name in plan.weights for file in plan.ckpt.model[name].files()}
    backup = backup_path(out) if in_place and os.path.exists(out) else None
    copied: dict[str, int] = {}
    edited = {os.path.realpath(p) for p in edited_files}
    with atomic_folder(out, backup=in_place) as tmp, ThreadPoolExecutor(1) as pool:
        names = [n for n in sorted(os.listdir(source)) if n not in TOKENIZER_FILES and n != "ckptfix.json"]
        # Entries no repair rewrites are copied (in the kernel) by a worker while the vocab shards are
        # rewritten: the repair takes about as long as the copy alone. Leaving the `with` waits for it.
        plain = [n for n in names if os.path.realpath(os.path.join(source, n)) not in edited and n not in TRAINING_FILES]
        copies = pool.submit(_copy_entries, source, tmp, plain)
        for name in names:
            if name in plain:
                continue
            src, dst = os.path.join(source, name), os.path.join(tmp, name)
            if os.path.realpath(src) in edited:
                _rewrite_weights(plan, src, dst, rng, progress)
            elif not (os.path.isfile(src) and _rewrite_training_file(plan, name, src, dst, rng, progress)):
                for method in copy_input_entry(src, dst, source):  # links stay links, never followed out
                    copied[method] = copied.get(method, 0) + 1
            if os.path.isfile(dst) and not os.path.islink(dst):  # a rewritten file keeps its source's mode
                shutil.copymode(src, dst)
        for method, n in copies.result().items():
            copied[method] = copied.get(method, 0) + n
        _write_recipe_state(plan, tmp, rng, progress)
        if copied:
            plan.notes.append("unchanged files copied: " + ", ".join(f"{m} x{n}" for m, n in copied.items()))
        _update_index_sizes(plan, tmp)
        _copy_tokenizer(plan.tokenizer, tmp)
        for name in CARRIED_IF_ABSENT:  # a processor folder's, which a new tokenizer.json alone does not bring
            if os.path.lexists(os.path.join(source, name)) and not os.path.lexists(os.path.join(tmp, name)):
                copy_input_entry(os.path.join(source, name), os.path.join(tmp, name), source)
        with create_file(os.path.join(tmp, "ckptfix.json"), replace=True) as f:
            f.write(record_json(record_fn()))
    return backup


def _copy_entries(source: str, folder: str, names: list[str]) -> dict[str, int]:
    """Copy the entries `names` of `source` into `folder` as they are; how many by each method."""
    copied: dict[str, int] = {}
    for name in names:
        for method in copy_input_entry(os.path.join(source, name), os.path.join(folder, name), source):
            copied[method] = copied.get(method, 0) + 1  # links stay links, never followed out
    return copied


def _rewrite_weights(plan: RepairPlan, src: str, dst: str, rng: np.random.Generator, progress: Progress | None) -> None:
    with create_file(dst, replace=True) as f:
        if src.endswith(".safetensors"):
            write_safetensors(plan, src, f, rng, progress)
        else:
            rewrite_torch_file(src, f, plan, rng, lambda tree, table: edit_model(tree, plan, table), progress)


def _write_recipe_state(plan: RepairPlan, folder: str, rng: np.random.Generator,
                        progress: Progress | None = None) -> None:
    """torchtune's recipe_state.pt (read from beside the model folder, or in it): the repaired one goes into
    OUT, since nothing outside OUT is written (make_plan's note says where torchtune looks for it)."""
    src = plan.ckpt.files.get("optimizer")
    if plan.ckpt.sections.get("optimizer") != "recipe_state.pt" or src is None:
        return

    def edit(tree: Any, table: Any) -> Any:
        return {**tree, "optimizer": edit_optimizer(tree["optimizer"], plan, table)}

    dst = os.path.join(folder, "recipe_state.pt")
    with create_file(dst, replace=True) as f:  # the copy made with the folder: replaced, never written through
        rewrite_torch_file(src, f, plan, rng, edit, progress)


def _rewrite_training_file(plan: RepairPlan, name: str, src: str, dst: str, rng: np.random.Generator,
                           progress: Progress | None = None) -> bool:
    """optimizer.pt / scheduler.pt / scaler.pt / config.json as the policy requires. False: copy as is."""
    if name in ("optimizer.pt", "scheduler.pt") and plan.reset_scheduler:
        return True  # both gone: the Trainer builds a fresh optimizer and schedule
    if name == "optimizer.pt" and (plan.moments or plan.drop_optimizer_state):
        with create_file(dst, replace=True) as f:
            rewrite_torch_file(src, f, plan, rng, lambda tree, table: edit_optimizer(tree, plan, table), progress)
        return True
    if name == "scaler.pt" and plan.reset_scaler:
        with create_file(dst, replace=True) as f:
            rewrite_torch_file(src, f, plan, rng, lambda tree, table: edit_scaler(tree, plan))
        return True
    if name == "config.json":
        config = load_json_file(src)
        if isinstance(config, dict):
            config = _new_config(plan, config)
        with create_file(dst, replace=True) as f:
            f.write((json.dumps(config, indent=2, sort_keys=True) + "\n").encode())
        return True
    return False


def _new_config(plan: RepairPlan, config: dict) -> dict:
    """config.json with the plan's recorded sizes (a composite config's text sub-config, where the model class
    reads it), and nothing else: a value the plan does not list (a `vocab_size` that is no size: null, a string,
    2**70) is left as read; writing it anyway made OUT differ from the plan (the verify stage refused it, exit 3;
    found by the fuzzer)."""
    from ckptfix.recorded import apply

    return apply(config, {path[1:]: value for path, value in plan.recorded.items() if path[0] == "config"})


def rewrite_torch_file(src: str, f: Any, plan: RepairPlan, rng: np.random.Generator, edit: Callable,
                       progress: Progress | None = None) -> None:
    """The torch file `src` with `edit(tree, table)` applied, streamed to `f` (shared with accelerate)."""
    tree, locate_for, archive = torch_file.load(src, opaque=True)  # inert records are refused when written
    table = StorageTable(tree, locate_for, archive, lambda e: e.output(plan.init, plan.std, rng))
    prefix = archive.prefix if archive is not None else "archive"
    torch_save.write(f, edit(tree, table), table.source_for, prefix=prefix, progress=progress)


def _update_index_sizes(plan: RepairPlan, folder: str) -> None:
    """Sharded indexes carry `metadata.total_size`; keep it true after rows changed."""
    delta = sum(_nbytes(e.new_shape, e.source.dtype) - e.source.nbytes for e in plan.weights.values())
    for name in os.listdir(folder):
        if not name.endswith(".index.json") or delta == 0:
            continue
        path = os.path.join(folder, name)
        index = load_json_file(path)
        meta = index.get("metadata")
        if isinstance(meta, dict) and isinstance(meta.get("total_size"), int):
            meta["total_size"] += delta
            with create_file(path, replace=True) as f:
                f.write((json.dumps(index, indent=2, sort_keys=True) + "\n").encode())


def _nbytes(shape: tuple[int, ...], dtype: str) -> int:
    return DTYPE_SIZES[dtype] * math.prod(shape)


def _copy_tokenizer(tokenizer: Any, folder: str) -> None:
    """The new tokenizer's files, so the folder loads with the vocab it was resized for."""
    path = tokenizer.path
    if os.path.isdir(path):
        for name in TOKENIZER_FILES:
            src = os.path.join(path, name)
            if os.path.lexists(src):
                untrusted.check_input(src, error=RepairError)  # never a FIFO or device (a copy would hang)
                if os.path.isdir(src):
                    raise RepairError(f"{untrusted.escape(src)}: a folder where a tokenizer file belongs")
                _copy_in(src, os.path.join(folder, name))
    elif tokenizer.kind == "sentencepiece":
        _copy_in(path, os.path.join(folder, "tokenizer.model"))
    else:
        _copy_in(path, os.path.join(folder, "tokenizer.json"))


def _copy_in(src: str, dst: str) -> None:
    """A tokenizer file copied into OUT: read only where it lives in its folder (a link out of the tokenizer
    folder is refused by `open_regular`, never copied: no bytes from elsewhere reach OUT), written as a new file."""
    with untrusted.open_regular(src, error=RepairError) as fin, create_file(dst, replace=True) as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)


def safetensors_refusal(ckpt: Any) -> str | None:
    """Why a torch checkpoint cannot be written as `.safetensors`, or None for a bare state_dict of tensors
    of dtypes safetensors has (what `safetensors.torch.save_file(model.state_dict())` would take)."""
    from ckptfix.formats.safetensors_file import SAFETENSORS_DTYPES

    if ckpt.format != "torch" or ckpt.sections.get("model") != "":
        return "it holds more than a model state_dict (optimizer, schedule...), which safetensors cannot store"
    raw = ckpt.raw if isinstance(ckpt.raw, dict) else {}
    others = [k for k in raw if k not in ckpt.model]
    if others:
        return f"its entry {others[0]!r} is not a tensor, which safetensors cannot store"
    odd = sorted({t.dtype for t in ckpt.model.values() if t.dtype not in SAFETENSORS_DTYPES})
    if odd:
        return f"safetensors has no {odd[0]} dtype"
    return None


def write_safetensors_from_torch(plan: RepairPlan, out: str, record_fn: Callable[[], dict], *,
                                 rng: np.random.Generator, in_place: bool, progress: Any = None) -> str | None:
    """A repaired bare state_dict written as `.safetensors` (the user named OUT so): edited tensors produced,
    contiguous ones copied byte for byte, other views materialised from the mapped file; tied names each
    get their own copy of the same values (safetensors stores no shared tensors). Record in OUT.ckptfix.json."""
    produced: dict[str, Any] = {}  # a tied pair's edited tensor is produced once (its new rows are random)

    def edited(owner: str) -> Any:
        if owner not in produced:
            produced[owner] = plan.weights[owner].produce(plan.init, plan.std, rng)
        return produced[owner]

    entries = []
    for name, t in plan.ckpt.model.items():
        owner = plan.ckpt.tied.get(name, name)
        if owner in plan.weights:
            entries.append(safetensors_save.Entry(name, t.dtype, plan.weights[owner].new_shape,
                                                  produce=lambda o=owner: edited(o)))  # type: ignore[misc]
        elif t.stride in (None, t.contiguous_stride()) and not t.repeats_storage():
            where = t.locate()
            start = where.start + t.offset * DTYPE_SIZES[t.dtype]
            entries.append(safetensors_save.Entry(name, t.dtype, t.shape,
                                                  copy_from=type(where)(where.file, start, t.nbytes)))
        else:
            entries.append(safetensors_save.Entry(name, t.dtype, t.shape,
                                                  produce=lambda t=t: np.ascontiguousarray(t.read_stored())))  # type: ignore[misc]
    backup = backup_path(out) if in_place else None
    with atomic_file(out, mode_like=plan.ckpt.path, backup=in_place) as f:
        safetensors_save.write(f, entries, {"format": "pt"}, progress)
    with atomic_file(out + ".ckptfix.json") as f:
        f.write(record_json(record_fn()))
    return backup
