"""Setup checks: `check_training_setup(model, optimizer, scaler)` looks at the objects before the
first step (cheap, no forward pass), plus the helpers the probe and the resume guard share
(parameter names, optimizer unwrapping, scaler state)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from ckptfix.guard.problems import Problem, report_problems
from ckptfix.mapping import MOMENT_KEYS

__all__ = ["check_training_setup", "check_live_state", "named_params", "unwrap_optimizer", "is_adapter_param",
           "SETUP_CHECKS"]

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


def scaler_enabled(scaler: Any) -> bool:
    """Works for torch.amp.GradScaler and the deprecated torch.cuda.amp.GradScaler (a subclass)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return bool(is_enabled()) if callable(is_enabled) else False


def _param_ids_in(optimizer: Any) -> set[int]:
    return {id(p) for group in optimizer.param_groups for p in group["params"]}


def _lr_by_param(optimizer: Any) -> dict[int, float]:
    return {id(p): float(g["lr"]) for g in optimizer.param_groups for p in g["params"]}


# ---------------------------------------------------------------------------------------------
# Setup checks
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
    if not scaler_enabled(s.scaler):
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


def _next_lrs(scheduler: Any) -> list[float] | None:
    """The lr a LambdaLR (every Hugging Face schedule is one) gives at its next step, from the live
    lambdas (the loop's own code, not the checkpoint's); None for other schedulers."""
    inner = getattr(scheduler, "scheduler", scheduler)  # accelerate's AcceleratedScheduler
    lambdas, bases = getattr(inner, "lr_lambdas", None), getattr(inner, "base_lrs", None)
    step = getattr(inner, "last_epoch", None)
    if not isinstance(lambdas, list) or not isinstance(bases, list) or not isinstance(step, int):
        return None
    try:
        return [float(base) * float(fn(step + 1)) for fn, base in zip(lambdas, bases)]
    except Exception:  # a user lambda that fails outside its loop: no opinion
        return None


_RESUME_LR = ("Which schedule comes next is the loop's: the Hugging Face Trainer rebuilds it from the resumed "
              "TrainingArguments, Lightning from configure_optimizers, a plain loop from its own code; "
              "scheduler.load_state_dict then restores only its step.")


def _check_learning_rate(s: _Setup) -> list[Problem]:
    """CKF807: a param group with lr 0. Information where the live scheduler raises it at its next step
    (the first step of a warm-up from 0; the end of a finished schedule resumed with a longer one): the
    first step changes nothing, the next ones train. A warning at warm-up step 0 when the next lr is
    unknown (not a LambdaLR) or still 0; an error otherwise (the parameters never change)."""
    if s.optimizer is None:
        return []
    zero = [i for i, g in enumerate(s.optimizer.param_groups)
            if g["params"] and float(g["lr"]) == 0.0]
    if not zero:
        return []
    names = {id(p): n for n, p in s.params.items()}
    params = tuple(names[id(p)] for i in zero for p in s.optimizer.param_groups[i]["params"]
                   if id(p) in names)
    upcoming = _next_lrs(s.scheduler)
    rises = upcoming is not None and all(upcoming[i] > 0 for i in zero if i < len(upcoming))
    if _scheduler_at_start(s.scheduler):
        if rises:
            return [Problem("CKF807", "info", f"param group(s) {zero} start a warm-up from lr 0: the first step "
                            f"changes nothing, the scheduler raises the lr to {max(upcoming or [0]):.3g} at its "
                            "next step.", params)]
        return [Problem(
            "CKF807", "warning",
            f"param group(s) {zero} have lr 0 at scheduler step 0 and the scheduler's next lr is "
            f"{'0 too' if upcoming is not None else 'unknown (not a LambdaLR)'}; fine for a warm-up that "
            "starts from 0, but nothing is learned if it stays 0.",
            params,
        )]
    if rises:
        return [Problem(
            "CKF807", "info",
            f"param group(s) {zero} have lr 0 (the end of the saved schedule, restored with the optimizer) and "
            f"the live scheduler raises it to {max(upcoming or [0]):.3g} at its next step: the first resumed "
            f"step changes nothing, the next ones train. {_RESUME_LR}",
            params,
        )]
    return [Problem(
        "CKF807", "error",
        f"param group(s) {zero} have learning rate 0 and the live scheduler "
        f"{'keeps it at 0 at its next step' if upcoming is not None else 'does not raise it (none, or not a LambdaLR at step 0)'}"
        f": their parameters will never change. {_RESUME_LR} Resume with a schedule that continues.",
        params,
    )]


def _check_scaler_scale(s: _Setup) -> list[Problem]:
    """CKF808: a GradScaler whose scale is non-finite or collapsed (every step overflowed)."""
    if not scaler_enabled(s.scaler):
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
    when `scaler` is None. An optimizer that already holds state (loaded by hand) has every moment
    checked against its parameter's shape (CKF822), whatever its implementation (for-loop,
    foreach, fused). `scheduler` only serves to tell warmup step 0 (lr 0 is expected)
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
    if setup.optimizer is not None and any(setup.optimizer.state.values()):
        # state loaded by hand (optimizer.load_state_dict): torch checks no moment's shape against its
        # parameter, and fused AdamW steps on wrong-shaped ones (CKF822; device and dtype are CKF805's)
        problems += [p for p in check_live_state(model, optimizer) if p.code == "CKF822"]
    return report_problems(problems, raise_on_error)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def check_live_state(model: Any, optimizer: Any) -> list[Problem]:
    """The live optimizer state against its parameters: CKF822 a moment shaped unlike its
    parameter (state loaded by position onto other parameters); CKF823 another dtype/device."""
    if optimizer is None:
        return []
    opt = unwrap_optimizer(optimizer)
    names = {id(p): n for n, p in named_params(model).items()}
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
                codes = value.dtype == torch.uint8 and p.dtype.is_floating_point  # bitsandbytes' 8-bit state, by design
                if value.shape == p.shape and ((value.dtype != p.dtype and not codes) or value.device != p.device):
                    bad.append(f"{name}:{key} ({_dtype_name(value.dtype)} on {value.device}; "
                               f"parameter {_dtype_name(p.dtype)} on {p.device})")
                    break
    problems = []
    if misshaped:
        problems.append(Problem(
            "CKF822", "error",
            f"the optimizer state of {len(misshaped)} parameter(s) has another shape than the "
            "parameter (state loaded by position onto other parameters, or a resized vocab "
            "without resized moments). optimizer.load_state_dict never checks this: the for-loop "
            "and foreach AdamW raise at the first step(), fused=True (Trainer's adamw_torch_fused) "
            "reads past the moments (NaN weights, heap corruption) or uses other rows' history. "
            "Fix: `ckptfix repair CKPT --tokenizer TOK -o FIXED` (moments follow their rows), or "
            "load with ResumeGuard(policy='remap').",
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
