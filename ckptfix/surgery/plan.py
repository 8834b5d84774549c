"""What a repair will do, decided from the checkpoint model alone (no format specifics, no bytes read).

Policies for the optimizer (`ckptfix.policies`, shared with the guard):
  remap  every optimizer state follows its parameter's rows by what it means (`ckptfix.optim_state`); the
         default: where a state cannot follow its rows, repair stops and names it (`_refuse`);
  fresh  drop all optimizer state, keep param_groups and the scheduler position; the loop must re-warm;
  reset  drop optimizer and scheduler state; the schedule starts again.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ckptfix.blockers import repair_blocker
from ckptfix.checkpoint import ByteRange, Checkpoint, JoinedTensor, TensorInfo, stored_to_torch, widen_stored
from ckptfix.checks.codes import Finding
from ckptfix.checks.reserved import never_trained_from
from ckptfix.checks.scaler import FP16_SMALLEST_SUBNORMAL
from ckptfix.dtypes import DTYPE_SIZES
from ckptfix.errors import RepairError
from ckptfix.fit import target_rows
from ckptfix.optim_state import Refusal, action_for, describe, state_keys, unremappable
from ckptfix.policies import REPAIR_POLICIES, canonical
from ckptfix.recorded import find_recorded, megatron_padding, model_token_ids, recorded_padding, recorded_rows, updates
from ckptfix.surgery.blockwise import BLOCKSIZE, BlockwiseRows, blocks_for
from ckptfix.surgery.options import RepairOptions
from ckptfix.surgery.pieces import piece_rows, why_no_segmenter
from ckptfix.surgery.rows import (
    RowPlan,
    apply_plan,
    fill_for,
    narrow_to_stored,
    new_rows_for,
    plan_by_id,
    plan_by_token,
)
from ckptfix.vocab import near, rows_on_last_axis, separate_tensors, vocab_rows

POLICIES = REPAIR_POLICIES
DEFAULT_SCALE = 65536.0
DEFAULT_OPTIONS = RepairOptions()  # frozen: one value every caller may share


@dataclass
class TensorEdit:
    """One tensor to rewrite with a row plan: a weight (new rows by `init`) or a moment (new rows by key)."""

    name: str
    role: str  # embedding | head | head-bias | vocab-sized | moment
    source: TensorInfo
    plan: RowPlan
    moment_key: str | None = None
    tied: bool = False  # an embedding whose rows are also the head's (its new rows produce logits)
    owner: str | None = None  # a moment's weight (its model tensor name); None for a weight
    fill: str | None = None  # a state's new rows, by its `optim_state.Rule` (always set); None: a weight's, `fill_for`'s
    value: float | None = None  # "group-lr": the value new rows start at
    copy_of: TensorEdit | None = None  # "weights": the weight whose new rows this state copies
    _new_cache: Any = field(default=None, repr=False)  # the new rows, computed once (a copy must equal them)

    @property
    def new_shape(self) -> tuple[int, ...]:
        if rows_on_last_axis(self.role, self.source.shape):
            return (self.source.shape[0], self.plan.new_rows)
        return (self.plan.new_rows, *self.source.shape[1:])

    def parts(self) -> list[tuple[TensorInfo, int, int, bool]]:
        """For a table saved in parts (a `JoinedTensor`), each part as it is written: (part, first row and row
        count in the new table, whether it is its old bytes as they are: the plan keeps its rows in place)."""
        out: list[tuple[TensorInfo, int, int, bool]] = []
        if not isinstance(self.source, JoinedTensor):
            return out
        start = 0
        for part, count in zip(self.source.parts, self.source.part_rows(self.plan.new_rows)):
            same = count == part.shape[0] and np.array_equal(self.plan.source[start:start + count],
                                                             np.arange(start, start + count))
            out.append((part, start, count, same))
            start += count
        return out

    def produce(self, init: str, std: float, rng: np.random.Generator) -> np.ndarray:
        """The rewritten tensor as stored (numpy, contiguous; bfloat16 as its bits), computed from a view
        of the mapped source. Only this tensor is held while it is written."""
        keep = self.plan.prefix_rows()
        if keep is not None and not rows_on_last_axis(self.role, self.source.shape):
            return self._produce_prefix(keep, init, std, rng)
        old = self.source.read_stored()
        transposed = rows_on_last_axis(self.role, old.shape)
        if transposed:  # a (1, vocab) bias as the 1-D bias it is; k columns per token as k-wide rows
            old = old.reshape(-1) if old.shape[0] == 1 else np.ascontiguousarray(old.T)
        fill = self.new_values(old, init, std, rng)
        out = apply_plan(old, self.plan, fill)
        if not transposed:
            return out
        return out.reshape(self.new_shape) if out.ndim == 1 else np.ascontiguousarray(out.T)

    def new_values(self, rows: np.ndarray, init: str, std: float, rng: np.random.Generator) -> np.ndarray:
        """The new rows' values as stored, from the old rows `rows` (as stored); computed once per edit, so
        a parameter copy (`copy_of`) gets exactly the rows its weight got."""
        if self._new_cache is None:
            fill = self.fill or fill_for(init, self.role, self.tied)
            count = int((self.plan.source < 0).sum())
            if fill == "weights" and self.copy_of is not None:
                weight = self.copy_of
                values = weight.new_values(weight.source.read_stored(), init, std, rng)
                values = narrow_to_stored(widen_stored(values, weight.source.dtype).astype(np.float32)
                                          .reshape(count, *rows.shape[1:]), self.source.dtype)
            elif fill == "group-lr":
                values = narrow_to_stored(np.full((count, *rows.shape[1:]), self.value, np.float32), self.source.dtype)
            else:
                values = new_rows_for(rows, self.source.dtype, self.plan, fill, std, rng)
            self._new_cache = values
        return self._new_cache

    def _produce_prefix(self, keep: int, init: str, std: float, rng: np.random.Generator) -> np.ndarray:
        """`produce` when the output is the source's rows 0..keep-1 then new rows: the kept rows are read
        straight into the output (one copy; a sharded source's pieces land in place, never assembled
        first) and the new rows' statistics come from that copy (all old rows, when rows are added)."""
        src = self.source
        if not src.shape or src.shape[0] != self.plan.old_rows:
            raise RepairError(f"{self.name}: {src.shape[0] if src.shape else 0} rows but the plan expects "
                              f"{self.plan.old_rows}")
        out = np.empty(self.new_shape, dtype=src.read_dtype())
        src.read_rows_into(out[:keep])
        if self.plan.new_rows > keep:  # rows added: keep == old_rows, every old row is in out[:keep]
            out[keep:] = self.new_values(out[:keep], init, std, rng)
        return out

    def produce_torch(self, init: str, std: float, rng: np.random.Generator) -> Any:
        """`produce` as a torch tensor (for writers and the guard that hand tensors to torch)."""
        return stored_to_torch(self.produce(init, std, rng), self.source.dtype)

    def output(self, init: str, std: float, rng: np.random.Generator) -> Any:
        """What a torch-archive writer stores: `stream()` where it applies, else `produce()`."""
        spliced = self.stream(init, std, rng)
        return spliced if spliced is not None else self.produce(init, std, rng)

    def stream(self, init: str, std: float, rng: np.random.Generator) -> Any:
        """The rewritten tensor as a `torch_save.Spliced` record: the source's leading rows copied raw and
        only the new rows computed, when the plan keeps rows 0..k-1 in place (rows added at the end or
        trailing rows dropped, the common case) and the source is a contiguous view. Values are those
        `produce` gives. None when the rows must be gathered: use `produce`."""
        from ckptfix.formats.torch_save import Spliced

        src, keep = self.source, self.plan.prefix_rows()
        itemsize = DTYPE_SIZES.get(src.dtype)
        if (keep is None or keep == 0 or itemsize is None or not src.shape or src.shape[0] != self.plan.old_rows
                or rows_on_last_axis(self.role, src.shape)
                or (src.stride is not None and tuple(src.stride) != src.contiguous_stride())):
            return None
        where = src.locate()
        start = where.start + src.offset * itemsize
        if src.offset < 0 or start + src.nbytes > where.start + where.length:
            return None  # a damaged record: `produce` reports it
        row_bytes = src.nbytes // src.shape[0]
        tail = self._new_rows(self.plan.new_rows - keep, init, std, rng)
        return Spliced(ByteRange(where.file, start, keep * row_bytes, where.big_endian), tail)

    def _new_rows(self, count: int, init: str, std: float, rng: np.random.Generator) -> Any:
        src, fill = self.source, self.fill or fill_for(init, self.role, self.tied)
        if count == 0 or fill == "zeros":
            return bytes(DTYPE_SIZES[src.dtype] * count * math.prod(src.shape[1:]))  # +0.0 in every float dtype
        return self.new_values(src.read_stored(), init, std, rng)

    def to_json(self) -> dict[str, Any]:
        return {"tensor": self.name, "role": self.role, "old_shape": list(self.source.shape),
                "new_shape": list(self.new_shape), **self.plan.to_json()}


@dataclass
class BlockwiseEdit(TensorEdit):
    """A bitsandbytes 8-bit state's codes, or their block scales (`scales`): both outputs of one
    `surgery.blockwise.BlockwiseRows`, computed once."""

    blockwise: Any = None
    scales: bool = False

    @property
    def new_shape(self) -> tuple[int, ...]:
        codes = self.blockwise.codes
        if self.scales:
            return (blocks_for(self.plan.new_rows * math.prod(codes.shape[1:])),)
        return (self.plan.new_rows, *codes.shape[1:])

    def produce(self, init: str, std: float, rng: np.random.Generator) -> np.ndarray:
        codes, scales = self.blockwise.result()
        return scales if self.scales else codes

    def stream(self, init: str, std: float, rng: np.random.Generator) -> Any:
        return None


@dataclass
class RepairPlan:
    ckpt: Checkpoint
    tokenizer: Any
    from_tokenizer: Any
    policy: str
    init: str
    std: float
    target_rows: int
    weights: dict[str, TensorEdit] = field(default_factory=dict)  # by model name (tied aliases follow)
    moments: dict[tuple[Any, str], TensorEdit] = field(default_factory=dict)  # by (optimizer index, key)
    drop_optimizer_state: bool = False
    reset_scheduler: bool = False
    reset_scaler: bool = False
    findings_before: list[Finding] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    rows_by: str = "id"  # id | token: how output rows were matched to input rows
    recorded: dict[tuple, int] = field(default_factory=dict)  # recorded vocab sizes to set (path -> value)
    keep: tuple[str, ...] = ()  # paths the user declared not vocab-indexed (--keep): the audit keeps them
    kept: dict[str, str] = field(default_factory=dict)  # vocab tensors left out of the plan -> why (the audit says it)
    audit: Any = None  # ckptfix.audit.Audit, once repair has run it

    @property
    def changes(self) -> list[dict[str, Any]]:
        return [e.to_json() for e in list(self.weights.values()) + list(self.moments.values())]

    def is_noop(self) -> bool:
        return not (self.weights or self.moments or self.drop_optimizer_state or self.reset_scheduler
                    or self.reset_scaler or self.recorded)


def default_policy(ckpt: Checkpoint) -> str:
    """Always `remap`: state follows its rows by what it means (`ckptfix.optim_state`). Where a state is
    not understood, repair stops naming it (`_refuse`); dropping state is only ever what was asked for."""
    return "remap"


def default_init(tokenizer: Any, from_tokenizer: Any) -> str:
    """`pieces` when the old tokenizer is known (it spells each new token in pieces the model was trained
    on), else HF's `mean`. The one place that decides what "known" means: `--from-tokenizer` today."""
    return "pieces" if from_tokenizer is not None else "mean"


def make_plan(report, tokenizer: Any, from_tokenizer: Any = None, options: RepairOptions = DEFAULT_OPTIONS, *,
              format_notes: bool = True, exact_rows: bool = False) -> RepairPlan:
    """Decide every edit from an inspect `Report` of the checkpoint and the target tokenizer, as `options`
    ask (validated when they were made: `RepairOptions`; its `policy`, `init`, `std`, `pad_to_multiple_of`,
    `keep_ids` and `keep` are the ones a plan reads).

    Every note of a repair is decided here, so `--dry-run` shows it: the format's own (`Format.notes`
    in `ckptfix.formats.FORMATS`) too, unless `format_notes` is off (the guard resizes in memory).
    `exact_rows` (the guard): the tokenizer's size is the live model's row count, the target as it is.

    Rows follow their token: by token string from the old tokenizer when it is known (`from_tokenizer`,
    else the report's: a ckptfix record's or an HF folder's own), by id otherwise (or with `keep_ids`),
    and not at all when the new tokenizer alone shows that ids moved (CKF122).
    `keep`: paths the user says are not indexed by this tokenizer's ids (a separate vocabulary, a count that
    only happens to equal the vocab size): left out of the plan; `ckptfix.audit` reports them as kept."""
    ckpt = report.ckpt
    keep, pad_to_multiple_of = options.keep, options.pad_to_multiple_of
    from_tokenizer, rows_by, identity_notes = _old_tokenizer(report, tokenizer, from_tokenizer, options.keep_ids)
    asked = options.policy is not None
    policy = canonical(options.policy) if options.policy else default_policy(ckpt)
    refused: list[Refusal] = []
    init = options.init or default_init(tokenizer, from_tokenizer)
    named = {v.name: "kept as asked (--keep): not indexed by this tokenizer's ids" for v in report.vocab if v.name in keep}
    kept = {**separate_tensors(ckpt), **named}
    vocab = [v for v in report.vocab if v.tied_to is None and v.name not in kept]
    blocked = repair_blocker(ckpt, vocab)
    if blocked:
        raise RepairError(f"{ckpt.path}: {blocked}")
    if not vocab:
        raise RepairError(f"{ckpt.path}: no embedding or LM-head tensor found to resize "
                          "(names like embed_tokens/wte/lm_head, or 2-D tensors with the vocab's row count)")
    for v in vocab:  # resizing copies every row: an expand()ed view would be materialised, row by row
        views = [ckpt.model[v.name], *v.moments.values()]
        if any(t.repeats_storage() for t in views):
            raise RepairError(f"{ckpt.path}: {v.name} is a view that repeats its storage (strides "
                              f"{list(ckpt.model[v.name].stride or ())}, e.g. from expand()); save it with "
                              ".contiguous() before repairing it")
    rows = max(v.token_rows for v in vocab)
    target, why = target_rows(tokenizer.size, rows, pad_to=pad_to_multiple_of,
                              config_vocab=rows if rows in recorded_rows(ckpt.extras) else None,
                              old_tokens=from_tokenizer.size if from_tokenizer is not None else None,
                              exact=exact_rows)
    megatron = megatron_padding(ckpt.extras, rows)
    if megatron and pad_to_multiple_of is None and not exact_rows:  # Megatron rebuilds exactly this many rows
        target = -(-tokenizer.size // megatron[0]) * megatron[0]
        why = f"rows: {target} for {tokenizer.size} tokens (padding rule: {megatron[1]}; --pad-to overrides)"
    recorded_multiple = recorded_padding(ckpt.extras, rows)
    if recorded_multiple and pad_to_multiple_of is None and not exact_rows and tokenizer.size > rows:
        target = -(-tokenizer.size // recorded_multiple) * recorded_multiple  # litgpt's own find_multiple
        why = (f"rows: {target} for {tokenizer.size} tokens (padding rule: the padding_multiple {recorded_multiple} "
               "the checkpoint records beside its padded_vocab_size)")
    plan = RepairPlan(ckpt, tokenizer, from_tokenizer, policy, init, options.std, target,
                      findings_before=list(report.findings), notes=[why, *identity_notes], rows_by=rows_by,
                      keep=tuple(keep), kept=kept)
    plans: dict[int, RowPlan] = {}
    for v in vocab:
        if v.token_rows not in plans:
            plans[v.token_rows] = _row_plan(v.token_rows, target, tokenizer, from_tokenizer)
            if from_tokenizer is None:
                _renew_untrained_rows(plan, plans[v.token_rows], report.vocab, v.token_rows)
            if init == "pieces":
                plans[v.token_rows].pieces = piece_rows(plans[v.token_rows].source, tokenizer, from_tokenizer,
                                                        v.token_rows)
        rows_plan = _offset_plan(plan, v, plans[v.token_rows]) if v.offset else plans[v.token_rows]
        if rows_plan.is_identity():
            continue
        tied = any(t.tied_to == v.name for t in report.vocab)
        plan.weights[v.name] = TensorEdit(v.name, v.role, ckpt.model[v.name], rows_plan, tied=tied)
        _note_parts(plan, plan.weights[v.name])
        if v.role == "lookup" and rows_plan.new:
            plan.notes.append(f"{v.name}: a token-id lookup of {v.shape[1]} id(s) per token (hash routing's "
                              f"token -> experts): its {rows_plan.new} new row(s) are ids drawn at random from "
                              "those the table holds, distinct per row (nothing records a new token's)")
        if policy == "remap":
            refused += _plan_states(plan, v, rows_plan)
            if ckpt.optimizer is not None and v.optimizer_index is None and v.role != "lookup":  # a buffer
                _no_state_for(plan, report, v)
    if plan.weights and policy == "remap":
        _refuse(plan, refused, asked=asked)
    _plan_optimizer(plan)
    _plan_scaler(plan)
    _plan_recorded(plan, {v.token_rows for v in vocab if v.role in ("embedding", "head")})
    if ckpt.sections.get("optimizer") == "recipe_state.pt":
        plan.notes.append(f"torchtune's optimizer state ({ckpt.files.get('optimizer')}) is written repaired as "
                          "OUT/recipe_state.pt; torchtune resumes from <output_dir>/recipe_state/recipe_state.pt")
    _note_lost_tokens(plan)
    _note_pieces(plan)
    if format_notes:
        _note_format(plan)
    return plan


def _note_format(plan: RepairPlan) -> None:
    from ckptfix.formats import BY_NAME, resolve

    spec = BY_NAME.get(plan.ckpt.format)
    if spec is not None and spec.notes is not None:
        plan.notes += resolve(spec.notes)(plan)


def _old_tokenizer(report, tokenizer: Any, given: Any, keep_ids: bool) -> tuple[Any, str, list[str]]:
    """(the tokenizer rows move from or None, "token" | "id", notes) for this repair."""
    from ckptfix.identity import data_evidence

    rows = vocab_rows(report.vocab)
    if keep_ids:
        return None, "id", ["rows kept by id (--keep-ids): token i keeps row i"]
    if tokenizer.id_to_token() is None:  # the guard's target without a token table: only a row count
        return None, "id", []
    old, notes = _known_old(report, rows, given)
    if old is not None:
        if old.origin != "given":
            notes.append(f"rows moved by token string from the old tokenizer {old.describe()}")
        return old.info, "token", notes
    if rows is None or rows == tokenizer.size:
        return None, "id", notes
    evidence = data_evidence(tokenizer, rows, report.ckpt.extras.get("config"))
    if evidence:
        raise RepairError(f"{evidence[0].message}. Pass from_tokenizer=OLD (the tokenizer the checkpoint was "
                          "trained with) to move rows by token string, or keep_ids=True if the ids really are unchanged")
    notes.append(f"rows kept by id: the tokenizer the checkpoint's {rows} rows were trained with is not known, "
                 f"and keeping ids is right only if {tokenizer.path} appends to it; pass --from-tokenizer OLD "
                 "to move rows by token string")
    return None, "id", notes


def _known_old(report: Any, rows: int | None, given: Any) -> tuple[Any, list[str]]:
    """`identity.known_old_tokenizer`'s answer: the analysis's when it asked the same question (so a record's or
    a folder's own tokenizer file is read once per run), else asked now (the guard analyses without one)."""
    from ckptfix.identity import known_old_tokenizer

    if report.identity is not None:
        old, notes = report.identity
        if (old.info if old is not None and old.origin == "given" else None) is given:
            return old, list(notes)
    return known_old_tokenizer(report.ckpt, rows, given)


def _plan_recorded(plan: RepairPlan, old_rows: set[int]) -> None:
    """Recorded vocab sizes (nanoGPT model_args, Lightning hyper_parameters, litgpt) follow the rows."""
    recorded = [r for r in find_recorded(plan.ckpt.extras) if r.where not in plan.keep]  # --keep PATH: left as it is
    plan.recorded = updates(recorded, old_rows, plan.target_rows, plan.tokenizer.size)
    for path, value in plan.recorded.items():
        plan.notes.append(f"recorded {'.'.join(map(str, path))} set to {value}")


def _note_parts(plan: RepairPlan, edit: TensorEdit) -> None:
    """Where a table saved in parts goes: into the same parts, rows split as `JoinedTensor.part_rows` says."""
    parts = edit.parts()
    if parts:
        plan.notes.append(f"{edit.name}: one table its loader concatenates from {len(parts)} saved tensors, written "
                          "as those again: " + ", ".join(f"{p.name} rows {start}..{start + count - 1}"
                                                         f"{' (as it was)' if same else ''}"
                                                         for p, start, count, same in parts))


def _offset_plan(plan: RepairPlan, v: Any, lm_plan: RowPlan) -> RowPlan:
    """The rows of a tensor with `v.offset` rows past the LM vocabulary (Mllama's embedding: vocab_size + 8
    image-token rows): rows = tokens + offset, the model's own rows after the token rows, where the class puts
    them (`nn.Embedding(vocab_size + 8)`: ids past vocab_size reach them). So the token rows follow the LM's row
    plan and the offset rows follow them: a new token id lands on a new row, never on an image row, and the image
    rows stay the last `offset` rows; a shrink drops token rows, never the model's own."""
    token_source = lm_plan.source.copy()
    # the model's own tokens the config names (Mllama's <|image|>, image_token_index = vocab_size), ids in the
    # rows it adds: the id keeps the row it was looked up in, not a new one (the trained image row)
    own = [i for i in model_token_ids(plan.ckpt.extras) if v.token_rows <= i < min(v.rows, len(token_source))
           and token_source[i] < 0]
    token_source[own] = own
    source = np.concatenate([token_source, np.arange(v.token_rows, v.rows, dtype=np.int64)])
    kept = int((source == np.arange(len(source))).sum())
    rows_plan = RowPlan(source, v.rows, kept=kept, moved=int((source >= 0).sum()) - kept, new=lm_plan.new - len(own),
                        dropped=lm_plan.dropped, dropped_ids=list(lm_plan.dropped_ids), pieces=dict(lm_plan.pieces))
    if not rows_plan.is_identity():
        plan.notes.append(f"{v.name}: {v.rows} rows = {v.token_rows} token rows + {v.offset} rows of the model's own "
                          f"past the LM vocabulary; now {rows_plan.new_rows} = {lm_plan.new_rows} + {v.offset} (token "
                          f"rows as the LM's: {rows_plan.new} new, {rows_plan.dropped} trained row(s) dropped; the "
                          f"{v.offset} rows of the model's own moved after them, rows {lm_plan.new_rows}.."
                          f"{rows_plan.new_rows - 1})" + (f"; id(s) {', '.join(map(str, own))}, the model's own "
                          "token(s) by its config, keep the row(s) they were looked up in" if own else ""))
    return rows_plan


def _plan_states(plan: RepairPlan, v: Any, rows_plan: RowPlan) -> list[Refusal]:
    """Every state of vocab tensor `v`'s optimizer entry, by its rule (`optim_state.action_for`): rows
    remapped (new rows as the rule says), a column factor or a counter kept, or refused. Returns what
    cannot be remapped."""
    opt = plan.ckpt.optimizer
    entry = opt.state.get(v.optimizer_index) if opt is not None and v.optimizer_index is not None else None
    if opt is None or entry is None:
        return []
    kind, refused = opt.kind_of(v.optimizer_index), []
    for key, t in entry.tensors.items():
        head_bias = rows_on_last_axis(v.role, t.shape)
        action = action_for(kind, key, t.shape, t.dtype, v.shape, head_bias)
        if action.what == "refuse":
            refused.append((key, v.name, action.why))
        elif action.what == "keep":
            plan.notes.append(f"{key} of {v.name} kept ({action.rule.meaning if action.rule else ''}: {action.why})")
        elif action.what == "blockwise":
            refused += _plan_blockwise(plan, v, key, entry.tensors, action.rule, rows_plan)
        elif action.what == "rows":
            refused += _plan_rows(plan, v, key, t, action.rule, rows_plan, head_bias)
    return refused


def _plan_rows(plan: RepairPlan, v: Any, key: str, t: TensorInfo, rule: Any, rows_plan: RowPlan,
               head_bias: bool) -> list[Refusal]:
    rows = t.shape[-1] if head_bias else t.shape[0]
    mplan = rows_plan if rows == v.rows else plan_by_id(rows, rows_plan.new_rows)
    if mplan is not rows_plan:
        plan.notes.append(f"{key} of {v.name} had {rows} rows, not {v.rows}: resized by id")
    edit = TensorEdit(f"{v.name}:{key}", v.role, t, mplan, key, owner=v.name, fill=rule.new_rows,
                      copy_of=plan.weights[v.name])
    if rule.new_rows == "group-lr":
        edit.value = _group_lr(plan.ckpt.optimizer, v.optimizer_index)
        if edit.value is None:
            return [(key, v.name, "its group records no lr to start new rows at")]
    plan.moments[(v.optimizer_index, key)] = edit
    return []


def _plan_blockwise(plan: RepairPlan, v: Any, key: str, tensors: dict, rule: Any,
                    rows_plan: RowPlan) -> list[Refusal]:
    """A bitsandbytes 8-bit state: its codes and block scales resized together (`surgery.blockwise`)."""
    scales_key, book_key = rule.blockwise
    codes, scales, book = tensors[key], tensors.get(scales_key), tensors.get(book_key)
    if scales is None or book is None:
        return [(key, v.name, "8-bit codes without their block scales and code book")]
    state = BlockwiseRows(codes, scales, book, rows_plan, rule.new_rows)
    why = state.check()
    if why:
        return [(key, v.name, why)]
    index = v.optimizer_index
    plan.moments[(index, key)] = BlockwiseEdit(f"{v.name}:{key}", v.role, codes, rows_plan, key, owner=v.name,
                                               blockwise=state)
    plan.moments[(index, scales_key)] = BlockwiseEdit(f"{v.name}:{scales_key}", v.role, scales, rows_plan,
                                                      scales_key, owner=v.name, blockwise=state, scales=True)
    moved = "" if rows_plan.prefix_rows() is not None else \
        "; blocks holding moved rows are requantized (their values within 8-bit precision of the source's)"
    plan.notes.append(f"{key} of {v.name}: 8-bit codes dequantized, moved by row and requantized in "
                      f"bitsandbytes' blocks of {BLOCKSIZE} (blocks whose values stay in place keep their scale "
                      f"and codes{moved})")
    return []


def _group_lr(opt: Any, index: Any) -> float | None:
    group = next((g for g in opt.groups if index in g.params), None)
    return group.lr if group is not None else None


def _refuse(plan: RepairPlan, refused: list[Refusal], asked: bool) -> None:
    """Stop, naming the optimizer and every state that cannot follow its rows, with the policies that
    repair anyway; also for an optimizer whose kind or flat state ckptfix does not understand."""
    opt = plan.ckpt.optimizer
    if opt is None or not opt.state:
        return
    refused = refused + unremappable({opt.kind_of(i) for i in opt.state}, state_keys(opt.state))
    if refused:
        how = "--policy remap" if asked else "the default policy (remap)"
        raise RepairError(f"{plan.ckpt.path}: {opt.kind}: {how} cannot remap {describe(refused)}"
                          + ". --policy fresh (drop optimizer state, keep the schedule; the LR re-warms) or "
                          "--policy reset (drop optimizer and scheduler state) repairs it")


def _no_state_for(plan: RepairPlan, report: Any, v: Any) -> None:
    """A vocab tensor no optimizer entry was matched to: a buffer or a frozen parameter when every entry
    with state belongs to another parameter (BART's `final_logits_bias`); otherwise its moments are among
    the unmatched entries and remapping cannot tell which: stop rather than drop or misplace them."""
    opt = plan.ckpt.optimizer
    assert opt is not None
    owned = set(report.mapping.names) | {x.optimizer_index for x in report.vocab if x.optimizer_index is not None}
    unmatched = [i for i in opt.indices() if i not in owned and opt.state.get(i) is not None
                 and any(could_hold_state_of(t.shape, v) for t in opt.state[i].tensors.values())]
    if not unmatched:
        shared = [x.name for x in report.vocab if not x.index_known and x.shape == v.shape]
        plan.notes.append(f"{v.name} has no optimizer state (a buffer or a frozen parameter)" if not shared else
                          f"{v.name} has no optimizer state of its own: {', '.join(shared)} of its shape hold "
                          f"{len(shared)} entries, which of them is not recorded (the moments' rows move the same "
                          "way whichever it is)")
        return
    raise RepairError(f"{plan.ckpt.path}: cannot tell which of {len(unmatched)} unmatched optimizer state "
                      f"entries holds the moments of {v.name} (parameters matched by {report.mapping.method}); "
                      "--policy fresh (drop optimizer state, keep the schedule) or --policy reset repairs it")


def could_hold_state_of(shape: tuple[int, ...], v: Any) -> bool:
    """Whether a state tensor of `shape` can be one of vocab tensor `v`'s: a moment has its parameter's shape
    on every axis but the vocab one, and there a length near the vocab's (a moment left at the rows before a
    resize: the window `vocab.near` allows a head resized apart from its embedding); a factored second moment
    (Adafactor's) has a row factor as long as the vocab axis. A state that fits neither cannot be v's, whatever
    entry holds it (BART's encoder and decoder (32, 32) weights are never `final_logits_bias`'s)."""
    axis = len(v.shape) - 1 if rows_on_last_axis(v.role, v.shape) else 0
    if len(shape) == 1 and len(v.shape) > 1:
        return shape[0] == v.shape[axis]
    if len(shape) != len(v.shape) or not near(shape[axis], {v.shape[axis]}):
        return False
    return all(a == b for k, (a, b) in enumerate(zip(shape, v.shape)) if k != axis)


def _note_pieces(plan: RepairPlan) -> None:
    if plan.init != "pieces":
        return
    edit = next((e for e in plan.weights.values() if e.role == "embedding"), None) or next(iter(plan.weights.values()), None)
    if edit is None or not edit.plan.new:
        return
    spelled = len(edit.plan.pieces)
    why = why_no_segmenter(plan.from_tokenizer or plan.tokenizer) if not spelled else None
    if why is not None:
        plan.notes.append(f"--init pieces: no new row has pieces ({why}); all {edit.plan.new} start from the "
                          "mean with small noise")
        return
    plan.notes.append(f"--init pieces: {spelled} of {edit.plan.new} new row(s) start from the mean of their "
                      f"text's old pieces; {edit.plan.new - spelled} (no usable pieces) from the mean with small noise")


def _renew_untrained_rows(plan: RepairPlan, rows_plan: RowPlan, vocab: list, rows: int) -> None:
    """Token ids kept by id on rows that never trained (CKF110: reserved rows at the end of an untied
    embedding, exp_avg_sq exactly 0) get new rows: `--init` applies to them, their moments restart.
    Only when rows are kept by id: with --from-tokenizer a token absent from the old one is new anyway."""
    starts = [s for s in (never_trained_from(v) for v in vocab if v.token_rows == rows) if s is not None]
    if not starts:
        return
    start = min(starts)
    stop = min(plan.tokenizer.size, rows_plan.new_rows, rows)  # rows no token id reaches stay as they are
    renew = [j for j in range(start, stop) if rows_plan.source[j] == j]
    if not renew:
        return
    rows_plan.source[renew] = -1
    rows_plan.kept -= len(renew)
    rows_plan.new += len(renew)
    plan.notes.append(f"rows {start}..{stop - 1} never trained (exp_avg_sq exactly 0, CKF110) and the tokenizer "
                      f"uses them: initialised like new rows (--init {plan.init}), their moments restarted")


def _row_plan(rows: int, target: int, tokenizer: Any, from_tokenizer: Any) -> RowPlan:
    if from_tokenizer is None:
        return plan_by_id(rows, target)
    return plan_by_token(rows, target, from_tokenizer.id_to_token(), tokenizer.id_to_token())


def _plan_optimizer(plan: RepairPlan) -> None:
    opt = plan.ckpt.optimizer
    if opt is None:
        return
    if plan.policy in ("fresh", "reset"):
        plan.drop_optimizer_state = True
    if plan.policy == "reset":
        plan.reset_scheduler = plan.ckpt.scheduler is not None


def _plan_scaler(plan: RepairPlan) -> None:
    scale = (plan.ckpt.scaler or {}).get("scale")
    if isinstance(scale, (int, float)) and not (FP16_SMALLEST_SUBNORMAL <= scale < float("inf")):
        plan.reset_scaler = True
        plan.notes.append(f"GradScaler scale {scale} reset to {DEFAULT_SCALE:g} (collapsed or not finite)")


def _note_lost_tokens(plan: RepairPlan) -> None:
    for edit in plan.weights.values():
        if edit.plan.dropped and edit.role == "embedding":
            ids = ", ".join(edit.plan.to_json()["dropped_ids"])
            plan.notes.append(f"shrinking {edit.name}: {edit.plan.dropped} row(s) dropped, token ids lost: {ids}")
