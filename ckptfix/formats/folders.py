"""Checkpoint folders: tell which framework wrote one, and hand it to that format's reader."""

from __future__ import annotations

import glob
import os

from ckptfix.checkpoint import Checkpoint
from ckptfix.errors import UnreadableCheckpoint

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "model.safetensors.index.json",
                "pytorch_model.bin.index.json")


def _has(path: str, *names: str) -> bool:
    return any(os.path.exists(os.path.join(path, n)) for n in names)


def detect(path: str) -> str:
    """The folder's format: hf-trainer, hf-model, peft-adapter, accelerate, dcp or deepspeed."""
    if _has(path, ".metadata"):
        return "dcp"
    if _has(path, "latest") or glob.glob(os.path.join(path, "global_step*")) or \
            glob.glob(os.path.join(path, "*mp_rank_*_model_states.pt")):
        return "deepspeed"
    if _has(path, "adapter_config.json"):
        return "peft-adapter"
    if _has(path, "trainer_state.json", "optimizer.pt", "scheduler.pt"):
        return "hf-trainer"
    if _has(path, "optimizer.bin", "scheduler.bin") or glob.glob(os.path.join(path, "random_states_*.pkl")):
        return "accelerate"
    if _has(path, *WEIGHT_FILES):
        return "hf-model"
    listing = ", ".join(sorted(os.listdir(path))[:6]) or "empty"
    raise UnreadableCheckpoint(f"{path}: folder holds no checkpoint ckptfix recognises ({listing})")


def read(path: str, kind: str, *, trust_pickle: bool = False) -> Checkpoint:
    if kind in ("hf-trainer", "hf-model", "peft-adapter"):
        from ckptfix.formats import hf_folder

        return hf_folder.read(path, kind, trust_pickle=trust_pickle)
    if kind == "accelerate":
        from ckptfix.formats import accelerate_folder

        return accelerate_folder.read(path, trust_pickle=trust_pickle)
    if kind == "dcp":
        from ckptfix.formats import dcp_folder

        return dcp_folder.read(path, trust_pickle=trust_pickle)
    if kind == "deepspeed":
        from ckptfix.formats import deepspeed_folder

        return deepspeed_folder.read(path, trust_pickle=trust_pickle)
    raise UnreadableCheckpoint(f"{path}: unsupported folder format {kind}")
