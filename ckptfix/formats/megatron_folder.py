"""Megatron-Core `torch_dist` checkpoints (Megatron-LM, NeMo 2, Megatron-Bridge): a DCP folder with Megatron's keys.

Layout (megatron-core 0.16.1, `dist_checkpointing.save` as Megatron-LM's `save_checkpoint` calls it; see
fixtures/megatron.py): `<save>/latest_checkpointed_iteration.txt` names the iteration, `<save>/iter_0000002/`
holds `.metadata` + `__<rank>_<n>.distcp` (DCP, read by `dcp_folder`), `common.pt` (everything that is not
sharded: `args`, `iteration`, the optimizer's `param_groups`, `opt_param_scheduler`; a `torch.save`) and
`metadata.json` (`sharded_backend: torch_dist`). Either folder may be given; the parent picks the iteration
its tracker file names, as Megatron-LM's `--load` does.

What differs from a plain DCP save:
- `.metadata` also keeps every rank's save plan (`all_local_plans`, reused by Megatron's next save): read
  as inert data (`dcp_folder.PLANNER_GLOBALS`), never interpreted, and not written back by repair (the plans
  describe the old shapes).
- keys are flat FQNs (no planner paths): `embedding.word_embeddings.weight`, `output_layer.weight`, and
  transformer layers stacked on a leading axis (`decoder.layers.mlp.linear_fc1.weight` is [layers, ...]).
  Tensor-parallel ranks save their row ranges of the vocab tensors as pieces of one global tensor.
- optimizer state (plain optimizer, and the distributed optimizer's `fully_reshardable` layout):
  `optimizer.state.<key>.<fqn>` with key `exp_avg`/`exp_avg_sq`, plus `optimizer.state.param.<fqn>`, the
  distributed optimizer's fp32 master copy of the weight (its new rows are the new weights' rows; the plain
  optimizer's under bf16 is `optimizer.state.fp32_param.<fqn>`). Which
  parameter is in which param group is not stored (common.pt keeps the groups' options only): Megatron
  rebuilds it with its default rule, biases and 1-D parameters (per layer) without weight decay, which is
  what the groups here are built with (noted in the report).
- the distributed optimizer's `dp_reshardable` layout (Megatron-LM's default) stores flat bucket buffers
  (`optimizer.distributed.dp_group_idx_<g>.gbuf_idx_<b>.dtype_(...).bucket_idx_<k>.<key>`, parameters in
  reverse registration order, padded per bucket) with no parameter names: read as an unmapped optimizer
  (CKF160), and repair refuses it unless its state is dropped (`repair_unsupported`).
- the vocab rows are Megatron-LM's `_vocab_size_with_padding`: the tokenizer's size rounded up to
  `args.make_vocab_size_divisible_by` x `args.tensor_model_parallel_size` (`recorded.recorded_padding`).
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.errors import CkptfixError, UnreadableCheckpoint
from ckptfix.formats import common, dcp_folder
from ckptfix.formats.dcp_folder import METADATA_FILE, DcpLayout
from ckptfix.formats.pickle_records import OpaqueObject, TensorRef
from ckptfix.untrusted import read_bounded

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
BACKEND = "metadata.json"
STATE_PREFIX = "optimizer.state."
DISTRIBUTED_PREFIX = "optimizer.distributed."
# fp32 master copies of the weights, not moments: fully_reshardable's `param`; `fp32_param` is the plain
# optimizer's under bf16/fp16 (Float16OptimizerWithFloat16Params; read the same way, not built by the fixtures)
MASTER_KEYS = ("param", "fp32_param")
RESHARDABLE_FLAG = "--dist-ckpt-optim-fully-reshardable"
_ITER = re.compile(r"iter_\d{7}|release")


@dataclass
class MegatronLayout(DcpLayout):
    """The DCP layout plus what Megatron adds; `ckpt.raw` of a Megatron checkpoint."""

    iteration_dir: str = ""
    parent: str | None = None  # the save folder with the tracker file, when that was the path given
    master_items: dict[str, str] = field(default_factory=dict)  # weight name -> its optimizer.state.param item
    sharding_type: str | None = None  # the distributed optimizer's param_state_sharding_type
    flat_buckets: list[str] = field(default_factory=list)  # dp_reshardable's unnamed flat buffers
    common_tree: Any = None  # common.pt as unpickled (allowlist), for the writer


# --- finding the iteration folder ----------------------------------------------------------------------

def sniff(path: str) -> bool:
    """An iteration folder (`metadata.json` naming the torch_dist backend beside `.metadata`), or a save
    folder whose tracker file names one."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        return True
    return _is_iteration_dir(path)


def _is_iteration_dir(path: str) -> bool:
    if not (os.path.isfile(os.path.join(path, METADATA_FILE)) and os.path.isfile(os.path.join(path, COMMON))):
        return False
    try:
        backend = json.loads(read_bounded(os.path.join(path, BACKEND), 1 << 16))
    except (OSError, ValueError, CkptfixError):
        return False
    return isinstance(backend, dict) and backend.get("sharded_backend") == "torch_dist"


def iteration_dir(path: str) -> tuple[str, str | None]:
    """(the iteration folder to read, the save folder when `path` is one): the tracker's iteration, as
    Megatron-LM's `read_metadata` reads it (an int, or `release`)."""
    tracker = os.path.join(path, TRACKER)
    if not os.path.isfile(tracker):
        return path, None
    try:
        text = read_bounded(tracker, 64).decode("ascii", "replace").strip()
    except (OSError, CkptfixError) as exc:
        raise UnreadableCheckpoint(f"{tracker}: cannot read ({exc})") from None
    if text == "release":
        name = "release"
    elif text.isdigit() and len(text) <= 12:
        name = f"iter_{int(text):07d}"
    else:
        raise UnreadableCheckpoint(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}")
    folder = os.path.join(path, name)
    if not _is_iteration_dir(folder):
        raise UnreadableCheckpoint(f"{tracker}: names iteration {text}, but {name}/ is not a torch_dist checkpoint "
                                   "(.metadata, common.pt, metadata.json)")
    return folder, path


# --- reading ---------------------------------------------------------------------------------------------

def read(path: str, *, trust_pickle: bool = False) -> Checkpoint:
    folder, parent = iteration_dir(path)
    items, version = dcp_folder.read_metadata(folder)
    layout = MegatronLayout(items, *dcp_folder.data_files(folder, items), iteration_dir=folder, parent=parent)
    ckpt = Checkpoint(path=path, format="megatron", raw=layout)  # the writer works in layout.iteration_dir
    ckpt.extras["dcp_version"] = version
    ckpt.files = {"metadata": os.path.join(folder, METADATA_FILE), "common": os.path.join(folder, COMMON)}
    if parent is not None:
        ckpt.files["tracker"] = os.path.join(parent, TRACKER)
    for fqn in items:  # Megatron's state dict is flat: the FQN is the whole path
        items[fqn].path = (fqn,)
    tensors, pending = _tensors(folder, items)
    ckpt.unopened_records = dcp_folder.unopened_records(items)
    common_tree, locate_for = _read_common(folder, ckpt, trust_pickle)
    layout.common_tree = common_tree
    ckpt.model = {fqn: t for fqn, t in tensors.items() if not fqn.startswith("optimizer.")}
    layout.model_items = {name: name for name in ckpt.model}
    ckpt.sections["model"] = ""
    _read_optimizer(ckpt, layout, tensors, common_tree, locate_for)
    objects = [fqn for fqn, item in items.items() if not item.is_tensor]
    if objects:
        ckpt.notes.append(f"{len(objects)} non-tensor item(s) (rng_state, _extra_state, ...) not unpickled; "
                          "repair carries them unchanged")
    if pending:
        ckpt.notes.append(f"{len(pending)} tensor(s) cannot be read in place ({pending[0]}); "
                          "inspect still works, values need torch.distributed.checkpoint")
    if not ckpt.model:
        raise UnreadableCheckpoint(f"{folder}: Megatron checkpoint holds no model tensors")
    if parent is not None:  # a repair's record lives in the iteration folder it changed
        from ckptfix.record import read_sidecar

        ckpt.record = read_sidecar(folder)
    return ckpt


def _tensors(folder: str, items: dict[str, dcp_folder.Item]) -> tuple[dict[str, TensorInfo], list[str]]:
    pending: list[str] = []
    out = {}
    for fqn, item in items.items():
        if item.is_tensor:
            out[fqn] = dcp_folder.tensor_info(folder, item, pending)
            out[fqn].name = fqn
    return out, pending


def _read_common(folder: str, ckpt: Checkpoint, trust_pickle: bool) -> tuple[dict, common.Locator]:
    """common.pt with the allowlist: Megatron-LM's args is an argparse.Namespace and its enums
    (attention_backend=AttnBackend.auto) are `data_globals.KNOWN_ENUMS`, both data; anything else outside the
    allowlist needs --trust-pickle, which reads it as an inert record (repair then cannot write it back)."""
    from ckptfix.formats import torch_file

    path = os.path.join(folder, COMMON)
    tree, locate_for, _ = torch_file.load(path, opaque=trust_pickle)
    if not isinstance(tree, dict):
        raise UnreadableCheckpoint(f"{path}: expected a dict, found {type(tree).__name__}")
    for key, value in tree.items():
        if key == "args":
            ckpt.extras["args"] = args_dict(value, path)
        elif key == "opt_param_scheduler" and isinstance(value, dict):
            # Megatron's OptimizerParamScheduler (max_lr, num_steps, lr_decay_style, ...), not a torch
            # LRScheduler: kept verbatim, the schedule checks do not read it
            ckpt.extras[key] = value
            steps = value.get("num_steps")
            ckpt.notes.append(f"{COMMON}: Megatron's opt_param_scheduler ({value.get('lr_decay_style', '?')} decay, "
                              f"num_steps {steps}) is kept as saved; the schedule checks (CKF3xx) do not read it")
        elif key != "optimizer":
            ckpt.extras[key] = value
    return tree, locate_for


def args_dict(value: Any, origin: str) -> dict:
    """Megatron-LM's `args` (an argparse.Namespace, read as data) as a dict of its fields."""
    if isinstance(value, dict):
        return value
    if isinstance(value, OpaqueObject) and value.cls == "argparse.Namespace" and isinstance(value.state, dict):
        return dict(value.state)
    raise UnreadableCheckpoint(f"{origin}: args is a {getattr(value, 'cls', type(value).__name__)}, not an "
                               "argparse.Namespace")


def _read_optimizer(ckpt: Checkpoint, layout: MegatronLayout, tensors: dict[str, TensorInfo], tree: dict,
                    locate_for: common.Locator) -> None:
    saved = tree.get("optimizer")
    if not isinstance(saved, dict):
        return
    layout.sharding_type = saved.get("param_state_sharding_type") if isinstance(
        saved.get("param_state_sharding_type"), str) else None
    layout.optimizer_prefix = ("optimizer",)
    # the plain optimizer's state_dict; the distributed one nests its inner optimizer's under "optimizer", or
    # (dp_reshardable) keeps it in a sharded object beside its buffers
    inner = saved["optimizer"] if isinstance(saved.get("optimizer"), dict) else saved
    if "param_groups" not in inner:
        inner = _bucket_optimizer(layout) or inner
    groups = inner["param_groups"] if isinstance(inner.get("param_groups"), list) else []
    state: dict[str, dict[str, Any]] = {}
    for fqn, info in tensors.items():
        if fqn.startswith(DISTRIBUTED_PREFIX):
            layout.flat_buckets.append(fqn)
        if not fqn.startswith(STATE_PREFIX):
            continue
        key, _, name = fqn[len(STATE_PREFIX):].partition(".")
        if name not in ckpt.model:
            ckpt.notes.append(f"{fqn}: optimizer state of {name!r}, which is not a model tensor; kept as is")
            continue
        if key in MASTER_KEYS:
            layout.master_items[name] = fqn
            continue
        state.setdefault(name, {})[key] = info
        layout.moment_items[(name, key)] = fqn
    step = _step(inner, locate_for)
    for entries in state.values():
        if step is not None:
            entries["step"] = step
    params = list(state)
    param_groups = _groups(groups, params, ckpt.model)
    if layout.flat_buckets:  # the buffers name no parameter: the groups' options only
        param_groups = [{**g, "params": []} for g in param_groups]
    sd = {"state": state, "param_groups": param_groups}
    ckpt.optimizer = common.parse_optimizer(sd, None, f"{layout.iteration_dir}: optimizer")
    ckpt.sections["optimizer"] = f"{COMMON}:optimizer + optimizer.state.*"
    if layout.flat_buckets:
        ckpt.sections["optimizer"] = f"{COMMON}:optimizer + {len(layout.flat_buckets)} flat bucket buffer(s)"
    if params and groups:
        ckpt.notes.append("Megatron does not store which parameter is in which param group: groups assigned by its "
                          "default rule (biases and 1-D parameters without weight decay)")


def _bucket_optimizer(layout: MegatronLayout) -> dict | None:
    """dp_reshardable: the inner optimizer's state_dict (its param_groups) saved as a sharded object."""
    for fqn, item in layout.items.items():
        if fqn.startswith(DISTRIBUTED_PREFIX) and ".optimizer/shard_" in fqn and not item.is_tensor:
            value = dcp_folder.object_value(layout.iteration_dir, item, False)
            value = value[0] if isinstance(value, list) and value else value
            if isinstance(value, dict) and isinstance(value.get("param_groups"), list):
                return value
    return None


def _step(saved: dict, locate_for: common.Locator) -> float | None:
    """The optimizer step: the plain optimizer's `state.common_step`, the distributed one's per-group `step`."""
    inner = saved.get("state")
    value = inner.get("common_step") if isinstance(inner, dict) else None
    if value is None:
        groups = saved.get("param_groups")
        value = groups[0].get("step") if isinstance(groups, list) and groups and isinstance(groups[0], dict) else None
    if isinstance(value, TensorRef) and value.shape in ((), (1,)):
        return common.read_scalar(common.tensor_from_ref("optimizer.state.common_step", value, locate_for))
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _groups(groups: list, params: list[str], model: dict[str, TensorInfo]) -> list[dict]:
    """The saved groups' options with their parameters assigned by Megatron's default rule (two groups told
    apart by `wd_mult`); any other grouping keeps every parameter in the first group (noted by the reader)."""
    options = [{k: v for k, v in g.items() if k != "params"} for g in groups if isinstance(g, dict)]
    if not options:
        return [{"params": params}] if params else []
    no_wd = [i for i, g in enumerate(options) if g.get("wd_mult") == 0.0]
    wd = [i for i, g in enumerate(options) if g.get("wd_mult") not in (0.0, None)]
    out = [{**g, "params": []} for g in options]
    if len(options) == 2 and len(no_wd) == 1 and len(wd) == 1:
        for name in params:
            out[no_wd[0] if _no_weight_decay(name, model[name].shape) else wd[0]]["params"].append(name)
    else:
        out[0]["params"] = list(params)
    return out


def _no_weight_decay(name: str, shape: tuple[int, ...]) -> bool:
    """Megatron's default: `len(param.shape) == 1 or name.endswith('.bias')`, on the per-layer shape."""
    per_layer = shape[1:] if name.startswith("decoder.layers.") else shape
    return name.endswith(".bias") or len(per_layer) == 1


# --- repair's refusal ------------------------------------------------------------------------------------

def flat_bucket_problem(ckpt: Checkpoint) -> str | None:
    """Why a repair keeping optimizer state cannot be written (dp_reshardable's unnamed flat buffers)."""
    layout = ckpt.raw
    if not isinstance(layout, MegatronLayout) or not layout.flat_buckets:
        return None
    return (f"the distributed optimizer's state is in the {layout.sharding_type or 'dp_reshardable'} layout "
            f"({len(layout.flat_buckets)} flat bucket buffers with no parameter names, "
            f"{layout.flat_buckets[0]}, ...), which repair does not remap: re-save the checkpoint with "
            f"Megatron-LM's {RESHARDABLE_FLAG} (load it and save again), or repair with --policy fresh "
            "(optimizer state dropped; resume with --no-load-optim)")
