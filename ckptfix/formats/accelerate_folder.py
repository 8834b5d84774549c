"""`accelerate.Accelerator.save_state` folders.

Measured on accelerate 1.15: model `i` is `model.safetensors` / `model_1.safetensors` ... (or
`pytorch_model.bin` / `pytorch_model_1.bin` with `safe_serialization=False`), optimizer `i` is
`optimizer.bin` / `optimizer_1.bin` ..., scheduler `i` `scheduler.bin` / `scheduler_1.bin` ..., all
`torch.save` files except the safetensors weights; `scaler.pt` only when a GradScaler is in use;
`random_states_<process>.pkl` per process. The first model/optimizer/scheduler is reported, the rest
are listed in `extras["accelerate"]` and a note.

Never unpickled: `random_states_*.pkl` (plain pickles of Python/NumPy/torch RNG state: NumPy's
state needs globals no allowlist should grant), `sampler*.bin` (a pickled sampler object),
`dl_state_dict*.bin` and `custom_checkpoint_*.pkl` (user objects registered for checkpointing).
"""

from __future__ import annotations

import glob
import os
import re

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.formats import common, safetensors_file, torch_file

MODEL_PATTERNS = ("model{}.safetensors", "pytorch_model{}.bin", "pytorch_model_fsdp{}.bin")
UNREAD_PATTERNS = ("random_states_*.pkl", "sampler*.bin", "dl_state_dict*.bin", "custom_checkpoint_*.pkl")


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
        ckpt.model = _weights(models[0], trust_pickle)
        ckpt.ordered = not models[0].endswith(".safetensors")
        ckpt.tied = common.find_tied(ckpt.model)
        _use(ckpt, "model", models[0])
    if optimizers:
        tree, locate_for, archive = torch_file.load(optimizers[0], opaque=trust_pickle)
        ckpt.unopened_records += torch_file.unopened_records(archive)
        if not common.is_optimizer_state(tree):
            raise UnreadableCheckpoint(f"{optimizers[0]}: not an optimizer state_dict")
        ckpt.optimizer = common.parse_optimizer(tree, locate_for, optimizers[0])
        _use(ckpt, "optimizer", optimizers[0])
    if schedulers:
        ckpt.scheduler = _small_dict(schedulers[0], trust_pickle)
        _use(ckpt, "scheduler", schedulers[0])
    scaler = os.path.join(path, "scaler.pt")
    if os.path.exists(scaler):
        ckpt.scaler = _small_dict(scaler, trust_pickle)
        _use(ckpt, "scaler", scaler)
    _list_the_rest(ckpt, path, models, optimizers, schedulers)
    if not ckpt.model and ckpt.optimizer is None:
        raise UnreadableCheckpoint(f"{path}: accelerate folder without model weights or optimizer.bin")
    return ckpt


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
