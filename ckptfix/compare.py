"""`diff`: what changed between two checkpoints, and whether training is moving the weights at all.

Any two supported formats can be compared (a `.pth` against a DCP folder, say). Tensors are matched
by name; same-shaped pairs are compared one pair at a time, in bounded chunks read lazily from the
files (`TensorInfo.read()` maps them; nothing is loaded whole), so neither checkpoint is ever held in
memory. "Trainable" means the tensors the optimizer keeps state for, or, when neither checkpoint
has per-parameter optimizer state, every floating-point parameter. Where the optimizer's entries cannot
all be mapped to parameter names (an HF Trainer folder: sorted safetensors keys, state by index), which
tensors are trainable is not known: every float parameter is counted, and the report says so.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from ckptfix.checkpoint import Checkpoint, TensorInfo, collapse_repeats, overlaps_itself, widen_stored
from ckptfix.errors import CkptfixError, UnreadableCheckpoint
from ckptfix.formats import read_checkpoint
from ckptfix.mapping import PEFT_FROZEN_COPY, map_optimizer, trainable_names

SCHEMA = "ckptfix.diff/1"
CHUNK_ELEMENTS = 1 << 20  # values per side per chunk: a few float64 temporaries of 8 MiB each
STEP_KEYS = ("step", "global_step", "global_steps", "iteration", "iter")
Progress = Callable[[Iterable, int, str], Iterable]


@dataclass
class TensorDiff:
    """One tensor name across the two checkpoints."""

    name: str
    status: str  # added | removed | reshaped | changed | unchanged | unreadable
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    max_abs: float | None = None  # max |b - a|
    rel_change: float | None = None  # ||b - a|| / ||a||
    trainable: bool = False
    detail: str = ""  # why a tensor could not be compared

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "trainable": self.trainable,
                "shape_a": _list(self.shape_a), "shape_b": _list(self.shape_b),
                "dtype_a": self.dtype_a, "dtype_b": self.dtype_b,
                "max_abs": _number(self.max_abs), "rel_change": _number(self.rel_change), "detail": self.detail}


@dataclass
class Side:
    path: str
    format: str
    step: float | None

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "format": self.format, "step": self.step}


@dataclass
class DiffReport:
    """What `ckptfix diff` found. `to_json()` is the documented `--json` schema (ckptfix.diff/1)."""

    a: Side
    b: Side
    tensors: list[TensorDiff]
    atol: float = 0.0
    trainable_from: str = "optimizer state"  # or "float parameters", or "not known" (see `unmapped`)
    unmapped: str = ""  # why trainable is not known: the optimizer entries not mapped to names
    notes: list[str] = field(default_factory=list)
    tokens: Any = None  # token_learning.TokensReport: the new tokens' rows, when a tokenizer is given or rows grew

    def with_status(self, *statuses: str) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status in statuses]

    @property
    def trainable_compared(self) -> list[TensorDiff]:
        return [t for t in self.tensors if t.trainable and t.status in ("changed", "unchanged")]

    @property
    def trainable_changed(self) -> list[TensorDiff]:
        return [t for t in self.trainable_compared if t.status == "changed"]

    @property
    def moving(self) -> bool:
        return bool(self.trainable_changed)

    @property
    def same_step(self) -> bool:
        """Both checkpoints say they were saved at the same step: no training lies between them (the
        same checkpoint, a copy, or a repaired copy), so unchanged weights are not a finding."""
        return self.a.step is not None and self.a.step == self.b.step

    @property
    def exit_code(self) -> int:
        """0 when weights move (or both sides are the same step); 1 when training between two steps
        changed nothing trainable (a finding, like inspect's errors), or when a new token did not learn."""
        if self.tokens is not None and self.tokens.severity:
            return 1
        return 0 if self.moving or self.same_step else 1

    @property
    def known(self) -> bool:
        """Whether the tensors counted are the trainable ones (else every float parameter, `unmapped` says why)."""
        return self.trainable_from != "not known"

    @property
    def summary_line(self) -> str:
        between = f"between {_step(self.a.step)} and {_step(self.b.step)}"
        if not self.known:
            return (f"not known — the optimizer's entries are not mapped to names in this format ({self.unmapped}); "
                    f"every float tensor counted: {len(self.trainable_changed)} of {len(self.trainable_compared)} "
                    f"changed {between}")
        return f"{len(self.trainable_changed)} of {len(self.trainable_compared)} trainable tensors changed {between}"

    @property
    def verdict(self) -> str:
        changed, compared = len(self.trainable_changed), len(self.trainable_compared)
        kind = "trainable" if self.known else "float"
        if not compared:
            return f"no {kind} tensor present in both checkpoints: nothing to compare"
        if not changed and self.same_step:
            other = len(self.tensors) - len(self.with_status("unchanged"))
            return (f"same step ({_step(self.a.step)} in both): no training between them; every tensor compared "
                    "is identical" + (f", {other} differ in shape or presence (a repaired copy?)" if other else ""))
        if not changed:
            return f"no {kind} tensor changed: training is not updating weights"
        if changed < compared and not self.known:
            return (f"weights are moving, but {compared - changed} float tensor(s) did not change (frozen on purpose "
                    "or by mistake, lr 0 in their group, or no gradient reaching them: which tensors are trainable "
                    "is not known here)")
        if changed < compared:
            return (f"weights are moving, but {compared - changed} trainable tensor(s) did not change "
                    "(frozen by mistake, lr 0 in their group, or no gradient reaching them?)")
        return f"weights are moving: every {kind} tensor changed"

    def to_json(self) -> dict[str, Any]:
        counts = {s: len(self.with_status(s)) for s in ("changed", "unchanged", "added", "removed", "reshaped", "unreadable")}
        return {
            "schema": SCHEMA,
            "a": self.a.to_json(),
            "b": self.b.to_json(),
            "atol": self.atol,
            "summary": {**counts, "trainable": len(self.trainable_compared),
                        "trainable_changed": len(self.trainable_changed), "trainable_from": self.trainable_from,
                        "trainable_unmapped": self.unmapped},
            "summary_line": self.summary_line,
            "moving": self.moving,
            "verdict": self.verdict,
            "tensors": [t.to_json() for t in self.tensors],
            "tokens": self.tokens.to_json() if self.tokens is not None else None,
            "notes": self.notes,
        }


def diff(a: str | os.PathLike, b: str | os.PathLike, *, atol: float = 0.0, progress: Progress | None = None,
         trust_pickle: bool = False, tokenizer: str | os.PathLike | None = None) -> DiffReport:
    """Compare checkpoint `a` (earlier) with `b` (later), in any supported formats. With `tokenizer` (B's),
    say per new token whether its embedding and head rows learned (`DiffReport.tokens`)."""
    if atol < 0 or not math.isfinite(atol):
        raise CkptfixError(f"atol must be a finite number >= 0, got {atol}")
    tok = None
    if tokenizer is not None:
        from ckptfix.tokenizers import load_tokenizer

        tok = load_tokenizer(tokenizer)
    ca = read_checkpoint(a, trust_pickle=trust_pickle)
    cb = read_checkpoint(b, trust_pickle=trust_pickle)
    return diff_checkpoints(ca, cb, atol=atol, progress=progress, tokenizer=tok)


def diff_checkpoints(ca: Checkpoint, cb: Checkpoint, *, atol: float = 0.0,
                     progress: Progress | None = None, tokenizer: Any = None) -> DiffReport:
    """`diff` on two already-read checkpoints (`tokenizer`: a loaded `TokenizerInfo`)."""
    trainable, source, unmapped, trainable_notes = _trainable(ca, cb)
    report = DiffReport(Side(ca.path, ca.format, checkpoint_step(ca)), Side(cb.path, cb.format, checkpoint_step(cb)),
                        [], atol, source, unmapped=unmapped, notes=trainable_notes)
    pairs = []
    for name, ta in ca.model.items():
        tb = cb.model.get(name)
        entry = TensorDiff(name, "removed", ta.shape, None, ta.dtype, None, trainable=name in trainable)
        if tb is not None:
            entry.shape_b, entry.dtype_b = tb.shape, tb.dtype
            entry.status = "reshaped" if (ta.shape, ta.dtype) != (tb.shape, tb.dtype) else "pending"
            if entry.status == "pending":
                pairs.append((ta, tb, entry))
        report.tensors.append(entry)
    for name, tb in cb.model.items():
        if name not in ca.model:
            report.tensors.append(TensorDiff(name, "added", None, tb.shape, None, tb.dtype, trainable=name in trainable))
    items = progress([p[0] for p in pairs], sum(p[0].nbytes for p in pairs), "diff") if progress else [p[0] for p in pairs]
    by_tensor = {id(p[0]): p for p in pairs}
    for ta in items:
        _, tb, entry = by_tensor[id(ta)]
        compare(ta, tb, entry, atol)
    from ckptfix.token_learning import token_learning

    a_step, b_step = report.a.step, report.b.step
    steps = b_step - a_step if a_step is not None and b_step is not None else b_step
    report.tokens = token_learning(ca, cb, tokenizer, steps=steps,
                                   trainable=trainable if report.known and source == "optimizer state" else None)
    report.notes.extend(_notes(report, ca, cb))
    return report


def compare(ta: TensorInfo, tb: TensorInfo, entry: TensorDiff, atol: float) -> None:
    """Fill `entry` with max-abs and relative change of one same-shaped pair, chunk by chunk."""
    max_abs, diff_sq, base_sq = 0.0, 0.0, 0.0
    numeric = not ta.dtype.startswith("float8")  # float8 arrive as raw codes: equality only
    try:
        raw_a, raw_b, weight = _distinct(ta, tb)
        for xa, xb in zip(_chunks(ta, raw_a), _chunks(tb, raw_b)):
            with np.errstate(invalid="ignore", over="ignore"):
                same = (xa == xb) | (np.isnan(xa) & np.isnan(xb))
                delta = np.nan_to_num(np.where(same, 0.0, np.abs(xa - xb)), nan=np.inf)  # NaN on one side only
                max_abs = max(max_abs, float(delta.max(initial=0.0)))
                diff_sq += weight * float(np.sum(np.square(delta)))
                base_sq += weight * float(np.sum(np.square(np.abs(np.nan_to_num(xa, nan=0.0, posinf=0.0, neginf=0.0)))))
    except CkptfixError as exc:
        entry.status, entry.detail = "unreadable", str(exc)
        return
    entry.status = "changed" if max_abs > atol else "unchanged"
    if numeric:
        entry.max_abs = max_abs
        entry.rel_change = math.sqrt(diff_sq) / math.sqrt(base_sq) if base_sq > 0 else (0.0 if diff_sq == 0 else math.inf)


def _distinct(ta: TensorInfo, tb: TensorInfo) -> tuple[np.ndarray, np.ndarray, int]:
    """Both sides' stored values with the dimensions along which both repeat (stride 0, `expand()`)
    read once, and how many elements each compared pair stands for. A side that still addresses fewer
    bytes than elements (an overlapping view) is not compared element by element: refused."""
    a, b = ta.read_stored(), tb.read_stored()
    both = tuple(d for d, (sa, sb) in enumerate(zip(a.strides, b.strides)) if sa == 0 and sb == 0)
    keep = tuple(d for d in range(a.ndim) if d not in both)
    (a, weight), (b, _) = collapse_repeats(a, keep), collapse_repeats(b, keep)
    if overlaps_itself(a) and overlaps_itself(b):  # one real side bounds the work; two repeated ones do not
        raise UnreadableCheckpoint(f"{ta.name}: both sides are views that repeat or overlap their storage "
                                   f"(strides {list(ta.stride or ())}, {list(tb.stride or ())}); not compared "
                                   "element by element")
    return a, b, weight


def _chunks(t: TensorInfo, raw: np.ndarray) -> Iterator[np.ndarray]:
    """The values of `t` (`raw`: as stored) as float64 (complex stays complex), at most CHUNK_ELEMENTS at a time."""
    if raw.flags.c_contiguous:  # the common case: a flat view, no copy
        flat = raw.reshape(-1)
        for i in range(0, flat.size, CHUNK_ELEMENTS):
            yield _widen(t, flat[i:i + CHUNK_ELEMENTS])
        return
    row = max(1, int(np.prod(raw.shape[1:])))  # a strided view: slice whole rows, copy only the slice
    step = max(1, CHUNK_ELEMENTS // row)
    for i in range(0, raw.shape[0], step):
        yield _widen(t, raw[i:i + step]).reshape(-1)


def _widen(t: TensorInfo, chunk: np.ndarray) -> np.ndarray:
    chunk = widen_stored(chunk, t.dtype)
    return chunk.astype(np.complex128 if np.iscomplexobj(chunk) else np.float64)


def _trainable(ca: Checkpoint, cb: Checkpoint) -> tuple[set[str], str, str, list[str]]:
    """(names, where they come from, why they are not known, notes): the names with optimizer state in either
    checkpoint; every float parameter when neither has per-parameter state, or when some entry with state
    has no name and the set cannot be had otherwise (then which tensors are trainable is not known, and
    counting only the named ones would report a few tensors as all the trainable ones). Where the entries are
    not all named (an HF Trainer folder) or were named by order onto PEFT's frozen copies, the set still is
    certain when the entries' shapes are exactly every parameter's or PEFT's trained tensors'
    (`mapping.trainable_names`)."""
    names: set[str] = set()
    unmapped: list[tuple[str, str]] = []
    notes: list[str] = []
    for side, ckpt in (("A", ca), ("B", cb)):
        if ckpt.optimizer is None:
            continue
        mapping = map_optimizer(ckpt)
        stateful = [i for i, ps in ckpt.optimizer.state.items() if ps.tensors or ps.step is not None]
        missing = sum(i not in mapping.names for i in stateful)
        onto_frozen = not mapping.by_name and any(PEFT_FROZEN_COPY.search(n) for n in mapping.names.values())
        if missing or onto_frozen:
            found = trainable_names(ckpt)
            if found is not None:
                names.update(found[0])
                why = (f"{missing} of {len(stateful)} entries have no name" if missing else
                       f"their order ({mapping.method}) would give them to PEFT's frozen copies")
                notes.append(f"trainable in {side}: the optimizer's entries are not named one by one ({why}); "
                             f"the {len(found[0])} tensors it trains are certain: {found[1]}")
                continue
            unmapped.append((side, f"{missing} of {len(stateful)} optimizer entries have no name" if missing else
                             "the optimizer's entries are mapped by order onto PEFT's frozen copies"))
            continue
        names.update(mapping.names[i] for i in stateful if i in mapping.names)
    floats = set(ca.parameters()) | set(cb.parameters())
    if unmapped:
        said = {why for _, why in unmapped}
        return floats, "not known", (said.pop() if len(said) == 1 else "; ".join(f"{s}: {w}" for s, w in unmapped)), []
    if len(notes) == 2 and notes[0].replace("in A:", "in B:", 1) == notes[1]:
        notes = [notes[1].replace("in B:", "in A and B:", 1)]
    if names:
        return names, "optimizer state", "", notes
    return floats, "float parameters", "", []


def checkpoint_step(ckpt: Checkpoint) -> float | None:
    """The training step: the optimizer's, else a saved step counter, else trainer_state's global_step."""
    if ckpt.optimizer is not None:
        steps = [ps.step for ps in ckpt.optimizer.state.values() if ps.step is not None]
        if steps:
            return max(steps)
    for key in STEP_KEYS:
        step = _step_float(ckpt.extras.get(key))
        if step is not None:
            return step
    state = ckpt.extras.get("trainer_state")
    return _step_float(state.get("global_step")) if isinstance(state, dict) else None


def _step_float(value: object) -> float | None:
    """A saved step counter as a float; None for a non-number or one out of float range (a 400-digit int)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    if isinstance(value, int) and value.bit_length() > 63:
        return None
    return float(value) if math.isfinite(value) else None


def _notes(report: DiffReport, ca: Checkpoint, cb: Checkpoint) -> list[str]:
    notes = []
    if report.trainable_from == "float parameters":
        why = "no optimizer saved" if ca.optimizer is None and cb.optimizer is None else \
            "the optimizer holds no per-parameter state (every parameter frozen, or a stateless optimizer)"
        notes.append(f"trainable = every float parameter: {why}")
    a, b = report.a.step, report.b.step
    if a is not None and b is not None and a == b:
        notes.append(f"both checkpoints are at {_step(a)}")
    elif a is not None and b is not None and b < a:
        notes.append(f"B ({_step(b)}) is older than A ({_step(a)})")
    unreadable = report.with_status("unreadable")
    if unreadable:
        notes.append(f"{len(unreadable)} tensor(s) could not be compared, e.g. {unreadable[0].detail}")
    return notes + [f"A: {n}" for n in ca.notes] + [f"B: {n}" for n in cb.notes]


def _step(step: float | None) -> str:
    return "an unknown step" if step is None else f"step {step:g}"


def _list(shape: tuple[int, ...] | None) -> list[int] | None:
    return list(shape) if shape is not None else None


def _number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if value != value else str(value)
