"""Resume guard: catch training that runs for hours while learning nothing.

Real runs have "trained" with 0 trainable parameters (a peft `LoraConfig` created but never
applied), with LoRA adapters re-frozen by a trainer, with fp16 weights under a GradScaler, with a
loss `.detach()`ed before backward, or with NaN gradients. Each shows up as a flat loss much later.
This module finds them up front, in three layers:

1. Findings: `Problem`, `TrainingSetupError`, `TrainingSetupWarning`.
2. Setup checks: `check_training_setup(model, optimizer, scaler)` looks at the objects before the
   first step (cheap, no forward pass).
3. First-step probe: `StepProbe` watches the first few real optimizer steps (gradients arrived,
   are finite and non-zero, the weights actually changed, the GradScaler did not skip every step)
   and then turns itself into a no-op.
4. Checkpoint loading (`ResumeGuard.load`) lives at the end of this module (see the marked section).

Only torch is imported here; framework integrations live in `ckptfix.integrations`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "Problem",
    "TrainingSetupError",
    "TrainingSetupWarning",
    "check_training_setup",
    "StepProbe",
]

# ---------------------------------------------------------------------------------------------
# 1. Findings
# ---------------------------------------------------------------------------------------------

#: How many parameter names a message lists before "and N more".
MAX_NAMES = 10


@dataclass(frozen=True)
class Problem:
    """One finding. `params` names the parameters concerned (may be empty)."""

    code: str  # "CKF8xx"
    severity: str  # "error" or "warning"
    message: str
    params: tuple[str, ...] = ()

    def __str__(self) -> str:
        line = f"{self.code} {self.severity}: {self.message}"
        if self.params:
            line += f" [{format_names(self.params)}]"
        return line


def format_names(names: Sequence[str], limit: int = MAX_NAMES) -> str:
    """`a, b, c and 7 more`: keep messages readable for models with thousands of parameters."""
    shown = ", ".join(names[:limit])
    rest = len(names) - limit
    return f"{shown} and {rest} more" if rest > 0 else shown


class TrainingSetupError(RuntimeError):
    """Raised when training, as set up, would run without learning. `.problems` lists why."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = list(problems)
        errors = sum(p.severity == "error" for p in self.problems)
        warns = len(self.problems) - errors
        summary = f"training would not learn: {errors} error(s), {warns} warning(s)"
        super().__init__("\n".join([summary, *(f"  {p}" for p in self.problems)]))


class TrainingSetupWarning(UserWarning):
    """Warning-level findings, emitted through `warnings.warn` in guard mode."""


def _report(problems: list[Problem], raise_on_error: bool, stacklevel: int = 3) -> list[Problem]:
    """Guard mode (`raise_on_error`): raise on errors, `warnings.warn` the warnings.

    Report mode: return everything and have no side effects.
    """
    if raise_on_error:
        if any(p.severity == "error" for p in problems):
            raise TrainingSetupError(problems)
        for problem in problems:
            warnings.warn(str(problem), TrainingSetupWarning, stacklevel=stacklevel)
    return problems


# ---------------------------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------------------------

# Name segments that mark parameter-efficient adapter weights (peft: LoRA/AdaLoRA/DoRA, IA3,
# LoHa, LoKr, OFT/BOFT, VeRA, prompt/prefix tuning, adaption prompt, classic adapters). Matched
# against the *start of a dotted segment* so that e.g. `vision_adapter` is not taken for one.
ADAPTER_MARKERS: tuple[str, ...] = (
    "lora_",
    "ia3_",
    "hada_",
    "lokr_",
    "oft_",
    "boft_",
    "vera_",
    "prompt_encoder",
    "adaption_",
    "adapter",
)


def is_adapter_param(name: str) -> bool:
    """True for parameter names that belong to a peft-style adapter."""
    return any(seg.startswith(ADAPTER_MARKERS) for seg in name.split("."))


def named_params(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Name -> parameter; a parameter shared by several modules (tied embeddings) appears once."""
    out: dict[str, torch.nn.Parameter] = {}
    seen: set[int] = set()
    for name, param in model.named_parameters():
        if id(param) not in seen:
            seen.add(id(param))
            out[name] = param
    return out


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside wrappers such as accelerate's `AcceleratedOptimizer`."""
    inner = optimizer
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    return inner


def _scaler_of(optimizer: Any, scaler: Any) -> Any:
    """The explicit scaler, else the one an accelerate-wrapped optimizer carries."""
    return scaler if scaler is not None else getattr(optimizer, "scaler", None)


def _scaler_enabled(scaler: Any) -> bool:
    """Works for torch.amp.GradScaler and the deprecated torch.cuda.amp.GradScaler (a subclass)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else False


def _param_ids_in(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _lr_by_param(optimizer: Any) -> dict[int, float]:
    return {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}


# ---------------------------------------------------------------------------------------------
# 2. Setup checks
# ---------------------------------------------------------------------------------------------


@dataclass
class _Setup:
    """What the setup checks look at, gathered once."""

    params: dict[str, torch.nn.Parameter]
    optimizer: Any  # unwrapped torch optimizer, or None
    scaler: Any
    scheduler: Any

    @property
    def trainable(self) -> dict[str, torch.nn.Parameter]:
        return {n: p for n, p in self.params.items() if p.requires_grad}


def _check_any_trainable(s: _Setup) -> list[Problem]:
    """CKF801: nothing has requires_grad=True, so nothing can ever be updated."""
    if s.trainable:
        return []
    return [Problem(
        "CKF801", "error",
        f"the model has 0 trainable parameters (of {len(s.params)}): no gradient will flow and "
        "the optimizer will update nothing (symptoms: loss 0.0 or flat, 'None of the inputs have "
        "requires_grad=True', 'element 0 of tensors does not require grad'). A peft LoraConfig "
        "does nothing by itself: apply it with model = get_peft_model(model, config). Some "
        "trainers/scripts also re-freeze everything (model.requires_grad_(False)) after the "
        "adapters were added.",
    )]


def _check_adapters_trainable(s: _Setup) -> list[Problem]:
    """CKF802: adapter weights exist but are frozen, so fine-tuning trains nothing useful."""
    adapters = [n for n in s.params if is_adapter_param(n)]
    frozen = [n for n in adapters if not s.params[n].requires_grad]
    if not frozen:
        return []
    if len(frozen) == len(adapters):
        return [Problem(
            "CKF802", "error",
            f"all {len(adapters)} adapter (LoRA/peft) parameters are frozen: the adapters will not "
            "learn. Something re-froze them after get_peft_model (e.g. model.requires_grad_(False) "
            "or a trainer freezing the base model by name); re-enable them or call "
            "model.print_trainable_parameters() to see what trains.",
            tuple(frozen),
        )]
    return [Problem(
        "CKF802", "warning",
        f"{len(frozen)} of {len(adapters)} adapter (LoRA/peft) parameters are frozen; "
        "they will not learn.",
        tuple(frozen),
    )]


def _check_optimizer_coverage(s: _Setup) -> list[Problem]:
    """CKF803/CKF804: trainable parameters the optimizer never sees; frozen ones it carries."""
    if s.optimizer is None:
        return []
    in_opt = _param_ids_in(s.optimizer)
    problems: list[Problem] = []
    missing = [n for n, p in s.trainable.items() if id(p) not in in_opt]
    if missing:
        model_ids = {id(p) for p in s.params.values()}
        stale = len(in_opt - model_ids)
        hint = (f" The optimizer holds {stale} tensor(s) that are not parameters of this model "
                "(stale copies)." if stale else "")
        problems.append(Problem(
            "CKF803", "error",
            f"{len(missing)} trainable parameter(s) are in no optimizer param group: they get "
            "gradients but will never be updated. Create the optimizer after get_peft_model / "
            "resize_token_embeddings / model.to(...) replaced parameters, or add them with "
            f"optimizer.add_param_group.{hint}",
            tuple(missing),
        ))
    frozen = [n for n, p in s.params.items() if not p.requires_grad and id(p) in in_opt]
    if frozen:
        problems.append(Problem(
            "CKF804", "warning",
            f"{len(frozen)} frozen parameter(s) are in the optimizer: they get no gradients and "
            "will not change (if they were meant to train, they were frozen after the optimizer "
            "was built).",
            tuple(frozen),
        ))
    return problems


def _check_state_devices(s: _Setup) -> list[Problem]:
    """CKF805: optimizer state (exp_avg, ...) on another device than its parameter.

    Only state tensors shaped like the parameter are compared: Adam's scalar `step` is kept on
    the CPU on purpose.
    """
    if s.optimizer is None:
        return []
    names = {id(p): n for n, p in s.params.items()}
    bad: list[str] = []
    seen_pair = ""
    for group in s.optimizer.param_groups:
        for p in group["params"]:
            for value in s.optimizer.state.get(p, {}).values():
                if (isinstance(value, torch.Tensor) and value.shape == p.shape
                        and value.device != p.device):
                    bad.append(names.get(id(p), f"<unnamed {tuple(p.shape)}>"))
                    seen_pair = seen_pair or f"parameter on {p.device}, state on {value.device}"
                    break
    if not bad:
        return []
    return [Problem(
        "CKF805", "error",
        f"optimizer state of {len(bad)} parameter(s) is on another device than the parameter "
        f"({seen_pair}): optimizer.step() will fail with 'Expected all tensors to be on the same "
        "device' or work on the wrong copy. Move the model before building the optimizer or "
        "before optimizer.load_state_dict (which moves state to each parameter's device).",
        tuple(bad),
    )]


def _check_fp16_with_scaler(s: _Setup) -> list[Problem]:
    """CKF806: fp16 trainable weights under an enabled GradScaler."""
    if not _scaler_enabled(s.scaler):
        return []
    fp16 = [n for n, p in s.trainable.items() if p.dtype == torch.float16]
    if not fp16:
        return []
    return [Problem(
        "CKF806", "error",
        f"{len(fp16)} trainable parameter(s) are float16 while a GradScaler is enabled: their "
        "gradients are fp16 and GradScaler.unscale_ (called by scaler.step) raises 'ValueError: "
        "Attempting to unscale FP16 gradients.'. Keep fp32 master weights and run the forward "
        "under torch.autocast(device_type, dtype=torch.float16), or use bfloat16 without a "
        "scaler.",
        tuple(fp16),
    )]


def _scheduler_at_start(scheduler: Any) -> bool:
    """True if an LR scheduler is at step 0, where warmup legitimately starts from lr 0."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler
    return getattr(inner, "last_epoch", None) == 0


def _check_learning_rate(s: _Setup) -> list[Problem]:
    """CKF807: a param group with lr 0 (fine at warmup step 0, dead otherwise)."""
    if s.optimizer is None:
        return []
    zero = [i for i, g in enumerate(s.optimizer.param_groups)
            if g["params"] and float(g["lr"]) == 0.0]
    if not zero:
        return []
    names = {id(p): n for n, p in s.params.items()}
    params = tuple(names[id(p)] for i in zero for p in s.optimizer.param_groups[i]["params"]
                   if id(p) in names)
    if _scheduler_at_start(s.scheduler):
        return [Problem(
            "CKF807", "warning",
            f"param group(s) {zero} have lr 0 at scheduler step 0; fine for a warmup that starts "
            "from 0, but nothing is learned if it stays 0.",
            params,
        )]
    return [Problem(
        "CKF807", "error",
        f"param group(s) {zero} have learning rate 0 (and no scheduler at warmup step 0): their "
        "parameters will never change.",
        params,
    )]


def _check_scaler_scale(s: _Setup) -> list[Problem]:
    """CKF808: a GradScaler whose scale is non-finite or collapsed (every step overflowed)."""
    if not _scaler_enabled(s.scaler):
        return []
    scale = float(s.scaler.get_scale())
    if not math.isfinite(scale) or scale < 2.0**-24:
        return [Problem(
            "CKF808", "error",
            f"GradScaler scale is {scale:g}: it has backed off on every step (inf/NaN gradients "
            "each time), so steps are being skipped and gradients underflow. Look for NaN "
            "weights/loss or fp16 overflow, then reset the scaler state.",
        )]
    if scale < 1.0:
        return [Problem(
            "CKF808", "warning",
            f"GradScaler scale is {scale:g} (< 1): it keeps backing off, so many steps were "
            "skipped for inf/NaN gradients.",
        )]
    return []


SETUP_CHECKS = (
    _check_any_trainable,
    _check_adapters_trainable,
    _check_optimizer_coverage,
    _check_state_devices,
    _check_fp16_with_scaler,
    _check_learning_rate,
    _check_scaler_scale,
)


def check_training_setup(
    model: torch.nn.Module,
    optimizer: Any = None,
    scaler: Any = None,
    *,
    scheduler: Any = None,
    raise_on_error: bool = True,
) -> list[Problem]:
    """Check, before the first step, that this model/optimizer/scaler can learn at all.

    `optimizer` may be a torch optimizer or a wrapper (accelerate); its own `.scaler` is used
    when `scaler` is None. `scheduler` only serves to tell warmup step 0 (lr 0 is expected)
    from a dead lr. With `raise_on_error` (default) error-level findings raise
    `TrainingSetupError` and warnings go through `warnings.warn`; otherwise all findings are
    just returned.
    """
    setup = _Setup(
        params=named_params(model),
        optimizer=unwrap_optimizer(optimizer) if optimizer is not None else None,
        scaler=_scaler_of(optimizer, scaler),
        scheduler=scheduler,
    )
    problems = [p for check in SETUP_CHECKS for p in check(setup)]
    return _report(problems, raise_on_error)


# ---------------------------------------------------------------------------------------------
# 3. First-step probe
# ---------------------------------------------------------------------------------------------


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """Values of a gradient, sparse ones (nn.Embedding(sparse=True)) included."""
    return grad.coalesce().values() if grad.is_sparse else grad


def _lora_a_zero_expected(name: str, params: dict[str, torch.nn.Parameter]) -> bool:
    """True if `name` is a LoRA A matrix whose B partner is still all zero.

    peft initialises lora_B to zero, so the gradient of lora_A (dL/dA = B^T ...) is exactly
    zero on the first step; it becomes non-zero once lora_B has moved. That is correct training.
    """
    segments = name.split(".")
    for a, b in (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B")):
        if a in segments:
            partner = params.get(".".join(b if s == a else s for s in segments))
            return partner is not None and not bool(partner.detach().any())
    return False


class StepProbe:
    """Watch the first `steps` optimizer steps of a real loop, then do nothing.

    Call the hooks around each step::

        probe = StepProbe(model, optimizer, scaler, steps=3)
        for batch in loader:
            scaler.scale(loss_fn(model, batch)).backward()
            probe.after_backward()   # optional: before_step runs it if you don't
            probe.before_step()
            scaler.step(optimizer); scaler.update()
            probe.after_step()
            optimizer.zero_grad()

    Checks: every trainable parameter got a gradient (CKF810 none did / CKF811 some did not),
    gradients are finite (CKF812), not all zero (CKF813), the step changed the weights (CKF814),
    the GradScaler did not skip every step (CKF815), lr was not 0 on every step (CKF807).
    Error-level findings raise `TrainingSetupError` at once (unless `raise_on_error=False`);
    everything found is kept in `.problems`.

    Cost, only during the first `steps` steps: one pass over the gradients (a few reductions
    per parameter, each synchronising with the device), and a full copy of the trainable
    parameters that received a non-zero gradient, taken in `before_step` one parameter at a
    time and freed in `after_step`. A full copy is needed because only an element-by-element
    comparison proves that a step changed nothing; for LoRA it is tiny, for full fine-tuning it
    is one extra copy of the weights, on their device, for the duration of one optimizer step.
    After the window every hook returns immediately.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scaler: Any = None,
        *,
        steps: int = 3,
        unused_ok: Iterable[str] = (),
        raise_on_error: bool = True,
    ):
        """`unused_ok`: name substrings of trainable parameters that may legitimately get no
        gradient (e.g. a head the loss does not use); better still, freeze them."""
        self.model = model
        self.optimizer = optimizer
        self.scaler = _scaler_of(optimizer, scaler)
        self.steps = steps
        self.unused_ok = tuple(unused_ok)
        self.raise_on_error = raise_on_error
        self.problems: list[Problem] = []
        self.steps_done = 0
        self._skipped = 0
        self._lr_all_zero: list[bool] = []
        self._always_zero: set[str] | None = None  # zero-grad params, intersected over steps
        self._backward_checked = False
        self._snapshot: dict[str, torch.Tensor] = {}
        self._step_before: dict[int, float] = {}
        self._scale_before: float | None = None

    @property
    def active(self) -> bool:
        """True while the probe is still watching steps."""
        return self.steps_done < self.steps

    # -- hooks ----------------------------------------------------------------------------------

    def after_backward(self) -> list[Problem]:
        """Check the gradients of this step (call after backward, before the optimizer step)."""
        if not self.active or self._backward_checked:
            return []
        self._backward_checked = True
        trainable = {n: p for n, p in named_params(self.model).items() if p.requires_grad}
        problems = self._check_grads_present(trainable)
        with torch.no_grad():
            problems += self._check_grads_finite(trainable)
            problems += self._check_grads_nonzero(trainable)
        return self._emit(problems)

    def before_step(self) -> None:
        """Snapshot what the optimizer step should change (call right before optimizer.step)."""
        if not self.active:
            return
        self.after_backward()
        opt = unwrap_optimizer(self.optimizer)
        self._lr_all_zero.append(all(float(g["lr"]) == 0.0 for g in opt.param_groups))
        self._snapshot = self._take_snapshot(opt)
        self._step_before = self._step_counters(opt)
        self._scale_before = (float(self.scaler.get_scale())
                              if _scaler_enabled(self.scaler) else None)

    def after_step(self) -> list[Problem]:
        """Check that the optimizer step changed the weights (call after optimizer.step)."""
        if not self.active:
            return []
        problems: list[Problem] = []
        if self._was_skipped():
            self._skipped += 1
            why = ("the GradScaler found inf/NaN gradients and lowered its scale; normal for the "
                   "first steps while the scale calibrates" if _scaler_enabled(self.scaler)
                   else "the optimizer did not advance its step counters")
            problems.append(Problem(
                "CKF815", "warning", f"optimizer step {self.steps_done + 1} was skipped ({why}).",
            ))
        else:
            problems += self._check_weights_changed()
        self._snapshot, self._step_before = {}, {}
        self._backward_checked = False
        self.steps_done += 1
        if not self.active:
            problems += self._window_summary()
        return self._emit(problems)

    # -- gradient checks ------------------------------------------------------------------------

    def _check_grads_present(self, trainable: dict[str, torch.nn.Parameter]) -> list[Problem]:
        """CKF810: no gradient at all (graph cut); CKF811: some trainable params got none."""
        missing = [n for n, p in trainable.items() if p.grad is None]
        if trainable and len(missing) == len(trainable):
            return [Problem(
                "CKF810", "error",
                f"none of the {len(trainable)} trainable parameters received a gradient: the "
                "loss graph was cut before backward (loss.detach(), a tensor rebuilt from "
                "loss.item(), the forward run under torch.no_grad()/inference_mode), backward() "
                "was not called, or gradient checkpointing (use_reentrant=True) saw inputs that "
                "do not require grad ('None of the inputs have requires_grad=True'; call "
                "model.enable_input_require_grads()).",
                tuple(missing),
            )]
        missing = [n for n in missing if not any(s in n for s in self.unused_ok)]
        if not missing:
            return []
        return [Problem(
            "CKF811", "error",
            f"{len(missing)} of {len(trainable)} trainable parameters received no gradient: they "
            "are not used by the loss, or gradient checkpointing cut them off ('None of the "
            "inputs have requires_grad=True'; call model.enable_input_require_grads()). Freeze "
            "parameters that are unused on purpose, or list them in unused_ok.",
            tuple(missing),
        )]

    def _check_grads_finite(self, trainable: dict[str, torch.nn.Parameter]) -> list[Problem]:
        """CKF812: NaN/Inf gradients. Under an enabled GradScaler an overflow only skips the
        step (a warning here; CKF815 turns it into an error if every probed step is skipped)."""
        bad: list[str] = []
        for name, p in trainable.items():
            if p.grad is None:
                continue
            g = _dense(p.grad)
            count = int((~torch.isfinite(g)).sum().item())
            if count:
                bad.append(f"{name} ({count} of {g.numel()})")
        if not bad:
            return []
        if _scaler_enabled(self.scaler):
            return [Problem(
                "CKF812", "warning",
                f"{len(bad)} parameter(s) have NaN/Inf (scaled) gradients; the GradScaler will "
                "skip this step.",
                tuple(bad),
            )]
        return [Problem(
            "CKF812", "error",
            f"{len(bad)} parameter(s) have NaN/Inf gradients (count of non-finite elements "
            "shown): the step would write NaN into the weights. Look for NaN weights or inputs, "
            "log/sqrt of non-positive values, division by zero, or fp16 overflow.",
            tuple(bad),
        )]

    def _check_grads_nonzero(self, trainable: dict[str, torch.nn.Parameter]) -> list[Problem]:
        """CKF813 (error): every gradient of this step is exactly zero.

        Single parameters with a zero gradient are *not* judged per step: peft's lora_A has an
        exactly-zero gradient on the first step because lora_B starts at zero, which is correct.
        They are only reported (as a warning) at the end of the window if their gradient was
        zero, for no such known reason, on every probed step; see `_window_summary`.
        """
        with_grad = {n: p for n, p in trainable.items() if p.grad is not None}
        nonzero = {n for n, p in with_grad.items() if bool(_dense(p.grad).any())}
        params = named_params(self.model)
        unexplained = {n for n in with_grad
                       if n not in nonzero and not _lora_a_zero_expected(n, params)}
        self._always_zero = (unexplained if self._always_zero is None
                             else self._always_zero & unexplained)
        if not with_grad or nonzero:
            return []
        return [Problem(
            "CKF813", "error",
            f"every gradient is exactly zero ({len(with_grad)} parameters): the loss does not "
            "depend on the trainable parameters (constant or masked-out loss, all labels "
            "ignored (-100), zero-initialised adapters on both sides).",
            tuple(with_grad),
        )]

    # -- step checks ----------------------------------------------------------------------------

    def _take_snapshot(self, opt: Any) -> dict[str, torch.Tensor]:
        """Copy every trainable parameter whose step must visibly change it.

        A parameter qualifies if it has a non-zero gradient, a group lr > 0 (or is outside the
        optimizer, which is itself a bug), and at least one element whose plain-SGD update
        lr*|g| is at least one ulp of the weight: smaller updates can round away legitimately,
        so no claim is made about them. Adaptive optimizers move by about lr per element, which
        is more than lr*|g| whenever |g| < 1, so this never flags a healthy Adam step.
        """
        lrs = _lr_by_param(opt)
        snap: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in named_params(self.model).items():
                if not p.requires_grad or p.grad is None or p.grad.is_sparse:
                    continue
                lr = lrs.get(id(p), 1.0)
                if lr == 0.0 or not p.is_floating_point() or not bool(p.grad.any()):
                    continue
                ulp = torch.finfo(p.dtype).eps * p.detach().abs()
                if bool((lr * p.grad.abs() >= ulp).any()):
                    snap[name] = p.detach().clone()
        return snap

    def _check_weights_changed(self) -> list[Problem]:
        """CKF814: parameters with a non-zero gradient and lr > 0 that the step left unchanged."""
        params = named_params(self.model)
        in_opt = _param_ids_in(unwrap_optimizer(self.optimizer))
        stuck = [n for n, before in self._snapshot.items()
                 if n in params and torch.equal(before, params[n].detach())]
        if not stuck:
            return []
        outside = [n for n in stuck if id(params[n]) not in in_opt]
        detail = (f" {len(outside)} of them are not in the optimizer at all (it was built "
                  "before the model's parameters were replaced)." if outside else "")
        return [Problem(
            "CKF814", "error",
            f"optimizer step {self.steps_done + 1} did not change {len(stuck)} parameter(s) "
            "although they had non-zero gradients and lr > 0: the optimizer is not updating "
            "the model you train (stale optimizer, params re-created after it was built, a "
            "no-op optimizer step, or updates below the precision of the weight dtype)."
            + detail,
            tuple(stuck),
        )]

    def _step_counters(self, opt: Any) -> dict[int, float]:
        """Adam-style per-parameter `step` counters (0 where no state exists yet)."""
        counters: dict[int, float] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    step = opt.state.get(p, {}).get("step", 0)
                    counters[id(p)] = float(step)
        return counters

    def _was_skipped(self) -> bool:
        """Did the optimizer skip this step? Several signals, most direct first."""
        skipped = getattr(self.optimizer, "step_was_skipped", None)  # accelerate
        if isinstance(skipped, bool):
            return skipped
        opt = unwrap_optimizer(self.optimizer)
        if _scaler_enabled(self.scaler):
            # Before scaler.update(): the scaler still holds this step's found_inf per device.
            states = getattr(self.scaler, "_per_optimizer_states", {})
            for key in (id(self.optimizer), id(opt)):
                found = states.get(key, {}).get("found_inf_per_device")
                if found:
                    return sum(float(v) for v in found.values()) > 0
            # After scaler.update(): a skipped step halved the scale.
            if self._scale_before is not None and self.scaler.get_scale() < self._scale_before:
                return True
        # Without a scaler signal: Adam-style step counters that did not advance.
        before = self._step_before
        after = self._step_counters(opt)
        if before and (any(after.values()) or any(before.values())):
            return all(after.get(k, 0) <= v for k, v in before.items())
        return False

    def _window_summary(self) -> list[Problem]:
        """Findings that need the whole probe window rather than one step."""
        problems: list[Problem] = []
        if self._skipped and self._skipped == self.steps_done:
            problems.append(Problem(
                "CKF815", "error",
                f"all {self.steps_done} probed optimizer steps were skipped by the GradScaler "
                "(inf/NaN gradients every time): nothing is being learned. Look for NaN weights "
                "or loss, or fp16 overflow.",
            ))
        if len(self._lr_all_zero) > 1 and all(self._lr_all_zero):
            problems.append(Problem(
                "CKF807", "error",
                f"the learning rate was 0 in every param group on all {len(self._lr_all_zero)} "
                "probed steps: a warmup would have raised it by now; nothing is being learned.",
            ))
        never = sorted(self._always_zero or ())
        if never:
            problems.append(Problem(
                "CKF813", "warning",
                f"{len(never)} parameter(s) had an all-zero gradient on every probed step; "
                "they are not learning yet.",
                tuple(never),
            ))
        return problems

    def _emit(self, problems: list[Problem]) -> list[Problem]:
        self.problems += problems
        return _report(problems, self.raise_on_error, stacklevel=4)  # the caller of the hook


# ---------------------------------------------------------------------------------------------
# 4. Checkpoint loading: `ResumeGuard` (with `ResumeGuard.load`) goes here.
#
# It is added separately. It is expected to reuse `check_training_setup` after loading model,
# optimizer and scaler state, and to expose the first-step probe as methods that delegate to a
# `StepProbe` (after_backward / before_step / after_step).
# ---------------------------------------------------------------------------------------------
