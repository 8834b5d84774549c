"""DeepSpeed checkpoint folders (`engine.save_checkpoint`), ZeRO stages 0-3, read-only.

Layout measured on DeepSpeed 0.19.8 (CPU, one process):

    <dir>/latest                                   the tag, e.g. "global_step3"
    <dir>/global_step3/mp_rank_00_model_states.pt  stages 0-2 ("zero_pp_rank_<dp>_mp_rank_00_..." for stage 3)
    <dir>/global_step3/[bf16_]zero_pp_rank_<dp>_mp_rank_00_optim_states.pt   stages 1-3, one per data-parallel rank

The model-states file holds `module` (the state dict; under ZeRO-3 every parameter is an empty
placeholder), `param_shapes` (one OrderedDict name -> shape per param group), `buffer_names`,
`lr_scheduler`, `global_steps`, `ds_config`, ...; at stage 0 also `optimizer` (a plain
`Optimizer.state_dict()`). An optim-states file holds `optimizer_state_dict` with the rank's flat fp32
partition per group (`single_partition_of_fp32_groups` at stages 1/2, `fp32_flat_groups` at 3), the
base optimizer's state over those flat partitions (`base_optimizer_state` at 1/2,
`optimizer_state_dict` at 3), `param_slice_mappings` (name -> fragment_address(numel, start), 1/2),
`zero_stage` and `partition_count`.

Those pickles name four DeepSpeed classes (`DEEPSPEED_GLOBALS`); they are read as inert opaque
records (nothing is imported) and interpreted by name. Any other class outside the weights
allowlist is still refused unless `trust_pickle`.

With one data-parallel partition, each parameter's moments (and, at ZeRO-3, its fp32 weights) are
exact views into the flat partitions, so they read like any other format. With several partitions a
parameter is spread over files: shapes, groups and flat sizes are reported, per-parameter values are
not; repair goes through DeepSpeed's own universal-checkpoint conversion (`repair_unsupported` says how;
`deepspeed_universal` reads the converted folder).
"""

from __future__ import annotations

import glob
import math
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.checkpoint import (
    Checkpoint,
    OptimizerState,
    ParamGroup,
    ParamState,
    TensorInfo,
    read_scalar,
    stored_to_torch,
)
from ckptfix.errors import UnreadableCheckpoint, UnsafePickle
from ckptfix.formats import common, torch_file
from ckptfix.formats.pickle_records import OpaqueObject, TensorRef
from ckptfix.untrusted import read_bounded, want_dict, want_int, want_list, want_shape, want_str

DEEPSPEED_GLOBALS = frozenset({
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
})
_MODEL_STATES = re.compile(r"^(zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# Keys of the model-states file that become model/optimizer/scheduler; the rest go to extras verbatim.
_USED = ("module", "optimizer", "lr_scheduler")


def sniff(path: str) -> bool:
    """A DeepSpeed save: a `latest` tag file, `global_step*` folders or `*mp_rank_*_model_states.pt`."""
    return (os.path.exists(os.path.join(path, "latest")) or bool(glob.glob(os.path.join(path, "global_step*")))
            or bool(glob.glob(os.path.join(path, "*mp_rank_*_model_states.pt")))
            or bool(glob.glob(os.path.join(path, "*zero_pp_rank_*_optim_states.pt"))))  # its model states lost


# What `engine.load_checkpoint(save_dir)` (DeepSpeed 0.19.8, torch 2.13) does with a file missing or torn: measured in
# tests/test_resume_deepspeed.py
LOAD_ASSERTS = "engine.load_checkpoint raises an AssertionError with no message"
LOAD_TORN = ("engine.load_checkpoint dies on it in torch.load (RuntimeError 'PytorchStreamReader failed reading zip "
             "archive' for a cut file, EOFError for an empty one), naming no file")


def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    """Read the tag `latest` names (or the newest `global_step*`, or `path` itself if it is a tag folder)."""
    tag_dir = resolve_tag(path)
    model_files = _rank_files(tag_dir, _MODEL_STATES)
    if not model_files:
        raise UnreadableCheckpoint(f"{path}: no DeepSpeed *model_states.pt file in {tag_dir} ({LOAD_ASSERTS})")
    model_file = model_files[0]
    tree, locate_for = _torn_refused(model_file, trust_pickle)
    if not isinstance(tree, Mapping):
        raise UnreadableCheckpoint(f"{model_file}: holds a {type(tree).__name__}, not DeepSpeed model states")
    ckpt = Checkpoint(path=path, format="deepspeed", raw=tree)
    ckpt.files["model"] = model_file
    ckpt.sections["model"] = f"{os.path.basename(model_file)}: module"
    module = tree.get("module")
    ckpt.model = common.model_tensors(module, locate_for) if isinstance(module, Mapping) else {}
    if isinstance(tree.get("lr_scheduler"), Mapping):
        ckpt.scheduler = dict(tree["lr_scheduler"])
        ckpt.sections["scheduler"] = "lr_scheduler"
    ckpt.extras = {k: v for k, v in tree.items() if k not in _USED}
    optim_files = _rank_files(tag_dir, _OPTIM_STATES)
    if optim_files:
        _zero_optimizer(ckpt, tree, optim_files, trust_pickle)
    elif common.is_optimizer_state(tree.get("optimizer")):  # stage 0: a plain Optimizer.state_dict()
        ckpt.optimizer = common.parse_optimizer(tree["optimizer"], locate_for, model_file)
        ckpt.sections["optimizer"] = "optimizer"
    elif isinstance(tree.get("optimizer"), Mapping) and common.is_optimizer_state(tree["optimizer"].get("optimizer_state_dict")):
        ckpt.optimizer = common.parse_optimizer(tree["optimizer"]["optimizer_state_dict"], locate_for, model_file)
        ckpt.sections["optimizer"] = "optimizer.optimizer_state_dict"  # FP16_Optimizer wraps it
    if not ckpt.model and ckpt.optimizer is None:
        raise UnreadableCheckpoint(f"{model_file}: no module weights and no optimizer state")
    ckpt.extras["deepspeed_files"] = resume_files(path, tag_dir, tree, model_files, optim_files)
    return ckpt


def resume_files(path: str, tag_dir: str, tree: Mapping, model_files: list[str],
                 optim_files: list[str]) -> dict[str, Any]:
    """What `engine.load_checkpoint` reads and this save lacks, as strings only (extras are searched for recorded
    integers): `missing` {file: why it is expected} (one ZeRO partition per data-parallel rank of the save, and at
    stage 3 one model-states file per rank), `no_latest` the tag read when `path` is a save folder without `latest`
    (DeepSpeed itself then loads nothing)."""
    world = tree.get("dp_world_size")
    config = tree.get("ds_config")
    config = config if isinstance(config, Mapping) else {}
    zero = config.get("zero_optimization")
    stage = _stage(zero.get("stage")) if isinstance(zero, Mapping) else None
    missing: dict[str, str] = {}
    if isinstance(world, int) and not isinstance(world, bool) and 0 < world <= 1 << 16 and stage:
        have = {os.path.basename(f) for f in optim_files}
        prefix = "bf16_" if any(n.startswith("bf16_") for n in have) or (
            not have and isinstance(config.get("bf16"), Mapping) and config["bf16"].get("enabled") is True) else ""
        for rank in range(world):
            name = f"{prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"
            if name not in have:
                missing[name] = f"ZeRO stage {stage}, saved by {world} data-parallel rank(s)"
        if stage == 3:
            models = {os.path.basename(f) for f in model_files}
            for rank in range(world):
                name = f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"
                if name not in models:
                    missing[name] = f"ZeRO stage 3, saved by {world} data-parallel rank(s)"
    no_latest = ""
    if tag_dir != path and not os.path.exists(os.path.join(path, "latest")):
        no_latest = os.path.basename(tag_dir)
    return {"missing": missing, "no_latest": no_latest, "tag": os.path.basename(tag_dir)}


def _torn_refused(file: str, trust_pickle: bool) -> tuple[Any, common.Locator]:
    """`_load`, its refusal of a file cut short or emptied extended with what engine.load_checkpoint does."""
    try:
        return _load(file, trust_pickle)
    except UnsafePickle:
        raise
    except UnreadableCheckpoint as exc:
        if str(exc).endswith(("truncated or corrupt?", "empty file (0 bytes)")):
            raise UnreadableCheckpoint(f"{exc} ({LOAD_TORN})") from None
        raise


def repair_unsupported(path: str) -> str:
    """Why `ckptfix repair` does not rewrite a DeepSpeed checkpoint, and what to run instead."""
    try:
        tag_dir = resolve_tag(path)
    except UnreadableCheckpoint:
        tag_dir = os.path.join(path, "global_stepN")
    universal = f"{tag_dir.rstrip(os.sep)}_universal"
    return (f"{path}: DeepSpeed ZeRO checkpoint: parameters and optimizer moments are flattened and partitioned "
            "across ranks, so ckptfix repairs DeepSpeed's universal layout instead. Convert it first: python -m "
            f"deepspeed.checkpoint.ds_to_universal --input_folder {tag_dir} --output_folder {universal} "
            "--inject_missing_state (engine.save_checkpoint of a ZeRO-1/2 run records no universal_checkpoint_info: "
            f"without that flag the tool stops), then: ckptfix repair {universal} -t TOKENIZER -o OUT, and resume "
            "with \"checkpoint\": {\"load_universal\": true} and engine.load_checkpoint(<OUT's folder>, tag=<OUT's name>)")


def resolve_tag(path: str) -> str:
    """The folder holding the *_states.pt files: `latest`'s tag, else the newest global_step*, else `path`."""
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        tag = read_bounded(latest, 4096, what="DeepSpeed 'latest' file").decode("utf-8", "replace").strip()
        tag_dir = os.path.join(path, tag)
        if not tag or not os.path.isdir(tag_dir):
            raise UnreadableCheckpoint(f"{latest}: names tag {tag!r}, but there is no such folder (torn? "
                                       f"{LOAD_ASSERTS})")
        return tag_dir
    steps = [d for d in glob.glob(os.path.join(path, "global_step*")) if os.path.isdir(d)]
    if steps:
        return max(steps, key=lambda d: int(re.sub(r"\D", "", os.path.basename(d)) or 0))
    return path


def _rank_files(tag_dir: str, pattern: re.Pattern) -> list[str]:
    """Files matching `pattern` for model-parallel rank 0, ordered by data-parallel rank."""
    found = []
    for name in os.listdir(tag_dir):
        m = pattern.match(name)
        if m and int(m.group(3)) == 0:
            found.append((int(m.group(2) or 0), os.path.join(tag_dir, name)))
    return [f for _, f in sorted(found)]


def _load(file: str, trust_pickle: bool) -> tuple[Any, common.Locator]:
    """The allowlist unpickler; DeepSpeed's own inert records (and only those) are read as opaque data."""
    try:
        tree, locate_for, _ = torch_file.load(file, opaque=trust_pickle)
    except UnsafePickle as exc:
        unknown = [g for g in exc.globals_needed if g not in DEEPSPEED_GLOBALS]
        if unknown:
            raise UnsafePickle(file, unknown) from None
        tree, locate_for, _ = torch_file.load(file, opaque=True)  # opaque mode imports and runs nothing
    return tree, locate_for


# --- ZeRO optimizer partitions --------------------------------------------------------------------

def _zero_optimizer(ckpt: Checkpoint, model_tree: Mapping, files: list[str], trust_pickle: bool) -> None:
    parts = [_partition(f, trust_pickle) for f in files]
    ckpt.files["optimizer"] = files[0]
    first = parts[0]
    names = _param_names(model_tree, ckpt.files.get("model", ckpt.path))
    stage = first["stage"]
    single = len(parts) == 1 and all(c == 1 for c in first["partition_count"])
    groups, state = [], {}
    for g, flat in enumerate(first["flat"]):
        options = dict(first["groups"][g]) if g < len(first["groups"]) else {}
        options.pop("params", None)
        shapes = names[g] if g < len(names) else {}
        groups.append(ParamGroup(params=list(shapes), options=options))
        flat_state = first["state"].get(g, {})
        if single:
            offsets = _offsets(first["slices"][g] if g < len(first["slices"]) else None, shapes)
            state.update(_views(flat_state, offsets, shapes, first, ckpt.files["optimizer"]))
            if stage == 3:
                ckpt.model.update(_master_weights(flat, offsets, shapes, first["locate_for"]))
        elif shapes:
            state.update(_gathered_state(parts, g, shapes, stage))
            if stage == 3:
                ckpt.model.update(_gathered_weights(parts, g, shapes))
    kind_probe = {g: ParamState(tensors={k: v for k, v in s.items() if isinstance(v, TensorRef)})  # type: ignore[misc]
                  for g, s in first["state"].items() if isinstance(s, Mapping)}
    ckpt.optimizer = OptimizerState(kind=common.infer_kind(kind_probe, groups), groups=groups, state=state)
    ckpt.sections["optimizer"] = os.path.basename(files[0]) + ": optimizer_state_dict"
    ckpt.extras["deepspeed"] = {
        "zero_stage": stage,
        "partition_count": first["partition_count"],
        "loss_scaler": first["loss_scaler"],
        "partitions": [{"file": os.path.basename(p["file"]), "flat_numel": [t.numel for t in p["flat"]],
                        "state_keys": sorted({k for s in p["state"].values() if isinstance(s, Mapping) for k in s})}
                       for p in parts],
    }
    sizes = ", ".join(f"{t.numel}" for t in first["flat"])
    ckpt.notes.append(f"ZeRO stage {stage}: optimizer state in {len(parts)} partition file(s), flat fp32 group "
                      f"size(s) [{sizes}] per partition")
    if stage == 3 and single:
        ckpt.notes.append("ZeRO-3: model weights are the fp32 master partitions (module holds empty placeholders)")
    if not single:
        ckpt.notes.append(f"parameters are split over {len(parts)} data-parallel partitions (world size {len(parts)} "
                          "at save time): each parameter's moments"
                          + (" and fp32 weights" if stage == 3 else "") + " are assembled from its pieces")
        if stage == 3:
            _placeholders(ckpt, [{n: s for n, s in group.items() if n not in ckpt.model} for group in names])


def _partition(file: str, trust_pickle: bool) -> dict[str, Any]:
    """One rank's optim-states file, normalised across stages (and across bf16/ZeRO writers)."""
    tree, locate_for = _torn_refused(file, trust_pickle)
    osd = tree.get("optimizer_state_dict") if isinstance(tree, Mapping) else None
    if not isinstance(osd, Mapping):
        raise UnreadableCheckpoint(f"{file}: no optimizer_state_dict; not a DeepSpeed optim-states file")
    flat = osd.get("single_partition_of_fp32_groups") or osd.get("fp32_flat_groups") or osd.get("fp32_groups") or []
    if not isinstance(flat, (list, tuple)) or not all(isinstance(t, TensorRef) for t in flat):
        raise UnreadableCheckpoint(f"{file}: flat fp32 groups are not tensors")
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(base, list):  # elastic checkpoints: one state dict per group, no param_groups
        state, groups = dict(enumerate(base)), []
    elif isinstance(base, Mapping):
        state = want_dict(base.get("state") or {}, file, "base_optimizer_state.state")
        groups = list(want_list(base.get("param_groups") or [], file, "base_optimizer_state.param_groups"))
    else:
        raise UnreadableCheckpoint(f"{file}: no base optimizer state")
    state, groups = _group_states(state, file), [want_dict(g, file, f"param_groups[{i}]") for i, g in enumerate(groups)]
    count = _partition_counts(osd.get("partition_count"), len(flat), file)
    return {
        "file": file, "flat": list(flat), "state": state, "groups": groups, "locate_for": locate_for,
        "stage": _stage(osd.get("zero_stage")),
        "loss_scaler": _loss_scaler(osd.get("loss_scaler")),
        "partition_count": count,
        "slices": [_fragments(m, file) for m in want_list(osd.get("param_slice_mappings") or [], file,
                                                          "param_slice_mappings")],
    }


def _group_states(state: dict, origin: str) -> dict[int, dict[str, Any]]:
    """The base optimizer's state over the flat partitions: group index -> {state name: value}."""
    out = {}
    for g, entries in state.items():
        g = want_int(g, origin, "base optimizer state key", hi=1 << 20)
        entries = want_dict(entries, origin, f"base optimizer state[{g}]")
        for key in entries:
            want_str(key, origin, f"base optimizer state[{g}] key")
        out[g] = entries
    return out


MAX_PARTITIONS = 1 << 20  # data-parallel ranks; the largest runs have tens of thousands


def _partition_counts(value: Any, groups: int, origin: str) -> list[int]:
    """`partition_count`: one count per group (or one for all), each a positive int."""
    if value is None:
        return [1] * groups
    if isinstance(value, (list, tuple)):
        return [want_int(c, origin, f"partition_count[{i}]", lo=1, hi=MAX_PARTITIONS) for i, c in enumerate(value)]
    return [want_int(value, origin, "partition_count", lo=1, hi=MAX_PARTITIONS)] * groups


def _stage(value: Any) -> int | None:
    if isinstance(value, OpaqueObject) and value.args:  # ZeroStageEnum(2)
        value = value.args[0]
    return int(value) if isinstance(value, int) else None


def _loss_scaler(value: Any) -> dict | None:
    """DeepSpeed's (Dynamic)LossScaler record: its fields (cur_scale, dynamic, ...), as saved."""
    if isinstance(value, OpaqueObject) and isinstance(value.state, Mapping):
        return {"class": value.cls.rsplit(".", 1)[-1], **{str(k): v for k, v in value.state.items()}}
    return None


def _fragments(mapping: Any, origin: str) -> dict[str, tuple[int, int]]:
    """param_slice_mappings[g]: name -> (numel, start) from opaque fragment_address records."""
    out = {}
    for name, frag in (want_dict(mapping, origin, "param_slice_mappings[]") if mapping else {}).items():
        state = frag.state if isinstance(frag, OpaqueObject) else None
        if isinstance(state, Mapping) and {"numel", "start"} <= state.keys():
            name = want_str(name, origin, "param_slice_mappings key")
            out[name] = (want_int(state["numel"], origin, f"param_slice_mappings[{name!r}].numel"),
                         want_int(state["start"], origin, f"param_slice_mappings[{name!r}].start"))
    return out


def _param_names(tree: Mapping, origin: str = "") -> list[Mapping[str, tuple]]:
    """`param_shapes`: per group, parameter name -> shape, checked."""
    shapes = tree.get("param_shapes")
    if isinstance(shapes, Mapping):  # very old checkpoints: one dict for all groups
        shapes = [shapes]
    groups = want_list(shapes, origin, "param_shapes") if shapes is not None else []
    return [{want_str(n, origin, "param_shapes key"): want_shape(v, origin, f"param_shapes[{n!r}]")
             for n, v in g.items()} for g in groups if isinstance(g, Mapping)]


def _offsets(slices: dict[str, tuple[int, int]] | None, shapes: Mapping[str, tuple]) -> dict[str, int]:
    """Where each parameter starts in its group's flat partition (one partition: params back to back)."""
    if slices:
        return {name: start for name, (_, start) in slices.items()}
    out, pos = {}, 0
    for name, shape in shapes.items():
        out[name] = pos
        pos += _numel(shape)
    return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)  # shapes were checked by `want_shape`


def _view(name: str, flat: TensorRef, start: int, shape: tuple, locate_for: common.Locator) -> TensorInfo | None:
    """`shape` elements of a flat partition from `start`, as a tensor; None if they do not fit."""
    if start < 0 or start + _numel(shape) > flat.numel:
        return None
    info = TensorInfo(name=name, shape=shape, dtype=flat.dtype, locate=locate_for(flat.storage),
                      storage_id=flat.storage.key, offset=flat.offset + start)
    info.stride = info.contiguous_stride()
    return info


def _views(flat_state: Mapping, offsets: dict[str, int], shapes: Mapping[str, tuple], part: dict,
           origin: str) -> dict[str, ParamState]:
    """Per-parameter moments (exact views into the flat moments), keyed by FQN like DCP."""
    step = flat_state.get("step") if isinstance(flat_state, Mapping) else None
    step_value = None
    if isinstance(step, TensorRef):
        step_value = read_scalar(common.tensor_from_ref("step", step, part["locate_for"]))
    elif isinstance(step, (int, float)):
        step_value = common.number(step)
    out = {}
    for name, shape in shapes.items():
        ps = ParamState(step=step_value)
        for key, flat in (flat_state or {}).items():
            if isinstance(flat, TensorRef) and key != "step":
                view = _view(f"{key} of {name}", flat, offsets.get(name, -1), shape, part["locate_for"])
                if view is None:
                    raise UnreadableCheckpoint(f"{origin}: {key} of {name} lies outside its flat partition")
                ps.tensors[key] = view
        out[name] = ps
    return out


def _master_weights(flat: TensorRef, offsets: dict[str, int], shapes: Mapping[str, tuple],
                    locate_for: common.Locator) -> dict[str, TensorInfo]:
    """ZeRO-3, one partition: the fp32 weights of each parameter, as views into fp32_flat_groups."""
    out = {}
    for name, shape in shapes.items():
        view = _view(name, flat, offsets.get(name, -1), shape, locate_for)
        if view is not None:
            view.is_parameter = True
            out[name] = view
    return out


def _placeholders(ckpt: Checkpoint, names: list[Mapping[str, tuple]]) -> None:
    """ZeRO-3 over several ranks: names and shapes from param_shapes; values need DeepSpeed."""
    def refuse() -> Any:
        raise UnreadableCheckpoint("ZeRO-3 parameter partitioned across ranks; consolidate it with zero_to_fp32.py")

    for group in names:
        for name, shape in group.items():
            ckpt.model[name] = TensorInfo(name=name, shape=shape, dtype="float32",
                                          locate=refuse, storage_id=f"zero3:{name}", is_parameter=True)


# --- several data-parallel partitions ---------------------------------------------------------------

@dataclass
class AssembledTensor(TensorInfo):
    """A parameter (or one of its moments) spread over ranks' flat partitions: `pieces` are 1-D views
    (TensorInfo) with where each starts in the flattened parameter; `read_stored()` concatenates them."""

    pieces: list = field(default_factory=list)

    def read_stored(self) -> np.ndarray:
        first = self.pieces[0][0].read_stored() if self.pieces else np.zeros(0, dtype=np.float32)
        out = np.empty(self.numel, dtype=first.dtype)
        for view, dest in self.pieces:
            out[dest:dest + view.numel] = view.read_stored()
        out.flags.writeable = False
        return out.reshape(self.shape)

    def to_torch(self):
        return stored_to_torch(self.read_stored().copy(), self.dtype)


def _layout(shapes: Mapping[str, tuple], stage: int | None, world: int, part_numel: int) -> dict[str, list]:
    """Where each parameter's elements lie: [(rank, start in that rank's flat partition, start in the
    parameter, count)]. ZeRO-1/2 split the group's flat buffer (parameters back to back, in param_shapes
    order) into `world` equal partitions; ZeRO-3 splits each parameter into ceil(numel/world) pieces,
    rank r holding piece r of every parameter back to back (as DeepSpeed's zero_to_fp32 reads them)."""
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel, pieces = _numel(shape), []
        if stage == 3:
            size = -(-numel // world)
            pieces = [(r, offset, r * size, min(size, numel - r * size)) for r in range(world) if r * size < numel]
            offset += size
        else:
            pos = offset
            while pos < offset + numel:
                rank = pos // part_numel
                count = min(offset + numel, (rank + 1) * part_numel) - pos
                pieces.append((rank, pos - rank * part_numel, pos - offset, count))
                pos += count
            offset += numel
        out[name] = pieces
    return out


def _assembled(name: str, shape: tuple, flats: list, pieces: list, parts: list) -> AssembledTensor:
    views = []
    for rank, start, dest, count in pieces:
        if rank >= len(flats) or not isinstance(flats[rank], TensorRef):
            raise UnreadableCheckpoint(f"{name}: its piece on rank {rank} is missing")
        view = _view(f"{name}[rank {rank}]", flats[rank], start, (count,), parts[rank]["locate_for"])
        if view is None:
            raise UnreadableCheckpoint(f"{parts[rank]['file']}: the piece of {name} lies outside its flat partition")
        views.append((view, dest))
    dtype = views[0][0].dtype if views else "float32"
    return AssembledTensor(name=name, shape=tuple(int(d) for d in shape), dtype=dtype, locate=_no_range(name),
                           storage_id=f"zero:{name}", pieces=views)


def _no_range(name: str):
    def locate() -> Any:
        raise UnreadableCheckpoint(f"{name}: assembled from several ZeRO partitions; it has no single byte range")
    return locate


def _gathered_state(parts: list, g: int, shapes: Mapping[str, tuple], stage: int | None) -> dict[str, ParamState]:
    """Per-parameter moments assembled from every rank's flat moments of group `g`."""
    states = [p["state"].get(g, {}) for p in parts]
    layout = _layout(shapes, stage, len(parts), parts[0]["flat"][g].numel)
    step = states[0].get("step") if isinstance(states[0], Mapping) else None
    step_value = (read_scalar(common.tensor_from_ref("step", step, parts[0]["locate_for"]))
                  if isinstance(step, TensorRef) else common.number(step))
    keys = [k for k, v in (states[0] or {}).items() if isinstance(v, TensorRef) and k != "step"]
    out = {}
    for name, shape in shapes.items():
        ps = ParamState(step=step_value)
        for key in keys:
            flats = [s.get(key) if isinstance(s, Mapping) else None for s in states]
            ps.tensors[key] = _assembled(f"{key} of {name}", shape, flats, layout[name], parts)
        out[name] = ps
    return out


def _gathered_weights(parts: list, g: int, shapes: Mapping[str, tuple]) -> dict[str, TensorInfo]:
    """ZeRO-3 over several ranks: each parameter's fp32 master weights from every rank's fp32_flat_groups."""
    layout = _layout(shapes, 3, len(parts), parts[0]["flat"][g].numel)
    flats = [p["flat"][g] if g < len(p["flat"]) else None for p in parts]
    out: dict[str, TensorInfo] = {}
    for name, shape in shapes.items():
        info = _assembled(name, shape, flats, layout[name], parts)
        info.name, info.is_parameter = name, True
        out[name] = info
    return out
