"""`ResumeGuard.load` into a sharded model (FSDP2's DTensors): a DCP folder read by every rank for its own
shards with `torch.distributed.checkpoint`, into the model's and optimizer's own sharded state dicts
(`get_state_dict` -> `dcp.load` -> `set_state_dict`), so no rank holds a whole tensor and every rank issues
the same collectives. The plan (`plan_resume`, pure) is computed alike on every rank; what this cannot do
yet (resize rows of DTensors, drop or regroup the optimizer state, a layout other than the nested
`{"model": ..., "optim": ...}` one `get_state_dict` gives) is `refusal`'s one line, raised on every rank.
"""

from __future__ import annotations

from typing import Any

from ckptfix.guard.resume_plan import ResumePlan


def _prefix(items: list[str], names: list[str]) -> str | None:
    """The key under which the model sits (`model` for `model.<fqn>`); None when not one nested key."""
    heads = {item[: -len(name) - 1] for item, name in zip(items, names) if item.endswith("." + name)}
    return heads.pop() if len(heads) == 1 and len(items) == len(names) and "." not in next(iter(heads)) else None


def refusal(ckpt: Any, plan: ResumePlan) -> str | None:
    """Why this load cannot run on DTensors yet (None: it can). Decided from the plan and the folder's
    metadata only, the same on every rank."""
    layout = ckpt.raw
    if ckpt.format != "dcp":
        return (f"a {ckpt.format} checkpoint holds whole tensors; into a sharded model only a DCP folder loads "
                "(each rank reads its own shards)")
    if plan.model.used_edits:
        return ("resizing vocab rows of a sharded model (each rank its own rows) is not built yet; resize the "
                "folder first with `ckptfix repair`, or load with policy='strict' at the checkpoint's vocab")
    if plan.optimizer_action not in ("load", "none") or plan.load_scaler or plan.sync_lr:
        return (f"optimizer action {plan.optimizer_action!r}"
                f"{' with a GradScaler' if plan.load_scaler else ''} on a sharded model is not built yet")
    if layout.flattened_optimizer or layout.meta_file or _model_key(ckpt) is None:
        return ("only the nested layout get_state_dict gives ({'model': ..., 'optim': ...}) loads into a sharded "
                "model yet (not torchtitan's flattened or Lightning's)")
    if plan.optimizer_action == "load" and len(layout.optimizer_prefix) != 1:
        return "the optimizer state is not under one top-level key"
    return None


def _model_key(ckpt: Any) -> str | None:
    names = list(ckpt.raw.model_items)
    return _prefix([ckpt.raw.model_items[n] for n in names], names)


def load_shards(ckpt: Any, plan: ResumePlan, model: Any, optimizer: Any, scheduler: Any) -> list[str]:
    """Load the folder's model (and optimizer) shards on every rank; the scheduler from its plain values."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from ckptfix.guard.resume_apply import Values
    from ckptfix.guard.setup import unwrap_optimizer

    opt = unwrap_optimizer(optimizer) if plan.optimizer_action == "load" else None
    msd, osd = get_state_dict(model, opt if opt is not None else [])
    state: dict[str, Any] = {_model_key(ckpt) or "model": msd}
    if opt is not None:
        state[ckpt.raw.optimizer_prefix[0]] = osd
    dcp.load(state, checkpoint_id=ckpt.path)
    set_state_dict(model, opt if opt is not None else [], model_state_dict=msd,
                   optim_state_dict=osd if opt is not None else {})
    actions = [f"loaded {len(msd)} model tensor(s) shard by shard (torch.distributed.checkpoint)"]
    if opt is not None:
        actions.append("loaded optimizer state shard by shard (matched by name)")
    if plan.scheduler_action == "load":
        scheduler.load_state_dict(Values(ckpt)(dict(ckpt.scheduler), "scheduler", "scheduler"))
        actions.append("loaded scheduler state")
    elif plan.scheduler_action == "keep":
        actions.append("kept the scheduler's fresh state (reset)")
    return actions
