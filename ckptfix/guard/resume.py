"""Resume guard: load a checkpoint into the live model/optimizer/scheduler/scaler, checking first
that it fits, then guard the first steps.

    guard = ResumeGuard(model, optimizer, scheduler, scaler, tokenizer=tok, policy="remap")
    report = guard.load("ckpt.pth")           # CKF82x checks, load, check_training_setup
    for batch in loader:
        loss.backward()
        guard.before_step()                    # probe snapshot (+ re-warm multiplier)
        optimizer.step()
        guard.after_step()                     # probe: did the step change the weights?
        scheduler.step()

Reading goes through `ckptfix.formats.read_checkpoint` (the allowlist unpickler, safetensors
header parser, HF folder reader); tensors are materialised with `TensorInfo.to_torch()`.
`torch.load` is never called.

Load-time findings (each a `Problem`; `params` names the tensors concerned):

  CKF820  a checkpoint tensor did not land in the model (after loading, the model's values
          differ from the checkpoint's: a shape-filtered or otherwise partial load left random
          weights). Always an error.
  CKF821  keys: model parameters the checkpoint lacks (error: they keep their random init;
          missing buffers are warnings) / checkpoint tensors the model has no place for
          (error under "strict", a warning otherwise: they are ignored).
  CKF822  optimizer state does not map onto the optimizer's parameters: another number of
          parameters or group layout, a moment whose shape differs from its parameter at the
          same position, or the same shapes in another order, so that
          `optimizer.load_state_dict` (which matches by position) would hand one parameter's
          Adam moments to another (e.g. the module registration order changed). Names come from,
          best first: a ckptfix record (`guard.record()` saved under "ckptfix", or a `ckptfix
          repair` record), torch's own `param_names` (optimizers built from named_parameters()),
          or the checkpoint's tensor order when it is a pickled state_dict (registration order)
          and the live optimizer holds the model's parameters in model order. Without any of
          these (e.g. a safetensors model, whose keys are sorted, with an optimizer built in a
          custom order) only counts and shapes by position are checked: two same-shape
          parameters swapped then go undetected, and the report's notes say so.
  CKF823  optimizer moments in another dtype/device than their parameter: 16-bit moments for
          32-bit parameters in the checkpoint (warning; error when exp_avg_sq underflowed to 0,
          which makes Adam's first updates there ~exp_avg/eps), or, after loading, live state
          whose dtype/device differs from the parameter (error: optimizer.step fails).
  CKF824  the tokenizer has more tokens than the model's embedding has rows (error: ids past
          the last row cannot be looked up).
  CKF825  a vocab-sized tensor (embedding, LM head, their moments) has another row count in the
          checkpoint than in the model (error under "strict"; resized under the other
          policies, with the same row plan as `ckptfix repair`).
  CKF826  any other tensor whose shape differs between checkpoint and model (error).
  CKF827  a training-state section is missing on one side: the checkpoint has no optimizer/
          scheduler/scaler state for a live object (it starts from scratch: warmup again), or
          it has one that no live object receives (warning).

Policies:

  strict           every structural mismatch (CKF821 unexpected, CKF822, CKF825) is an error.
  remap            vocab-sized tensors and their Adam moments are resized in memory exactly as
                   `ckptfix repair --policy remap` does (ckptfix.surgery.make_plan + TensorEdit),
                   optimizer state is matched to parameters by name where names are known.
  fresh            as remap for the weights; on any optimizer mismatch the optimizer state is
                   dropped (param-group options kept), the scheduler kept (or reset with
                   `reset_scheduler=True`), and the LR re-warmed linearly over `rewarm_steps`.
                   `fresh-optimizer` is accepted as an alias (the guard's older spelling).
  reset            weights only: optimizer, scheduler and scaler keep their fresh state.

The policy names are `ckptfix repair`'s (`ckptfix.policies`), plus "strict".

Re-warm: step k (0-based, counting optimizer steps actually taken) runs at
`lr * min(1, (k + 1) / rewarm_steps)`. The factor is applied to each param group's "lr" right
before `optimizer.step()` (by `guard.before_step()`, or else by an optimizer step pre-hook) and the
scheduled lr is restored right after (a step post-hook, or `guard.after_step()` for a step the
GradScaler skipped). The user's scheduler therefore always reads and writes its own, unscaled
lr; `scheduler.get_last_lr()` does not show the re-warm, the lr seen inside `optimizer.step()`
does. A `ckptfix repair` record with `"rewarm": true` (the `--policy fresh` output) turns the
re-warm on whatever the policy.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ckptfix.guard.probe import StepProbe
from ckptfix.guard.problems import Problem, TrainingSetupError, TrainingSetupWarning, format_names
from ckptfix.guard.setup import _scaler_enabled, check_training_setup, named_params, unwrap_optimizer
from ckptfix.policies import GUARD_POLICIES, canonical

__all__ = ["ResumeGuard", "ResumeReport", "ResumeError", "POLICIES", "tokenizer_size"]

POLICIES = GUARD_POLICIES
SCHEMA = "ckptfix.resume/1"
NAMES_SCHEMA = "ckptfix.names/1"

#: Elements compared per tensor to prove it was loaded (evenly spread over the tensor).
SAMPLE = 64
#: Wrapper prefixes (DDP, torch.compile) tolerated between checkpoint and model keys.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")
#: Second-moment state keys: in fp16 their small values underflow to 0.
SECOND_MOMENTS = ("exp_avg_sq", "max_exp_avg_sq", "square_avg", "sum")


class ResumeError(TrainingSetupError):
    """The checkpoint does not fit the live training objects. `.problems` lists why."""

    def __init__(self, problems: list[Problem], path: str = ""):
        self.problems = list(problems)
        self.path = path
        errors = sum(p.severity == "error" for p in self.problems)
        warns = len(self.problems) - errors
        where = f"{path}: " if path else ""
        summary = (f"{where}checkpoint does not fit the model/optimizer: {errors} error(s), "
                   f"{warns} warning(s)")
        RuntimeError.__init__(self, "\n".join([summary, *(f"  {p}" for p in self.problems)]))


@dataclass
class ResumeReport:
    """What `ResumeGuard.load` found and did."""

    path: str
    format: str
    policy: str
    problems: list[Problem] = field(default_factory=list)
    actions: list[str] = field(default_factory=list)  # what the policy did, in order
    extras: dict[str, Any] = field(default_factory=dict)  # epoch, step, ... (tensors as torch)
    rewarm_steps: int = 0  # > 0: the LR re-warms over this many steps
    optimizer_matched_by: str = "none"  # names (recorded|torch|inferred) | position | dropped | none
    record: dict[str, Any] | None = None  # the checkpoint's ckptfix record, if any
    notes: list[str] = field(default_factory=list)
    checkpoint_findings: list[str] = field(default_factory=list)  # `ckptfix inspect` codes

    @property
    def ok(self) -> bool:
        return not any(p.severity == "error" for p in self.problems)

    def to_json(self) -> dict[str, Any]:
        from ckptfix.inspect import plain

        return {
            "schema": SCHEMA,
            "path": self.path,
            "format": self.format,
            "policy": self.policy,
            "problems": [{"code": p.code, "severity": p.severity, "message": p.message,
                          "params": list(p.params)} for p in self.problems],
            "actions": list(self.actions),
            "extras": {str(k): plain(_jsonable(v)) for k, v in self.extras.items()},
            "rewarm_steps": self.rewarm_steps,
            "optimizer_matched_by": self.optimizer_matched_by,
            "record": self.record,
            "notes": list(self.notes),
            "checkpoint_findings": list(self.checkpoint_findings),
        }


def _jsonable(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else {"tensor": list(value.shape),
                                                         "dtype": str(value.dtype).replace("torch.", "")}
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    return value


def tokenizer_size(tokenizer: Any) -> int | None:
    """Rows a tokenizer needs: a path (read by ckptfix.tokenizers), a `TokenizerInfo`, an int, or
    any tokenizer object with `len()` (Hugging Face: base vocabulary + added tokens)."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, bool):
        raise TypeError("tokenizer must be a path, a TokenizerInfo, a tokenizer object or an int")
    if isinstance(tokenizer, int):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        from ckptfix.tokenizers import load_tokenizer

        return load_tokenizer(tokenizer).size
    from ckptfix.tokenizers import TokenizerInfo

    if isinstance(tokenizer, TokenizerInfo):
        return tokenizer.size
    if hasattr(tokenizer, "__len__"):
        return len(tokenizer)
    raise TypeError(f"cannot tell the size of a {type(tokenizer).__name__} tokenizer "
                    "(pass a path, a TokenizerInfo, an object with len(), or an int)")


# ---------------------------------------------------------------------------------------------
# Re-warm
# ---------------------------------------------------------------------------------------------


class _Rewarm:
    """Scale every param group's lr by min(1, (k+1)/steps) for the duration of optimizer step k."""

    def __init__(self, optimizer: Any, steps: int):
        self.opt = unwrap_optimizer(optimizer)
        self.steps = steps
        self.done = 0
        self._saved: list[Any] | None = None
        self._handles = [self.opt.register_step_pre_hook(lambda *_: self.apply()),
                         self.opt.register_step_post_hook(lambda *_: self.restore(stepped=True))]

    @property
    def active(self) -> bool:
        return self.done < self.steps

    @property
    def factor(self) -> float:
        return min(1.0, (self.done + 1) / self.steps) if self.active else 1.0

    def apply(self) -> None:
        if self._saved is not None or not self.active:
            return
        self._saved = [g["lr"] for g in self.opt.param_groups]
        factor = self.factor
        for g in self.opt.param_groups:
            g["lr"] = g["lr"] * factor  # a new object: a tensor lr is not modified in place

    def restore(self, stepped: bool) -> None:
        if self._saved is None:
            return
        for g, lr in zip(self.opt.param_groups, self._saved):
            g["lr"] = lr
        self._saved = None
        if stepped:
            self.done += 1
            if not self.active:
                self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


# ---------------------------------------------------------------------------------------------
# Reading checkpoint values
# ---------------------------------------------------------------------------------------------


class _Values:
    """Checkpoint values as torch objects (private copies: nothing keeps the file mapped)."""

    def __init__(self, ckpt: Any):
        self.ckpt = ckpt
        self._locators: dict[str, Any] = {}

    def tensor(self, info: Any) -> torch.Tensor:
        return info.to_torch().clone()

    def __call__(self, value: Any, part: str = "extras", name: str = "") -> Any:
        from ckptfix.checkpoint import TensorInfo
        from ckptfix.formats.pickle_safe import TensorRef, TorchDevice, TorchDtype

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
                self._locators[file] = lambda storage: (lambda: handle.record_range(storage.key))
            else:
                from ckptfix.formats import torch_file

                self._locators[file] = torch_file.load(file)[1]
        return self._locators[file]


def _read(source: Any) -> Any:
    """A Checkpoint from a path (or a Checkpoint as is), with a repair sidecar record attached."""
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.formats import read_checkpoint

    ckpt = source if isinstance(source, Checkpoint) else read_checkpoint(os.fspath(source))
    sidecar = ckpt.path + ".ckptfix.json"
    if ckpt.record is None and os.path.isfile(sidecar):
        with open(sidecar, encoding="utf-8") as f:
            record = json.load(f)
        if isinstance(record, dict):
            ckpt.record = record
            if ckpt.optimizer is not None and isinstance(record.get("param_names"), list):
                ckpt.optimizer.param_names = [str(n) for n in record["param_names"]]
    return ckpt


# ---------------------------------------------------------------------------------------------
# Comparing tensors
# ---------------------------------------------------------------------------------------------


def _same_values(live: torch.Tensor, ref: torch.Tensor, prefix: int | None = None,
                 full: bool = False) -> bool | None:
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


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _key_map(ckpt_keys: list[str], live_keys: list[str]) -> tuple[dict[str, str], str | None]:
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


# ---------------------------------------------------------------------------------------------
# The guard
# ---------------------------------------------------------------------------------------------


@dataclass
class _Target:
    """What `make_plan` needs of a tokenizer: the row count to resize to."""

    size: int
    path: str = "<live model>"

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size}


@dataclass
class _Model:
    """The model side of a load: what goes where, and what does not fit."""

    key_map: dict[str, str]  # checkpoint name -> live state_dict key
    renamed: str | None = None  # how keys were renamed (a wrapper prefix), if they were
    load: dict[str, torch.Tensor] = field(default_factory=dict)  # live key -> value to load
    plan: Any = None  # ckptfix.surgery.plan.RepairPlan when vocab tensors are resized
    used_edits: set[str] = field(default_factory=set)  # checkpoint names whose plan edit is used
    vocab_rows: set[int] = field(default_factory=set)  # ids of live tensors reported as CKF825


@dataclass
class _Optim:
    """The optimizer side: checkpoint index -> live position, and how that was decided."""

    assign: dict[Any, int] = field(default_factory=dict)
    matched_by: str = "none"
    moved: int = 0  # parameters whose state comes from another index than their position
    drop: bool = False
    layout_ok: bool = False


def _layout_ok(copt: Any, opt: Any) -> bool:
    return [len(g.params) for g in copt.groups] == [len(g["params"]) for g in opt.param_groups]


class ResumeGuard:
    """Load a checkpoint into live training objects under a policy, then guard the first steps.

    `tokenizer`: a path, a `ckptfix.tokenizers.TokenizerInfo`, a Hugging Face tokenizer (its
    `len()`) or an int; checked against the model's embedding rows (CKF824).
    `policy`: "strict", "remap", "fresh" or "reset" (see the module docstring;
    "fresh-optimizer" is an alias of "fresh").
    `rewarm_steps`: length of the linear LR re-warm after the optimizer state was dropped.
    `reset_scheduler`: with "fresh", also start the scheduler from scratch when the
    optimizer state is dropped.
    `probe_steps`: optimizer steps watched by the first-step probe (0: no probe).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
                 scaler: Any = None, tokenizer: Any = None, policy: str = "strict", *,
                 rewarm_steps: int = 100, reset_scheduler: bool = False, probe_steps: int = 3):
        policy = canonical(policy)
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r} (choose {', '.join(POLICIES)})")
        if rewarm_steps < 0 or probe_steps < 0:
            raise ValueError("rewarm_steps and probe_steps must be >= 0")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.scaler = scaler
        self.tokenizer = tokenizer
        self.policy = policy
        self.rewarm_steps = rewarm_steps
        self.reset_scheduler = reset_scheduler
        self.probe_steps = probe_steps
        self.report: ResumeReport | None = None
        self.probe: StepProbe | None = None
        self._rewarm: _Rewarm | None = None
        self._tok_size: int | None = None
        self._tok_read = False
        self._rng = np.random.default_rng(0)
        self._produced: dict[str, torch.Tensor] = {}

    # -- public API -----------------------------------------------------------------------------

    def load(self, path: Any) -> ResumeReport:
        """Check the checkpoint against the live objects, load it under the policy, run
        `check_training_setup`, and arm the first-step probe (and the re-warm, if any).

        `path`: a file or folder `read_checkpoint` understands, or a `Checkpoint`. Raises
        `ResumeError` before anything is modified when the checkpoint does not fit under the
        policy, `ResumeError` after loading if a tensor did not land (CKF820) or the loaded
        optimizer state is unusable (CKF823), and `TrainingSetupError` if the loaded setup cannot
        learn. Warnings go through `warnings.warn(..., TrainingSetupWarning)`.
        """
        from ckptfix.inspect import analyse

        ckpt = _read(path)
        values = _Values(ckpt)
        analysis = analyse(ckpt)
        record = ckpt.record if isinstance(ckpt.record, dict) else {}
        report = ResumeReport(path=ckpt.path, format=ckpt.format, policy=self.policy,
                              record=ckpt.record, notes=list(ckpt.notes),
                              checkpoint_findings=[f.code for f in analysis.findings])
        self.report = report
        self._rng = np.random.default_rng(0)
        self._produced = {}

        # -- checks (nothing is modified until they pass) ------------------------------------------
        problems = self._check_tokenizer()
        model_side, model_problems = self._plan_model(ckpt, analysis)
        problems += model_problems
        opt_side = _Optim()
        load_optimizer = (self.optimizer is not None and ckpt.optimizer is not None
                          and self.policy != "reset")
        if load_optimizer:
            plan = model_side.plan
            if plan is not None and plan.drop_optimizer_state:
                opt = unwrap_optimizer(self.optimizer)
                opt_side = _Optim(drop=True, layout_ok=_layout_ok(ckpt.optimizer, opt))
                if self.policy == "remap":
                    problems.append(Problem(
                        "CKF822", "warning",
                        "the optimizer state of the resized tensors could not be matched to them "
                        "(" + "; ".join(plan.notes) + "): optimizer state dropped, LR re-warmed, "
                        "as `ckptfix repair` does.", tuple(plan.weights)))
            else:
                opt_side, opt_problems = self._plan_optimizer(ckpt, analysis.mapping, model_side,
                                                              self.policy)
                problems += opt_problems
        problems += self._check_sections(ckpt, record)
        report.problems = problems
        if any(p.severity == "error" for p in problems):
            raise ResumeError(problems, ckpt.path)
        for problem in problems:
            warnings.warn(str(problem), TrainingSetupWarning, stacklevel=2)

        # -- model ---------------------------------------------------------------------------------
        if model_side.renamed:
            report.actions.append(model_side.renamed)
        if model_side.plan is not None:
            report.notes += [n for n in model_side.plan.notes if n not in report.notes]
            for owner in sorted(model_side.used_edits):
                edit = model_side.plan.weights[owner]
                report.actions.append(
                    f"resized {owner} {list(edit.source.shape)} -> {list(edit.new_shape)} "
                    f"(rows kept by id; {edit.plan.dropped} dropped, {edit.plan.new} new "
                    f"initialised by '{model_side.plan.init}')")
        self.model.load_state_dict(model_side.load, strict=False)
        report.actions.append(f"loaded {len(model_side.load)} model tensor(s)")
        not_landed = self._not_landed(model_side.load)
        if not_landed is not None:
            report.problems.append(not_landed)
            raise ResumeError(report.problems, ckpt.path)

        # -- optimizer -----------------------------------------------------------------------------
        rewarm = bool(record.get("rewarm"))
        if rewarm:
            report.notes.append("the checkpoint's ckptfix repair record asks for an LR re-warm")
        if self.optimizer is not None and self.policy != "reset":
            if ckpt.optimizer is None:
                rewarm = rewarm or self.policy == "fresh"
            elif opt_side.drop:
                rewarm = True
                report.optimizer_matched_by = "dropped"
                if opt_side.layout_ok and not self.reset_scheduler:
                    self._load_optimizer(ckpt, opt_side, model_side, values, with_state=False)
                    report.actions.append("dropped the optimizer state (param-group options kept)")
                else:
                    report.actions.append("dropped the optimizer state (fresh optimizer)")
            else:
                self._load_optimizer(ckpt, opt_side, model_side, values, with_state=True)
                report.optimizer_matched_by = opt_side.matched_by
                report.actions.append(f"loaded optimizer state (matched by {opt_side.matched_by})")
                if opt_side.moved:
                    report.actions.append(f"gave {opt_side.moved} parameter(s) the optimizer state "
                                          "recorded under their name (not their position)")
                if model_side.plan is not None and any(
                        e.name.rsplit(":", 1)[0] in model_side.used_edits
                        for e in model_side.plan.moments.values()):
                    report.actions.append("resized the optimizer moments of the resized tensors "
                                          "with the same row plan (kept rows bit-identical)")

        # -- scheduler, scaler ---------------------------------------------------------------------
        reset_sched = self.policy == "reset" or (opt_side.drop and self.reset_scheduler)
        scheduler_loaded = False
        if self.scheduler is not None and ckpt.scheduler is not None:
            if reset_sched:
                report.actions.append("kept the scheduler's fresh state (reset)")
            else:
                self.scheduler.load_state_dict(values(dict(ckpt.scheduler), "scheduler", "scheduler"))
                scheduler_loaded = True
                report.actions.append("loaded scheduler state")
        if opt_side.drop and scheduler_loaded and not opt_side.layout_ok:
            self._sync_lr_from_scheduler()
        if self.scaler is not None and ckpt.scaler is not None and self.policy != "reset":
            self._load_scaler(ckpt, model_side, values, report)

        # -- re-warm, extras, live checks, setup checks, probe -------------------------------------
        self.close()
        if rewarm and self.optimizer is not None and self.rewarm_steps > 0:
            self._rewarm = _Rewarm(self.optimizer, self.rewarm_steps)
            report.rewarm_steps = self.rewarm_steps
            report.actions.append(f"LR re-warms linearly over {self.rewarm_steps} steps")
        report.extras = {k: values(v, "extras", str(k)) for k, v in ckpt.extras.items()}
        self._produced = {}

        post = self._check_live_state()
        report.problems += post
        if any(p.severity == "error" for p in post):
            raise ResumeError(report.problems, ckpt.path)
        setup = check_training_setup(self.model, self.optimizer, self.scaler,
                                     scheduler=self.scheduler, raise_on_error=False)
        report.problems += setup
        if any(p.severity == "error" for p in setup):
            raise TrainingSetupError(setup)
        for problem in setup:
            warnings.warn(str(problem), TrainingSetupWarning, stacklevel=2)
        self.probe = self._new_probe()
        return report

    def verify_loaded(self, source: Any, *, full: bool = False,
                      raise_on_error: bool = True) -> list[Problem]:
        """Compare the live model (and optimizer) with a checkpoint after your own loading code.

        Catches tensors a filtered or non-strict load skipped (CKF820, naming them), keys on
        one side only (CKF821), an optimizer whose parameter order does not match the
        checkpoint's (CKF822) and live optimizer state in the wrong dtype/device (CKF823).
        Values are compared on SAMPLE evenly spread elements per tensor (`full=True`: all).
        `source`: a path or a `Checkpoint`. Raises `ResumeError` on errors (and warns the
        warnings) unless `raise_on_error=False`, which just returns the findings.
        """
        from ckptfix.mapping import map_optimizer

        ckpt = _read(source)
        live = self._live_state()
        key_map, _ = _key_map(list(ckpt.model), list(live))
        problems = self._key_problems(ckpt, key_map, live, unexpected_severity="warning")
        not_loaded, resized, shapes = [], [], []
        for cname, lname in key_map.items():
            info, tensor = ckpt.model[cname], live[lname]
            ref = info.to_torch()
            if tuple(info.shape) == tuple(tensor.shape):
                if _same_values(tensor, ref, full=full) is False:
                    not_loaded.append(lname)
                continue
            rows_only = (len(info.shape) == len(tensor.shape) >= 1
                         and tuple(info.shape[1:]) == tuple(tensor.shape[1:]))
            width = math.prod(info.shape[1:]) if len(info.shape) > 1 else 1
            common = min(info.shape[0], tensor.shape[0]) * width if rows_only else 0
            if rows_only and common and _same_values(tensor, ref, prefix=common, full=full):
                resized.append(lname)
            else:
                not_loaded.append(lname)
                shapes.append(f"{lname} {list(info.shape)} in the checkpoint, {list(tensor.shape)} "
                              "in the model")
        if not_loaded:
            why = (f" Shapes differ ({format_names(shapes, 3)}): a shape-filtered load "
                   "({k: v for k, v in sd.items() if v.shape == model_sd[k].shape}) or "
                   "load_state_dict(strict=False) skipped them. Load with "
                   "ResumeGuard(..., policy='remap').load(path) to resize vocab tensors instead."
                   if shapes else "")
            problems.append(Problem(
                "CKF820", "error",
                f"{len(not_loaded)} checkpoint tensor(s) did not land in the model: the model's "
                "values differ from the checkpoint's (random init or stale weights)." + why,
                tuple(not_loaded),
            ))
        if resized:
            problems.append(Problem(
                "CKF825", "warning",
                f"{len(resized)} tensor(s) have another row count than in the checkpoint; the rows "
                "both have hold the checkpoint's values (loaded with resizing).",
                tuple(resized),
            ))
        if self.optimizer is not None and unwrap_optimizer(self.optimizer).state:
            live_problems = self._check_live_state()
            if ckpt.optimizer is not None and not any(p.code == "CKF822" for p in live_problems):
                _, opt_problems = self._plan_optimizer(ckpt, map_optimizer(ckpt),
                                                       _Model(key_map=key_map), "strict")
                problems += [p for p in opt_problems if p.code == "CKF822"]
            problems += live_problems
        if raise_on_error:
            if any(p.severity == "error" for p in problems):
                raise ResumeError(problems, ckpt.path)
            for problem in problems:
                warnings.warn(str(problem), TrainingSetupWarning, stacklevel=2)
        return problems

    def record(self) -> dict[str, Any]:
        """A `ckptfix` entry for your own checkpoints: parameter names in optimizer order.

            torch.save({..., "optimizer": optimizer.state_dict(), "ckptfix": guard.record()}, p)

        With it, `load` matches optimizer state to parameters by name: a changed module
        registration order is caught (and, with policy "remap", corrected).
        """
        names = {id(p): n for n, p in named_params(self.model).items()}
        opt = unwrap_optimizer(self.optimizer) if self.optimizer is not None else None
        params = [p for g in opt.param_groups for p in g["params"]] if opt is not None else []
        return {"schema": NAMES_SCHEMA, "tool": "ckptfix",
                "param_names": [names.get(id(p), "") for p in params]}

    @property
    def lr_factor(self) -> float:
        """The re-warm multiplier for the next optimizer step (1.0 when not re-warming)."""
        return self._rewarm.factor if self._rewarm is not None and self._rewarm.active else 1.0

    # -- step hooks ------------------------------------------------------------------------------

    def after_backward(self) -> list[Problem]:
        """Gradient checks of the first-step probe (optional: before_step runs them)."""
        probe = self._probe()
        return probe.after_backward() if probe is not None else []

    def before_step(self) -> None:
        """Call right before optimizer.step() / scaler.step(optimizer)."""
        if self._rewarm is not None:
            self._rewarm.apply()  # before the probe's snapshot: it judges the lr really used
        probe = self._probe()
        if probe is not None:
            probe.before_step()

    def after_step(self) -> list[Problem]:
        """Call right after the optimizer/scaler step (and before scheduler.step())."""
        if self._rewarm is not None:
            self._rewarm.restore(stepped=False)  # still applied only if the step was skipped
        probe = self._probe()
        return probe.after_step() if probe is not None else []

    def close(self) -> None:
        """Remove the re-warm hooks from the optimizer (a finished re-warm removes them itself)."""
        if self._rewarm is not None:
            self._rewarm.close()
            self._rewarm = None

    # -- internals: live objects ------------------------------------------------------------------

    def _probe(self) -> StepProbe | None:
        if self.probe is None:
            self.probe = self._new_probe()  # a run without a checkpoint: probe anyway
        return self.probe if self.probe is not None and self.probe.active else None

    def _new_probe(self) -> StepProbe | None:
        if self.optimizer is None or self.probe_steps <= 0:
            return None
        return StepProbe(self.model, self.optimizer, self.scaler, steps=self.probe_steps)

    def _live_state(self) -> dict[str, torch.Tensor]:
        return self.model.state_dict(keep_vars=True)

    def _tokenizer_size(self) -> int | None:
        if not self._tok_read:
            self._tok_size = tokenizer_size(self.tokenizer)
            self._tok_read = True
        return self._tok_size

    def _embedding(self) -> tuple[str, torch.Tensor] | None:
        """The model's input embedding weight: HF's accessor, else by name, else the largest."""
        from ckptfix.vocab import EMBEDDING_NAMES

        names = {id(p): n for n, p in self.model.named_parameters()}
        get = getattr(self.model, "get_input_embeddings", None)
        if callable(get):
            try:
                weight = getattr(get(), "weight", None)
            except (NotImplementedError, AttributeError):
                weight = None
            if isinstance(weight, torch.Tensor) and id(weight) in names:
                return names[id(weight)], weight
        embeddings = [(names.get(id(m.weight), f"{n}.weight"), m.weight)
                      for n, m in self.model.named_modules() if isinstance(m, torch.nn.Embedding)]
        pool = [e for e in embeddings if EMBEDDING_NAMES.search(e[0])] or embeddings
        return max(pool, key=lambda e: e[1].shape[0]) if pool else None

    def _produce(self, edit: Any, init: str) -> torch.Tensor:
        """A resized tensor from a repair edit (once per edit: tied aliases share it)."""
        if edit.name not in self._produced:
            self._produced[edit.name] = edit.produce_torch(init, 0.02, self._rng)
        return self._produced[edit.name]

    # -- internals: checks ------------------------------------------------------------------------

    def _check_tokenizer(self) -> list[Problem]:
        """CKF824: the tokenizer needs more rows than the embedding has."""
        size = self._tokenizer_size()
        found = self._embedding() if size is not None else None
        if found is None or size is None or size <= found[1].shape[0]:
            return []
        name, weight = found
        rows = weight.shape[0]
        return [Problem(
            "CKF824", "error",
            f"the tokenizer has {size} tokens but the model's embedding has {rows} rows: token ids "
            f"{rows}..{size - 1} cannot be looked up (IndexError on CPU, a device-side assert on "
            "GPU). Resize the model first (model.resize_token_embeddings(len(tokenizer)) before "
            "building the optimizer), then load with policy='remap'.",
            (name,),
        )]

    def _key_problems(self, ckpt: Any, key_map: dict[str, str], live: dict[str, torch.Tensor],
                      unexpected_severity: str) -> list[Problem]:
        """CKF821: model keys without a checkpoint value; checkpoint tensors without a place.
        A tied alias of a loaded tensor counts as loaded (HF drops tied lm_head weights)."""
        targets = set(key_map.values())
        loaded_ids = {id(live[k]) for k in targets}
        params = {id(p) for p in self.model.parameters()}
        missing = [k for k, t in live.items() if k not in targets and id(t) not in loaded_ids]
        missing_params = [k for k in missing if id(live[k]) in params]
        missing_buffers = [k for k in missing if id(live[k]) not in params]
        unexpected = [k for k in ckpt.model if k not in key_map]
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

    def _plan_model(self, ckpt: Any, analysis: Any) -> tuple[_Model, list[Problem]]:
        """CKF821/825/826 and, if they allow it, the tensors to load (vocab ones resized)."""
        live = self._live_state()
        key_map, renamed = _key_map(list(ckpt.model), list(live))
        side = _Model(key_map=key_map, renamed=renamed)
        strict = self.policy == "strict"
        problems = self._key_problems(ckpt, key_map, live, "error" if strict else "warning")
        vocab_names = {v.name for v in analysis.vocab}
        vocab_names |= {alias for alias, owner in ckpt.tied.items() if owner in vocab_names}
        vocab_diff: list[str] = []
        other_diff: list[str] = []
        for cname, lname in key_map.items():
            if tuple(ckpt.model[cname].shape) != tuple(live[lname].shape):
                (vocab_diff if cname in vocab_names else other_diff).append(cname)

        def shapes(names: list[str]) -> str:
            return ", ".join(f"{n} {list(ckpt.model[n].shape)} vs {list(live[key_map[n]].shape)}"
                             for n in names[:4])

        if vocab_diff and not strict:
            plan, why = self._vocab_plan(ckpt, analysis, vocab_diff, live, key_map)
            if plan is not None:
                for cname in vocab_diff:
                    owner = ckpt.tied.get(cname, cname)
                    edit = plan.weights.get(owner)
                    if edit is not None and tuple(edit.new_shape) == tuple(live[key_map[cname]].shape):
                        side.used_edits.add(owner)
                side.plan = plan if side.used_edits else None
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
                           f"as `ckptfix repair --policy {self.policy}` would.")
            problems.append(Problem("CKF825", "error" if strict else "warning", message,
                                    tuple(vocab_diff)))
            side.vocab_rows = {id(live[key_map[n]]) for n in vocab_diff}
        if other_diff:
            problems.append(Problem(
                "CKF826", "error",
                f"{len(other_diff)} tensor(s) have another shape in the checkpoint than in the model "
                f"({shapes(other_diff)}): the model's architecture or config differs from the one "
                "that saved the checkpoint.",
                tuple(other_diff),
            ))
        if any(p.severity == "error" for p in problems):
            return side, problems
        for cname, lname in key_map.items():
            owner = ckpt.tied.get(cname, cname)
            if owner in side.used_edits:
                side.load[lname] = self._produce(side.plan.weights[owner], side.plan.init)
            else:
                side.load[lname] = ckpt.model[cname].to_torch()  # load_state_dict copies it
        return side, problems

    def _vocab_plan(self, ckpt: Any, analysis: Any, names: list[str], live: dict,
                    key_map: dict[str, str]) -> tuple[Any, str]:
        """The `ckptfix repair` plan to the model's row count (None and why, if impossible)."""
        from ckptfix.errors import CkptfixError
        from ckptfix.surgery.plan import make_plan

        bias = {v.name for v in analysis.vocab if v.role == "head-bias"}
        targets = {live[key_map[n]].shape[-1 if ckpt.tied.get(n, n) in bias else 0] for n in names}
        if len(targets) != 1:
            return None, f"the model's vocab tensors disagree on their row count ({sorted(targets)})"
        try:
            plan = make_plan(analysis, _Target(targets.pop()), policy=self.policy)
        except CkptfixError as exc:
            return None, str(exc)
        return plan, ""

    def _plan_optimizer(self, ckpt: Any, mapping: Any, model_side: _Model,
                        policy: str) -> tuple[_Optim, list[Problem]]:
        """CKF822/CKF823: does the checkpoint's optimizer state map onto the live optimizer?"""
        from ckptfix.mapping import MOMENT_KEYS

        side = _Optim()
        opt = unwrap_optimizer(self.optimizer)
        copt = ckpt.optimizer
        live_params = [p for g in opt.param_groups for p in g["params"]]
        pnames = {id(p): n for n, p in named_params(self.model).items()}
        live_name = [pnames.get(id(p), f"<unnamed {list(p.shape)}>") for p in live_params]
        cidx = copt.indices()
        problems: list[Problem] = []

        def mismatch(message: str, params: tuple[str, ...], by_name: bool = False) -> None:
            if policy == "fresh":
                side.drop = True
                problems.append(Problem("CKF822", "warning", message + " Policy 'fresh': "
                                        "optimizer state dropped, LR re-warmed.", params))
            elif by_name and policy == "remap":
                problems.append(Problem("CKF822", "warning", message + " Policy 'remap': each "
                                        "parameter gets the state recorded under its name.", params))
            else:
                hint = (" Use policy='remap' to match the state by name, or 'fresh' to "
                        "drop it." if by_name else
                        " Use policy='fresh' to drop the optimizer state.")
                problems.append(Problem("CKF822", "error", message + hint, params))

        side.layout_ok = _layout_ok(copt, opt)
        if not side.layout_ok:
            c_layout = [len(g.params) for g in copt.groups]
            l_layout = [len(g["params"]) for g in opt.param_groups]
            mismatch(f"the checkpoint's optimizer has {len(cidx)} parameter(s) in groups of "
                     f"{c_layout}, the optimizer {len(live_params)} in groups of {l_layout}: its "
                     "state cannot be mapped onto these parameters.", ())
            return side, problems

        plan = model_side.plan

        def moment_shape(ci: Any) -> tuple[str, tuple[int, ...]] | None:
            """The first parameter-shaped moment of index `ci`, with its shape after resizing."""
            ps = copt.state.get(ci)
            for key in MOMENT_KEYS:
                t = ps.tensors.get(key) if ps is not None else None
                if t is None:
                    continue
                edit = plan.moments.get((ci, key)) if plan is not None else None
                if edit is not None and edit.name.rsplit(":", 1)[0] in model_side.used_edits:
                    return key, tuple(edit.new_shape)
                return key, tuple(t.shape)
            return None

        names, source = self._checkpoint_names(ckpt, mapping, live_params)
        if names is not None:
            live = self._live_state()
            position = {id(p): i for i, p in enumerate(live_params)}
            assign: dict[Any, Any] = {}
            unresolved: list[Any] = []
            for ci, cname in zip(cidx, names):
                tensor = live.get(model_side.key_map.get(cname, cname))
                pos = position.get(id(tensor)) if tensor is not None else None
                if pos is None or pos in assign.values():
                    unresolved.append(cname)
                else:
                    assign[ci] = pos
            if unresolved:
                mismatch(f"the checkpoint's optimizer holds state for {len(unresolved)} parameter(s) "
                         f"that this optimizer does not hold (names {source}).", tuple(unresolved))
                return side, problems
            side.assign, side.matched_by = assign, f"names ({source})"
            moved = [(k, ci, pos) for k, (ci, pos) in enumerate(assign.items()) if pos != k]
            side.moved = len(moved)
            if moved:
                pairs = ", ".join(f"{live_name[k]} <- state of {names[k]}" for k, _, _ in moved[:4])
                how = ("recorded in the checkpoint" if source in ("recorded", "torch") else
                       "inferred from the checkpoint's tensor order, as this optimizer follows the "
                       "model's order")
                mismatch(f"the optimizer holds {len(moved)} parameter(s) at other positions than the "
                         f"checkpoint (names {how}): optimizer.load_state_dict, which matches by "
                         f"position, would give {pairs}. The module registration or parameter "
                         "order changed since saving.",
                         tuple(live_name[k] for k, _, _ in moved), by_name=True)
        else:
            side.assign, side.matched_by = {ci: k for k, ci in enumerate(cidx)}, "position"
            if self.report is not None:
                self.report.notes.append(
                    "the checkpoint records no parameter names and its order cannot be inferred: "
                    "optimizer state is matched by position and checked by shape only (store "
                    "guard.record() under the 'ckptfix' key of your checkpoints to match by name)")
        bad, saved_shapes = [], []
        for ci, pos in side.assign.items():
            found = moment_shape(ci)
            if found is None:
                continue
            key, shape = found
            saved_shapes.append(shape)
            pshape = tuple(live_params[pos].shape)
            if id(live_params[pos]) in model_side.vocab_rows and shape[1:] == pshape[1:]:
                continue  # CKF825 reports these rows already
            if shape != pshape:
                bad.append((live_name[pos], f"{live_name[pos]} {list(live_params[pos].shape)} "
                                            f"<- {key} {list(shape)}"))
        if bad:
            with_state = [tuple(live_params[pos].shape) for ci, pos in side.assign.items()
                          if moment_shape(ci) is not None]
            permuted = side.matched_by == "position" and sorted(saved_shapes) == sorted(with_state)
            hint = (" The moments fit these parameters only under a permutation: the parameter "
                    "order changed since saving (module registration order, param-group "
                    "construction)." if permuted else "")
            mismatch(f"{len(bad)} optimizer moment(s) do not fit their parameter "
                     f"(matched by {side.matched_by}): {format_names([b for _, b in bad], 4)}."
                     + hint, tuple(n for n, _ in bad))
            return side, problems
        problems += self._check_moment_dtypes(copt, side, live_params, live_name, policy)
        return side, problems

    def _checkpoint_names(self, ckpt: Any, mapping: Any, live_params: list) -> tuple[list | None, str]:
        """Checkpoint optimizer index -> parameter name, when it can be trusted (the mapping
        module's answer; `live_params` tells whether the live optimizer follows the model order)."""
        from ckptfix.mapping import names_for_resume

        order = {id(p): i for i, p in enumerate(named_params(self.model).values())}
        seq = [order.get(id(p), -1) for p in live_params]
        in_model_order = -1 not in seq and all(a < b for a, b in zip(seq, seq[1:]))
        return names_for_resume(ckpt, mapping, in_model_order)

    def _check_moment_dtypes(self, copt: Any, side: _Optim, live_params: list,
                             live_name: list, policy: str) -> list[Problem]:
        """CKF823 (checkpoint side): 16-bit moments for 32/64-bit parameters; fp16 underflow."""
        low, underflow = [], []
        for ci, pos in side.assign.items():
            param, ps = live_params[pos], copt.state.get(ci)
            if ps is None or not param.is_floating_point() or torch.finfo(param.dtype).bits < 32:
                continue
            for key, t in ps.tensors.items():
                if t.dtype not in ("float16", "bfloat16") or tuple(t.shape) != tuple(param.shape):
                    continue
                low.append(f"{live_name[pos]}:{key} ({t.dtype})")
                first = ps.tensors.get("exp_avg")
                if key in SECOND_MOMENTS and t.dtype == "float16" and first is not None:
                    count = int(((t.to_torch() == 0) & (first.to_torch() != 0)).sum())
                    if count:
                        underflow.append(f"{live_name[pos]}:{key} ({count} of {t.numel})")
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

    def _check_sections(self, ckpt: Any, record: dict) -> list[Problem]:
        """CKF827: training state on one side only."""
        if self.policy == "reset":
            return []
        missing = []
        if self.optimizer is not None and ckpt.optimizer is None:
            missing.append(("optimizer", "the optimizer starts with empty moments"))
        if (self.scheduler is not None and ckpt.scheduler is None
                and record.get("scheduler_state") != "reset"):
            missing.append(("scheduler", "the scheduler restarts from step 0 (warmup again)"))
        if _scaler_enabled(self.scaler) and not ckpt.scaler:
            missing.append(("scaler", "the GradScaler recalibrates from its initial scale"))
        unused = [what for what, live, saved in (("optimizer", self.optimizer, ckpt.optimizer),
                                                 ("scheduler", self.scheduler, ckpt.scheduler))
                  if live is None and saved is not None]
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

    def _not_landed(self, loaded: dict[str, torch.Tensor]) -> Problem | None:
        """CKF820 after our own load: every tensor loaded must now be in the model."""
        live = self._live_state()
        bad = [k for k, v in loaded.items() if k in live and _same_values(live[k], v) is False]
        if not bad:
            return None
        return Problem(
            "CKF820", "error",
            f"{len(bad)} tensor(s) did not land in the model after load_state_dict: the model "
            "ignores them (a load_state_dict pre-hook or override that filters keys?).",
            tuple(bad),
        )

    def _check_live_state(self) -> list[Problem]:
        """The live optimizer state against its parameters: CKF822 a moment shaped unlike its
        parameter (state loaded by position onto other parameters); CKF823 another dtype/device."""
        from ckptfix.mapping import MOMENT_KEYS

        if self.optimizer is None:
            return []
        opt = unwrap_optimizer(self.optimizer)
        names = {id(p): n for n, p in named_params(self.model).items()}
        bad, misshaped = [], []
        for group in opt.param_groups:
            for p in group["params"]:
                name = names.get(id(p), f"<unnamed {list(p.shape)}>")
                for key, value in opt.state.get(p, {}).items():
                    if not isinstance(value, torch.Tensor) or key == "step":
                        continue
                    if key in MOMENT_KEYS and value.shape != p.shape:
                        misshaped.append(f"{name} {list(p.shape)} <- {key} {list(value.shape)}")
                        break
                    if value.shape == p.shape and (value.dtype != p.dtype or value.device != p.device):
                        bad.append(f"{name}:{key} ({_dtype_name(value.dtype)} on {value.device}; "
                                   f"parameter {_dtype_name(p.dtype)} on {p.device})")
                        break
        problems = []
        if misshaped:
            problems.append(Problem(
                "CKF822", "error",
                f"the optimizer state of {len(misshaped)} parameter(s) has another shape than the "
                "parameter (state loaded by position onto other parameters, or a resized vocab "
                "without resized moments): optimizer.step() fails or corrupts them.",
                tuple(misshaped),
            ))
        if not bad:
            return problems
        return problems + [Problem(
            "CKF823", "error",
            f"optimizer state of {len(bad)} parameter(s) has another dtype/device than the "
            "parameter: optimizer.step() fails ('expected dtype ... but got ...') or updates a "
            "copy. Convert the model (model.to(...)) before building/loading the optimizer.",
            tuple(bad),
        )]

    # -- internals: loading -----------------------------------------------------------------------

    def _load_optimizer(self, ckpt: Any, side: _Optim, model_side: _Model, values: _Values,
                        with_state: bool) -> None:
        """optimizer.load_state_dict with a state dict built for the live positions."""
        opt = unwrap_optimizer(self.optimizer)
        copt = ckpt.optimizer
        groups, start = [], 0
        for cg, lg in zip(copt.groups, opt.param_groups):
            options = {k: values(v, "optimizer", f"param_groups.{k}")
                       for k, v in cg.options.items() if k != "param_names"}
            n = len(lg["params"])
            groups.append({**options, "params": list(range(start, start + n))})
            start += n
        state: dict[int, dict[str, Any]] = {}
        plan = model_side.plan
        for ci, pos in (side.assign.items() if with_state else ()):
            ps = copt.state.get(ci)
            if ps is None:
                continue
            entry: dict[str, Any] = {}
            for key, info in ps.tensors.items():
                edit = plan.moments.get((ci, key)) if plan is not None else None
                if edit is not None and edit.name.rsplit(":", 1)[0] in model_side.used_edits:
                    entry[key] = self._produce(edit, plan.init)
                else:
                    entry[key] = values.tensor(info)
            if ps.step is not None:
                entry["step"] = (int(ps.step) if copt.kind == "adafactor"
                                 else torch.tensor(float(ps.step), dtype=torch.float32))
            entry.update({k: values(v, "optimizer", f"state.{ci}.{k}") for k, v in ps.other.items()})
            state[pos] = entry
        opt.load_state_dict({"state": state, "param_groups": groups})

    def _sync_lr_from_scheduler(self) -> None:
        """Optimizer state dropped without its param groups: take the lr the scheduler set last."""
        get = getattr(self.scheduler, "get_last_lr", None)
        lrs = get() if callable(get) else None
        opt = unwrap_optimizer(self.optimizer)
        if isinstance(lrs, list) and len(lrs) == len(opt.param_groups):
            for g, lr in zip(opt.param_groups, lrs):
                g["lr"] = lr
            if self.report is not None:
                self.report.actions.append("set each param group's lr to the restored scheduler's")

    def _load_scaler(self, ckpt: Any, model_side: _Model, values: _Values,
                     report: ResumeReport) -> None:
        if not _scaler_enabled(self.scaler):
            if ckpt.scaler:
                report.notes.append("the checkpoint has GradScaler state; the live scaler is "
                                    "disabled, so it is not restored")
            return
        state = values(dict(ckpt.scaler), "scaler", "scaler")
        if not state:
            return  # saved from a disabled scaler; CKF827 said so
        plan = model_side.plan
        if plan is not None and plan.reset_scaler:
            from ckptfix.surgery.plan import DEFAULT_SCALE

            state["scale"] = DEFAULT_SCALE
            state["_growth_tracker"] = 0
            report.actions.append(f"reset the GradScaler scale to {DEFAULT_SCALE:g} (it had collapsed)")
        self.scaler.load_state_dict(state)
        report.actions.append("loaded GradScaler state")
