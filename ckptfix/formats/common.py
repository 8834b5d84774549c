"""What every format shares: finding the sections of a checkpoint dict, parsing optimizer state."""

from __future__ import annotations

from typing import Any, Callable, Iterator, Mapping

from ckptfix.checkpoint import ByteRange, Checkpoint, OptimizerState, ParamGroup, ParamState, TensorInfo, read_scalar
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.formats.pickle_safe import RebuiltTensor, StorageRef, TensorRef
from ckptfix.record import RECORD_KEY, Record
from ckptfix.untrusted import escape, fail

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state", "net", "network")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state", "opt")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp_scaler")
LIGHTNING_KEYS = ("optimizer_states", "lr_schedulers", "pytorch-lightning_version")

Locator = Callable[[StorageRef], Callable[[], ByteRange]]


def iter_leaves(tree: Any) -> Iterator[Any]:
    """Every non-container value in a tree, each container visited once (memo-shared pickles stay linear)."""
    seen: set[int] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if not isinstance(node, (dict, list, tuple, set, frozenset)):
            yield node
        elif id(node) not in seen:
            seen.add(id(node))
            stack.extend(node.values() if isinstance(node, dict) else node)


def iter_tensor_refs(tree: Any) -> Iterator[TensorRef]:
    """Every TensorRef in a tree, with the per-channel scales and zero points of quantized ones (they have
    storage records of their own)."""
    for node in iter_leaves(tree):
        if isinstance(node, TensorRef):
            yield node
            if node.quantizer:
                yield from (p for p in node.quantizer if isinstance(p, TensorRef))
        elif isinstance(node, RebuiltTensor):  # a sparse or nested tensor's components
            yield from node.parts


def is_state_dict(value: Any) -> bool:
    """A flat name -> tensor mapping (a bare `model.state_dict()`)."""
    if not isinstance(value, Mapping) or not value:
        return False
    tensors = sum(isinstance(v, TensorRef) for v in value.values())
    return tensors > 0 and tensors >= len(value) - 1 and all(isinstance(k, str) for k in value)


def is_optimizer_state(value: Any) -> bool:
    return isinstance(value, Mapping) and "state" in value and "param_groups" in value


def _first(tree: Mapping, keys: tuple[str, ...], accept: Callable[[Any], bool]) -> str | None:
    return next((k for k in keys if k in tree and accept(tree[k])), None)


def checkpoint_from_tree(path: str, fmt: str, tree: Any, locate_for: Locator) -> Checkpoint:
    """Build the checkpoint model from an unpickled `torch.save` tree."""
    if not isinstance(tree, Mapping):
        raise UnreadableCheckpoint(f"{path}: holds a {type(tree).__name__}, not a dict; not a checkpoint ckptfix understands")
    ckpt = Checkpoint(path=path, format=fmt, raw=tree)
    if is_state_dict(tree):
        ckpt.sections["model"] = ""
        ckpt.model = _model_tensors(path, tree, locate_for)
        ckpt.tied = find_tied(ckpt.model)
        return ckpt
    if is_optimizer_state(tree):  # a lone optimizer.state_dict(): optimizer.pt, accelerate's optimizer.bin
        ckpt.sections["optimizer"] = ""
        ckpt.optimizer = parse_optimizer(tree, locate_for, path)
        ckpt.notes.append("a lone optimizer state_dict: no model weights in this file (moments are checked "
                          "against each other only; inspect the checkpoint folder to check them against the model)")
        return ckpt
    if any(k in tree for k in LIGHTNING_KEYS):
        ckpt.format = "lightning"
    if _is_composer(tree):
        return _composer(ckpt, tree, locate_for)
    used = set()
    model_key = _first(tree, MODEL_KEYS, is_state_dict)
    if model_key is not None:
        ckpt.sections["model"] = model_key
        ckpt.model = _model_tensors(path, tree[model_key], locate_for)
        ckpt.tied = find_tied(ckpt.model)
        used.add(model_key)
    optim_key = _first(tree, OPTIMIZER_KEYS, is_optimizer_state)
    if optim_key is None and isinstance(tree.get("optimizer_states"), list) and tree["optimizer_states"] \
            and isinstance(tree["optimizer_states"][0], Mapping):
        optim_key = "optimizer_states"
        if len(tree[optim_key]) > 1:
            ckpt.notes.append(f"{len(tree[optim_key])} optimizers saved; ckptfix reports the first")
    if optim_key is not None:
        sd = tree[optim_key][0] if optim_key == "optimizer_states" else tree[optim_key]
        ckpt.sections["optimizer"] = optim_key + ("[0]" if optim_key == "optimizer_states" else "")
        ckpt.optimizer = parse_optimizer(sd, locate_for, path)
        used.add(optim_key)
    sched_key = _first(tree, SCHEDULER_KEYS, lambda v: isinstance(v, Mapping))
    if sched_key is None and isinstance(tree.get("lr_schedulers"), list) and tree["lr_schedulers"] \
            and isinstance(tree["lr_schedulers"][0], Mapping):
        sched_key = "lr_schedulers"
    if sched_key is not None:
        value = tree[sched_key]
        ckpt.scheduler = dict(value[0] if isinstance(value, list) else value)
        ckpt.sections["scheduler"] = sched_key + ("[0]" if isinstance(value, list) else "")
        used.add(sched_key)
    scaler_key = _first(tree, SCALER_KEYS, lambda v: isinstance(v, Mapping))
    if scaler_key is not None:
        ckpt.scaler = dict(tree[scaler_key])
        ckpt.sections["scaler"] = scaler_key
        used.add(scaler_key)
    if isinstance(tree.get(RECORD_KEY), Mapping):
        from ckptfix.formats import attach_record

        attach_record(ckpt, Record.from_json(tree[RECORD_KEY], f"{path}: the {RECORD_KEY!r} entry"))
        used.add(RECORD_KEY)
    ckpt.extras = {k: v for k, v in tree.items() if k not in used}
    if not ckpt.model and ckpt.optimizer is None:
        side = _side_file(tree)
        if side is None:
            keys = ", ".join(_key_text(k) for k in list(tree)[:8])
            raise UnreadableCheckpoint(f"{path}: no model weights or optimizer state found (top-level keys: {keys})")
        ckpt.notes.append(f"no model weights or optimizer state: {side}")
    return ckpt


def _is_composer(tree: Mapping) -> bool:
    """Composer's `{'state': {'model', 'optimizers': {'AdamW': ...}, 'schedulers': {...}, ...}, 'rng': ...}`."""
    state = tree.get("state")
    return isinstance(state, Mapping) and is_state_dict(state.get("model")) and \
        isinstance(state.get("optimizers", {}), Mapping)


def _composer(ckpt: Checkpoint, tree: Mapping, locate_for: Locator) -> Checkpoint:
    """A Composer checkpoint: sections are nested paths ("state/optimizers/AdamW"); optimizers and schedulers
    are saved under their class names (composer/core/state.py `State.state_dict`)."""
    state = tree["state"]
    ckpt.format = "composer"
    ckpt.sections["model"] = "state/model"
    ckpt.model = _model_tensors(ckpt.path, state["model"], locate_for)
    ckpt.tied = find_tied(ckpt.model)
    optimizers = [(k, v) for k, v in state.get("optimizers", {}).items() if is_optimizer_state(v)]
    if optimizers:
        name, sd = optimizers[0]
        ckpt.sections["optimizer"] = f"state/optimizers/{name}"
        ckpt.optimizer = parse_optimizer(sd, locate_for, ckpt.path)
        if len(optimizers) > 1:
            ckpt.notes.append(f"{len(optimizers)} optimizers saved; ckptfix reports the first ({name})")
    schedulers = state.get("schedulers")
    if isinstance(schedulers, Mapping):
        first = next(((k, v) for k, v in schedulers.items() if isinstance(v, Mapping)), None)
        if first is not None:
            ckpt.scheduler = dict(first[1])
            ckpt.sections["scheduler"] = f"state/schedulers/{first[0]}"
    rest = {k: v for k, v in state.items() if k not in ("model", "optimizers", "schedulers")}
    ckpt.extras = {**{k: v for k, v in tree.items() if k != "state"}, "state": rest}
    return ckpt


# The generator states HF Trainer (`rng_state.pth`) and accelerate (`random_states_N.pkl`) save beside a checkpoint.
_RNG_KEYS = ({"python", "numpy", "cpu"}, {"random_state", "numpy_random_seed", "torch_manual_seed"})


def _side_file(tree: Mapping) -> str | None:
    """What a file without model or optimizer is, when it is a known part of a checkpoint (inspect reads it)."""
    if any(keys <= tree.keys() for keys in _RNG_KEYS):
        return "a saved RNG state (HF Trainer rng_state.pth / accelerate random_states_N.pkl)"
    if {"optimizer_state_dict", "ds_version"} <= tree.keys():
        return "one DeepSpeed ZeRO optimizer partition (inspect its folder for the whole checkpoint)"
    from ckptfix.formats.data_globals import uses

    if uses(tree):
        return "it holds pickled objects (listed under weights_only)"
    return None


def _key_text(key: Any) -> str:
    """A top-level key for an error message: printable, one line, short (keys come from the file)."""
    text = key if isinstance(key, str) else type(key).__name__
    return "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text[:60])


MAX_NESTING = 100  # module nesting in a state dict; real models stay far below


def _model_tensors(path: str, state: Mapping, locate_for: Locator) -> dict[str, TensorInfo]:
    try:
        return model_tensors(state, locate_for)
    except UnreadableCheckpoint as exc:
        raise UnreadableCheckpoint(f"{path}: {exc}") from None


def model_tensors(state: Mapping, locate_for: Locator, prefix: str = "", _path: tuple[int, ...] = ()) -> dict[str, TensorInfo]:
    # A pickle can nest a state dict in itself (a cycle) or 100k deep: each dict once per path, bounded depth.
    if len(_path) > MAX_NESTING:
        raise UnreadableCheckpoint(f"state dict nested too deeply (more than {MAX_NESTING} levels) at {prefix[:80]!r}")
    out: dict[str, TensorInfo] = {}
    path = _path + (id(state),)
    for key, value in state.items():
        name = f"{prefix}{key}"
        if isinstance(value, TensorRef):
            out[name] = tensor_from_ref(name, value, locate_for)
        elif isinstance(value, Mapping) and id(value) not in path and is_state_dict(value):
            out.update(model_tensors(value, locate_for, prefix=f"{name}.", _path=path))
    return out


def tensor_from_ref(name: str, ref: TensorRef, locate_for: Locator) -> TensorInfo:
    return TensorInfo(name=name, shape=ref.shape, dtype=ref.dtype, locate=locate_for(ref.storage),
                      storage_id=ref.storage.key, offset=ref.offset, stride=ref.stride,
                      is_parameter=ref.is_parameter)


def find_tied(model: Mapping[str, TensorInfo]) -> dict[str, str]:
    """Tensors that are views of the same bytes as an earlier one (GPT-2 style tied heads)."""
    first: dict[tuple, str] = {}
    tied = {}
    for name, t in model.items():
        key = (t.storage_id, t.offset, t.shape, t.stride)
        if key in first:
            tied[name] = first[key]
        else:
            first[key] = name
    return tied


def parse_optimizer(sd: Mapping, locate_for: Locator | None, origin: str) -> OptimizerState:
    """An `Optimizer.state_dict()` into OptimizerState; tensors stay lazy."""
    groups_raw, state_raw = sd.get("param_groups"), sd.get("state")
    if not isinstance(groups_raw, list) or not isinstance(state_raw, Mapping):
        raise UnreadableCheckpoint(f"{origin}: optimizer state is malformed (state/param_groups of the wrong type)")
    groups = []
    for g in groups_raw:
        if not isinstance(g, Mapping) or not isinstance(g.get("params"), list):
            raise UnreadableCheckpoint(f"{origin}: optimizer param group without a params list")
        options = {k: _lazy(v, ("param_groups", k), locate_for) for k, v in g.items() if k != "params"}
        if not all(isinstance(i, (int, str)) for i in g["params"]):
            raise UnreadableCheckpoint(f"{origin}: optimizer param group with a parameter id that is not an int or name")
        groups.append(ParamGroup(params=list(g["params"]), options=options))
    state = {}
    for index, entries in state_raw.items():
        if not isinstance(entries, Mapping):  # every torch optimizer keeps a dict per parameter
            raise fail(origin, f"optimizer state[{escape(index, 80)}]", "a dict of per-parameter state", entries)
        ps = ParamState()
        for key, value in entries.items():
            value = _lazy(value, ("state", index, key), locate_for)
            if key == "step":
                ps.step = read_scalar(value) if isinstance(value, TensorInfo) else _number(value)
            elif isinstance(value, TensorInfo):
                ps.tensors[key] = value
            else:
                ps.other[key] = value
        state[index] = ps
    return OptimizerState(kind=infer_kind(state, groups), groups=groups, state=state)


def _lazy(value: Any, where: tuple, locate_for: Locator | None) -> Any:
    # The name is built only for tensors: str() of an arbitrary pickled key can be costly.
    if isinstance(value, TensorRef) and locate_for is not None:
        return tensor_from_ref(".".join(map(str, where)), value, locate_for)
    return value


def _number(value: Any) -> float | None:
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return None


def infer_kind(state: Mapping[Any, ParamState], groups: list[ParamGroup]) -> str:
    """The optimizer family, from the names of its state tensors and group options."""
    keys: set[str] = set()
    for ps in state.values():
        keys.update(ps.tensors)
    options = groups[0].options if groups else {}
    # transformers' Adafactor (exp_avg_sq_row/col, scale_parameter) and torch.optim.Adafactor
    # (row_var/col_var/variance, beta2_decay)
    if {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq_R", "exp_avg_sq_C", "row_var", "col_var"} & keys \
            or {"scale_parameter", "relative_step", "beta2_decay"} & options.keys():
        return "adafactor"
    if {"exp_avg", "exp_avg_sq"} <= keys or (not keys and "betas" in options):
        if options.get("decoupled_weight_decay") is True:
            return "adamw"
        if options.get("decoupled_weight_decay") is False:
            return "adam"
        return "adam" if not options.get("weight_decay") else "adamw"
    if "momentum_buffer" in keys:
        return "sgd-momentum"
    if not keys and "momentum" in options and "dampening" in options:
        return "sgd-momentum" if options.get("momentum") else "sgd"
    if "sum" in keys:
        return "adagrad"
    if "square_avg" in keys:
        return "rmsprop"
    return "unknown"
