"""`accelerate.Accelerator.save_state` folders.

Measured on accelerate 1.15: model `i` is `model.safetensors` / `model_1.safetensors` ... (or
`pytorch_model.bin` / `pytorch_model_1.bin` with `safe_serialization=False`), optimizer `i` is
`optimizer.bin` / `optimizer_1.bin` ..., scheduler `i` `scheduler.bin` / `scheduler_1.bin` ..., all
`torch.save` files except the safetensors weights; `scaler.pt` only when a GradScaler is in use;
`random_states_<process>.pkl` per process. The first model/optimizer/scheduler is reported, the rest
are listed in `extras["accelerate"]` and a note.

`random_states_<process>.pkl` (a torch.save file of the Python/NumPy/torch RNG state and
`Accelerator.step`) is read as data with the allowlist only, to tell a torn one; `custom_checkpoint_*.pkl`
(user objects registered for checkpointing, which accelerate loads with weights_only=False) is never
unpickled: its zip structure is checked. Neither is `sampler*.bin` nor `dl_state_dict*.bin`. What the folder
lacks for `Accelerator.load_state` is recorded in `extras["accelerate_files"]` (strings only) for
`checks/resume_accelerate.py`.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, Callable, TypeVar

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.errors import CkptfixError, UnreadableCheckpoint
from ckptfix.formats import common, safetensors_file, torch_file

MODEL_PATTERNS = ("model{}.safetensors", "pytorch_model{}.bin", "pytorch_model_fsdp{}.bin")
UNREAD_PATTERNS = ("sampler*.bin", "dl_state_dict*.bin", "custom_checkpoint_*.pkl")
RNG_FILE = re.compile(r"random_states_(\d+)\.pkl")
CUSTOM_FILE = re.compile(r"custom_checkpoint_(\d+)\.pkl")
RNG_KEYS = ("random_state", "numpy_random_seed", "torch_manual_seed")  # what load_accelerator_state sets first
# What Accelerator.load_state (accelerate 1.15) does with a torn file it reads: torch.load or safetensors raises, and
# the error names no file (measured in tests/test_resume_accelerate.py)
TORN = {"torch": "Accelerator.load_state dies on it in torch.load (RuntimeError 'PytorchStreamReader failed reading "
                 "zip archive' for a cut file, EOFError for an empty one), naming no file",
        "safetensors": "Accelerator.load_state dies on it in safetensors (SafetensorError 'Error while deserializing "
                       "header'), naming no file"}
T = TypeVar("T")


def sniff(path: str) -> bool:
    """`Accelerator.save_state`: optimizer.bin / scheduler.bin, or random_states_*.pkl."""
    return (any(os.path.exists(os.path.join(path, n)) for n in ("optimizer.bin", "scheduler.bin"))
            or bool(glob.glob(os.path.join(path, "random_states_*.pkl"))))


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    """Model 0, optimizer 0, scheduler 0 and the scaler of a `save_state` folder (metadata only)."""
    ckpt = Checkpoint(path=path, format="accelerate")
    models = [f for pattern in MODEL_PATTERNS for f in _numbered(path, pattern)]
    optimizers = _numbered(path, "optimizer{}.bin")
    schedulers = _numbered(path, "scheduler{}.bin")
    if models:
        ckpt.model = _torn_refused(models[0], lambda: _weights(models[0], trust_pickle))
        ckpt.ordered = not models[0].endswith(".safetensors")
        ckpt.tied = common.find_tied(ckpt.model)
        _use(ckpt, "model", models[0])
    if optimizers:
        tree, locate_for, archive = _torn_refused(optimizers[0], lambda: torch_file.load(optimizers[0],
                                                                                      opaque=trust_pickle))
        ckpt.unopened_records += torch_file.unopened_records(archive)
        if not common.is_optimizer_state(tree):
            raise UnreadableCheckpoint(f"{optimizers[0]}: not an optimizer state_dict")
        ckpt.optimizer = common.parse_optimizer(tree, locate_for, optimizers[0])
        _use(ckpt, "optimizer", optimizers[0])
    if schedulers:
        ckpt.scheduler = _torn_refused(schedulers[0], lambda: _small_dict(schedulers[0], trust_pickle))
        _use(ckpt, "scheduler", schedulers[0])
    scaler = os.path.join(path, "scaler.pt")
    if os.path.exists(scaler):
        ckpt.scaler = _torn_refused(scaler, lambda: _small_dict(scaler, trust_pickle))
        _use(ckpt, "scaler", scaler)
    _list_the_rest(ckpt, path, models, optimizers, schedulers)
    ckpt.extras["accelerate_files"] = resume_files(path, ckpt, models, optimizers, schedulers)
    if not ckpt.model and ckpt.optimizer is None:
        raise UnreadableCheckpoint(f"{path}: accelerate folder without model weights or optimizer.bin")
    return ckpt


def _torn_refused(file: str, read: Callable[[], T]) -> T:
    """`read()`, its one-line refusal of a torn file extended with what `Accelerator.load_state` does with it."""
    try:
        return read()
    except UnreadableCheckpoint as exc:
        if " refusing " in str(exc) or "TorchScript" in str(exc):
            raise
        kind = "safetensors" if file.endswith(".safetensors") else "torch"
        raise type(exc)(f"{exc} ({TORN[kind]})") from None


def resume_files(path: str, ckpt: Checkpoint, models: list[str], optimizers: list[str],
                 schedulers: list[str]) -> dict[str, Any]:
    """What `Accelerator.load_state(path)` reads and this folder lacks or holds torn, as strings only (extras are
    searched for recorded integers): `missing` {name: why it is expected}, `torn` {name: why}, `rng` the RNG files,
    `no_optimizer` "yes" when the save holds neither optimizer nor scheduler (saved with none prepared)."""
    names = set(os.listdir(path))
    sharded = any(os.path.isdir(os.path.join(path, n)) for n in names)  # FSDP / DeepSpeed keep state in folders
    missing: dict[str, str] = {}
    for kind, files in (("model", models), ("optimizer", optimizers), ("scheduler", schedulers)):
        for gap in _gaps(files, kind):
            missing[gap] = f"{os.path.basename(files[-1])} is there"
    if not models and not sharded:
        missing["model.safetensors"] = "every save_state writes the weights"
    if not optimizers and schedulers and not sharded:
        missing["optimizer.bin"] = f"{os.path.basename(schedulers[0])} is there"
    if optimizers and not schedulers and ckpt.optimizer is not None and any(
            "initial_lr" in g.options for g in ckpt.optimizer.groups):
        missing["scheduler.bin"] = (f"{os.path.basename(optimizers[0])}'s param groups hold initial_lr, which an LR "
                                    "scheduler adds")
    torn: dict[str, str] = {}
    rng = sorted((n for n in names if RNG_FILE.fullmatch(n)), key=_number)
    for gap in _gaps([os.path.join(path, n) for n in rng], "random_states"):
        missing[gap] = f"{rng[-1]} is there"
    for name in rng:
        if why := _rng_reason(os.path.join(path, name)):
            torn[name] = why
    if rng:
        ckpt.notes.append(f"{len(rng)} random_states file(s) read as data (RNG state only)")
    custom = sorted((n for n in names if CUSTOM_FILE.fullmatch(n)), key=_number)
    for gap in _gaps([os.path.join(path, n) for n in custom], "custom_checkpoint"):
        missing[gap] = f"{custom[-1]} is there"
    for name in custom:
        try:
            torch_file.check_whole(os.path.join(path, name))  # structure only: never unpickled
        except CkptfixError as exc:
            torn[name] = _why(exc, os.path.join(path, name))
    return {"missing": missing, "torn": torn, "rng": rng,
            "no_optimizer": "yes" if not optimizers and not schedulers and not sharded else ""}


def _number(name: str) -> int:
    m = re.search(r"(\d+)\.\w+$", name)
    return int(m.group(1)) if m else 0


def _gaps(files: list[str], kind: str) -> list[str]:
    """The names below the highest index of a numbered family that are not there (`optimizer_2.bin` without
    `optimizer_1.bin`): accelerate loads every index up to its count."""
    if not files:
        return []
    base = os.path.basename(files[0])
    if kind in ("random_states", "custom_checkpoint"):
        have = {_number(os.path.basename(f)) for f in files}
        return [f"{kind}_{i}.pkl" for i in range(max(have)) if i not in have]
    have = {int(m.group(1)) if (m := re.search(r"_(\d+)\.\w+$", os.path.basename(f))) else 0 for f in files}
    stem, ext = re.sub(r"_\d+$", "", os.path.splitext(base)[0]), os.path.splitext(base)[1]
    return [stem + (f"_{i}" if i else "") + ext for i in range(max(have)) if i not in have]


def _rng_reason(file: str) -> str | None:
    """Why a random_states file would not restore the RNGs (read as data with the allowlist), or None."""
    try:
        tree, _, _ = torch_file.load(file)
    except CkptfixError as exc:
        return _why(exc, file)
    if not isinstance(tree, dict):
        return f"holds a {type(tree).__name__}, not the RNG state dict"
    absent = [k for k in RNG_KEYS if k not in tree]
    return f"holds no {', '.join(absent)}" if absent else None


def _why(exc: Exception, file: str) -> str:
    return str(exc).replace(file + ": ", "")


def _numbered(path: str, pattern: str) -> list[str]:
    """`name{}.ext` files in accelerate's order: no suffix first, then `_1`, `_2`, ... numerically."""
    found = []
    regex = re.compile(re.escape(pattern).replace(r"\{\}", r"(_(\d+))?") + "$")
    for file in os.listdir(path):
        m = regex.match(file)
        if m:
            found.append((int(m.group(2) or 0), os.path.join(path, file)))
    return [f for _, f in sorted(found)]


def _weights(file: str, trust_pickle: bool) -> dict[str, TensorInfo]:
    if file.endswith(".safetensors"):
        return safetensors_file.tensors(file)[0]
    return torch_file.read(file, trust_pickle=trust_pickle).model


def _small_dict(file: str, trust_pickle: bool) -> dict:
    tree, _, _ = torch_file.load(file, opaque=trust_pickle)
    if not isinstance(tree, dict):
        raise UnreadableCheckpoint(f"{file}: holds a {type(tree).__name__}, expected a state_dict")
    return dict(tree)


def _use(ckpt: Checkpoint, part: str, file: str) -> None:
    ckpt.sections[part] = os.path.basename(file)
    ckpt.files[part] = file


def _list_the_rest(ckpt: Checkpoint, path: str, models: list[str], optimizers: list[str],
                   schedulers: list[str]) -> None:
    """Record what is saved but not reported: further models/optimizers, and files never unpickled."""
    names = {"models": models, "optimizers": optimizers, "schedulers": schedulers}
    listing = {k: [os.path.basename(f) for f in v] for k, v in names.items() if v}
    for kind, files in listing.items():
        if len(files) > 1:
            ckpt.notes.append(f"{len(files)} {kind} saved ({', '.join(files)}); ckptfix reports the first")
    unread = sorted(os.path.basename(f) for p in UNREAD_PATTERNS for f in glob.glob(os.path.join(path, p)))
    if unread:
        listing["not_unpickled"] = unread
        ckpt.notes.append(f"{len(unread)} file(s) never unpickled (RNG/sampler/custom state, arbitrary pickles): "
                          f"{', '.join(unread[:4])}{' ...' if len(unread) > 4 else ''}")
    fsdp = sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    if fsdp:
        listing["folders"] = fsdp
        ckpt.notes.append(f"sub-folders not read ({', '.join(fsdp[:4])}); FSDP sharded state is a DCP "
                          "folder: inspect it directly")
    ckpt.extras["accelerate"] = listing
