"""Decide a resume: `plan_resume(checkpoint, analysis, live, policy) -> ResumePlan`.

Pure: reads the checkpoint (metadata; the fp16-underflow check reads two moments) and a `Live`
description of the training objects, modifies nothing, and returns every decision (what each live
tensor is loaded from, which checkpoint optimizer entry goes to which live position, what happens to
the optimizer, scheduler and scaler), the problems (CKF821-827) and the notes. `resume_apply`
carries a plan out; `ResumeGuard.load` raises on its errors first. Tests build a `Live` by hand: no
torch model is needed to test a decision.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptfix.fit import fit_rows
from ckptfix.guard.live import Live, LiveTensor
from ckptfix.guard.problems import Problem, format_names
from ckptfix.mapping import MOMENT_KEYS, WRAPPER_PREFIXES, ParamMapping, names_for_resume
from ckptfix.record import Record

#: Second-moment state keys: in fp16 their small values underflow to 0.
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


@dataclass
class _Target:
    """What `make_plan` needs of a tokenizer: the row count to resize to (the live model's), and the
    live tokenizer's id -> token table when the guard has it (then rows can move by token string)."""

    size: int
    path: str = "<live model>"
    tokens: Any = None  # TokenizerInfo of the live tokenizer, or None
    special_tokens: tuple[str, ...] = ()

    def id_to_token(self) -> list[str | None] | None:
        return self.tokens.id_to_token() if self.tokens is not None else None

    def __getattr__(self, name: str) -> Any:  # anything else a plan reads of a tokenizer (source, kind...)
        tokens = self.__dict__.get("tokens")
        if tokens is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(tokens, name)

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size}


@dataclass
class ModelPlan:
    """The model side: what each live tensor is loaded from, and what does not fit."""

    key_map: dict[str, str]  # checkpoint name -> live state_dict key
    renamed: str | None = None  # how keys were renamed (a wrapper prefix), if they were
    load: dict[str, str] = field(default_factory=dict)  # live key -> checkpoint name
    repair: Any = None  # ckptfix.surgery.plan.RepairPlan when vocab tensors are resized
    used_edits: set[str] = field(default_factory=set)  # checkpoint names whose repair edit is used
    vocab_rows: set[int] = field(default_factory=set)  # idents of live tensors reported as CKF825
    rows_by_id: str = ""  # resized rows kept by id: "asked" (keep_ids=True) | "unchecked" (old tokenizer not known)

    def weight_edit(self, owner: str) -> Any:
        """The resize of checkpoint tensor `owner` (a tied alias's owner), if it is used."""
        return self.repair.weights[owner] if owner in self.used_edits else None

    def moment_edit(self, index: Any, key: str) -> Any:
        """The resize of a moment, when the weight that owns it is resized."""
        edit = self.repair.moments.get((index, key)) if self.repair is not None else None
        return edit if edit is not None and edit.owner in self.used_edits else None


@dataclass
class OptimizerPlan:
    """The optimizer side: checkpoint index -> live position, and how that was decided."""

    assign: dict[Any, int] = field(default_factory=dict)
    matched_by: str = "none"
    moved: int = 0  # parameters whose state comes from another index than their position
    drop: bool = False
    layout_ok: bool = False


@dataclass
class ResumePlan:
    """Every decision of a resume, before anything is modified."""

    policy: str
    model: ModelPlan
    optimizer: OptimizerPlan = field(default_factory=OptimizerPlan)
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # "load" (state at the assigned positions) | "groups" (param-group options, no state) |
    # "fresh" (the live optimizer keeps its fresh state) | "none" (nothing to load)
    optimizer_action: str = "none"
    scheduler_action: str = "none"  # "load" | "keep" (its fresh state, reset) | "none"
    load_scaler: bool = False
    rewarm: bool = False
    sync_lr: bool = False  # optimizer state dropped without its groups: take the lr the scheduler set

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    @property
    def matched_by(self) -> str:
        if self.optimizer_action == "load":
            return self.optimizer.matched_by
        return "dropped" if self.optimizer_action in ("groups", "fresh") else "none"


def plan_resume(ckpt: Any, analysis: Any, live: Live, policy: str, *, reset_scheduler: bool = False) -> ResumePlan:
    """Decide how `ckpt` (with its `inspect.analyse` result) loads into `live` under `policy`."""
    if analysis.identity is None and live.tokenizer is not None:  # asked once: the resize plan and CKF828 share it
        from ckptfix.identity import known_old_tokenizer
        from ckptfix.vocab import vocab_rows

        analysis.identity = known_old_tokenizer(ckpt, vocab_rows(analysis.vocab), live.from_tokenizer)
    model = plan_model(ckpt, analysis, live, policy)
    plan = ResumePlan(policy, model.plan, notes=list(ckpt.notes))
    plan.problems = check_tokenizer(live) + check_token_ids(ckpt, analysis, live, model.plan) + model.problems
    plan.optimizer = _plan_optimizer_side(ckpt, analysis.mapping, live, plan)
    record = ckpt.record if ckpt.record is not None else Record()
    plan.problems += check_sections(ckpt, live, policy, record)
    if plan.model.repair is not None:
        from ckptfix.errors import for_api

        plan.notes += [n for n in map(for_api, plan.model.repair.notes) if n not in plan.notes]
        plan.problems += audit_problems(plan.model.repair, analysis.mapping)
    _decide_training_state(plan, ckpt, live, record, reset_scheduler)
    return plan


def audit_problems(repair: Any, mapping: ParamMapping) -> list[Problem]:
    """The audit of the in-memory resize (`ckptfix.audit`, as repair runs it): a value that carries the old
    vocab size and that the resize does not account for (a second optimizer's state, a recorded size, a
    second vocabulary) is an error, named with its path and what resolves it."""
    from ckptfix.audit import audit

    return [Problem(v.code or "CKF130", "error", f"{v.path} ({v.what}): {v.reason}; resolve: {v.resolve}", (v.path,))
            for v in audit(repair, mapping).unresolved]


def _plan_optimizer_side(ckpt: Any, mapping: ParamMapping, live: Live, plan: ResumePlan) -> OptimizerPlan:
    if live.optimizer is None or ckpt.optimizer is None or plan.policy == "reset":
        return OptimizerPlan()
    repair = plan.model.repair
    if repair is not None and repair.drop_optimizer_state:
        if plan.policy == "remap":
            plan.problems.append(Problem(
                "CKF822", "warning",
                "the optimizer state of the resized tensors could not be matched to them "
                "(" + "; ".join(repair.notes) + "): optimizer state dropped, LR re-warmed, "
                "as `ckptfix repair` does.", tuple(repair.weights)))
        return OptimizerPlan(drop=True, layout_ok=_layout_ok(ckpt.optimizer, live))
    result = plan_optimizer(ckpt, mapping, plan.model, live, plan.policy)
    plan.problems += result.problems
    plan.notes += result.notes
    return result.plan


def _decide_training_state(plan: ResumePlan, ckpt: Any, live: Live, record: Record, reset_scheduler: bool) -> None:
    """Optimizer, scheduler, scaler and re-warm, from the checks' outcome."""
    plan.rewarm = record.rewarm
    if plan.rewarm:
        plan.notes.append("the checkpoint's ckptfix repair record asks for an LR re-warm")
    opt = plan.optimizer
    if live.optimizer is not None and plan.policy != "reset":
        if ckpt.optimizer is None:
            plan.rewarm = plan.rewarm or plan.policy == "fresh"
        elif opt.drop:
            plan.rewarm = True
            plan.optimizer_action = "groups" if opt.layout_ok and not reset_scheduler else "fresh"
        else:
            plan.optimizer_action = "load"
    if live.has_scheduler and ckpt.scheduler is not None:
        reset = plan.policy == "reset" or (opt.drop and reset_scheduler)
        plan.scheduler_action = "keep" if reset else "load"
    plan.sync_lr = opt.drop and plan.scheduler_action == "load" and not opt.layout_ok
    if live.has_scaler and ckpt.scaler is not None and plan.policy != "reset":
        if live.scaler_enabled:
            plan.load_scaler = True
        elif ckpt.scaler:
            plan.notes.append("the checkpoint has GradScaler state; the live scaler is disabled, so it is not restored")


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


@dataclass
class _ModelResult:
    plan: ModelPlan
    problems: list[Problem]


def key_map(ckpt_keys: list[str], live_keys: list[str]) -> tuple[dict[str, str], str | None]:
    """Checkpoint name -> model name; tolerates a DDP/torch.compile prefix on either side."""
    live = set(live_keys)
    best: dict[str, str] = {k: k for k in ckpt_keys if k in live}
    how = None
    for pre in WRAPPER_PREFIXES:
        strip = {k: k[len(pre):] for k in ckpt_keys if k.startswith(pre) and k[len(pre):] in live}
        add = {k: pre + k for k in ckpt_keys if pre + k in live}
        for cand, what in ((strip, f"stripped the {pre!r} prefix from checkpoint keys"),
                           (add, f"added the {pre!r} prefix to checkpoint keys")):
            if len(cand) > len(best):
                best, how = cand, what
    return best, how


def key_problems(ckpt: Any, keys: dict[str, str], live: Live, unexpected_severity: str) -> list[Problem]:
    """CKF821: model keys without a checkpoint value; checkpoint tensors without a place.
    A tied alias of a loaded tensor counts as loaded (HF drops tied lm_head weights)."""
    targets = set(keys.values())
    loaded = {live.state[k].ident for k in targets}
    missing = [k for k, t in live.state.items() if k not in targets and t.ident not in loaded]
    missing_params = [k for k in missing if live.state[k].is_param]
    missing_buffers = [k for k in missing if not live.state[k].is_param]
    unexpected = [k for k in ckpt.model if k not in keys]
    problems = []
    if missing_params:
        problems.append(Problem(
            "CKF821", "error",
            f"{len(missing_params)} model parameter(s) have no value in the checkpoint: they "
            "would keep their random initialisation (renamed modules? a checkpoint of another "
            "model, or of an adapter only?).",
            tuple(missing_params),
        ))
    if missing_buffers:
        problems.append(Problem(
            "CKF821", "warning",
            f"{len(missing_buffers)} model buffer(s) have no value in the checkpoint; they keep "
            "their initial values.",
            tuple(missing_buffers),
        ))
    if unexpected:
        tail = (" and are ignored." if unexpected_severity == "warning" else
                " (policy 'strict'; 'remap' ignores them).")
        problems.append(Problem(
            "CKF821", unexpected_severity,
            f"{len(unexpected)} checkpoint tensor(s) have no place in the model" + tail,
            tuple(unexpected),
        ))
    return problems


def check_token_ids(ckpt: Any, analysis: Any, live: Live, model: ModelPlan) -> list[Problem]:
    """CKF828: the checkpoint's rows belong to an old tokenizer whose tokens have other ids in the live one,
    and the rows would be loaded by id (same shapes: nothing resizes them; or no remap by token)."""
    if live.tokenizer is None:
        return []
    from ckptfix.identity import id_moves, known_old_tokenizer
    from ckptfix.vocab import vocab_rows

    rows = vocab_rows(analysis.vocab)
    old, _ = analysis.identity or known_old_tokenizer(ckpt, rows, live.from_tokenizer)
    if old is None or rows is None:
        return []
    moves = id_moves(old.info, live.tokenizer, rows)
    if not moves.moved:
        return []
    if live.keep_ids and (model.repair is None or model.repair.rows_by != "token"):
        return [Problem(
            "CKF828", "warning",
            f"{len(moves.moved)} of {moves.shared} tokens have another id in the live tokenizer than in the one the "
            f"checkpoint was trained with ({old.describe()}), e.g. {moves.examples(3)}: rows loaded by id as asked "
            "(keep_ids=True) belong to other tokens.", tuple(v.name for v in analysis.vocab if v.tied_to is None))]
    fix = (f"`ckptfix repair CKPT --tokenizer {live.tokenizer.path} --from-tokenizer {old.path} -o FIXED` "
           "and load FIXED")
    return [Problem(
        "CKF828", "error",
        f"{len(moves.moved)} of {moves.shared} tokens have another id in the live tokenizer than in the one the "
        f"checkpoint was trained with ({old.describe()}), e.g. {moves.examples(3)}: rows loaded by id would "
        f"belong to other tokens. Fix: {fix}" + (", or policy='remap' with from_tokenizer= when the row count "
                                                 "changed too" if model.repair is None else "") + ".",
        tuple(v.name for v in analysis.vocab if v.tied_to is None))] if model.repair is None or \
        model.repair.rows_by != "token" else []


def check_tokenizer(live: Live) -> list[Problem]:
    """CKF824: the tokenizer needs more rows than the embedding has."""
    size, found = live.tokenizer_size, live.embedding
    if found is None or size is None or fit_rows(found[1], size).verdict != "too-few":
        return []  # the fit rule (ckptfix.fit): only fewer rows than tokens breaks a lookup
    name, rows = found
    return [Problem(
        "CKF824", "error",
        f"the tokenizer has {size} tokens but the model's embedding has {rows} rows: token ids "
        f"{rows}..{size - 1} cannot be looked up (IndexError on CPU, a device-side assert on "
        "GPU). Resize the model first (model.resize_token_embeddings(len(tokenizer)) before "
        "building the optimizer), then load with policy='remap'.",
        (name,),
    )]


def plan_model(ckpt: Any, analysis: Any, live: Live, policy: str) -> _ModelResult:
    """CKF821/825/826 and, if they allow it, what each live tensor is loaded from."""
    keys, renamed = key_map(list(ckpt.model), list(live.state))
    side = ModelPlan(key_map=keys, renamed=renamed)
    strict = policy == "strict"
    problems = key_problems(ckpt, keys, live, "error" if strict else "warning")
    vocab_names = {v.name for v in analysis.vocab}
    vocab_names |= {alias for alias, owner in ckpt.tied.items() if owner in vocab_names}
    vocab_diff: list[str] = []
    other_diff: list[str] = []
    for cname, lname in keys.items():
        if tuple(ckpt.model[cname].shape) != live.state[lname].shape:
            (vocab_diff if cname in vocab_names else other_diff).append(cname)

    def shapes(names: list[str]) -> str:
        return ", ".join(f"{n} {list(ckpt.model[n].shape)} vs {list(live.state[keys[n]].shape)}"
                         for n in names[:4])

    if vocab_diff and not strict:
        repair, why = _vocab_plan(ckpt, analysis, vocab_diff, live, keys, policy)
        if repair is not None:
            for cname in vocab_diff:
                owner = ckpt.tied.get(cname, cname)
                edit = repair.weights.get(owner)
                if edit is not None and tuple(edit.new_shape) == live.state[keys[cname]].shape:
                    side.used_edits.add(owner)
            side.repair = repair if side.used_edits else None
            if side.repair is not None and side.repair.rows_by == "id":
                side.rows_by_id = "asked" if live.keep_ids else "unchecked"
        unfit = [n for n in vocab_diff if ckpt.tied.get(n, n) not in side.used_edits]
        if unfit:
            vocab_diff = [n for n in vocab_diff if n not in unfit]
            problems.append(Problem(
                "CKF825", "error",
                f"{len(unfit)} vocab-sized tensor(s) cannot be resized to the model's shape "
                f"({shapes(unfit)})" + (f": {why}" if why else "."), tuple(unfit)))
    if vocab_diff:
        if strict:
            message = (f"{len(vocab_diff)} vocab-sized tensor(s) have another row count in the "
                       f"checkpoint than in the model ({shapes(vocab_diff)}): the tokenizer "
                       "changed since the checkpoint was saved. Their rows and Adam moments must "
                       "be resized together: use policy='remap' (or 'fresh'), or "
                       "`ckptfix repair CKPT --tokenizer TOK -o FIXED`.")
        else:
            message = (f"{len(vocab_diff)} vocab-sized tensor(s) have another row count in the "
                       f"checkpoint than in the model ({shapes(vocab_diff)}); resized in memory "
                       f"as `ckptfix repair --policy {policy}` would" + _rows_by_id(side.rows_by_id) + ".")
        problems.append(Problem("CKF825", "error" if strict else "warning", message, tuple(vocab_diff)))
        side.vocab_rows = {live.state[keys[n]].ident for n in vocab_diff}
    if other_diff:
        problems.append(Problem(
            "CKF826", "error",
            f"{len(other_diff)} tensor(s) have another shape in the checkpoint than in the model "
            f"({shapes(other_diff)}): the model's architecture or config differs from the one "
            "that saved the checkpoint.",
            tuple(other_diff),
        ))
    if not any(p.severity == "error" for p in problems):
        side.load = {lname: cname for cname, lname in keys.items()}
    return _ModelResult(side, problems)


def _rows_by_id(how: str) -> str:
    """What CKF825 says of rows kept by id: as asked, or unchecked (a retrained tokenizer moves ids unseen)."""
    if how == "asked":
        return ", rows kept by id as asked (keep_ids=True)"
    if how == "unchecked":
        return (", rows kept by id, unchecked: the tokenizer the checkpoint's rows were trained with is not known, "
                "so a token whose id moved (a retrained tokenizer) gets another token's row. Pass from_tokenizer= "
                "(the old tokenizer; it and tokenizer= as paths or TokenizerInfos) to remap rows by token")
    return ""


def _vocab_plan(ckpt: Any, analysis: Any, names: list[str], live: Live, keys: dict[str, str],
                policy: str) -> tuple[Any, str]:
    """The `ckptfix repair` plan to the model's row count (None and why, if impossible)."""
    from ckptfix.errors import CkptfixError
    from ckptfix.surgery.options import RepairOptions
    from ckptfix.surgery.plan import make_plan

    bias = {v.name for v in analysis.vocab if v.role == "head-bias"}
    targets = {live.state[keys[n]].shape[-1 if ckpt.tied.get(n, n) in bias else 0] for n in names}
    if len(targets) != 1:
        return None, f"the model's vocab tensors disagree on their row count ({sorted(targets)})"
    try:
        tok = live.tokenizer
        target = _Target(targets.pop(), tok.path if tok is not None else "<live model>", tok)
        plan = make_plan(analysis, target, live.from_tokenizer, RepairOptions(policy=policy, keep_ids=live.keep_ids),
                         format_notes=False, exact_rows=True)
    except CkptfixError as exc:
        return None, str(exc)
    return plan, ""


# ---------------------------------------------------------------------------------------------
# Optimizer
# ---------------------------------------------------------------------------------------------


@dataclass
class _OptimizerResult:
    plan: OptimizerPlan
    problems: list[Problem] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _layout_ok(copt: Any, live: Live) -> bool:
    return [len(g.params) for g in copt.groups] == live.layout


def plan_optimizer(ckpt: Any, mapping: ParamMapping, model: ModelPlan, live: Live, policy: str) -> _OptimizerResult:
    """CKF822/CKF823: does the checkpoint's optimizer state map onto the live optimizer?"""
    copt = ckpt.optimizer
    params = live.optimizer_params
    out = _OptimizerResult(OptimizerPlan(layout_ok=_layout_ok(copt, live)))
    side = out.plan
    cidx = copt.indices()

    def mismatch(message: str, names: tuple[str, ...], by_name: bool = False) -> None:
        if policy == "fresh":
            side.drop = True
            out.problems.append(Problem("CKF822", "warning", message + " Policy 'fresh': "
                                        "optimizer state dropped, LR re-warmed.", names))
        elif by_name and policy == "remap":
            out.problems.append(Problem("CKF822", "warning", message + " Policy 'remap': each "
                                        "parameter gets the state recorded under its name.", names))
        else:
            hint = (" Use policy='remap' to match the state by name, or 'fresh' to drop it." if by_name else
                    " Use policy='fresh' to drop the optimizer state.")
            out.problems.append(Problem("CKF822", "error", message + hint, names))

    if copt.parts:  # Muon + AdamW saved together: each needs its own live optimizer
        mismatch(f"the checkpoint holds {len(copt.parts)} optimizers ({copt.kind}, under "
                 f"{', '.join(p.section for p in copt.parts)}); ResumeGuard restores one optimizer.", ())
        return out
    if not side.layout_ok:
        c_layout = [len(g.params) for g in copt.groups]
        mismatch(f"the checkpoint's optimizer has {len(cidx)} parameter(s) in groups of "
                 f"{c_layout}, the optimizer {len(params)} in groups of {live.layout}: its "
                 "state cannot be mapped onto these parameters.", ())
        return out

    names, source = names_for_resume(ckpt, mapping, live.follows_model_order())
    if names is not None:
        position = {p.ident: i for i, p in enumerate(params)}
        assign: dict[Any, int] = {}
        unresolved: list[str] = []
        for ci, cname in zip(cidx, names):
            tensor = live.state.get(model.key_map.get(cname, cname))
            pos = position.get(tensor.ident) if tensor is not None else None
            if pos is None or pos in assign.values():
                unresolved.append(cname)
            else:
                assign[ci] = pos
        if unresolved:
            mismatch(f"the checkpoint's optimizer holds state for {len(unresolved)} parameter(s) "
                     f"that this optimizer does not hold (names {source}).", tuple(unresolved))
            return out
        side.assign, side.matched_by = assign, f"names ({source})"
        moved = [k for k, pos in enumerate(assign.values()) if pos != k]
        side.moved = len(moved)
        if moved:
            pairs = ", ".join(f"{params[k].name} <- state of {names[k]}" for k in moved[:4])
            how = ("recorded in the checkpoint" if source in ("recorded", "torch") else
                   "inferred from the checkpoint's tensor order, as this optimizer follows the "
                   "model's order")
            mismatch(f"the optimizer holds {len(moved)} parameter(s) at other positions than the "
                     f"checkpoint (names {how}): optimizer.load_state_dict, which matches by "
                     f"position, would give {pairs}. The module registration or parameter "
                     "order changed since saving.",
                     tuple(params[k].name for k in moved), by_name=True)
    else:
        side.assign, side.matched_by = {ci: k for k, ci in enumerate(cidx)}, "position"
        out.notes.append(
            "the checkpoint records no parameter names and its order cannot be inferred: "
            "optimizer state is matched by position and checked by shape only (store "
            "guard.record() under the 'ckptfix' key of your checkpoints to match by name)")
    if _check_moment_shapes(copt, model, params, side, mismatch):
        out.problems += _check_moment_dtypes(copt, side, params, policy)
    return out


def _moment_shape(copt: Any, model: ModelPlan, ci: Any) -> tuple[str, tuple[int, ...]] | None:
    """The first parameter-shaped moment of index `ci`, with its shape after resizing."""
    ps = copt.state.get(ci)
    for key in MOMENT_KEYS:
        t = ps.tensors.get(key) if ps is not None else None
        if t is None:
            continue
        edit = model.moment_edit(ci, key)
        return key, tuple(edit.new_shape if edit is not None else t.shape)
    return None


def _check_moment_shapes(copt: Any, model: ModelPlan, params: list[LiveTensor], side: OptimizerPlan,
                         mismatch: Any) -> bool:
    """CKF822: every moment fits the parameter it is assigned to (False: `mismatch` was called)."""
    bad, saved_shapes, with_state = [], [], []
    for ci, pos in side.assign.items():
        found = _moment_shape(copt, model, ci)
        if found is None:
            continue
        key, shape = found
        param = params[pos]
        saved_shapes.append(shape)
        with_state.append(param.shape)
        if param.ident in model.vocab_rows and shape[1:] == param.shape[1:]:
            continue  # CKF825 reports these rows already
        if shape != param.shape:
            bad.append((param.name, f"{param.name} {list(param.shape)} <- {key} {list(shape)}"))
    if not bad:
        return True
    permuted = side.matched_by == "position" and sorted(saved_shapes) == sorted(with_state)
    hint = (" The moments fit these parameters only under a permutation: the parameter "
            "order changed since saving (module registration order, param-group "
            "construction)." if permuted else "")
    mismatch(f"{len(bad)} optimizer moment(s) do not fit their parameter "
             f"(matched by {side.matched_by}): {format_names([b for _, b in bad], 4)}."
             + hint, tuple(n for n, _ in bad))
    return False


def _check_moment_dtypes(copt: Any, side: OptimizerPlan, params: list[LiveTensor], policy: str) -> list[Problem]:
    """CKF823 (checkpoint side): 16-bit moments for 32/64-bit parameters; fp16 underflow."""
    low, underflow = [], []
    for ci, pos in side.assign.items():
        param, ps = params[pos], copt.state.get(ci)
        if ps is None or not param.is_float32_or_wider:
            continue
        for key, t in ps.tensors.items():
            if t.dtype not in ("float16", "bfloat16") or tuple(t.shape) != param.shape:
                continue
            low.append(f"{param.name}:{key} ({t.dtype})")
            first = ps.tensors.get("exp_avg")
            if key in SECOND_MOMENTS and t.dtype == "float16" and first is not None:
                count = int(((t.read() == 0) & (first.read() != 0)).sum())
                if count:
                    underflow.append(f"{param.name}:{key} ({count} of {t.numel})")
    problems = []
    if underflow:
        fresh = policy == "fresh"
        side.drop = side.drop or fresh
        problems.append(Problem(
            "CKF823", "warning" if fresh else "error",
            f"{len(underflow)} float16 second moment(s) have elements that underflowed to 0 "
            "where exp_avg is not 0: Adam's first updates there would be about exp_avg/eps, "
            "orders of magnitude above lr. Save optimizer state in the parameters' dtype"
            + ("; policy 'fresh': optimizer state dropped, LR re-warmed." if fresh
               else ", or resume with policy='fresh'."),
            tuple(underflow),
        ))
    if low:
        problems.append(Problem(
            "CKF823", "warning",
            f"{len(low)} optimizer moment(s) were saved in 16 bits for 32-bit parameters: "
            "optimizer.load_state_dict casts them to the parameter dtype, but the precision "
            "lost when saving stays lost.",
            tuple(low),
        ))
    return problems


def check_sections(ckpt: Any, live: Live, policy: str, record: Record) -> list[Problem]:
    """CKF827: training state on one side only."""
    if policy == "reset":
        return []
    missing = []
    if live.optimizer is not None and ckpt.optimizer is None:
        missing.append(("optimizer", "the optimizer starts with empty moments"))
    if live.has_scheduler and ckpt.scheduler is None and record.scheduler_state != "reset":
        missing.append(("scheduler", "the scheduler restarts from step 0 (warmup again)"))
    if live.scaler_enabled and not ckpt.scaler:
        missing.append(("scaler", "the GradScaler recalibrates from its initial scale"))
    unused = [what for what, has, saved in (("optimizer", live.optimizer is not None, ckpt.optimizer),
                                            ("scheduler", live.has_scheduler, ckpt.scheduler))
              if not has and saved is not None]
    problems = []
    if missing:
        problems.append(Problem(
            "CKF827", "warning",
            f"the checkpoint has no {'/'.join(m for m, _ in missing)} state: "
            + "; ".join(why for _, why in missing) + ".",
        ))
    if unused:
        problems.append(Problem(
            "CKF827", "warning",
            f"the checkpoint has {'/'.join(unused)} state but ResumeGuard was given no "
            f"{'/'.join(unused)}: it is not restored.",
        ))
    return problems
