"""Optimizer state against the model's parameters."""

from __future__ import annotations

from collections import Counter
from typing import Iterator

from ckptfix.checks.codes import Context, Finding, check, finding
from ckptfix.mapping import MOMENT_KEYS
from ckptfix.optim_state import describe, refusals


@check("CKF201", "error", "optimizer moment shape differs from its parameter",
       "An exp_avg/exp_avg_sq (or momentum) tensor's shape is not its parameter's shape.")
def moment_shape_mismatch(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None:
        return
    bad = []
    for index, name in ctx.mapping.names.items():
        param = ctx.ckpt.model.get(name)
        ps = opt.state.get(index)
        if param is None or ps is None:
            continue
        for key in MOMENT_KEYS:
            t = ps.tensors.get(key)
            if t is not None and t.shape != param.shape:
                bad.append((name, key, t.shape, param.shape))
    if not bad:
        return
    name, key, got, want = bad[0]
    yield finding(
        "CKF201", f"{len(bad)} moment tensor(s) do not match their parameter, e.g. {key} of {name} is "
        f"{list(got)} but the parameter is {list(want)}",
        pytorch="Optimizer.load_state_dict accepts them silently; the first optimizer.step() raises "
        "'The size of tensor a ... must match the size of tensor b' (or, for a view of the right size, updates "
        "rows with another row's history).",
        fix=ctx.repair_command("--policy remap"), tensors=sorted({b[0] for b in bad}))


@check("CKF202", "error", "optimizer parameter count cannot match the model",
       "The optimizer holds more parameters than the model has, or its state indexes params in no group.")
def param_count_mismatch(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None or not ctx.ckpt.model or ctx.mapping.method in ("torch", "fqn", "recorded"):
        return
    indices = opt.indices()
    params = ctx.ckpt.parameters()
    grouped = set(indices)
    orphans = [i for i in opt.state if i not in grouped]
    if len(indices) > len(params) and _converted_layout(ctx, indices, params):
        return  # CKF205 says it
    if len(indices) > len(params):
        yield finding(
            "CKF202", f"the optimizer's param groups hold {len(indices)} parameters but the model has "
            f"{len(params)} floating-point parameter tensors",
            pytorch="Optimizer.load_state_dict raises ValueError 'loaded state dict contains a parameter group that "
            "doesn't match the size of optimizer's group' unless the live optimizer was built the same way; "
            "if it was, state lands on the wrong parameters.",
            fix=ctx.repair_command("--policy fresh"))
    elif orphans:
        yield finding(
            "CKF202", f"{len(orphans)} optimizer state entries belong to no param group (e.g. index {orphans[0]})",
            pytorch="Optimizer.load_state_dict drops them silently.", fix=ctx.repair_command("--policy fresh"))


@check("CKF205", "warning", "optimizer holds the model class's parameters, the weights file another layout",
       "An HF folder whose optimizer has more entries than the weights file has tensors, with no more elements: "
       "transformers 5 saves some models in their checkpoint layout (q/k/v or gate/up fused, renamed), while the "
       "optimizer was built from the loaded model's own parameters.")
def converted_layout(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None or not ctx.ckpt.model or ctx.mapping.method in ("torch", "fqn", "recorded"):
        return
    indices, params = opt.indices(), ctx.ckpt.parameters()
    if len(indices) > len(params) and _converted_layout(ctx, indices, params):
        named = sum(1 for v in ctx.vocab if v.optimizer_index is not None and v.tied_to is None)
        vocab = f"{named} vocab tensor(s) among them" if named else "no vocab tensor among them"
        yield finding(
            "CKF205", f"the optimizer holds {len(indices)} parameters, the weights file {len(params)} tensors with "
            "as many elements or more: the file is in a converted layout (transformers' save_pretrained fuses "
            f"or splits some models' tensors), so only the entries of a unique shape are named ({vocab}); the "
            "rest are checked by element count only",
            pytorch="Trainer.train(resume_from_checkpoint=...) loads the weights through the same conversion and "
            "the optimizer by position into the class's own parameters: right while the model code is unchanged.")


def _converted_layout(ctx: Context, indices: list, params: list[str]) -> bool:
    """More optimizer entries than file tensors is certain to be wrong, except in a `save_pretrained` folder
    (its config.json beside the weights), whose file may hold the class's parameters fused or renamed: there
    the entries' elements (their moments') must still fit in the file's tensors' elements."""
    from ckptfix.mapping import moment_shape

    if not ctx.ckpt.format.startswith("hf-") or not isinstance(ctx.ckpt.extras.get("config"), dict):
        return False
    assert ctx.ckpt.optimizer is not None
    held = 0
    for i in indices:
        shape = moment_shape(ctx.ckpt.optimizer.state.get(i))
        held += _elements(shape) if shape is not None else 0
    return held <= sum(ctx.ckpt.model[n].numel for n in params)


def _elements(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


@check("CKF203", "warning", "per-parameter step counts disagree",
       "Adam's per-parameter `step` differs between parameters (bias correction differs too).")
def steps_disagree(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None:
        return
    steps = Counter(ps.step for ps in opt.state.values() if ps.step is not None)
    if len(steps) <= 1:
        return
    common_step, _ = steps.most_common(1)[0]
    odd = [ctx.mapping.names.get(i, f"index {i}") for i, ps in opt.state.items()
           if ps.step is not None and ps.step != common_step]
    yield finding(
        "CKF203", f"step is {common_step:g} for most parameters but differs for {len(odd)} "
        f"(values: {', '.join(f'{s:g}' for s in sorted(steps))})",
        severity="warning",
        pytorch="Adam keeps one step per parameter; parameters with a small step get large bias-corrected updates. "
        "Normal only for parameters that were frozen or added mid-run.",
        tensors=odd[:20])


@check("CKF204", "info", "optimizer state mapped to parameters by a weak method",
       "Optimizer indices could not be matched to parameter names by count and shape; checks on moments are partial.")
def weak_mapping(ctx: Context) -> Iterator[Finding]:
    opt = ctx.ckpt.optimizer
    if opt is None or not ctx.ckpt.model or ctx.mapping.method in ("torch", "recorded", "fqn", "position", "hf-groups"):
        return
    mapped, total = len(ctx.mapping.names), len(opt.indices())
    if ctx.mapping.method == "shape" and not ctx.ckpt.ordered and _shapes_agree(ctx):
        # an HF Trainer folder: optimizer.pt is in the model class's parameter order, model.safetensors sorted
        # by name; the Trainer loads the state by position into the same class, which ckptfix cannot build
        yield finding(
            "CKF204", f"the optimizer's {total} entries follow the model class's parameter order, which the "
                      f"weights file does not record (safetensors stores names sorted): ckptfix names {mapped} of "
                      "them (unique shapes); taken together their shapes are exactly the model's parameters' "
                      "shapes",
            pytorch="optimizer.load_state_dict matches entries by position into a model built from the same "
            "class and config (what Trainer.train(resume_from_checkpoint=...) does): right when the model code "
            "is unchanged; a changed parameter order would give moments to other same-shaped parameters silently.")
        return
    yield finding(
        "CKF204", f"{mapped} of {total} optimizer entries matched to parameters (method: {ctx.mapping.method})",
        pytorch="torch.optim saves state by position, not name; a model whose parameter order changed gets "
        "another parameter's moments without any error.")


def _shapes_agree(ctx: Context) -> bool:
    """Whether the optimizer's moment shapes are, as a multiset, the model's parameter shapes."""
    from ckptfix.mapping import moment_shape

    opt, params = ctx.ckpt.optimizer, ctx.ckpt.parameters()
    assert opt is not None
    shapes = [moment_shape(opt.state.get(i)) for i in opt.indices()]
    if len(shapes) != len(params) or None in shapes:
        return False
    return Counter(shapes) == Counter(ctx.ckpt.model[n].shape for n in params)


@check("CKF210", "warning", "optimizer state that cannot follow a vocab resize",
       "A state of a vocab-sized parameter whose rows cannot be moved row by row (a preconditioner over the vocab "
       "axis, a state whose meaning is not recorded, flat history over all parameters, an unknown optimizer): "
       "repair stops on it unless --policy fresh or --policy reset is given.")
def unremappable_state(ctx: Context) -> Iterator[Finding]:
    found = refusals(ctx.ckpt.optimizer, ctx.vocab) if ctx.vocab else []
    if not found:
        return
    opt = ctx.ckpt.optimizer
    assert opt is not None
    yield finding(
        "CKF210", f"{opt.kind}: {len(found)} state(s) cannot follow a resize of the vocab rows: {describe(found)}",
        pytorch="Resizing the vocab rows leaves these states at the old size or in the old rows' basis: the first "
        "optimizer.step() raises on a size mismatch or updates new rows with another row's statistics.",
        fix=ctx.repair_command("--policy fresh") + "  (drops optimizer state, keeps the schedule; or --policy reset)",
        tensors=sorted({v.name for v in ctx.vocab}))
