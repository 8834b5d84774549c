"""What an optimizer's state means: its kind, told by structure, and one rule per state.

The kind is read from the state's keys and the param groups' options (never from a class name: a
state_dict has none), and named as users name the optimizer. A structure that is not exactly one of
`KINDS` is `unknown (states: ...)`, never the nearest known one.

Each state of a vocab-sized parameter has a `Rule`: what its rows mean and what the rows a repair
adds become. Everything repair and the guard do to optimizer state follows these rules:

  first moment      a running mean of the gradient (Adam's exp_avg, SGD's momentum_buffer): new rows 0,
                    as a fresh optimizer starts them.
  second moment     a running mean of squared gradients (exp_avg_sq, Adagrad's sum, Adafactor's row
                    factor): new rows get the old rows' column mean. Why not 0: under an inherited step
                    the bias correction no longer scales it up, so the first update of a new row is
                    |g|/sqrt(1-beta2)*sqrt(1-beta2^t) ... about 1.35 x lr at step 200 and 3.16 x lr from a
                    few thousand steps on, ~3.7x the size of old rows' updates (measured in
                    tests/test_repair_e2e.py); with the mean it is ~0.4-0.8x of theirs.
  parameter copy    an average or anchor of the weights (schedule-free `z`, Prodigy's `p0`, ASGD's
                    `ax`): new rows are the new weights, as the optimizer sets them at its first step.
  step size         Rprop's per-element `step_size`: new rows start at the group's `lr`, as Rprop
                    starts every element (0 would clamp to step_sizes[0]: ~10^4x slower).
  column factor     a factored second moment's per-column mean over all rows (Adafactor, CAME): kept;
                    it averages over every row, so new rows filled at the mean move it by nothing,
                    and it is re-estimated at every step.
  8-bit blockwise    bitsandbytes' codes: dequantized, moved, requantized in its own layout (new rows by the
                    moment's rule; `surgery/blockwise.py`); block scales follow their codes; code books kept.
  refused           state whose rows cannot be moved by row: a matrix preconditioner over the vocab
                    axis (SOAP, Shampoo), flat histories over all parameters (LBFGS), a state whose
                    meaning is not recorded (bitsandbytes' one-state optimizers), an unexpected shape.
                    repair stops and names them with `--policy fresh` / `--policy reset`.

Scalars (`step`, ASGD's `eta`/`mu`, NAdam's `mu_product`, Adafactor's `RMS`) are counters: kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

#: The nested dict bitsandbytes keeps its state in (bitsandbytes/optim/optimizer.py).
BNB_STATE = "__bnb_optimizer_quant_state__"


@dataclass(frozen=True)
class Rule:
    meaning: str
    new_rows: str  # zeros | column-mean | weights | group-lr | keep | with-codes | refuse
    why: str = ""  # for keep / refuse: the reason shown
    blockwise: tuple[str, str] | None = None  # 8-bit codes: the keys of their block scales and code book


FIRST = Rule("first moment", "zeros")
SECOND = Rule("second moment", "column-mean")
COPY = Rule("parameter copy", "weights")
STEP_SIZE = Rule("step size", "group-lr")
ROW_FACTOR = Rule("factored second moment, row factor", "column-mean")
COUNTER = Rule("counter or per-parameter scalar", "keep", why="not per row")
KAHAN = Rule("Kahan compensation of the weights' rounding", "zeros")  # new rows have no rounding error yet
CODE_BOOK = Rule("quantization code book", "keep", why="the same 256 values for every row")
COLUMN_FACTOR = Rule("factored second moment, column factor", "keep",
                    "a mean over all rows, unchanged by new rows at the row factor's mean; re-estimated every step")
PRECONDITIONER = Rule("matrix preconditioner over the vocab axis", "refuse",
                      why="a (rows x rows) preconditioner and its eigenbasis (the moments live in that basis) "
                          "cannot be moved row by row")
BLOCK_SCALES = Rule("block scales of an 8-bit state", "with-codes")  # resized with their codes
FLAT = Rule("flat history over all parameters", "refuse",
            why="one vector over every parameter concatenated, not rows of one parameter")


@dataclass(frozen=True)
class Kind:
    name: str
    states: Mapping[str, Rule]  # every per-parameter state key this optimizer keeps
    required: frozenset[str]  # keys that identify it (all present in some entry)
    options: frozenset[str] = frozenset()  # group options that identify it (all present)
    absent: frozenset[str] = frozenset()  # group options it never has


def _kind(name: str, states: Mapping[str, Rule], required: Iterable[str], options: Iterable[str] = (),
          absent: Iterable[str] = ()) -> Kind:
    return Kind(name, dict(states), frozenset(required), frozenset(options), frozenset(absent))


_ADAM = {"exp_avg": FIRST, "exp_avg_sq": SECOND, "max_exp_avg_sq": SECOND}
_SF = ("weight_sum", "train_mode")  # schedule-free's group options (schedulefree package)
_BNB_ADAM = {f"{BNB_STATE}/state1": FIRST, f"{BNB_STATE}/state2": SECOND}

def _bnb(key: str) -> str:
    return f"{BNB_STATE}/{key}"


# bitsandbytes' 8-bit state: codes dequantized, moved by row, requantized in its layout (surgery/blockwise.py);
# parameters under 4096 elements keep the same keys in 32 bits (then plain rows).
_BNB_8BIT = {_bnb("state1"): Rule("first moment, 8-bit blockwise", "zeros", blockwise=(_bnb("absmax1"), _bnb("qmap1"))),
             _bnb("state2"): Rule("second moment, 8-bit blockwise", "column-mean",
                                  blockwise=(_bnb("absmax2"), _bnb("qmap2"))),
             _bnb("absmax1"): BLOCK_SCALES, _bnb("absmax2"): BLOCK_SCALES,
             _bnb("qmap1"): CODE_BOOK, _bnb("qmap2"): CODE_BOOK}
_ONE_STATE = Rule("first or second moment (bitsandbytes does not record which)", "refuse",
                  why="Lion and SGD keep a first moment in state1, RMSprop and Adagrad a second moment; the file "
                      "does not say which optimizer saved it")
_LBFGS_STATE = ("d", "old_dirs", "old_stps", "prev_flat_grad", "ro", "H_diag", "al")

# Most specific first: the first kind whose required keys and options are present and whose states
# hold every key seen is the answer. Group options tell apart optimizers with the same state keys.
KINDS: tuple[Kind, ...] = (
    _kind("bitsandbytes AdamW8bit", _BNB_8BIT, [_bnb("absmax1"), _bnb("absmax2")], ["t_alpha", "t_beta3"]),
    _kind("bitsandbytes 8-bit, one state (Lion8bit, SGD8bit, RMSprop8bit or Adagrad8bit)",
          {_bnb("state1"): _ONE_STATE, _bnb("absmax1"): BLOCK_SCALES, _bnb("qmap1"): CODE_BOOK}, [_bnb("absmax1")]),
    _kind("bitsandbytes AdamW", _BNB_ADAM, _BNB_ADAM, ["t_alpha", "t_beta3"]),
    _kind("bitsandbytes 32-bit, one state (Lion, SGD, RMSprop or Adagrad)", {_bnb("state1"): _ONE_STATE},
          [_bnb("state1")]),
    _kind("LBFGS", {k: FLAT for k in _LBFGS_STATE}, ["old_dirs"]),
    _kind("SOAP", {**_ADAM, "GG": PRECONDITIONER, "Q": PRECONDITIONER}, ["GG", "Q"]),
    _kind("Shampoo", {"momentum_buffer": FIRST, "pre_cond_0": PRECONDITIONER, "inv_pre_cond_0": PRECONDITIONER,
                      "pre_cond_1": PRECONDITIONER, "inv_pre_cond_1": PRECONDITIONER}, ["pre_cond_0"]),
    _kind("CAME", {"exp_avg": FIRST, "exp_avg_sq": SECOND, "exp_avg_sq_row": ROW_FACTOR,
                   "exp_avg_sq_col": COLUMN_FACTOR, "exp_avg_res_row": ROW_FACTOR, "exp_avg_res_col": COLUMN_FACTOR},
          ["exp_avg_res_row"]),
    _kind("Adafactor (transformers)", {"exp_avg": FIRST, "exp_avg_sq": SECOND, "exp_avg_sq_row": ROW_FACTOR,
                                       "exp_avg_sq_col": COLUMN_FACTOR}, [], ["scale_parameter", "relative_step"]),
    _kind("Adafactor (torch.optim)", {"row_var": ROW_FACTOR, "col_var": COLUMN_FACTOR, "variance": SECOND},
          [], ["beta2_decay"]),
    _kind("StableAdamW (optimi)", {"exp_avg": FIRST, "exp_avg_sq": SECOND, "eps_sq": COUNTER,
                                   "kahan_comp": KAHAN}, ["eps_sq"], ["kahan_sum"]),
    _kind("Prodigy", {**_ADAM, "p0": COPY, "s": FIRST}, ["p0"], ["d0"]),
    _kind("AdEMAMix", {**_ADAM, "exp_avg_slow": FIRST}, ["exp_avg_slow"]),
    _kind("AdamWScheduleFree", {"z": COPY, "exp_avg_sq": SECOND}, ["z", "exp_avg_sq"], _SF, ["silent_sgd_phase"]),
    _kind("RAdamScheduleFree", {"z": COPY, "exp_avg_sq": SECOND}, ["z", "exp_avg_sq"], [*_SF, "silent_sgd_phase"]),
    _kind("SGDScheduleFree", {"z": COPY}, ["z"], [*_SF, "momentum"]),
    _kind("ASGD", {"ax": COPY}, ["ax"], ["t0", "lambd"]),
    _kind("Rprop", {"prev": FIRST, "step_size": STEP_SIZE}, ["step_size"], ["etas", "step_sizes"]),
    _kind("Adadelta", {"square_avg": SECOND, "acc_delta": SECOND}, ["acc_delta"], ["rho"]),
    _kind("RMSprop", {"square_avg": SECOND, "momentum_buffer": FIRST, "grad_avg": FIRST}, [],
          ["alpha", "centered"]),
    _kind("Adagrad", {"sum": SECOND}, [], ["lr_decay", "initial_accumulator_value"]),
    _kind("Adamax", {"exp_avg": FIRST, "exp_inf": SECOND}, ["exp_inf"]),
    _kind("NAdam", _ADAM, [], ["momentum_decay"]),
    _kind("Muon", {"momentum_buffer": FIRST}, [], ["ns_steps", "ns_coefficients"]),
    _kind("SGD", {"momentum_buffer": FIRST}, [], ["dampening", "nesterov"]),
    _kind("AdamW", _ADAM, [], ["amsgrad"]),  # AdamW vs Adam: `_name` below reads the options
    _kind("RAdam", _ADAM, [], ["decoupled_weight_decay", "betas"], ["amsgrad", "momentum_decay"]),
    _kind("SparseAdam", _ADAM, [], ["betas"], ["weight_decay"]),
    _kind("Lion", {"exp_avg": FIRST}, ["exp_avg"], ["betas"], ["eps"]),
)

_SCALARS = {"step", "eta", "mu", "mu_product", "RMS"}  # counters and per-parameter scalars: kept


def state_path(key: str) -> list[Any]:
    """A flattened state key (`formats.common._nested_tensors`) as dict keys and list indices:
    "GG[1]" -> ["GG", 1]; "__bnb_optimizer_quant_state__/state1" -> [that, "state1"]."""
    out: list[Any] = []
    for part in key.split("/"):
        name, *indices = part.split("[")
        out += [name, *(int(i.rstrip("]")) for i in indices)]
    return out


def state_keys(state: Mapping[Any, Any]) -> set[str]:
    """Every per-parameter state key with a tensor (or list of tensors) in any entry."""
    keys: set[str] = set()
    for ps in state.values():
        keys.update(k.split("[")[0] for k in ps.tensors if isinstance(k, str))  # others: refused by validate
    return keys


def infer_kind(state: Mapping[Any, Any], groups: list[Any]) -> Kind | None:
    """The one kind whose structure this is; None when none fits exactly."""
    keys = state_keys(state) - _SCALARS
    options: set[str] = set()
    for g in groups:
        options.update(k for k in g.options if isinstance(k, str))
    for kind in KINDS:
        if kind.required <= keys and keys <= kind.states.keys() and kind.options <= options \
                and not kind.absent & options:
            return kind
    return None


def kind_name(state: Mapping[Any, Any], groups: list[Any]) -> str:
    """The optimizer as users name it, or `unknown (states: ...)`."""
    kind = infer_kind(state, groups)
    if kind is None:
        keys = sorted(state_keys(state))
        return f"unknown (states: {', '.join(keys)})" if keys else "unknown (no state)"
    return _name(kind, groups)


def _name(kind: Kind, groups: list[Any]) -> str:
    options = groups[0].options if groups else {}
    betas = options.get("betas")
    if kind.name.startswith("bitsandbytes AdamW") and isinstance(betas, (list, tuple)) and len(betas) == 3:
        return kind.name.replace("AdamW", "AdEMAMix")  # AdEMAMix: a third beta for its slow EMA
    if kind.name == "AdamW":  # torch >= 2.7 records it; older files: L2 decay on Adam is rare
        decoupled, decay = options.get("decoupled_weight_decay"), options.get("weight_decay")
        if not isinstance(decoupled, bool):
            decoupled = not isinstance(decay, (int, float)) or decay != 0
        return "AdamW" if decoupled else "Adam"
    if kind.name == "SGD":
        momentum = options.get("momentum")
        return "SGD" if isinstance(momentum, (int, float)) and momentum == 0 else "SGD (momentum)"
    return kind.name


def rule_for(kind_or_name: Kind | str | None, key: str) -> Rule | None:
    """The rule of state `key` (a list element's `GG[0]` is `GG`'s) under this kind; None if unknown."""
    kind = kind_or_name if isinstance(kind_or_name, Kind) or kind_or_name is None else by_name(kind_or_name)
    if kind is None:
        return None
    return kind.states.get(key.split("[")[0])


def by_name(name: str) -> Kind | None:
    base = {"Adam": "AdamW", "SGD (momentum)": "SGD"}.get(name, name)
    if base.startswith("bitsandbytes AdEMAMix"):
        base = base.replace("AdEMAMix", "AdamW")
    return next((k for k in KINDS if k.name == base), None)


@dataclass(frozen=True)
class Action:
    """What resizing a parameter's rows does to one of its states."""

    what: str  # counter | keep | with-codes | blockwise | rows | refuse
    rule: Rule | None
    why: str = ""  # for refuse / keep


def action_for(kind: str, key: str, shape: tuple[int, ...], dtype: str, param_shape: tuple[int, ...],
               head_bias: bool = False) -> Action:
    """The one decision, for inspect, repair and the guard: state `key` (of that shape and dtype) of a
    parameter shaped `param_shape` whose rows change. `head_bias`: a (1, rows) bias (rows on the last axis)."""
    numel = 1
    for d in shape:
        numel *= d
    if numel <= 1 and (not param_shape or param_shape[0] > 1):
        return Action("counter", None)
    rule = rule_for(kind, key)
    if rule is None:
        return Action("refuse", None, UNKNOWN if by_name(kind) is None else f"not a state of {kind}")
    if rule.blockwise is not None and dtype == "uint8":  # codes shaped like the parameter (AdEMAMix stacks two)
        if tuple(shape) != tuple(param_shape):
            return Action("refuse", rule, f"8-bit codes of shape {list(shape)} for a {list(param_shape)} parameter")
        return Action("blockwise", rule)
    if rule.new_rows in ("with-codes", "keep"):
        return Action(rule.new_rows, rule, rule.why)
    if rule.new_rows == "refuse":
        return Action("refuse", rule, rule.why)
    rows = shape[-1] if head_bias and len(shape) == 2 else (shape[0] if shape else 0)
    like_param = len(shape) == len(param_shape) and (shape[:-1] == param_shape[:-1] if head_bias
                                                     else shape[1:] == param_shape[1:])
    row_factor = len(param_shape) == 2 and shape in ((rows,), (rows, 1)) and rows == param_shape[0]
    if not (like_param or row_factor):
        return Action("refuse", rule, f"shape {list(shape)} for a {list(param_shape)} parameter")
    return Action("rows", rule)


UNKNOWN = "not an optimizer ckptfix knows: what its states mean is not known"

#: What cannot follow the rows: (state key, the tensor it belongs to or "" for the whole optimizer, why).
Refusal = tuple[str, str, str]


def unremappable(kinds: Iterable[str], keys: Iterable[str]) -> list[Refusal]:
    """What makes a whole optimizer impossible to remap, whichever parameter: an unknown kind, flat state."""
    keys = sorted(set(keys))
    out = []
    for kind in kinds:
        if by_name(kind) is None:
            out += [(k, "", UNKNOWN) for k in keys]
        out += [(k, "", FLAT.why) for k in keys if rule_for(kind, k) is FLAT]
    return out


def describe(refused: Iterable[Refusal]) -> str:
    """"GG[0], Q[0] of text_embedding.weight, text_head.weight (why); ..." : grouped by reason."""
    by_why: dict[str, tuple[list[str], list[str]]] = {}
    for key, owner, why in refused:
        keys, owners = by_why.setdefault(why, ([], []))
        keys.extend([key] if key not in keys else [])
        owners.extend([owner] if owner and owner not in owners else [])
    return "; ".join(f"{', '.join(keys)}{' of ' + ', '.join(owners) if owners else ''} ({why})"
                     for why, (keys, owners) in by_why.items())


def refusals(opt: Any, vocab: Iterable[Any]) -> list[Refusal]:
    """What repair's default policy would refuse to remap in optimizer state `opt` when the vocab tensors
    `vocab` (`ckptfix.vocab.VocabTensor`) are resized; [] when all is understood."""
    from ckptfix.vocab import rows_on_last_axis  # here: this module stays a leaf of the import graph

    if opt is None or not opt.state:
        return []
    out = []
    for v in vocab:
        entry = opt.state.get(v.optimizer_index) if v.optimizer_index is not None and v.tied_to is None else None
        for key, t in (entry.tensors.items() if entry is not None else ()):
            action = action_for(opt.kind_of(v.optimizer_index), key, t.shape, t.dtype, v.shape,
                                rows_on_last_axis(v.role, t.shape))
            if action.what == "refuse":
                out.append((key, v.name, action.why))
    return out + unremappable({opt.kind_of(i) for i in opt.state}, state_keys(opt.state))
