"""Which model parameter each optimizer state entry belongs to.

`torch.optim` saves state by integer index (the order of `optimizer.param_groups`), not by name.
Names are recovered, best evidence first: names recorded by `ckptfix repair`; FQN keys (DCP);
the model's own order when counts and shapes agree; the Hugging Face Trainer's two groups
(weight decay / no decay); and last, shape alone where a shape is unique. Position is never used
for safetensors weights: they are stored sorted by name, not in registration order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.checkpoint import Checkpoint, ParamState, TensorInfo

# State tensors shaped exactly like their parameter (Adafactor's row/col factors are not).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
               "acc_delta", "ax", "grad_avg", "prev", "exp_inf")

# The Hugging Face Trainer puts these in its no-weight-decay group (biases and norm weights).
_NO_DECAY = re.compile(r"(bias|norm|ln_|layernorm|layer_norm|rmsnorm)", re.IGNORECASE)


@dataclass
class ParamMapping:
    names: dict[Any, str] = field(default_factory=dict)  # optimizer index -> model tensor name
    method: str = "none"  # recorded | fqn | position | hf-groups | aligned | shape | none

    def index_of(self, name: str) -> Any:
        return next((i for i, n in self.names.items() if n == name), None)


def moment_shape(ps: ParamState | None) -> tuple[int, ...] | None:
    if ps is None:
        return None
    t = next((ps.tensors[k] for k in MOMENT_KEYS if k in ps.tensors), None)
    return t.shape if t is not None else None


def _fits(shape: tuple[int, ...] | None, param: TensorInfo, tolerant: bool) -> bool:
    """A moment fits its parameter: same shape, or (tolerant) the same but for the row count."""
    if shape is None:
        return True  # no state yet for this parameter: nothing contradicts the mapping
    if shape == param.shape:
        return True
    return tolerant and len(shape) == len(param.shape) >= 1 and shape[1:] == param.shape[1:]


def _consistent(ckpt: Checkpoint, pairs: list[tuple[Any, str]]) -> bool:
    assert ckpt.optimizer is not None
    state = ckpt.optimizer.state
    # Row-count differences are allowed (they are the findings we look for) but not everywhere.
    exact = sum(moment_shape(state.get(i)) in (None, ckpt.model[n].shape) for i, n in pairs)
    tolerant = all(_fits(moment_shape(state.get(i)), ckpt.model[n], True) for i, n in pairs)
    return tolerant and exact >= len(pairs) - 2


def map_optimizer(ckpt: Checkpoint) -> ParamMapping:
    """Recover optimizer index -> parameter name, and say how it was done."""
    opt = ckpt.optimizer
    if opt is None:
        return ParamMapping()
    indices = opt.indices()
    if opt.param_names and len(opt.param_names) == len(indices):
        return ParamMapping(dict(zip(indices, opt.param_names)), "recorded")
    if indices and all(isinstance(i, str) for i in indices):
        return ParamMapping({i: i for i in indices if i in ckpt.model}, "fqn")
    params = ckpt.parameters()
    if not ckpt.ordered:  # tensors sorted by name: position says nothing about optimizer indices
        return ParamMapping(_by_unique_shape(ckpt, indices, params), "shape")
    if len(params) == len(indices) and _consistent(ckpt, list(zip(indices, params))):
        return ParamMapping(dict(zip(indices, params)), "position")
    grouped = _hf_groups(ckpt, params)
    if grouped is not None:
        return ParamMapping(grouped, "hf-groups")
    aligned = _align(ckpt, indices, params)
    if aligned is not None:
        return ParamMapping(aligned, "aligned")
    return ParamMapping(_by_unique_shape(ckpt, indices, params), "shape")


def _hf_groups(ckpt: Checkpoint, params: list[str]) -> dict[Any, str] | None:
    assert ckpt.optimizer is not None
    groups = ckpt.optimizer.groups
    if len(groups) != 2:
        return None
    decay = [n for n in params if not _NO_DECAY.search(n)]
    no_decay = [n for n in params if _NO_DECAY.search(n)]
    if (len(groups[0].params), len(groups[1].params)) != (len(decay), len(no_decay)):
        return None
    pairs = list(zip(groups[0].params, decay)) + list(zip(groups[1].params, no_decay))
    return dict(pairs) if _consistent(ckpt, pairs) else None


def _align(ckpt: Checkpoint, indices: list[Any], params: list[str]) -> dict[Any, str] | None:
    """Frozen parameters are left out of the optimizer: match indices to params in order by shape."""
    if len(indices) >= len(params):
        return None
    assert ckpt.optimizer is not None
    out, j = {}, 0
    for i in indices:
        shape = moment_shape(ckpt.optimizer.state.get(i))
        while j < len(params) and shape is not None and shape != ckpt.model[params[j]].shape:
            j += 1
        if j >= len(params):
            return None
        out[i] = params[j]
        j += 1
    return out


def _by_unique_shape(ckpt: Checkpoint, indices: list[Any], params: list[str]) -> dict[Any, str]:
    by_shape: dict[tuple, list[str]] = {}
    for n in params:
        by_shape.setdefault(ckpt.model[n].shape, []).append(n)
    assert ckpt.optimizer is not None
    out = {}
    for i in indices:
        shape = moment_shape(ckpt.optimizer.state.get(i))
        if shape is not None and len(by_shape.get(shape, [])) == 1:
            out[i] = by_shape[shape][0]
    return out
