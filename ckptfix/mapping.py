"""Which model parameter each optimizer state entry belongs to: the one answer for inspect, repair
and the guard.

`torch.optim` saves state by integer index (the order of `optimizer.param_groups`), not by name.
Names are recovered, best evidence first:

1. `torch`: the `param_names` torch stores in each param group when the optimizer was built from
   `model.named_parameters()` (torch >= 2.6);
2. `recorded`: names a ckptfix record carries (`ckptfix repair`, `ResumeGuard.record()`); FQN keys
   (`fqn`: DCP saves state under the parameter's name);
3. shapes and order: the model's own order when counts and shapes agree (`position`); the Hugging
   Face Trainer's two groups, weight decay / no decay (`hf-groups`); frozen parameters left out
   (`aligned`); and last, shape alone where a shape is unique (`shape`). Position is never used for
   safetensors weights: they are stored sorted by name, not in registration order.

`ParamMapping.by_name` says whether the names are true names (1-2) or inferred (3);
`names_for_resume` is the guard's question: can these names be trusted to move state between
positions of a live optimizer?
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.checkpoint import Checkpoint, OptimizerState, ParamState, TensorInfo

# State tensors shaped exactly like their parameter (Adafactor's row/col factors are not).
MOMENT_KEYS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "momentum_buffer", "sum", "square_avg",
               "acc_delta", "ax", "grad_avg", "prev", "exp_inf")

# Parameters above which the order-preserving split of two groups is not tried (it is quadratic).
_MAX_SPLIT = 3000

# The Hugging Face Trainer puts these in its no-weight-decay group (biases and norm weights).
_NO_DECAY = re.compile(r"(bias|norm|ln_|layernorm|layer_norm|rmsnorm)", re.IGNORECASE)

#: Wrapper prefixes (DDP, torch.compile) that differ between an optimizer's names and a state_dict's keys.
WRAPPER_PREFIXES = ("module.", "_orig_mod.")

#: Methods whose names come from the file itself, not from shapes and order.
TRUE_NAME_METHODS = ("torch", "recorded", "fqn")


@dataclass
class ParamMapping:
    names: dict[Any, str] = field(default_factory=dict)  # optimizer index -> model tensor name
    method: str = "none"  # torch | recorded | fqn | position | hf-groups | aligned | shape | none
    # For "recorded": how the record itself got its names (a `ckptfix repair` record says so).
    recorded_method: str | None = None

    def index_of(self, name: str) -> Any:
        return next((i for i, n in self.names.items() if n == name), None)

    @property
    def by_name(self) -> bool:
        """The names are true names: torch's, DCP's, or a record of true names (not a guess)."""
        if self.method == "recorded":
            return self.recorded_method in (None, *TRUE_NAME_METHODS)
        return self.method in TRUE_NAME_METHODS


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


def torch_param_names(ckpt: Checkpoint) -> list[str] | None:
    """The `param_names` torch saved in every param group, in index order (None unless complete)."""
    if ckpt.optimizer is None:
        return None
    out: list[str] = []
    for group in ckpt.optimizer.groups:
        names = group.options.get("param_names")
        if not isinstance(names, (list, tuple)) or len(names) != len(group.params):
            return None
        out.extend(str(n) for n in names)
    return out


def checkpoint_name(name: str, model: dict[str, Any]) -> str:
    """`name` as the checkpoint's model keys spell it (a DDP/torch.compile prefix added or removed)."""
    if name in model or not model:
        return name
    for pre in WRAPPER_PREFIXES:
        if name.startswith(pre) and name[len(pre):] in model:
            return name[len(pre):]
        if pre + name in model:
            return pre + name
    return name


def map_optimizer(ckpt: Checkpoint) -> ParamMapping:
    """Recover optimizer index -> parameter name, and say how it was done."""
    opt = ckpt.optimizer
    if opt is None:
        return ParamMapping()
    if opt.parts:
        return _map_parts(ckpt)
    indices = opt.indices()
    named = torch_param_names(ckpt)
    if named is not None:
        return ParamMapping({i: checkpoint_name(n, ckpt.model) for i, n in zip(indices, named)}, "torch")
    if opt.param_names and len(opt.param_names) == len(indices):
        origin = ckpt.record.param_names_method if ckpt.record is not None else None
        return ParamMapping(dict(zip(indices, opt.param_names)), "recorded", recorded_method=origin)
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


def _map_parts(ckpt: Checkpoint) -> ParamMapping:
    """Several optimizers (Muon for the matrices, AdamW for the rest): each is mapped alone, by the same
    rules, as an optimizer over a subset of the parameters; the union is the answer when no parameter is
    claimed twice. The method is the parts' one, or theirs joined by "+" when they differ."""
    assert ckpt.optimizer is not None
    opt, start, names, methods = ckpt.optimizer, 0, {}, []
    for part in opt.parts:
        groups = opt.groups[start:start + part.groups]
        start += part.groups
        view = OptimizerState(part.kind, groups, {i: ps for i, ps in opt.state.items() if i in part.indices})
        found = map_optimizer(dataclasses.replace(ckpt, optimizer=view))
        names.update(found.names)
        methods.append(found.method)
    if len(set(names.values())) < len(names):
        names = {}
    return ParamMapping(names, methods[0] if len(set(methods)) == 1 else "+".join(methods))


def _hf_groups(ckpt: Checkpoint, params: list[str]) -> dict[Any, str] | None:
    """Two param groups, weight decay and none: the HF Trainer splits by name (biases, norms) with the decay
    group first; timm's `param_groups_weight_decay` (and nanoGPT) by shape (1-D or `.bias`), timm with the
    no-decay group first. The group whose `weight_decay` is 0 is the no-decay one where the options say so.
    Where neither rule splits them, the one order-preserving split that fits the shapes (`_split_in_order`)."""
    assert ckpt.optimizer is not None
    groups = ckpt.optimizer.groups
    if len(groups) != 2:
        return None
    wd = [g.options.get("weight_decay") for g in groups]
    orders = [(0, 1), (1, 0)] if wd[0] == wd[1] or not all(isinstance(w, (int, float)) for w in wd) else \
        [(0, 1)] if wd[1] == 0 else [(1, 0)] if wd[0] == 0 else [(0, 1), (1, 0)]
    rules = (lambda n: bool(_NO_DECAY.search(n)),
             lambda n: len(ckpt.model[n].shape) <= 1 or n.endswith(".bias"))
    for no_decay_rule in rules:
        decay = [n for n in params if not no_decay_rule(n)]
        no_decay = [n for n in params if no_decay_rule(n)]
        for d, nd in orders:  # d: the index of the decay group
            if (len(groups[d].params), len(groups[nd].params)) != (len(decay), len(no_decay)):
                continue
            pairs = list(zip(groups[d].params, decay)) + list(zip(groups[nd].params, no_decay))
            if _consistent(ckpt, pairs):
                return dict(pairs)
    for tolerant in (False, True):
        split = _split_in_order(ckpt, groups[0].params, groups[1].params, params, tolerant)
        if split is not None:
            return split if _consistent(ckpt, list(split.items())) else None
    return None


def _split_in_order(ckpt: Checkpoint, a: list[Any], b: list[Any], params: list[str],
                    tolerant: bool) -> dict[Any, str] | None:
    """Two groups each built in the model's parameter order, split by a rule not known here (timm adds the
    model's own `no_weight_decay()` names, e.g. a ViT's `pos_embed` and `cls_token`, to its no-decay group):
    the one interleaving of the two groups whose moment shapes fit the model's parameters in order. None when
    no interleaving or more than one fits (then which moment is whose is not certain)."""
    if len(a) + len(b) != len(params) or len(params) > _MAX_SPLIT:
        return None
    assert ckpt.optimizer is not None
    state = ckpt.optimizer.state
    sa = [moment_shape(state.get(i)) for i in a]
    sb = [moment_shape(state.get(i)) for i in b]
    n, m = len(a), len(b)
    # ways[i][j]: how many interleavings (counted up to 2) of a[i:] and b[j:] fit params[i + j:]
    ways = [[0] * (m + 1) for _ in range(n + 1)]
    ways[n][m] = 1
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i < n or j < m:
                param = ckpt.model[params[i + j]]
                take_a = ways[i + 1][j] if i < n and _fits(sa[i], param, tolerant) else 0
                take_b = ways[i][j + 1] if j < m and _fits(sb[j], param, tolerant) else 0
                ways[i][j] = min(2, take_a + take_b)
    if ways[0][0] != 1:
        return None
    out, i, j = {}, 0, 0
    while i + j < len(params):  # the unique path: only one of the two steps leads to a fit
        if i < n and ways[i + 1][j] and _fits(sa[i], ckpt.model[params[i + j]], tolerant):
            out[a[i]] = params[i + j]
            i += 1
        else:
            out[b[j]] = params[i + j]
            j += 1
    return out


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


def names_for_resume(ckpt: Checkpoint, mapping: ParamMapping, live_in_model_order: bool) -> tuple[list[str] | None, str]:
    """Checkpoint optimizer index -> parameter name, in index order, when the guard may trust it to
    move state between positions of a live optimizer; and where the names come from.

    torch / recorded: true names (`ParamMapping.by_name`). inferred: position in the checkpoint's
    own tensor order, used only when that order is the saving model's registration order (a pickled
    state_dict; safetensors sort their keys) and the live optimizer holds the model's parameters in
    the model's order (`live_in_model_order`: then the saving run's optimizer, built by the same
    code, followed the saving model's order too). Otherwise (None, "none").
    """
    assert ckpt.optimizer is not None
    cidx = ckpt.optimizer.indices()
    if not all(i in mapping.names for i in cidx):
        return None, "none"
    names = [mapping.names[i] for i in cidx]
    if mapping.by_name:
        return names, "torch" if mapping.method == "torch" else "recorded"
    method = mapping.recorded_method if mapping.method == "recorded" else mapping.method
    pickled_order = not any(str(f).endswith(".safetensors") for f in (ckpt.path, ckpt.files.get("model", "")))
    if method in ("position", "aligned") and pickled_order and live_in_model_order:
        return names, "inferred"
    return None, "none"


# What a PEFT model trains, by name (`mark_only_lora_as_trainable`, `modules_to_save`, trainable tokens): the LoRA
# matrices, the trained copy of a module to save (`modules_to_save.<adapter>`), the trainable token rows. Its
# frozen copies (`original_module`, `base_layer`, the `token_adapter.base_layer` table) are never trained.
PEFT_TRAINED = re.compile(r"(^|\.)(lora_[A-Za-z_]+|modules_to_save|trainable_tokens_delta)(\.|$)")
PEFT_FROZEN_COPY = re.compile(r"(^|\.)(original_module|base_layer)(\.|$)")


def trainable_names(ckpt: Checkpoint) -> tuple[set[str], str] | None:
    """The parameters the optimizer trains, as a set, where the entries are not all named one by one (an HF
    Trainer folder: the entries follow the model class's order, the weights file is sorted by name) but the
    set is still certain: the optimizer's entries, counted with their moment shapes, are exactly every
    parameter's (every parameter is trained), or exactly the parameters PEFT trains by name (never its frozen
    `original_module` / `base_layer` copies). (names, how), or None when neither fits or an entry has no state."""
    from collections import Counter

    opt = ckpt.optimizer
    if opt is None:
        return None
    shapes = Counter(moment_shape(opt.state.get(i)) for i in opt.indices())
    if not shapes or None in shapes:
        return None
    params = ckpt.parameters()
    peft = [n for n in params if PEFT_TRAINED.search(n)]
    for how, names in (("entry shapes = every parameter's", params), ("entry shapes = PEFT's trained tensors'", peft)):
        if names and sum(shapes.values()) == len(names) and shapes == Counter(ckpt.model[n].shape for n in names):
            return set(names), how
    return None
