"""Hugging Face folders: a Trainer `checkpoint-N/`, a `save_pretrained` model, a PEFT adapter.

Weights come from `model.safetensors`, `pytorch_model.bin` or their sharded `*.index.json`;
optimizer/scheduler/scaler from `optimizer.pt`/`scheduler.pt`/`scaler.pt`. `training_args.bin` is a
pickled `TrainingArguments` class: it is never unpickled, only read statically (opaque mode, no
import) for a few hyperparameters. `rng_state*.pth` is read as data only to tell a torn file; what a Trainer
folder lacks for a resume is recorded in `extras["trainer_files"]` (strings only) for `checks/resume.py`.
"""

from __future__ import annotations

import os
import re
from typing import Any

from ckptfix.checkpoint import Checkpoint, TensorInfo, join_split_tables
from ckptfix.errors import CkptfixError, UnreadableCheckpoint
from ckptfix.formats import common, safetensors_file, torch_file
from ckptfix.formats.pickle_records import OpaqueObject

TRAINING_ARG_FIELDS = ("learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio", "max_steps",
                       "num_train_epochs", "per_device_train_batch_size", "gradient_accumulation_steps",
                       "weight_decay", "fp16", "bf16", "max_grad_norm", "optim", "seed", "ignore_data_skip",
                       "dataloader_drop_last", "auto_find_batch_size")


WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def _has(path: str, *names: str) -> bool:
    return any(os.path.exists(os.path.join(path, n)) for n in names)


def sniff_adapter(path: str) -> bool:
    """A PEFT adapter (`save_pretrained` of a PeftModel; its weights alone: one that lost its config, which `read`
    refuses naming what PeftModel.from_pretrained then does)."""
    return _has(path, "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")


def sniff_trainer(path: str) -> bool:
    """A Trainer `checkpoint-N/` folder."""
    return _has(path, "trainer_state.json", "optimizer.pt", "scheduler.pt")


def sniff_model(path: str) -> bool:
    """A `save_pretrained` model folder (with config.json but no weights file or index: one that lost them, which
    `read` refuses naming what from_pretrained then does)."""
    return _has(path, *WEIGHT_FILES, "config.json")


SHARD_FILE = re.compile(r"(model|pytorch_model)-\d+-of-\d+\.(safetensors|bin)")
# What transformers 5.24's from_pretrained does with a model folder's file missing or torn: measured in
# tests/test_resume_hf_model.py
NO_WEIGHTS = ("from_pretrained raises OSError: 'Error no file named model.safetensors, or pytorch_model.bin, found in "
              "directory ...'")
NO_ADAPTER_WEIGHTS = ("PeftModel.from_pretrained (peft 0.21) then looks for the folder's name on the Hub and raises "
                      "HFValidationError: 'Repo id must be in the form ...', naming no file")


def read_adapter(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    return read(path, "peft-adapter", trust_pickle=trust_pickle)


# the folder formats `read` reads, trainer_state.json included (kept as extras["trainer_state"]): a Trainer's
# checkpoint-N of a full model or of a PEFT adapter, and a model folder holding one
TRAINER_STATE_FORMATS = ("hf-trainer", "hf-model", "peft-adapter")


def read_trainer(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    return read(path, "hf-trainer", trust_pickle=trust_pickle)


def read_model(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    return read(path, "hf-model", trust_pickle=trust_pickle)


def read(path: str, kind: str, *, trust_pickle: bool = False) -> Checkpoint:
    ckpt = Checkpoint(path=path, format=kind)
    weights = _weight_files(path, adapter=(kind == "peft-adapter"))
    for file in weights:
        ckpt.model.update(_read_weights(file, trust_pickle, ckpt.pickles))
        ckpt.files.setdefault("model", file)
    ckpt.sections["model"] = ", ".join(os.path.basename(f) for f in weights)
    ckpt.ordered = not any(f.endswith(".safetensors") for f in weights)
    ckpt.tied = common.find_tied(ckpt.model)
    if weights and all(f.endswith(".safetensors") for f in weights):  # what `write_safetensors` saves in parts
        ckpt.model = join_split_tables(ckpt.model, ckpt.tied)
    try:
        config = _json(path, "adapter_config.json" if kind == "peft-adapter" else "config.json")
    except UnreadableCheckpoint as exc:
        if "not valid JSON" not in str(exc):
            raise
        said = ("PeftModel.from_pretrained raises json.JSONDecodeError, naming no file" if kind == "peft-adapter" else
                "from_pretrained raises OSError: 'It looks like the config file at ... is not a valid JSON file.'")
        raise UnreadableCheckpoint(f"{exc} ({said})") from None
    if config is None and kind == "peft-adapter" and not sniff_trainer(path):  # (a Trainer folder: its rules)
        raise UnreadableCheckpoint(f"{path}: no adapter_config.json beside the adapter weights (PeftModel.from_pretrained "
                                   "raises ValueError: \"Can't find 'adapter_config.json' at ...\")")
    if config is not None:
        ckpt.extras["config"] = config
    elif kind == "hf-model":  # save_pretrained always writes it; from_pretrained cannot build the model without it
        ckpt.extras["model_files"] = {"missing": ["config.json"]}
    _read_training_state(path, ckpt, trust_pickle)
    if kind == "hf-trainer" or (kind == "peft-adapter" and sniff_trainer(path)):  # a PEFT model's checkpoint-N too
        ckpt.extras["trainer_files"] = trainer_files(path, ckpt)
    if not ckpt.model and ckpt.optimizer is None:
        if kind == "peft-adapter":
            raise UnreadableCheckpoint(f"{path}: no adapter weights (adapter_model.safetensors or adapter_model.bin) in "
                                       f"the folder ({NO_ADAPTER_WEIGHTS})")
        shards = sorted(n for n in os.listdir(path) if SHARD_FILE.fullmatch(n))
        lost = f"{len(shards)} shard file(s) without their index.json: " if shards else ""
        raise UnreadableCheckpoint(f"{path}: no weight file (model.safetensors, pytorch_model.bin or an index) in the "
                                   f"folder ({lost}{NO_WEIGHTS})")
    return ckpt


def _weight_files(path: str, adapter: bool) -> list[str]:
    names = ("adapter_model.safetensors", "adapter_model.bin") if adapter else \
        ("model.safetensors", "pytorch_model.bin")
    for name in names:
        index = os.path.join(path, name + ".index.json")
        if os.path.exists(index):
            return _shards(index)
        file = os.path.join(path, name)
        if os.path.exists(file):
            return [file]
    return []


def _shards(index_path: str) -> list[str]:
    """The shard files an index names, in first-use order; each must exist."""
    try:
        index = _load_json(index_path)
    except UnreadableCheckpoint as exc:
        if "not valid JSON" not in str(exc):
            raise
        raise UnreadableCheckpoint(f"{exc} (from_pretrained raises json.JSONDecodeError on it, naming no file)") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise UnreadableCheckpoint(f"{index_path}: index without a weight_map")
    folder = os.path.dirname(index_path)
    if not all(isinstance(s, str) and s for s in weight_map.values()):
        raise UnreadableCheckpoint(f"{index_path}: weight_map names a shard that is not a file name")
    shards = list(dict.fromkeys(weight_map.values()))
    # A shard is a file in the folder: an absolute path or ../ would make ckptfix read files elsewhere.
    escaping = [s for s in shards if os.path.isabs(s) or ".." in s.replace("\\", "/").split("/")]
    if escaping:
        raise UnreadableCheckpoint(f"{index_path}: shard {escaping[0][:120]!r} lies outside the folder")
    missing = [s for s in shards if not os.path.exists(os.path.join(folder, str(s)))]
    if missing:
        raise UnreadableCheckpoint(f"{index_path}: shard files missing: {', '.join(map(str, missing[:3]))} "
                                   "(from_pretrained raises FileNotFoundError on the first)")
    return _distinct_files([os.path.join(folder, str(s)) for s in shards])


def _distinct_files(paths: list[str]) -> list[str]:
    """Each file once, under the first name that reaches it: an index may spell one shard 400 ways
    (`./a`, `.//a`, a hard link), and reading it once per spelling multiplied the work by 400."""
    seen: dict[tuple[int, int], str] = {}
    for path in paths:
        st = os.stat(path)
        seen.setdefault((st.st_dev, st.st_ino), path)
    return list(seen.values())


def _read_weights(file: str, trust_pickle: bool, pickles: dict[str, Any]) -> dict[str, TensorInfo]:
    if file.endswith(".safetensors"):
        return safetensors_file.tensors(file)[0]
    sub = torch_file.read(file, trust_pickle=trust_pickle)
    pickles[os.path.basename(file)] = sub.raw
    for info in sub.model.values():  # every shard numbers its storages from "0": one namespace per file
        info.storage_id = f"{os.path.basename(file)}:{info.storage_id}"
    return sub.model


def _read_training_state(path: str, ckpt: Checkpoint, trust_pickle: bool) -> None:
    optimizer = os.path.join(path, "optimizer.pt")
    if os.path.exists(optimizer):
        tree, locate_for, archive = torch_file.load(optimizer, opaque=trust_pickle)
        ckpt.unopened_records += torch_file.unopened_records(archive)
        ckpt.pickles["optimizer.pt"] = tree
        if not common.is_optimizer_state(tree):
            raise UnreadableCheckpoint(f"{optimizer}: not an optimizer state_dict")
        ckpt.optimizer = common.parse_optimizer(tree, locate_for, optimizer)
        ckpt.sections["optimizer"] = "optimizer.pt"
        ckpt.files["optimizer"] = optimizer
    else:
        _read_recipe_state(path, ckpt, trust_pickle)
    for part, name in (("scheduler", "scheduler.pt"), ("scaler", "scaler.pt")):
        file = os.path.join(path, name)
        if os.path.exists(file):
            tree, _, _ = torch_file.load(file, opaque=trust_pickle)
            ckpt.pickles[name] = tree
            if isinstance(tree, dict):
                setattr(ckpt, part, dict(tree))
                ckpt.sections[part] = name
                ckpt.files[part] = file
    try:
        state = _json(path, "trainer_state.json")
    except CkptfixError as exc:  # torn by a crash mid-write: a finding (CKF311), not a refusal
        state = None
        ckpt.notes.append(f"trainer_state.json unreadable: {exc}")
    if state is not None:
        ckpt.extras["trainer_state"] = state
    args = os.path.join(path, "training_args.bin")
    if os.path.exists(args):
        ckpt.extras["training_args"] = _training_args(args)
        ckpt.notes.append("training_args.bin is a pickled class: read statically, never unpickled")


RNG_FILE = re.compile(r"rng_state(_\d+)?\.pth")


def trainer_files(path: str, ckpt: Checkpoint) -> dict[str, Any]:
    """What `Trainer.train(resume_from_checkpoint=path)` needs and this folder lacks, as strings only (extras
    are searched for recorded integers): `missing` file names, `torn` {name: why}, `rng` the RNG files,
    `optimizer_elsewhere` where a DeepSpeed/FSDP/accelerate save keeps the optimizer instead of optimizer.pt,
    `save_only_model` "yes" when training_args.bin records it (the Trainer then saves no optimizer on purpose)."""
    names = set(os.listdir(path))
    missing = [n for n in ("optimizer.pt", "scheduler.pt", "trainer_state.json") if n not in names]
    torn: dict[str, str] = {}
    if "trainer_state.json" in names and "trainer_state" not in ckpt.extras:
        note = next((n for n in ckpt.notes if n.startswith("trainer_state.json unreadable: ")), "")
        torn["trainer_state.json"] = note.split(": ", 1)[-1] or "not readable JSON"
    # transformers' Trainer._load_optimizer_and_scheduler also counts optimizer.bin or a sub-folder named like
    # "optimizer" (FSDP/accelerate) as the optimizer; DeepSpeed keeps both in its global_stepN/ folder
    elsewhere = sorted(n for n in names if n == "optimizer.bin" or (
        os.path.isdir(os.path.join(path, n)) and ("optimizer" in n or re.fullmatch(r"global_step\d+", n))))
    rng = sorted(n for n in names if RNG_FILE.fullmatch(n))
    for name in rng:
        try:
            torch_file.load(os.path.join(path, name))  # data only, the allowlist: never torch.load
        except CkptfixError as exc:
            torn[name] = str(exc).replace(os.path.join(path, name) + ": ", "")
    if rng:
        ckpt.notes.append(f"{len(rng)} rng_state file(s) read as data (RNG state only)")
    only_model = "yes" if _training_arg(os.path.join(path, "training_args.bin"), "save_only_model") is True else ""
    return {"missing": missing, "torn": torn, "rng": rng, "optimizer_elsewhere": elsewhere,
            "save_only_model": only_model}


# torchtune keeps the optimizer apart from the model folder (<output_dir>/epoch_N/): in
# <output_dir>/recipe_state/recipe_state.pt (recipe_state.pt at the output_dir in older releases) under
# 'optimizer' (torchtune/training/checkpointing/_utils.py RECIPE_STATE_DIRNAME, training.OPT_KEY)
RECIPE_STATE = "recipe_state.pt"


def recipe_state_file(path: str) -> str | None:
    """torchtune's recipe state for the model folder `path`: in it, or beside it in its output_dir."""
    parent = os.path.dirname(os.path.abspath(path))
    for file in (os.path.join(path, RECIPE_STATE), os.path.join(parent, "recipe_state", RECIPE_STATE),
                 os.path.join(parent, RECIPE_STATE)):
        if os.path.isfile(file):
            return file
    return None


def _read_recipe_state(path: str, ckpt: Checkpoint, trust_pickle: bool) -> None:
    file = recipe_state_file(path)
    if file is None:
        return
    tree, locate_for, _ = torch_file.load(file, opaque=trust_pickle)
    if not isinstance(tree, dict) or not common.is_optimizer_state(tree.get("optimizer")):
        return
    ckpt.optimizer = common.parse_optimizer(tree["optimizer"], locate_for, file)
    ckpt.sections["optimizer"] = RECIPE_STATE
    ckpt.files["optimizer"] = file
    ckpt.notes.append(f"optimizer state read from torchtune's {file}")


def _training_args(file: str) -> dict[str, Any]:
    """A few fields of a pickled TrainingArguments, read without importing transformers."""
    try:
        tree, _, _ = torch_file.load(file, opaque=True)
    except CkptfixError as exc:
        return {"unreadable": str(exc)}
    state = tree.state if isinstance(tree, OpaqueObject) else None
    if not isinstance(state, dict):
        return {"class": getattr(tree, "cls", type(tree).__name__)}
    out = {"class": tree.cls}
    values = {k: _enum_value(state.get(k)) for k in TRAINING_ARG_FIELDS}
    out.update({k: v for k, v in values.items() if isinstance(v, (int, float, str, bool))})
    kwargs = state.get("lr_scheduler_kwargs")  # the schedule's shape (cosine's num_cycles ...), when set
    if isinstance(kwargs, dict) and kwargs and all(isinstance(v, (int, float, str, bool)) for v in kwargs.values()):
        out["lr_scheduler_kwargs"] = {str(k): v for k, v in kwargs.items()}
    return out


def _enum_value(value: Any) -> Any:
    """A str enum member as its value: TrainingArguments keeps lr_scheduler_type as `SchedulerType("linear")`
    (`optim` as `OptimizerNames(...)`), which the opaque reader records as the call, never made."""
    if isinstance(value, OpaqueObject) and value.cls.startswith("transformers.") and len(value.args) == 1 \
            and isinstance(value.args[0], str) and not value.kwargs and value.state is None:
        return value.args[0]
    return value


def _training_arg(file: str, name: str) -> Any:
    """One field of a pickled TrainingArguments (read statically, as `_training_args`), or None."""
    if not os.path.isfile(file):
        return None
    try:
        tree, _, _ = torch_file.load(file, opaque=True)
    except CkptfixError:
        return None
    state = tree.state if isinstance(tree, OpaqueObject) else None
    return state.get(name) if isinstance(state, dict) else None


def _json(folder: str, name: str) -> Any:
    file = os.path.join(folder, name)
    return _load_json(file) if os.path.exists(file) else None


def _load_json(file: str) -> Any:
    from ckptfix.untrusted import load_json_file

    return load_json_file(file)  # regular files only, bounded size, digits and nesting
