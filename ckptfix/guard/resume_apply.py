"""Carry out a `ResumePlan` on the live torch objects, and check afterwards what landed.

`Apply(plan, ckpt, model, optimizer, scheduler, scaler)`: `.model()` loads the model tensors (vocab
ones resized with the plan's repair edits), `.training_state()` the optimizer, scheduler and scaler;
each returns the actions taken. `not_landed` looks at the live model after loading (CKF820;
`setup.check_live_state` looks at the optimizer state: CKF822, CKF823). Values are materialised here, never in
the plan.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from ckptfix.dtypes import DTYPE_SIZES
from ckptfix.guard.problems import Problem
from ckptfix.guard.resume_plan import ResumePlan
from ckptfix.guard.setup import unwrap_optimizer
from ckptfix.optim_state import state_path

#: Elements compared per tensor to prove it was loaded (evenly spread over the tensor).
SAMPLE = 64


def _put(entry: dict[str, Any], path: list[Any], value: Any) -> None:
    """Set a state value at its path (`optim_state.state_path`): SOAP's lists, bitsandbytes' nested dict."""
    node: Any = entry
    for head, nxt in zip(path, path[1:]):
        if isinstance(node, list):
            node.extend([None] * (head + 1 - len(node)))
            if node[head] is None:
                node[head] = [] if isinstance(nxt, int) else {}
            node = node[head]
        else:
            node = node.setdefault(head, [] if isinstance(nxt, int) else {})
    if isinstance(node, list):
        node.extend([None] * (path[-1] + 1 - len(node)))
    node[path[-1]] = value


class Values:
    """Checkpoint values as torch objects (private copies: nothing keeps the file mapped)."""

    def __init__(self, ckpt: Any):
        self.ckpt = ckpt
        self._locators: dict[str, Any] = {}

    def tensor(self, info: Any) -> torch.Tensor:
        return info.to_torch().clone()

    def __call__(self, value: Any, part: str = "extras", name: str = "") -> Any:
        from ckptfix.checkpoint import TensorInfo
        from ckptfix.formats.pickle_records import TensorRef, TorchDevice, TorchDtype

        if isinstance(value, TensorInfo):
            return self.tensor(value)
        if isinstance(value, TensorRef):
            from ckptfix.formats.common import tensor_from_ref

            return self.tensor(tensor_from_ref(name or part, value, self._locator(part)))
        if isinstance(value, TorchDtype):
            return getattr(torch, value.name, value)
        if isinstance(value, TorchDevice):
            try:
                return torch.device(str(value.spec))
            except (RuntimeError, TypeError):
                return value
        if isinstance(value, OrderedDict):
            return OrderedDict((k, self(v, part, f"{name}.{k}")) for k, v in value.items())
        if isinstance(value, dict):
            return {k: self(v, part, f"{name}.{k}") for k, v in value.items()}
        if isinstance(value, list):
            return [self(v, part, f"{name}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(self(v, part, f"{name}[{i}]") for i, v in enumerate(value))
        return value

    def _locator(self, part: str) -> Any:
        file = self.ckpt.files.get(part) or self.ckpt.path
        if file not in self._locators:
            handle = self.ckpt.handle
            if file == self.ckpt.path and hasattr(handle, "record_range"):
                self._locators[file] = lambda storage: (lambda: handle.record_range(storage.key, DTYPE_SIZES[storage.dtype]))
            else:
                from ckptfix.formats import torch_file

                self._locators[file] = torch_file.load(file)[1]
        return self._locators[file]


def _how_rows_moved(rows_by: str, rows: Any, by_id: str = "") -> str:
    """What the row plan did, as it did it: by token string only when the rows were matched that way; by id
    as asked (keep_ids=True) or unchecked (the old tokenizer not known: `ModelPlan.rows_by_id`)."""
    if rows_by == "token":
        return f"rows matched by token string: {rows.kept} kept at their id, {rows.moved} moved to a new id"
    if by_id == "asked":
        return f"rows kept by id as asked (keep_ids=True): {rows.kept}"
    return (f"rows kept by id, unchecked (the tokenizer the rows were trained with is not known; from_tokenizer= "
            f"remaps them by token): {rows.kept}")


class Apply:
    """One plan carried out on the live objects (resized tensors produced once: tied aliases share)."""

    def __init__(self, plan: ResumePlan, ckpt: Any, model: Any, optimizer: Any = None, scheduler: Any = None,
                 scaler: Any = None):
        self.plan, self.ckpt = plan, ckpt
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.values = Values(ckpt)
        self.loaded: dict[str, torch.Tensor] = {}
        self._rng = np.random.default_rng(0)
        self._produced: dict[str, torch.Tensor] = {}

    def _produce(self, edit: Any) -> torch.Tensor:
        if edit.name not in self._produced:
            self._produced[edit.name] = edit.produce_torch(self.plan.model.repair.init, 0.02, self._rng)
        return self._produced[edit.name]

    def model_tensors(self) -> list[str]:
        side, actions = self.plan.model, []
        if side.renamed:
            actions.append(side.renamed)
        for owner in sorted(side.used_edits):
            edit = side.repair.weights[owner]
            actions.append(f"resized {owner} {list(edit.source.shape)} -> {list(edit.new_shape)} "
                           f"({_how_rows_moved(side.repair.rows_by, edit.plan, side.rows_by_id)}; {edit.plan.dropped} dropped, "
                           f"{edit.plan.new} new initialised by '{side.repair.init}')")
        for lname, cname in side.load.items():
            edit = side.weight_edit(self.ckpt.tied.get(cname, cname))
            self.loaded[lname] = self._produce(edit) if edit is not None else self.ckpt.model[cname].to_torch()
        self.model.load_state_dict(self.loaded, strict=False)
        actions.append(f"loaded {len(self.loaded)} model tensor(s)")
        return actions

    def training_state(self) -> list[str]:
        """Optimizer, scheduler and scaler, as the plan decided."""
        plan, actions = self.plan, []
        if plan.optimizer_action == "groups":
            self._load_optimizer(with_state=False)
            actions.append("dropped the optimizer state (param-group options kept)")
        elif plan.optimizer_action == "fresh":
            actions.append("dropped the optimizer state (fresh optimizer)")
        elif plan.optimizer_action == "load":
            self._load_optimizer(with_state=True)
            actions.append(f"loaded optimizer state (matched by {plan.optimizer.matched_by})")
            if plan.optimizer.moved:
                actions.append(f"gave {plan.optimizer.moved} parameter(s) the optimizer state "
                               "recorded under their name (not their position)")
            repair = plan.model.repair
            if repair is not None and any(e.owner in plan.model.used_edits for e in repair.moments.values()):
                actions.append("resized the optimizer moments of the resized tensors "
                               "with the same row plan (kept rows bit-identical)")
        if plan.scheduler_action == "keep":
            actions.append("kept the scheduler's fresh state (reset)")
        elif plan.scheduler_action == "load":
            self.scheduler.load_state_dict(self.values(dict(self.ckpt.scheduler), "scheduler", "scheduler"))
            actions.append("loaded scheduler state")
        if plan.sync_lr and self._sync_lr_from_scheduler():
            actions.append("set each param group's lr to the restored scheduler's")
        if plan.load_scaler:
            actions += self._load_scaler()
        return actions

    def extras(self) -> dict[str, Any]:
        return {k: self.values(v, "extras", str(k)) for k, v in self.ckpt.extras.items()}

    def _load_optimizer(self, with_state: bool) -> None:
        """optimizer.load_state_dict with a state dict built for the live positions."""
        opt = unwrap_optimizer(self.optimizer)
        copt, values, side = self.ckpt.optimizer, self.values, self.plan.model
        groups, start = [], 0
        for cg, lg in zip(copt.groups, opt.param_groups):
            options = {k: values(v, "optimizer", f"param_groups.{k}")
                       for k, v in cg.options.items() if k != "param_names"}
            n = len(lg["params"])
            groups.append({**options, "params": list(range(start, start + n))})
            start += n
        state: dict[int, dict[str, Any]] = {}
        for ci, pos in (self.plan.optimizer.assign.items() if with_state else ()):
            ps = copt.state.get(ci)
            if ps is None:
                continue
            entry: dict[str, Any] = {}
            for key, info in ps.tensors.items():
                edit = side.moment_edit(ci, key)
                _put(entry, state_path(key), self._produce(edit) if edit is not None else values.tensor(info))
            if ps.step is not None:
                entry["step"] = {"int": int, "float": float}.get(ps.step_kind, lambda s: torch.tensor(
                    float(s), dtype=torch.float32))(ps.step)
            entry.update({k: values(v, "optimizer", f"state.{ci}.{k}") for k, v in ps.other.items()})
            state[pos] = entry
        opt.load_state_dict({"state": state, "param_groups": groups})

    def _sync_lr_from_scheduler(self) -> bool:
        """Optimizer state dropped without its param groups: take the lr the scheduler set last."""
        get = getattr(self.scheduler, "get_last_lr", None)
        lrs = get() if callable(get) else None
        opt = unwrap_optimizer(self.optimizer)
        if not (isinstance(lrs, list) and len(lrs) == len(opt.param_groups)):
            return False
        for g, lr in zip(opt.param_groups, lrs):
            g["lr"] = lr
        return True

    def _load_scaler(self) -> list[str]:
        state = self.values(dict(self.ckpt.scaler), "scaler", "scaler")
        if not state:
            return []  # saved from a disabled scaler; CKF827 said so
        actions = []
        repair = self.plan.model.repair
        if repair is not None and repair.reset_scaler:
            from ckptfix.surgery.plan import DEFAULT_SCALE

            state["scale"] = DEFAULT_SCALE
            state["_growth_tracker"] = 0
            actions.append(f"reset the GradScaler scale to {DEFAULT_SCALE:g} (it had collapsed)")
        self.scaler.load_state_dict(state)
        return actions + ["loaded GradScaler state"]


# ---------------------------------------------------------------------------------------------
# After loading: what landed
# ---------------------------------------------------------------------------------------------


def same_values(live: torch.Tensor, ref: torch.Tensor, prefix: int | None = None, full: bool = False) -> bool | None:
    """Do `live` and `ref` hold the same values (the first `prefix` flat elements only, if set)?

    Compares SAMPLE elements spread evenly over the tensor (all of them with `full`), after
    casting the reference to the live dtype (the cast `load_state_dict` applies). None: cannot tell
    (meta tensors, dtypes without ==).
    """
    live = live.detach()
    if live.device.type == "meta":
        return None
    n = live.numel() if prefix is None else prefix
    if n == 0:
        return True
    flat_live, flat_ref = live.reshape(-1)[:n], ref.detach().reshape(-1)[:n]
    if not full and n > SAMPLE:
        index = torch.linspace(0, n - 1, SAMPLE, dtype=torch.float64).round().long()
        flat_live = flat_live[index.to(flat_live.device)]
        flat_ref = flat_ref[index]
    try:
        flat_ref = flat_ref.to(device=flat_live.device, dtype=flat_live.dtype)
        equal = flat_live == flat_ref
        if flat_live.is_floating_point() or flat_live.is_complex():
            equal |= torch.isnan(flat_live) & torch.isnan(flat_ref)
        return bool(equal.all())
    except (RuntimeError, TypeError):
        return None


def not_landed(model: Any, loaded: dict[str, torch.Tensor]) -> Problem | None:
    """CKF820 after our own load: every tensor loaded must now be in the model."""
    live = model.state_dict(keep_vars=True)
    bad = [k for k, v in loaded.items() if k in live and same_values(live[k], v) is False]
    if not bad:
        return None
    return Problem(
        "CKF820", "error",
        f"{len(bad)} tensor(s) did not land in the model after load_state_dict: the model "
        "ignores them (a load_state_dict pre-hook or override that filters keys?).",
        tuple(bad),
    )
