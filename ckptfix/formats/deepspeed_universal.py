"""DeepSpeed universal checkpoints (what `ds_to_universal` writes), read per parameter.

Layout measured on DeepSpeed 0.19.8 (`ds_to_universal --inject_missing_state` of a 2-rank ZeRO-2 save):

    <folder>/mp_rank_00_model_states.pt        the source's model-states file (`module`, `param_shapes`,
                                               `lr_scheduler`, `global_steps`, `ds_config`, ...)
    <folder>/zero/optimizer_state.pt           loss scaler, zero_stage, partition_count, param_groups
    <folder>/zero/<param name>/fp32.pt         {"param": full fp32 tensor, "cat_dim": 0, ...}
    <folder>/zero/<param name>/exp_avg.pt      the same dict for each optimizer moment
    <folder>/zero/<param name>/exp_avg_sq.pt
    <folder>/zero/<param name>/step.pt         a 0-d tensor

Under ZeRO-3 there is one model-states file per data-parallel rank (`zero_pp_rank_<r>_mp_rank_00_...`,
`module` holding empty placeholders, `param_shapes` the real shapes), each fp32/moment file holds the
flat parameter itself (no dict), and there is no step.pt (the step is in optimizer_state.pt).

Every parameter is whole in its own files, at any world size: DeepSpeed re-partitions them when a run
loads the folder with `"checkpoint": {"load_universal": true}` (`engine.load_checkpoint(dir, tag)`).
The model is the fp32 master weights; the optimizer is keyed by parameter name.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from ckptfix.checkpoint import Checkpoint, OptimizerState, ParamGroup, ParamState, read_scalar
from ckptfix.dtypes import contiguous_stride
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.formats import common
from ckptfix.formats.deepspeed_folder import _MODEL_STATES, LOAD_ASSERTS
from ckptfix.formats.deepspeed_folder import _torn_refused as _load
from ckptfix.formats.pickle_records import TensorRef

ZERO = "zero"
OPTIMIZER_STATE = "optimizer_state.pt"
WEIGHTS = "fp32"  # the per-parameter file holding the master weights; every other *.pt but step is a moment


def sniff(path: str) -> bool:
    """A model-states file beside zero/ (either one alone: a save that lost the other, which `read` refuses)."""
    zero = os.path.join(path, ZERO)
    return os.path.isfile(os.path.join(zero, OPTIMIZER_STATE)) or (
        os.path.isdir(zero) and model_states_file(path) is not None)


# What engine.load_checkpoint(..., load_universal) (DeepSpeed 0.19.8) does without a per-parameter file: measured in
# tests/test_resume_deepspeed.py
MISSING_PARAM_FILE = {
    "fp32": "engine.load_checkpoint loads without a word and leaves that parameter at the new run's initialisation "
            "while restoring its moments: the resumed model is silently not the saved one",
    "step": "engine.load_checkpoint raises AssertionError: 'Steps [...] are not equal'",
    "": "engine.load_checkpoint raises ValueError: '{key} not found in optimizer state fragment'",
}


def model_states_file(path: str) -> str | None:
    """The model-states file for model-parallel rank 0 (`zero_pp_rank_0_...` under ZeRO-3)."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    for name in names:
        m = _MODEL_STATES.match(name)
        if m and int(m.group(3)) == 0 and int(m.group(2) or 0) == 0:
            return os.path.join(path, name)
    return None


def param_folders(path: str) -> dict[str, str]:
    """Parameter name -> its folder under zero/ (the folder's name is the parameter's name)."""
    zero = os.path.join(path, ZERO)
    return {n: os.path.join(zero, n) for n in sorted(os.listdir(zero)) if os.path.isdir(os.path.join(zero, n))}


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    model_file = model_states_file(path)
    if model_file is None:
        raise UnreadableCheckpoint(f"{path}: no DeepSpeed *model_states.pt file beside zero/ ({LOAD_ASSERTS})")
    if not os.path.isfile(os.path.join(path, ZERO, OPTIMIZER_STATE)):
        raise UnreadableCheckpoint(f"{path}: zero/{OPTIMIZER_STATE} is missing (engine.load_checkpoint with "
                                   "load_universal raises AssertionError: '... containing optimizer global state is "
                                   "missing! Cannot proceed.')")
    tree, _ = _load(model_file, trust_pickle)
    if not isinstance(tree, Mapping):
        raise UnreadableCheckpoint(f"{model_file}: holds a {type(tree).__name__}, not DeepSpeed model states")
    ckpt = Checkpoint(path=path, format="deepspeed-universal", raw=tree)
    ckpt.files["model"] = model_file
    ckpt.files["optimizer"] = os.path.join(path, ZERO, OPTIMIZER_STATE)
    ckpt.sections["model"] = "zero/<name>/fp32.pt"
    ckpt.sections["optimizer"] = "zero/<name>/{exp_avg,exp_avg_sq,step}.pt"
    state: dict[Any, ParamState] = {}
    shapes = {n: tuple(s) for g in tree.get("param_shapes") or [] if isinstance(g, Mapping) for n, s in g.items()}
    for name, folder in param_folders(path).items():
        weights, ps = _param(name, folder, shapes.get(name), trust_pickle)
        if weights is not None:
            ckpt.model[name] = weights
        if ps.tensors:
            state[name] = ps
    if not ckpt.model:
        raise UnreadableCheckpoint(f"{path}: zero/ holds no parameter folder with an fp32.pt")
    if isinstance(tree.get("lr_scheduler"), Mapping):
        ckpt.scheduler = dict(tree["lr_scheduler"])
        ckpt.sections["scheduler"] = f"{os.path.basename(model_file)}: lr_scheduler"
    ckpt.extras = {k: v for k, v in tree.items() if k not in ("module", "optimizer", "lr_scheduler")}
    groups = _groups(ckpt.files["optimizer"], tree, list(ckpt.model), trust_pickle)
    ckpt.optimizer = OptimizerState(kind=common.infer_kind(state, groups), groups=groups, state=state)
    ckpt.notes.append(f"DeepSpeed universal checkpoint: {len(ckpt.model)} parameter(s), each whole in "
                      "zero/<name>/ (fp32 weights and moments); loads at any world size with load_universal")
    ckpt.extras["deepspeed_files"] = {"missing": _missing_param_files(path), "no_latest": "", "tag": ""}
    return ckpt


def _missing_param_files(path: str) -> dict[str, str]:
    """zero/<name>/<file> -> what load_checkpoint does without it, for each file some parameter folder holds and
    another lacks (ds_to_universal writes the same files for every parameter)."""
    folders = {n: {f for f in os.listdir(d) if f.endswith(".pt")} for n, d in param_folders(path).items()}
    every = set().union(*folders.values()) if folders else set()
    missing = {}
    for name, have in folders.items():
        for file in sorted(every - have):
            key = file[:-3]
            why = MISSING_PARAM_FILE.get(key, MISSING_PARAM_FILE[""]).format(key=key)
            missing[f"{ZERO}/{name}/{file}"] = why
    return missing


def _param(name: str, folder: str, shape: tuple | None, trust_pickle: bool) -> tuple[Any, ParamState]:
    """fp32 weights and moments of one parameter: each file a {"param": tensor, ...} dict (ZeRO-1/2), or
    the flat tensor itself (ZeRO-3, shaped by the model states' `param_shapes`)."""
    ps, weights = ParamState(), None
    for file in sorted(os.listdir(folder)):
        key, ext = os.path.splitext(file)
        if ext != ".pt":
            continue
        tree, locate_for = _load(os.path.join(folder, file), trust_pickle)
        if key == "step":
            ps.step = read_scalar(common.tensor_from_ref(f"{name}:step", tree, locate_for)) \
                if isinstance(tree, TensorRef) else tree if isinstance(tree, (int, float)) else None
            continue
        ref = tree.get("param") if isinstance(tree, Mapping) else tree
        if not isinstance(ref, TensorRef):
            raise UnreadableCheckpoint(f"{os.path.join(folder, file)}: no 'param' tensor")
        if ref.shape != shape and shape is not None and len(ref.shape) == 1 and ref.numel == math.prod(shape) \
                and ref.stride in ((1,), ()):  # ZeRO-3 stores the flat parameter
            ref = TensorRef(ref.storage, ref.offset, shape, contiguous_stride(shape), ref.dtype, ref.requires_grad)
        info = common.tensor_from_ref(name if key == WEIGHTS else f"{name}:{key}", ref, locate_for)
        if key == WEIGHTS:
            info.is_parameter, weights = True, info
        else:
            ps.tensors[key] = info
    return weights, ps


def _groups(file: str, tree: Mapping, names: list[str], trust_pickle: bool) -> list[ParamGroup]:
    """Param groups from zero/optimizer_state.pt, their parameters named from the model states'
    `param_shapes` (one ordered name -> shape mapping per group)."""
    sd, _ = _load(file, trust_pickle)
    raw = sd.get("param_groups") if isinstance(sd, Mapping) else None
    shapes = tree.get("param_shapes")
    per_group = [list(s) for s in shapes if isinstance(s, Mapping)] if isinstance(shapes, list) else []
    if not isinstance(raw, list) or not raw:
        return [ParamGroup(params=names, options={})]
    groups = []
    for g, options in enumerate(raw):
        options = {k: v for k, v in options.items() if k != "params"} if isinstance(options, Mapping) else {}
        params = per_group[g] if g < len(per_group) else (names if len(raw) == 1 else [])
        groups.append(ParamGroup(params=params, options=options))
    return groups
