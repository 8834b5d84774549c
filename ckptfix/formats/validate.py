"""The checkpoint boundary: the values every format reader hands over, checked once into the types the
checks, renderers and writers rely on.

Each format reader parses its own container (zip, pickle, safetensors header, DCP `.metadata`,
DeepSpeed partitions) and validates what it takes in there; `check_checkpoint` then checks the
sections every format shares — optimizer param groups and state, scheduler and scaler state, the
repair record — so code past `read_checkpoint` never meets a `weight_decay` that is a list, `betas`
that are None or a scaler keyed by ints. A wrong value is a `CorruptInput` naming the file, the
field and what was expected (exit 2), never a wrong report or an internal error.
"""

from __future__ import annotations

from typing import Any

from ckptfix.checkpoint import Checkpoint, OptimizerState, TensorInfo
from ckptfix.formats.pickle_records import TensorRef
from ckptfix.untrusted import check_plain_tree, escape, fail, want_dict, want_int, want_number

_TENSOR = (TensorInfo, TensorRef)
# Param-group options torch's optimizers hold as numbers (a 0-d tensor where `capturable`/`lr` tensors are used).
# Only what ckptfix itself reads as a number is held to it; other options (Adafactor's `eps` is a pair)
# may be a number, a tensor or a short tuple of numbers.
_NUMBER_OPTIONS = ("lr", "initial_lr", "weight_decay", "momentum")
_NUMERIC_OPTIONS = ("eps", "dampening", "alpha", "lr_decay", "initial_accumulator_value", "rho", "max_lr",
                    "min_lr", "base_lr", "clip_threshold", "decay_rate", "beta1", "beta2_decay")
_FLAG_OPTIONS = ("amsgrad", "nesterov", "maximize", "foreach", "capturable", "differentiable", "fused",
                 "decoupled_weight_decay", "centered")
_SCHED_INTS = ("last_epoch", "_step_count", "T_max", "step_size", "total_steps", "warmup_steps", "T_0", "T_i",
               "T_cur")
_SCHED_LISTS = ("base_lrs", "_last_lr")
_SCALER_NUMBERS = ("scale", "growth_factor", "backoff_factor")
_SCALER_INTS = ("growth_interval", "_growth_tracker")


def check_checkpoint(ckpt: Checkpoint) -> Checkpoint:
    """Check the shared sections of a freshly read checkpoint (see the module doc). Returns it."""
    origin = ckpt.path
    if ckpt.optimizer is not None:
        check_optimizer(ckpt.optimizer, f"{origin}: {ckpt.sections.get('optimizer') or 'optimizer'}")
    if ckpt.scheduler is not None:
        check_scheduler(ckpt.scheduler, f"{origin}: {ckpt.sections.get('scheduler') or 'scheduler'}")
    if ckpt.scaler is not None:
        check_scaler(ckpt.scaler, f"{origin}: {ckpt.sections.get('scaler') or 'scaler'}")
    if ckpt.record is not None:  # typed by `Record.from_json`; what it keeps verbatim is printed by --json
        provenance = getattr(ckpt.record, "provenance", ckpt.record)
        check_plain_tree(provenance, origin, "ckptfix record")
    return ckpt


def _number_or_tensor(value: Any, origin: str, field: str) -> None:
    if isinstance(value, _TENSOR):
        if len(value.shape) > 1 or (value.shape and value.shape[0] != 1):
            raise fail(origin, field, "a number or a one-element tensor", f"a tensor of shape {list(value.shape)}")
        return
    want_number(value, origin, field)


def check_optimizer(opt: OptimizerState, origin: str) -> None:
    for i, group in enumerate(opt.groups):
        where = f"param_groups[{i}]"
        for key, value in group.options.items():
            if not isinstance(key, str):
                raise fail(origin, f"{where} key", "string option names", key)
            if key in _NUMBER_OPTIONS and value is not None:
                _number_or_tensor(value, origin, f"{where}.{key}")
            elif key in _NUMERIC_OPTIONS and value is not None:
                items = value if isinstance(value, (list, tuple)) and len(value) <= 8 else [value]
                for j, item in enumerate(items):  # torch's Adafactor: eps=(None, 1e-3)
                    if item is not None:
                        _number_or_tensor(item, origin, f"{where}.{key}" + (f"[{j}]" if items is value else ""))
            elif key == "betas":  # two for Adam, three for AdEMAMix and CAME: data, whatever the count
                if not isinstance(value, (list, tuple)) or not 1 <= len(value) <= 8:
                    raise fail(origin, f"{where}.betas", "a short list of numbers", value)
                for j, beta in enumerate(value):
                    if beta is not None:  # bitsandbytes' Lion/SGD pad with 0, others with None
                        _number_or_tensor(beta, origin, f"{where}.betas[{j}]")
            elif key in _FLAG_OPTIONS and value is not None and not isinstance(value, bool):
                raise fail(origin, f"{where}.{key}", "True, False or None", value)
    for index, ps in opt.state.items():
        inner = index[1] if opt.parts and isinstance(index, tuple) and len(index) == 2 else index  # (part, index)
        if isinstance(inner, bool) or not isinstance(inner, (int, str)):
            raise fail(origin, "state key", "a parameter index (int) or name (str)", index)
        for key in ps.tensors:
            if not isinstance(key, str):
                raise fail(origin, f"state[{escape(index, 80)}] key", "string state names", key)


def check_scheduler(sched: Any, origin: str) -> None:
    want_dict(sched, origin, "scheduler state")
    for key, value in sched.items():
        if not isinstance(key, str):
            raise fail(origin, "scheduler key", "string attribute names", key)
        if key in _SCHED_INTS and value is not None:
            want_int(value, origin, key, lo=-(1 << 63))
        elif key in _SCHED_LISTS and value is not None:
            if not isinstance(value, (list, tuple)):
                raise fail(origin, key, "a list of learning rates", value)
            for j, lr in enumerate(value):
                _number_or_tensor(lr, origin, f"{key}[{j}]")


def check_scaler(scaler: Any, origin: str) -> None:
    want_dict(scaler, origin, "scaler state")
    for key, value in scaler.items():
        if not isinstance(key, str):
            raise fail(origin, "scaler key", "string attribute names", key)
        if key in _SCALER_NUMBERS and value is not None:
            _number_or_tensor(value, origin, key)
        elif key in _SCALER_INTS and value is not None and not isinstance(value, _TENSOR):
            want_int(value, origin, key, lo=-(1 << 63))
