"""What every format shares: finding the sections of a checkpoint dict, parsing optimizer state."""

from __future__ import annotations

import sys
from collections.abc import Mapping  # isinstance with typing.Mapping is several times slower: once per state entry
from typing import Any, Callable, Iterator

from ckptfix.checkpoint import (
    ByteRange,
    Checkpoint,
    OptimizerPart,
    OptimizerState,
    ParamGroup,
    ParamState,
    TensorInfo,
    read_scalar,
)
from ckptfix.errors import UnreadableCheckpoint
from ckptfix.formats.pickle_records import RebuiltTensor, StorageRef, TensorRef
from ckptfix.optim_state import kind_name
from ckptfix.record import RECORD_KEY, Record
from ckptfix.untrusted import escape, fail

MODEL_KEYS = ("model", "state_dict", "model_state_dict", "module", "model_state", "net", "network")
OPTIMIZER_KEYS = ("optimizer", "optimizer_state_dict", "optim", "optimizer_state", "opt")
SCHEDULER_KEYS = ("scheduler", "lr_scheduler", "scheduler_state_dict", "sched")
SCALER_KEYS = ("scaler", "grad_scaler", "scaler_state_dict", "amp_scaler")
LIGHTNING_KEYS = ("optimizer_states", "lr_schedulers", "pytorch-lightning_version")
# What Lightning 2.6's `Trainer.fit(ckpt_path=...)` reads of a .ckpt (`_CheckpointConnector`; measured in
# tests/test_resume_lightning.py): without one of these it raises KeyError; without `loops` it silently restarts the
# loop's progress (epoch, global_step, batches) at 0, without `callbacks` the callbacks' state
LIGHTNING_RAISES = ("pytorch-lightning_version", "state_dict", "optimizer_states", "lr_schedulers")
LIGHTNING_FRESH = ("loops", "callbacks")
LIGHTNING_WEIGHTS_ONLY = ("callbacks", "optimizer_states", "lr_schedulers")  # what save_weights_only leaves out


def lightning_resume_gaps(tree: Mapping) -> dict[str, str]:
    """The keys `fit(ckpt_path=...)` reads that a Lightning checkpoint lacks: key -> "raises" (KeyError), "fresh"
    (restarted silently) or "weights-only" (all of `LIGHTNING_WEIGHTS_ONLY` absent: saved so on purpose)."""
    absent = [k for k in (*LIGHTNING_RAISES, *LIGHTNING_FRESH) if k not in tree]
    weights_only = all(k in absent for k in LIGHTNING_WEIGHTS_ONLY) and "state_dict" in tree
    return {k: "weights-only" if weights_only and k in LIGHTNING_WEIGHTS_ONLY else
            "raises" if k in LIGHTNING_RAISES else "fresh" for k in absent}

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
    sections = optimizer_sections(tree, path)
    if sections:
        ckpt.optimizer = parse_optimizers([(sec, _section(tree, sec)) for sec in sections], locate_for, path)
        ckpt.sections["optimizer"] = sections[0]
        used.update(sec.split("[")[0] for sec in sections)
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


def optimizer_sections(tree: Mapping, origin: str = "checkpoint") -> list[str]:
    """Where a dict checkpoint keeps optimizer state: "optimizer", "optimizer_states[1]", ... Every optimizer
    is found, under the usual keys first, then under any other key, alone or in a list (modded-nanogpt's
    `optimizers: [muon, adamw]`, Lightning's `optimizer_states`, a second `muon_optimizer` key)."""
    keys = [k for k in OPTIMIZER_KEYS if k in tree] + [k for k in tree if isinstance(k, str) and k not in OPTIMIZER_KEYS]
    out: list[str] = []
    for key in keys:
        value = tree[key]
        holds = is_optimizer_state(value) or (isinstance(value, list) and value and all(map(is_optimizer_state, value)))
        if holds and ("[" in key or "/" in key):  # sections are addressed as "key[i]" / "a/b" (fuzz finding)
            raise UnreadableCheckpoint(f"{origin}: optimizer state under the key '{escape(key, 80)}', whose '[' or "
                                       "'/' ckptfix cannot address; rename the key")
        if is_optimizer_state(value):
            out.append(key)
        elif holds:
            out += [f"{key}[{i}]" for i in range(len(value))]
    return out


def _section(tree: Mapping, section: str) -> Any:
    key, _, index = section.partition("[")
    return tree[key][int(index[:-1])] if index else tree[key]


def parse_optimizers(found: list[tuple[str, Mapping]], locate_for: Locator | None, origin: str) -> OptimizerState:
    """One optimizer, or several merged into one `OptimizerState` whose entries are `(part, index)`
    (each optimizer numbers its own parameters from 0), with an `OptimizerPart` per optimizer."""
    if len(found) == 1:
        return parse_optimizer(found[0][1], locate_for, origin)
    groups: list[ParamGroup] = []
    state: dict[Any, ParamState] = {}
    parts: list[OptimizerPart] = []
    unread: list[tuple[ParamState, TensorInfo]] = []
    for k, (section, sd) in enumerate(found):
        one = parse_optimizer(sd, locate_for, f"{origin}: {section}")
        unread += one.unread_steps
        groups += [ParamGroup([(k, i) for i in g.params], g.options) for g in one.groups]
        state.update({(k, i): ps for i, ps in one.state.items()})
        parts.append(OptimizerPart(section, one.kind, len(one.groups),
                                   frozenset((k, i) for i in [*one.indices(), *one.state])))
    return OptimizerState(kind=" + ".join(p.kind for p in parts), groups=groups, state=state, parts=parts,
                          unread_steps=unread)


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
    optimizers = [(f"state/optimizers/{k}", v) for k, v in state.get("optimizers", {}).items() if is_optimizer_state(v)]
    if optimizers:
        ckpt.sections["optimizer"] = optimizers[0][0]
        ckpt.optimizer = parse_optimizers(optimizers, locate_for, ckpt.path)
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
    step_tensors: list[tuple[ParamState, TensorInfo]] = []
    for index, entries in state_raw.items():
        if not isinstance(entries, Mapping):  # every torch optimizer keeps a dict per parameter
            raise fail(origin, f"optimizer state[{escape(index, 80)}]", "a dict of per-parameter state", entries)
        ps = ParamState()
        for key, value in entries.items():
            value = _lazy(value, ("state", index, key), locate_for)
            nested = _nested_tensors(key, value, ("state", index), locate_for)
            if key == "step":
                if isinstance(value, TensorInfo):
                    step_tensors.append((ps, value))
                else:
                    ps.step = number(value)
                ps.step_kind = "tensor" if isinstance(value, TensorInfo) else type(value).__name__
            elif isinstance(value, TensorInfo):
                ps.tensors[key] = value
            elif nested:
                ps.tensors.update(nested)
            else:
                ps.other[key] = value
        state[index] = ps
    unread = read_steps(step_tensors)
    return OptimizerState(kind=infer_kind(state, groups), groups=groups, state=state, unread_steps=unread)


def read_steps(found: list[tuple[ParamState, TensorInfo]], everything: bool = False) -> list[tuple[ParamState, TensorInfo]]:
    """Each parameter's `step` tensor, read into its ParamState; those left unread.

    In object storage a step that lies among the moments (torch.save and DCP write each parameter's state
    together) costs a request of its own: hundreds for a large model. There the steps are read from both
    ends of the state (the embedding and the head, in most models' order) while reading costs no more than
    `remote.PREFETCH_BUDGET` requests; the rest stay unread (`everything`: read them all, as `--scan` does),
    and the report says how many."""
    remote = sys.modules.get("ckptfix.remote")
    maps: dict = {}
    if everything or remote is None or not remote.active():
        for ps, tensor in found:
            ps.step = read_scalar(tensor, maps)
        return []
    both_ends = [found[i // 2] if i % 2 == 0 else found[-1 - i // 2] for i in range(len(found))]
    start, unread = remote.stats().requests, []
    for ps, tensor in both_ends:
        if remote.stats().requests - start >= remote.PREFETCH_BUDGET:
            unread.append((ps, tensor))
        else:
            ps.step = read_scalar(tensor, maps)
    return unread


def _nested_tensors(key: Any, value: Any, where: tuple, locate_for: Locator | None,
                    depth: int = 0) -> dict[str, TensorInfo]:
    """State kept in a list of tensors (SOAP's `GG`, `Q`) or a nested dict (bitsandbytes'
    `__bnb_optimizer_quant_state__`), flattened to paths `GG[0]`, `__bnb_optimizer_quant_state__/state1`
    (`surgery.torch_tree` writes them back by path). {} unless every leaf is a tensor or an empty list."""
    if not isinstance(key, str) or depth > 3 or locate_for is None:
        return {}
    if isinstance(value, Mapping):
        items = [(f"{key}/{k}", v) for k, v in value.items() if isinstance(k, str)]
        if len(items) != len(value):
            return {}
    elif isinstance(value, (list, tuple)):
        items = [(f"{key}[{j}]", v) for j, v in enumerate(value)]
    else:
        return {}
    out: dict[str, TensorInfo] = {}
    for path, item in items:
        if isinstance(item, TensorRef):
            out[path] = tensor_from_ref(".".join(map(str, (*where, path))), item, locate_for)
        elif isinstance(item, (list, tuple)) and not item:
            continue
        else:
            inner = _nested_tensors(path, item, where, locate_for, depth + 1)
            if not inner:
                return {}
            out.update(inner)
    return out


def _lazy(value: Any, where: tuple, locate_for: Locator | None) -> Any:
    # The name is built only for tensors: str() of an arbitrary pickled key can be costly.
    if isinstance(value, TensorRef) and locate_for is not None:
        return tensor_from_ref(".".join(map(str, where)), value, locate_for)
    return value


def number(value: Any) -> float | None:
    """A saved int/float as a float; None for anything else or an int beyond float range."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        return float(value)
    except OverflowError:  # an int beyond float range
        return None


def infer_kind(state: Mapping[Any, ParamState], groups: list[ParamGroup]) -> str:
    """The optimizer as users name it, told by structure (`ckptfix.optim_state`)."""
    return kind_name(state, groups)
