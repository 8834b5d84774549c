"""Are the new tokens learning? Per token, from two checkpoints of one run (A earlier, B later): whether its
input-embedding row and its head row learned between them, the evidence, and the cause where they did not.

The tokens looked at: those the tokenizer adds past its base vocabulary, and ids past A's rows (added by a
resize between A and B). Evidence per row: the relative change ||B - A|| / ||A||; B's `exp_avg_sq` row (Adam's
second moment: exactly 0 for a row no gradient ever reached, positive for good after one real gradient); and a
change that is weight decay alone (B = A x c with c < 1 to float precision: AdamW's decoupled decay scales every
row by 1 - lr x wd per step, a row with no gradient gets only that).

Causes named: the table is not trained (a PEFT adapter that neither saves nor trains it: LoRA without
`modules_to_save` or `trainable_token_indices`; a table with no optimizer entry); the token never occurred in the
data (its embedding row's `exp_avg_sq` is exactly 0 while the table trains). An untied head row always gets a
gradient through the softmax (pushed down for a token that never occurs), so the embedding row is the evidence
for occurrence; a tied head is the embedding's own rows. PEFT's layouts are read by name: a module to save is
trained in its `modules_to_save.<adapter>` copy (its `original_module` stays frozen on purpose), trainable token
rows in `token_adapter.trainable_tokens_delta` (row k is id `trainable_token_indices[k]`; the
`token_adapter.base_layer` table stays frozen on purpose).
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.checkpoint import Checkpoint, TensorInfo, widen_stored
from ckptfix.errors import CkptfixError
from ckptfix.mapping import PEFT_FROZEN_COPY, map_optimizer, moment_shape
from ckptfix.vocab import find_vocab_tensors, tied_head_missing, trainable_token_rows

_ZERO_BLOCK = 4096  # rows read at a time when looking for exactly-zero moment rows


@dataclass
class RowEvidence:
    """One table's row of one token."""

    table: str  # embedding | head
    status: str  # learned | unchanged | decay-only | frozen | tied | no-row-in-A | unknown
    tensor: str | None = None  # B's tensor holding the row
    rel_change: float | None = None  # ||B - A|| / ||A|| (inf where A's row is 0: a PEFT delta starts at 0)
    moment_zero: bool | None = None  # B's exp_avg_sq row is exactly 0 (None: no moment found)
    decay_factor: float | None = None  # B = A x this, where the change is a scaling only
    detail: str = ""

    @property
    def learned(self) -> bool | None:
        if self.status in ("learned", "tied"):
            return True
        if self.status == "no-row-in-A":  # only B's moment speaks: a gradient reached the row or not
            return None if self.moment_zero is None else not self.moment_zero
        return None if self.status == "unknown" else False

    def to_json(self) -> dict[str, Any]:
        return {"table": self.table, "status": self.status, "tensor": self.tensor, "learned": self.learned,
                "rel_change": _number(self.rel_change), "exp_avg_sq_row_zero": self.moment_zero,
                "decay_factor": self.decay_factor, "detail": self.detail}


@dataclass
class TokenLearning:
    id: int
    token: str | None
    why: str  # why this token is looked at: added to the tokenizer, a row past A's
    embedding: RowEvidence
    head: RowEvidence
    cause: str = ""  # frozen | never-in-data | "" (learned, or not known)

    @property
    def learned(self) -> bool | None:
        return self.embedding.learned

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "token": self.token, "why": self.why, "learned": self.learned, "cause": self.cause,
                "embedding": self.embedding.to_json(), "head": self.head.to_json()}


@dataclass
class TokensReport:
    tokens: list[TokenLearning] = field(default_factory=list)
    causes: list[str] = field(default_factory=list)  # one line per cause, with its evidence
    fixes: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def not_learning(self) -> list[TokenLearning]:
        return [t for t in self.tokens if t.learned is False]

    @property
    def severity(self) -> str:
        """error: a table that does not train (no data can teach these tokens in this run); warning: tokens
        the data never showed (the run trains them when they occur); "" when every token looked at learned."""
        bad = self.not_learning
        if not bad:
            return ""
        return "error" if any(t.cause == "frozen" for t in bad) else "warning"

    @property
    def summary(self) -> str:
        if not self.tokens:
            return "no new token to look at"
        bad, unknown = self.not_learning, [t for t in self.tokens if t.learned is None]
        if not bad and not unknown:
            return f"the {len(self.tokens)} new token(s) learned: their embedding rows moved beyond weight decay"
        if not bad:
            return f"{len(unknown)} of {len(self.tokens)} new token(s): whether they learned is not known"
        return f"{len(bad)} of {len(self.tokens)} new token(s) did not learn: {_names(bad)}"

    def to_json(self) -> dict[str, Any]:
        return {"summary": self.summary, "severity": self.severity, "tokens": [t.to_json() for t in self.tokens],
                "causes": self.causes, "fixes": self.fixes, "notes": self.notes}


@dataclass
class _Table:
    role: str  # embedding | head
    name: str
    tensor: TensorInfo
    ids: list[int] | None = None  # row k is token ids[k] (a PEFT delta); None: row r is token r
    moment: TensorInfo | None = None
    moment_note: str = ""


def token_learning(ca: Checkpoint, cb: Checkpoint, tokenizer: Any = None, *, trainable: set[str] | None = None,
                   steps: float | None = None) -> TokensReport | None:
    """The per-token report, or None when there is nothing to look at (no tokenizer, no rows added)."""
    ta, tb = _tables(ca), _tables(cb)
    report = TokensReport()
    ids = _ids_of_interest(tokenizer, ta, tb, cb)
    if ids is None:
        return None
    names = tokenizer.id_to_token() if tokenizer is not None else []
    adapter = _adapter_config(cb)
    wd, lr = _decay(cb)
    for token_id, why in ids:
        emb = _row(token_id, "embedding", ta, tb, adapter, wd, lr, steps)
        head = _head_row(token_id, ta, tb, cb, adapter, wd, lr, steps)
        token = names[token_id] if token_id < len(names) else None
        if trainable is not None and emb.tensor is not None and emb.tensor not in trainable and emb.status == "unchanged":
            emb.status, emb.detail = "frozen", "the optimizer has no entry for this table"
        report.tokens.append(TokenLearning(token_id, token, why, emb, head, _cause(emb)))
    _explain(report, cb, adapter, tokenizer)
    if ta.get("head") is not None and tb.get("head") is None and tied_head_missing(cb) or \
            ta.get("head") is None and tied_head_missing(ca) and tb.get("head") is not None:
        report.notes.append("the head is tied in one checkpoint and untied in the other: its rows are compared "
                            "only where both store them")
    return report


def _ids_of_interest(tokenizer: Any, ta: dict[str, _Table], tb: dict[str, _Table],
                     cb: Checkpoint) -> list[tuple[int, str]] | None:
    rows_a = _rows(ta.get("embedding"))
    rows_b = _rows(tb.get("embedding"))
    out: dict[int, str] = {}
    if tokenizer is not None:
        for token_id, _, _ in tokenizer.added_tokens:
            if token_id >= tokenizer.base_size:
                out[token_id] = "added to the tokenizer"
    if rows_a is not None and rows_b is not None and rows_b > rows_a:
        for token_id in range(rows_a, rows_b):
            out.setdefault(token_id, "a row past A's")
    for token_ids in trainable_token_rows(cb).values():  # a PEFT adapter's trainable token rows
        for token_id in token_ids:
            out.setdefault(token_id, "a trainable token row of the adapter")
    if not out and tokenizer is None:
        return None
    limit = rows_b if rows_b is not None else (tokenizer.size if tokenizer is not None else 0)
    return sorted((i, w) for i, w in out.items() if i < limit or tb.get("embedding") is None)


def _rows(table: _Table | None) -> int | None:
    if table is None or table.ids is not None:
        return None
    return table.tensor.shape[0]


def _tables(ckpt: Checkpoint) -> dict[str, _Table]:
    """The input embedding and the head whose rows train (PEFT's frozen copies left out), with the
    `exp_avg_sq` of each where it can be told which entry is whose."""
    view, real = _peft_view(ckpt)
    found = [v for v in find_vocab_tensors(view, map_optimizer(view)) if v.role in ("embedding", "head")
             and v.tied_to is None]
    out: dict[str, _Table] = {}
    for v in found:
        if v.role not in out:
            out[v.role] = _Table(v.role, real.get(v.name, v.name), view.model[v.name])
            if v.index_known and "exp_avg_sq" in v.moments:
                out[v.role].moment = v.moments["exp_avg_sq"]
    _moments_by_content(ckpt, out)
    for module, token_ids in trainable_token_rows(ckpt).items():
        delta = next((n for n in ckpt.model if f"{module}.token_adapter.trainable_tokens_delta" in n), None)
        if delta is not None and "embedding" not in out:
            t = ckpt.model[delta]
            out["embedding"] = _Table("embedding", delta, t, token_ids, _moment_of_shape(ckpt, t.shape))
    return out


def _peft_view(ckpt: Checkpoint) -> tuple[Checkpoint, dict[str, str]]:
    """A PeftModel's whole state_dict as the model it trains: each module to save by its trained copy
    (`x.modules_to_save.default.weight` read as `x.weight`), the frozen copies (`original_module`, `base_layer`)
    left out; and the view's names -> the checkpoint's."""
    if not any(PEFT_FROZEN_COPY.search(n) or ".modules_to_save." in n for n in ckpt.model):
        return ckpt, {}
    model, real = {}, {}
    for name, t in ckpt.model.items():
        if PEFT_FROZEN_COPY.search(name):
            continue
        short = re.sub(r"\.modules_to_save\.[^.]+", "", name)
        model[short], real[short] = t, name
    return dataclasses.replace(ckpt, model=model, tied={}), real


def _moments_by_content(ckpt: Checkpoint, tables: dict[str, _Table]) -> None:
    """An untied embedding and head share their shape: when the entries are not named one by one (an HF
    Trainer folder), the embedding's `exp_avg_sq` is the one with rows exactly 0 (tokens absent from every
    batch; the softmax gives every head row a gradient). When neither has such rows, every row of both got a
    gradient: each table's moment rows are non-zero whichever entry is whose."""
    if ckpt.optimizer is None or not tables:
        return
    wanted = [t for t in tables.values() if t.moment is None]
    if not wanted:
        return
    shape = wanted[0].tensor.shape
    entries = [ps.tensors["exp_avg_sq"] for i in ckpt.optimizer.indices()
               if (ps := ckpt.optimizer.state.get(i)) is not None and "exp_avg_sq" in ps.tensors
               and moment_shape(ps) == shape]
    if len(entries) == 1 and len(wanted) == 1:
        wanted[0].moment = entries[0]
        return
    same = [t for t in tables.values() if t.tensor.shape == shape]
    if len(entries) != len(same) or len(entries) != 2:
        return
    zeros = [_has_zero_row(e) for e in entries]
    if zeros == [True, False] or zeros == [False, True]:
        emb = entries[zeros.index(True)]
        for t in same:
            t.moment = emb if t.role == "embedding" else entries[zeros.index(False)]
            t.moment_note = "told apart by content: the entry with rows exactly 0 is the input embedding's"
    elif zeros == [False, False]:
        for t in same:
            t.moment = entries[0]  # either entry: every row of both is non-zero
            t.moment_note = "both entries of this shape have every row non-zero"


def _moment_of_shape(ckpt: Checkpoint, shape: tuple[int, ...]) -> TensorInfo | None:
    if ckpt.optimizer is None:
        return None
    entries = [ps.tensors["exp_avg_sq"] for ps in ckpt.optimizer.state.values()
               if "exp_avg_sq" in ps.tensors and ps.tensors["exp_avg_sq"].shape == shape]
    return entries[0] if len(entries) == 1 else None


def _has_zero_row(moment: TensorInfo) -> bool:
    values = moment.read_stored()
    for start in range(0, values.shape[0], _ZERO_BLOCK):
        block = np.asarray(values[start:start + _ZERO_BLOCK])
        block = block.reshape(block.shape[0], -1)
        nonzero = (block & 0x7FFF) != 0 if moment.dtype == "bfloat16" else block != 0
        if not nonzero.any(axis=1).all():
            return True
    return False


def _read_row(t: TensorInfo, row: int) -> np.ndarray:
    return widen_stored(np.asarray(t.read_stored()[row]), t.dtype).astype(np.float64).reshape(-1)


def _position(table: _Table, token_id: int) -> int | None:
    if table.ids is None:
        return token_id if token_id < table.tensor.shape[0] else None
    return table.ids.index(token_id) if token_id in table.ids else None


def _row(token_id: int, role: str, ta: dict[str, _Table], tb: dict[str, _Table], adapter: dict | None,
         wd: float, lr: float, steps: float | None) -> RowEvidence:
    b = tb.get(role)
    if b is None:
        if adapter is not None:
            return RowEvidence(role, "frozen", detail="the adapter neither saves nor trains this table: the "
                               "base model's rows are used as they are")
        return RowEvidence(role, "unknown", detail="no such table found in B")
    pos_b = _position(b, token_id)
    if pos_b is None:
        if b.ids is not None:
            return RowEvidence(role, "frozen", b.name, detail="not among the adapter's trainable token rows")
        return RowEvidence(role, "unknown", b.name, detail=f"B's {b.name} has no row {token_id}")
    ev = RowEvidence(role, "unknown", b.name)
    try:
        if b.moment is not None:
            row = np.asarray(b.moment.read_stored()[pos_b])
            ev.moment_zero = not bool(((row & 0x7FFF) != 0).any() if b.moment.dtype == "bfloat16" else (row != 0).any())
        a = ta.get(role)
        pos_a = _position(a, token_id) if a is not None and a.name == b.name or a is not None and a.ids is None \
            and b.ids is None else None
        if a is None or pos_a is None:
            ev.status = "no-row-in-A"
            ev.detail = "A has no row for it (added after A): B's optimizer moment is the evidence"
            return ev
        xa, xb = _read_row(a.tensor, pos_a), _read_row(b.tensor, pos_b)
    except (CkptfixError, OSError, ValueError) as exc:
        ev.detail = f"not read: {exc}"
        return ev
    norm_a = float(np.linalg.norm(xa))
    delta = float(np.linalg.norm(xb - xa))
    ev.rel_change = delta / norm_a if norm_a > 0 else (0.0 if delta == 0 else math.inf)
    if delta == 0:
        ev.status = "unchanged"
        return ev
    factor = float(np.dot(xa, xb) / np.dot(xa, xa)) if norm_a > 0 else None
    tol = 4e-3 if b.tensor.dtype in ("bfloat16", "float16") else 1e-5
    if factor is not None and factor < 1 and float(np.linalg.norm(xb - factor * xa)) <= tol * norm_a:
        low = (1 - lr * wd) ** steps - tol if steps and lr and wd else None
        if low is not None and factor >= low or low is None and factor > 0.9:
            ev.status, ev.decay_factor = "decay-only", factor
            return ev
    ev.status = "learned"
    return ev


def _head_row(token_id: int, ta: dict[str, _Table], tb: dict[str, _Table], cb: Checkpoint, adapter: dict | None,
              wd: float, lr: float, steps: float | None) -> RowEvidence:
    if tb.get("head") is None and (tied_head_missing(cb) or any(
            n.endswith("lm_head.weight") and n in cb.tied for n in cb.model) or cb.tied and "embedding" in tb):
        return RowEvidence("head", "tied", detail="tied to the input embedding: the same row")
    ev = _row(token_id, "head", ta, tb, adapter, wd, lr, steps)
    if ev.status == "unknown" and tb.get("head") is None and "embedding" in tb:
        ev.detail = "no head found in B (tied, or a base model without one)"
    return ev


def _cause(emb: RowEvidence) -> str:
    if emb.learned is not False:
        return ""
    if emb.status == "frozen":
        return "frozen"
    return "never-in-data" if emb.moment_zero else ""


def _adapter_config(ckpt: Checkpoint) -> dict | None:
    config = ckpt.extras.get("config") if ckpt.format == "peft-adapter" else None
    return config if isinstance(config, dict) else None


def _decay(ckpt: Checkpoint) -> tuple[float, float]:
    """The largest weight decay and peak learning rate of B's param groups (0 where not saved)."""
    if ckpt.optimizer is None:
        return 0.0, 0.0
    wd = [g.options.get("weight_decay") for g in ckpt.optimizer.groups]
    lr = [g.options.get("initial_lr", g.options.get("lr")) for g in ckpt.optimizer.groups]
    numbers = lambda xs: [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)]  # noqa: E731
    return max(numbers(wd), default=0.0), max(numbers(lr), default=0.0)


def _explain(report: TokensReport, cb: Checkpoint, adapter: dict | None, tokenizer: Any) -> None:
    frozen = [t for t in report.tokens if t.cause == "frozen"]
    absent = [t for t in report.tokens if t.cause == "never-in-data"]
    if frozen:
        ids = [t.id for t in frozen]
        peft = adapter is not None or any("lora_" in n for n in cb.model)
        if peft:
            adapter = adapter or {}
            targets = adapter.get("target_modules", "its target modules")
            shown = ", ".join(sorted(map(str, targets))) if isinstance(targets, (list, tuple)) else str(targets)
            report.causes.append(
                f"frozen: {_names(frozen)}: the PEFT adapter trains only its {_kind(adapter)} matrices on {shown}, with no modules_to_save and no trainable_token_indices: the input embedding "
                "and the head stay the base model's, so their new rows never train (and are not saved with the "
                "adapter)")
            emb, head = _module_names(cb)
            report.fixes.append(f'LoraConfig(..., modules_to_save=["{emb}", "{head}"])  (trains and saves both '
                                "tables whole)")
            report.fixes.append(f"LoraConfig(..., trainable_token_indices={ids})  (trains only these rows of "
                                f"{emb}; a tied head follows it)")
        else:
            report.causes.append(f"frozen: {_names(frozen)}: their embedding rows are bit-identical between A and B "
                                 "and the optimizer trains no such table (requires_grad=False, or not given to the "
                                 "optimizer)")
            report.fixes.append("train the embedding: model.get_input_embeddings().weight.requires_grad_(True) "
                                "before the optimizer is built")
    if absent:
        decayed = [t for t in absent if t.embedding.status == "decay-only"]
        factor = f"; B's row = A's x {decayed[0].embedding.decay_factor:.5f} (weight decay only)" if decayed else ""
        report.causes.append(f"never in the data: {_names(absent)}: their embedding rows' exp_avg_sq in B is "
                             f"exactly 0 while the table trains (no batch the optimizer saw up to B held them){factor}")
        report.fixes.append("add text with these tokens to the training data (or check the data pipeline "
                            "tokenizes them: a tokenizer without them splits them into pieces)")
    for t in absent:
        if t.head.status == "learned":
            t.head.detail = "moved by the softmax alone: the token is never a target, its logit is pushed down"
    heads = [t for t in report.tokens if t.head.status == "frozen" and t.learned]
    if heads:
        report.notes.append(f"head rows of {_names(heads)} are not trained by the adapter (its trainable token rows "
                            "are the input embedding's; the head is untied): they keep their initial values")
    moment_notes = {t.embedding.tensor for t in report.tokens if t.embedding.moment_zero is None
                    and t.embedding.status not in ("frozen", "tied")}
    if moment_notes and any(moment_notes):
        report.notes.append("no exp_avg_sq found for the embedding in B (no optimizer saved, or its entry not told "
                            "apart): whether the tokens occurred is not known")


def _kind(adapter: dict) -> str:
    kind = str(adapter.get("peft_type", ""))
    return {"LORA": "LoRA", "": "adapter"}.get(kind, kind)


def _module_names(ckpt: Checkpoint) -> tuple[str, str]:
    """The input embedding's and the head's module names for a PEFT config (embed_tokens / lm_head unless
    the checkpoint's own tensors name others)."""
    emb, head = "embed_tokens", "lm_head"
    for name in ckpt.model:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight" and "embed" in parts[-2] and "pos" not in parts[-2]:
            emb = parts[-2]
    return emb, head


def _names(tokens: list[TokenLearning]) -> str:
    shown = [f"{t.token!r} ({t.id})" if t.token is not None else f"id {t.id}" for t in tokens[:8]]
    return ", ".join(shown) + (f" and {len(tokens) - 8} more" if len(tokens) > 8 else "")


def _number(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if value != value else str(value)



def embedding_moment(ckpt: Checkpoint) -> tuple[str, TensorInfo, list[int] | None] | None:
    """The input embedding's `exp_avg_sq` (PEFT layouts and same-shape pairs as `diff` tells them apart):
    (the embedding's name, the moment, the token id of each row where the rows are a PEFT delta's), or None."""
    table = _tables(ckpt).get("embedding")
    if table is None or table.moment is None:
        return None
    return table.name, table.moment, table.ids


def zero_rows(moment: TensorInfo, ids: list[int] | None, wanted: list[int]) -> tuple[list[int], bool]:
    """The ids of `wanted` whose moment rows are exactly 0, and whether some other row is not."""
    values = moment.read_stored()
    position = {token_id: k for k, token_id in enumerate(ids)} if ids is not None else None
    zero = []
    for token_id in wanted:
        row = position.get(token_id) if position is not None else token_id
        if row is None or row >= values.shape[0]:
            continue
        x = np.asarray(values[row])
        if not bool(((x & 0x7FFF) != 0).any() if moment.dtype == "bfloat16" else (x != 0).any()):
            zero.append(token_id)
    others = [r for r in range(min(values.shape[0], 4096))
              if (position is None and r not in zero) or (position is not None and ids is not None and ids[r] not in zero)]
    sample: Any = np.asarray(values[others]) if others else np.zeros((0,), dtype=np.uint16)
    nonzero = bool(((sample & 0x7FFF) != 0).any() if moment.dtype == "bfloat16" else (sample != 0).any())
    return zero, nonzero
