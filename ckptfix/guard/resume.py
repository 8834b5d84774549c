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
  CKF828  the live tokenizer gives other ids to tokens the checkpoint's rows belong to (its
          record, its folder or `from_tokenizer=` names that tokenizer) and the rows would be
          loaded by id (error; "remap" with `from_tokenizer=` moves them when the rows resize;
          a warning with `keep_ids=True`, which loads them by id as asked).

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

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptfix.errors import UnrecognisedFolder
from ckptfix.guard.live import Live
from ckptfix.guard.probe import StepProbe
from ckptfix.guard.problems import Problem, TrainingSetupError, format_names, raise_or_warn
from ckptfix.guard.ranks import ShardedUnsupported, gather, has_dtensors, local_box
from ckptfix.guard.resume_apply import Apply, not_landed, same_values
from ckptfix.guard.resume_plan import ModelPlan, key_map, key_problems, plan_optimizer, plan_resume
from ckptfix.guard.resume_sharded import load_shards, refusal
from ckptfix.guard.rewarm import Rewarm
from ckptfix.guard.setup import check_live_state, check_training_setup, named_params, unwrap_optimizer
from ckptfix.guard.whole import not_whole_problems, run_folder_problem
from ckptfix.policies import GUARD_POLICIES, canonical
from ckptfix.record import NAMES_SCHEMA, Record, TokenizerRef

__all__ = ["ResumeGuard", "ResumeReport", "ResumeError", "POLICIES", "tokenizer_size"]

POLICIES = GUARD_POLICIES
SCHEMA = "ckptfix.resume/1"


class ResumeError(TrainingSetupError):
    """The checkpoint does not fit the live training objects. `.problems` lists why."""

    def __init__(self, problems: list[Problem], path: str = ""):
        self.problems = list(problems)
        self.path = path
        errors = sum(p.severity == "error" for p in self.problems)
        warns = sum(p.severity == "warning" for p in self.problems)
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
        from ckptfix.plain import plain

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


def token_table(tokenizer: Any) -> Any:
    """A TokenizerInfo (id -> token table) for a path or TokenizerInfo; None for sizes and tokenizer objects."""
    from ckptfix.tokenizers import TokenizerInfo, load_tokenizer

    if isinstance(tokenizer, TokenizerInfo):
        return tokenizer
    if isinstance(tokenizer, (str, os.PathLike)):
        return load_tokenizer(tokenizer)
    return None


def _read(source: Any) -> Any:
    """A Checkpoint from a path (or a Checkpoint as is), with a repair sidecar record attached."""
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.formats import read_checkpoint

    if isinstance(source, Checkpoint):
        return source
    try:
        return read_checkpoint(os.fspath(source))
    except UnrecognisedFolder:
        problem = run_folder_problem(os.fspath(source))
        if problem is None:
            raise
        raise ResumeError([problem], os.fspath(source)) from None


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
    `from_tokenizer`: the tokenizer the checkpoint was trained with (a path or TokenizerInfo, with
    `tokenizer` one too): resized rows move by token string. Without it (and without a record or
    folder naming it) resized rows are kept by id unchecked, and CKF825 says so.
    `keep_ids`: keep row i for token i even where the old tokenizer is known or ids look moved, as
    `ckptfix repair --keep-ids` (CKF828 is then a warning).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Any = None, scheduler: Any = None,
                 scaler: Any = None, tokenizer: Any = None, policy: str = "strict", *,
                 rewarm_steps: int = 100, reset_scheduler: bool = False, probe_steps: int = 3,
                 from_tokenizer: Any = None, keep_ids: bool = False):
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
        self.from_tokenizer = from_tokenizer  # the tokenizer the checkpoint was trained with (path/TokenizerInfo)
        self.keep_ids = keep_ids
        self.policy = policy
        self.rewarm_steps = rewarm_steps
        self.reset_scheduler = reset_scheduler
        self.probe_steps = probe_steps
        self.report: ResumeReport | None = None
        self.probe: StepProbe | None = None
        self._rewarm: Rewarm | None = None
        self._tok_size: int | None = None
        self._tok_info: Any = None
        self._tok_read = False

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

        ckpt = _read(path)  # read
        analysis = analyse(ckpt)
        live = Live.capture(self.model, self.optimizer, self.scheduler, self.scaler, self._tokenizer_size())
        live.tokenizer, live.from_tokenizer = self._tokens(), token_table(self.from_tokenizer)
        live.keep_ids = self.keep_ids
        if self.from_tokenizer is not None and (live.from_tokenizer is None or live.tokenizer is None):
            raise TypeError("from_tokenizer needs tokenizer= and from_tokenizer= as paths or TokenizerInfos "
                            "(their id -> token tables), not sizes or tokenizer objects")
        plan = plan_resume(ckpt, analysis, live, self.policy, reset_scheduler=self.reset_scheduler)  # plan
        plan.problems[:0] = not_whole_problems(ckpt, analysis.findings)
        report = self.report = ResumeReport(
            path=ckpt.path, format=ckpt.format, policy=self.policy, problems=list(plan.problems),
            record=ckpt.record.to_json() if ckpt.record is not None else None, notes=plan.notes, checkpoint_findings=[f.code for f in analysis.findings])
        raise_or_warn(report.problems, lambda _: ResumeError(report.problems, ckpt.path))  # raise
        apply = Apply(plan, ckpt, self.model, self.optimizer, self.scheduler, self.scaler)  # apply
        if has_dtensors(self.model):  # metadata and the plan: every rank takes this path, or refuses, alike
            report.actions += self._load_sharded(ckpt, plan, report)
        else:
            report.actions += apply.model_tensors()
            self._raise_if(report, [p for p in [not_landed(self.model, apply.loaded)] if p is not None])
            report.actions += apply.training_state()
        report.optimizer_matched_by = plan.matched_by
        self.close()
        if plan.rewarm and self.optimizer is not None and self.rewarm_steps > 0:
            self._rewarm = Rewarm(self.optimizer, self.rewarm_steps)
            report.rewarm_steps = self.rewarm_steps
            report.actions.append(f"LR re-warms linearly over {self.rewarm_steps} steps")
        report.extras = apply.extras()
        self._raise_if(report, check_live_state(self.model, self.optimizer))  # probe
        setup = check_training_setup(self.model, self.optimizer, self.scaler,
                                     scheduler=self.scheduler, raise_on_error=False)
        report.problems += setup
        raise_or_warn(setup, TrainingSetupError)
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
        live = Live.capture(self.model, self.optimizer)
        keys, _ = key_map(list(ckpt.model), list(live.state))
        problems = key_problems(ckpt, keys, live, unexpected_severity="warning")
        problems += _compare_loaded(ckpt, keys, self.model.state_dict(keep_vars=True), full)
        if self.optimizer is not None and unwrap_optimizer(self.optimizer).state:
            live_problems = check_live_state(self.model, self.optimizer)
            if ckpt.optimizer is not None and not any(p.code == "CKF822" for p in live_problems):
                result = plan_optimizer(ckpt, map_optimizer(ckpt), ModelPlan(key_map=keys), live, "strict")
                problems += [p for p in result.problems if p.code == "CKF822"]
            problems += live_problems
        if raise_on_error:
            raise_or_warn(problems, lambda found: ResumeError(found, ckpt.path))
        return problems

    def record(self) -> dict[str, Any]:
        """A `ckptfix` entry for your own checkpoints: parameter names in optimizer order.

            torch.save({..., "optimizer": optimizer.state_dict(), "ckptfix": guard.record()}, p)

        With it, `load` matches optimizer state to parameters by name: a changed module
        registration order is caught (and, with policy "remap", corrected). When the guard was given
        the tokenizer as a path (or TokenizerInfo), the record also names it with its fingerprint:
        a later `ckptfix repair`/`inspect`/guard then knows which token each row belongs to.
        """
        names = {id(p): n for n, p in named_params(self.model).items()}
        opt = unwrap_optimizer(self.optimizer) if self.optimizer is not None else None
        params = [p for g in opt.param_groups for p in g["params"]] if opt is not None else []
        tok = self._tokens()
        ref = None
        if tok is not None:
            from ckptfix.identity import fingerprint

            ref = TokenizerRef(os.path.abspath(tok.path), tok.size, fingerprint(tok))
        return Record(NAMES_SCHEMA, param_names=[names.get(id(p), "") for p in params], tokenizer=ref).to_json()

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

    # -- internals ------------------------------------------------------------------------------

    def _load_sharded(self, ckpt: Any, plan: Any, report: ResumeReport) -> list[str]:
        """A DCP folder into DTensors, each rank its own shards (`resume_sharded`); then what landed,
        compared shard by shard and agreed over ranks (CKF820)."""
        why = refusal(ckpt, plan)
        if why is not None:
            raise ShardedUnsupported(f"{ckpt.path}: ResumeGuard.load into a sharded model (DTensor parameters): "
                                     f"{why}.")
        actions = load_shards(ckpt, plan, self.model, self.optimizer, self.scheduler)
        keys = {cname: lname for lname, cname in plan.model.load.items()}
        self._raise_if(report, [p for p in _compare_loaded(ckpt, keys, self.model.state_dict(keep_vars=True), False)
                                if p.code == "CKF820"])
        return actions

    def _raise_if(self, report: ResumeReport, problems: list[Problem]) -> None:
        """Post-load findings go into the report; an error among them stops the load."""
        report.problems += problems
        if any(p.severity == "error" for p in problems):
            raise ResumeError(report.problems, report.path)

    def _probe(self) -> StepProbe | None:
        if self.probe is None:
            self.probe = self._new_probe()  # a run without a checkpoint: probe anyway
        return self.probe if self.probe is not None and self.probe.active else None

    def _new_probe(self) -> StepProbe | None:
        if self.optimizer is None or self.probe_steps <= 0:
            return None
        return StepProbe(self.model, self.optimizer, self.scaler, steps=self.probe_steps)

    def _tokens(self) -> Any:
        """The tokenizer's id -> token table (None for a size or a tokenizer object), read once per guard."""
        if not self._tok_read:
            self._tok_info = token_table(self.tokenizer)
            self._tok_size = self._tok_info.size if self._tok_info is not None else tokenizer_size(self.tokenizer)
            self._tok_read = True
        return self._tok_info

    def _tokenizer_size(self) -> int | None:
        self._tokens()
        return self._tok_size


def _loaded_here(info: Any, tensor: torch.Tensor, full: bool) -> int:
    """Does this rank's piece of `tensor` hold the checkpoint's values? 0 yes, 1 no (CKF820), 2 its
    shape differs, only the rows both have compared and they hold the checkpoint's (CKF825).

    Compared piece by piece: a DTensor's local shard against the same rows (and columns) of the
    checkpoint tensor, so nothing here is a collective and uneven shards (1003 rows on 2 ranks) work.
    `_compare_loaded` agrees over ranks."""
    piece, box = local_box(tensor)
    ref = info.to_torch()
    if tuple(info.shape) == tuple(tensor.shape):
        return int(same_values(piece, ref[box], full=full) is False)
    rows_only = (len(info.shape) == len(tensor.shape) >= 1
                 and tuple(info.shape[1:]) == tuple(tensor.shape[1:]))
    if not rows_only or min(info.shape[0], tensor.shape[0]) * math.prod(info.shape[1:]) == 0:
        return 1
    rows = box[0] if box else slice(0, 0)
    common = max(0, min(rows.stop, info.shape[0]) - rows.start)  # this piece's rows the checkpoint has
    if common == 0:
        return 2  # nothing of this piece is in the checkpoint: the other ranks judge
    same = same_values(piece[:common], ref[(slice(rows.start, rows.start + common),) + box[1:]], full=full)
    return 2 if same else 1


def _compare_loaded(ckpt: Any, keys: dict[str, str], live: dict[str, torch.Tensor], full: bool) -> list[Problem]:
    """CKF820 (a checkpoint tensor whose values are not in the model) and CKF825 (resized, rows kept),
    judged on every rank's piece and agreed in one all_reduce: every rank reports the same."""
    pairs = list(keys.items())  # the same order on every rank
    ranks = gather([_loaded_here(ckpt.model[cname], live[lname], full) for cname, lname in pairs])
    not_loaded, resized, shapes = [], [], []
    for k, (cname, lname) in enumerate(pairs):
        verdicts = [r[k] for r in ranks]
        if 1 not in verdicts:
            if 2 in verdicts:
                resized.append(lname)
            continue
        not_loaded.append(lname)
        info, tensor = ckpt.model[cname], live[lname]
        if tuple(info.shape) != tuple(tensor.shape):
            shapes.append(f"{lname} {list(info.shape)} in the checkpoint, {list(tensor.shape)} "
                          "in the model")
    problems = []
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
    return problems
