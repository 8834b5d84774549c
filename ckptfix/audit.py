"""The audit: after planning, before writing, every value that carries the old vocab size is accounted for.

The plan is built from what ckptfix recognises (named or shaped embeddings and heads, the moments of a parsed
optimizer, recorded `vocab_size`-like keys). Everything else a checkpoint holds is assumed fine by the plan,
so this module walks all of it, independently of how the plan was made: every model tensor, every tensor
anywhere in the file's own tree (every optimizer under any key, nested dicts and lists of state, Lightning's
`optimizer_states` list), every integer of the saved configs, hparams and args (nested configs included).
A value carries the old size when a tensor has it along an axis, a 1-D buffer's length is the total of
parameters that include a vocab tensor, or an integer equals it. Each such value is

  changed     the plan rewrites it (what the writer will do is said);
  kept        left as it is for a stated reason (a position table, a per-layer tensor, a counter whose
              name says what it counts, a separate vocabulary, `--keep`);
  unresolved  nobody checked it: a finding in inspect (CKF130-CKF133), a refusal in repair (exit 2) naming
              the value, its path in the file and the flag or policy that resolves it.

"kept" is only said of what was checked. The writers never see this module; `repair()` runs it between
`make_plan` and the writer, inspect after its checks, the guard after its plan.

Bounded: containers are visited once each (a pickle's memo can share one dict under many keys: a DAG that
is exponential as a tree), at most `MAX_DEPTH` deep and `MAX_NODES` in all; a tree past either bound is
itself unresolved (never "kept": the rest was not looked at).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from ckptfix.checkpoint import TensorInfo
from ckptfix.checks.codes import finding
from ckptfix.formats.pickle_records import OpaqueObject, TensorRef
from ckptfix.recorded import other_sizes, recorded_rows
from ckptfix.vocab import NOT_VOCAB_NAMES, PER_LAYER, embedding_like, near

if TYPE_CHECKING:
    from ckptfix.surgery.plan import RepairPlan

CHANGED, KEPT, UNRESOLVED = "changed", "kept", "unresolved"
MAX_DEPTH = 32  # configs and optimizer states nest a few levels; SECURITY.md's pickle depth bound is larger
MAX_NODES = 1_000_000  # containers and leaves visited in one audit; a real checkpoint has far fewer

# Integer keys that name what they count: equal to the vocab size by chance, never a vocab size.
_COUNTER_KEY = re.compile(
    r"(position|max_len|length|seq|ctx|context|block_size|window|hidden|intermediate|inner|d_model|d_ff|d_kv|"
    r"n_embd|embed_dim|^dim$|_dim$|width|head|layer|step|epoch|iter|batch|seed|sample|warmup|patience|worker|"
    r"rank|world|gpu|node|label|class|_id$|^id$|_ids$|index|idx|time|year|version|port|flos|save|eval|log|"
    r"accum|expert|channel|image|patch|num_query|query_length|bucket|shard|chunk|frame|mel|audio|resolution|"
    r"^params$|param_names)",  # an optimizer's parameter ids (a second optimizer kept in the extras)
    re.IGNORECASE)
# ... and keys that say "vocab size" (an unplanned one of these is always unresolved)
_VOCAB_KEY = re.compile(r"(vocab|^n_?tokens?$|^ntokens?$|^num_tokens$|^n_words$|token_count)", re.IGNORECASE)


@dataclass(frozen=True)
class Value:
    """One value that carries an old vocab size, and what happens to it."""

    path: str  # where it is in the file (a model tensor's name; `optimizer_states[1].state.0.exp_avg`; `config.text_config.vocab_size`)
    what: str  # "[300, 16] float32" or "300"
    status: str  # changed | kept | unresolved
    reason: str  # what the plan does, why it is kept, or why nobody can say
    code: str | None = None  # the finding code of an unresolved value
    resolve: str = ""  # the flag or policy that resolves it

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "value": self.what, "status": self.status, "reason": self.reason,
                "code": self.code, "resolve": self.resolve or None}


@dataclass
class Audit:
    sizes: tuple[int, ...]  # the old sizes looked for (row counts, the old tokenizer's size)
    values: list[Value] = field(default_factory=list)

    @property
    def unresolved(self) -> list[Value]:
        return [v for v in self.values if v.status == UNRESOLVED]

    def refusal(self, source: str) -> str:
        """repair's one-line refusal: every unresolved value (the first few named), grouped by reason, each group
        with its resolution (PATH: each value's path as printed)."""
        bad = self.unresolved
        return (f"{source}: {len(bad)} value(s) carry the old vocab size ({'/'.join(map(str, self.sizes))}) and the "
                f"plan does not account for them: {grouped(bad)}")

    def to_json(self) -> dict[str, Any]:
        return {"sizes": list(self.sizes), "values": [v.to_json() for v in self.values]}


def grouped(values: list[Value], limit: int = 4) -> str:
    """Values with the same reason and resolution in one clause: "a, b, c (and 2 more) [301, 16] ...: reason;
    resolve: ..." (a second optimizer's state is one clause, not one per moment)."""
    groups: dict[tuple[str, str], list[Value]] = {}
    for v in values:
        groups.setdefault((v.reason, v.resolve), []).append(v)
    clauses = []
    for (reason, resolve), members in groups.items():
        named = ", ".join(f"{v.path} ({v.what})" if v.what else v.path for v in members[:limit])
        more = f" and {len(members) - limit} more" if len(members) > limit else ""
        clauses.append(f"{named}{more}: {reason}; resolve: {resolve}")
    return " | ".join(clauses)


def audit(plan: RepairPlan, mapping: Any = None) -> Audit:
    """Account for every value of `plan.ckpt` that carries an old vocab size (module docstring)."""
    sizes, int_sizes = old_sizes(plan)
    result = Audit(tuple(sorted(sizes | int_sizes)))
    if not sizes:
        return result
    ctx = _Context(plan, sizes, int_sizes, mapping)
    walk = _Walk()
    if _one_file(plan.ckpt):  # one file's own tree: every section, parsed or not
        items = walk.tree(plan.ckpt.raw, ())
    else:  # a folder: its model (tensors from every file, the parsed optimizer, the configs as extras)
        items = walk.model(plan.ckpt)
    for path, value in items:
        found = ctx.classify(path, value)
        if found is not None:
            result.values.append(found)
    listed = {v.path for v in result.values}
    for name, reason in plan.kept.items():  # left out of the plan: checked, whatever their rows
        t = plan.ckpt.model[name]
        where = display(ctx.model_at + (name,)) if ctx.model_at is not None else name
        if where not in listed:
            result.values.append(Value(where, f"{list(t.shape)} {t.dtype}", KEPT, reason))
    result.values += ctx.row_counts()
    if walk.truncated:
        result.values.append(Value(walk.truncated, "", UNRESOLVED, f"the tree is past the audit's bound ({MAX_DEPTH} "
                                   f"levels, {MAX_NODES} values): what lies beyond was not checked", "CKF130",
                                   "none: ckptfix cannot vouch for this checkpoint"))
    return result


def _one_file(ckpt: Any) -> bool:
    """Whether `ckpt.raw` is the whole checkpoint (a torch.save file's tree), so walking it walks everything.
    A folder's `raw` is one of its files at most (DeepSpeed's model states): its model is walked instead."""
    return isinstance(ckpt.raw, Mapping) and not ckpt.files and os.path.isfile(ckpt.path)


def old_sizes(plan: RepairPlan) -> tuple[set[int], set[int]]:
    """(row counts that change, other old sizes integers may record: the old tokenizer's)."""
    rows = {e.plan.old_rows for e in plan.weights.values() if e.plan.old_rows != e.plan.new_rows}
    if not rows:
        return set(), set()
    extra = set()
    if plan.from_tokenizer is not None and plan.from_tokenizer.size != plan.tokenizer.size:
        extra.add(plan.from_tokenizer.size)
    return rows, extra - rows


class _Pos(int):
    """A list position in a path (a dict key that is an int is spelled .3, a list position [3])."""


def display(path: tuple) -> str:
    """A path in the file as one string: keys joined by dots, list positions as [i]."""
    out = ""
    for key in path:
        if key == "<model>":  # a folder's model: its tensors by name
            continue
        key = "optimizer" if key == "<optimizer>" else key
        if isinstance(key, _Pos) and out:
            out += f"[{key}]"
        else:
            out += ("." if out else "") + str(key)
    return out


class _Walk:
    """Each container once, depth- and count-bounded; yields (path, leaf) for tensors and integers."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.nodes = 0
        self.truncated = ""

    def tree(self, node: Any, path: tuple) -> Iterator[tuple[tuple, Any]]:
        stack = [(path, node)]
        while stack:
            path, node = stack.pop()
            self.nodes += 1
            if self.nodes > MAX_NODES or len(path) > MAX_DEPTH:
                self.truncated = self.truncated or display(path)[:200] or "(top level)"
                continue
            if isinstance(node, (TensorRef, TensorInfo)) or (isinstance(node, int) and not isinstance(node, bool)):
                yield path, node
                continue
            children = _children(node)
            if children is None or id(node) in self.seen:
                continue
            self.seen.add(id(node))
            stack.extend((path + (k,), v) for k, v in reversed(children))

    def model(self, ckpt: Any) -> Iterator[tuple[tuple, Any]]:
        for name, t in ckpt.model.items():
            yield _MODEL + (name,), t
        opt = ckpt.optimizer
        if opt is not None:
            for i, group in enumerate(opt.groups):
                yield from self.tree(group.options, _OPTIMIZER + ("param_groups", i))
            for index, ps in opt.state.items():
                for key, t in ps.tensors.items():
                    yield _OPTIMIZER + ("state", index, key), t
                yield from self.tree(ps.other, _OPTIMIZER + ("state", index))
        for name, part in (("scheduler", ckpt.scheduler), ("scaler", ckpt.scaler)):
            if part is not None:
                yield from self.tree(part, (f"<{name}>",))
        yield from self.tree(ckpt.extras, ())


# Section markers of a folder's model walk (a file's tree uses its own keys)
_MODEL, _OPTIMIZER = ("<model>",), ("<optimizer>",)


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    if isinstance(node, Mapping):
        return list(node.items())
    if isinstance(node, (list, tuple)):
        return [(_Pos(i), v) for i, v in enumerate(node)]
    if isinstance(node, OpaqueObject):  # a pickled object's fields (argparse.Namespace, an AttributeDict)
        parts: list[tuple[Any, Any]] = []
        if isinstance(node.state, Mapping):
            parts += list(node.state.items())
        parts += list(node.items.items())
        return parts
    return None


def _section(spelled: str | None) -> tuple | None:
    """A `Checkpoint.sections` entry as a path in the file's tree ("optimizer_states[0]", "state/model")."""
    if spelled is None:
        return None
    if spelled == "":
        return ()
    out: list[Any] = []
    for part in spelled.split("/"):
        m = re.fullmatch(r"(.*)\[(\d+)\]", part)
        out += [m.group(1), _Pos(m.group(2))] if m else [part]
    return tuple(out)


class _Context:
    def __init__(self, plan: RepairPlan, sizes: set[int], int_sizes: set[int], mapping: Any) -> None:
        ckpt = plan.ckpt
        self.plan, self.ckpt, self.sizes, self.int_sizes = plan, ckpt, sizes, int_sizes
        in_file = _one_file(ckpt)
        self.model_at = _section(ckpt.sections.get("model")) if in_file else _MODEL
        self.optimizer_at = _section(ckpt.sections.get("optimizer")) if in_file else _OPTIMIZER
        # several optimizers merged into one model (entries `(part, index)`): each one's place in the file
        parts = ckpt.optimizer.parts if ckpt.optimizer is not None else []
        self.parts = [_section(p.section) for p in parts] if in_file else []
        self.extras_at: tuple = ()
        self.keep = set(plan.keep)
        self.names = dict(getattr(mapping, "names", {}) or {})
        self.widths = {e.source.shape[1] for e in plan.weights.values() if len(e.source.shape) == 2}
        self.flat = self._flat_totals()

    # --- one value ---------------------------------------------------------------------------------

    def classify(self, path: tuple, value: Any) -> Value | None:
        if isinstance(value, int):
            return self._integer(path, value) if self._in_extras(path) else None
        shape = tuple(value.shape)
        hit = next((s for s in shape if s in self.sizes), None)
        flat = hit is None and len(shape) == 1 and shape[0] in self.flat
        if hit is None and not flat:
            return None
        what = f"{list(shape)} {value.dtype}"
        where = display(path)
        if where in self.keep:
            return Value(where, what, KEPT, "kept as asked (--keep)")
        name = self._model_name(path)
        if name is not None:
            return self._model_tensor(where, name, what, shape, hit, flat)
        state = self._optimizer_entry(path)
        if state is not None:
            return self._state_tensor(where, state, what, hit, flat)
        size = f"{hit} rows" if hit is not None else f"the length of {self.flat[shape[0]]}"
        code = "CKF130" if not flat else "CKF131"
        if any(isinstance(k, str) and ("optim" in k.lower() or k == "state") for k in path):
            return Value(where, what, UNRESOLVED, f"optimizer state with {size} outside the optimizer ckptfix reads "
                         "(a second optimizer, or one under a key it does not know): it would be written back "
                         "unchanged", code, "none yet: ckptfix reads one optimizer per checkpoint; save the "
                         "others' state separately, or drop it and resume them fresh")
        return Value(where, what, UNRESOLVED, f"a tensor with {size} that ckptfix does not read: it would be "
                     "written back unchanged", code, "--keep PATH if it is not indexed by token ids; otherwise "
                     "ckptfix cannot repair this checkpoint yet")

    def _model_tensor(self, where: str, name: str, what: str, shape: tuple, hit: int | None, flat: bool) -> Value:
        plan = self.plan
        owner = self.ckpt.tied.get(name, name)
        if owner in plan.weights:
            edit = plan.weights[owner]
            return Value(where, what, CHANGED, f"resized to {list(edit.new_shape)}"
                         + (f" (shares storage with {owner})" if owner != name else ""))
        if owner in plan.kept:
            return Value(where, what, KEPT, plan.kept[owner])
        reason = self._incidental(name, shape, hit)
        if reason:
            return Value(where, what, KEPT, reason)
        code = "CKF131" if flat else "CKF130"
        return Value(where, what, UNRESOLVED, "a model tensor with the vocab's size "
                     f"{'in its length' if flat else f'({hit}) along an axis'} that the plan does not resize: it "
                     "would stay at the old size", code,
                     "--keep PATH if it is not indexed by token ids (it then stays as it is)")

    def _token_lookup(self, name: str, shape: tuple, hit: int) -> bool:
        """An integer table with the vocab's rows first: a lookup by token id, per layer or not (DeepSeek-V4's
        hash-routing `tid2eid`, token -> expert ids, in every hash-MoE layer). Never an accidental size."""
        t = self.ckpt.model.get(name)
        return t is not None and not t.is_float and bool(shape) and shape[0] == hit

    def _incidental(self, name: str, shape: tuple, hit: int | None) -> str:
        """Why a tensor's dimension equals the vocab size without being indexed by token ids, or ''."""
        if NOT_VOCAB_NAMES.search(name):
            return "indexed by position or segment, not by token id (its name says so)"
        if hit is not None and PER_LAYER.search(name) and not self._token_lookup(name, shape, hit):
            return "a per-layer tensor (vocab tables are never per layer): its size only happens to be equal"
        if hit is not None and hit in self.widths and shape.count(hit) == len(shape):
            return f"a square matrix of the model width {hit}, which only happens to equal the vocab's rows"
        return ""

    def _state_tensor(self, where: str, state: tuple, what: str, hit: int | None, flat: bool) -> Value:
        plan = self.plan
        index, key, nested = state
        if not nested and (index, key) in plan.moments:
            return Value(where, what, CHANGED, f"resized to {list(plan.moments[(index, key)].new_shape)} with its "
                         "parameter's rows")
        if plan.drop_optimizer_state:
            return Value(where, what, CHANGED, f"dropped (--policy {plan.policy}: the optimizer restarts its state)")
        owner = self.names.get(index)
        if isinstance(owner, str) and (owner in self.keep or owner in plan.kept):
            return Value(where, what, KEPT, f"state of {owner}, kept as asked")
        if isinstance(owner, str) and owner not in plan.weights and hit is not None:
            reason = self._incidental(owner, tuple(self.ckpt.model[owner].shape) if owner in self.ckpt.model else (),
                                      hit)
            if reason:
                return Value(where, what, KEPT, f"state of {owner}: {reason}")
        whose = f" of {owner}" if isinstance(owner, str) else ""
        return Value(where, what, UNRESOLVED, f"optimizer state{whose} ckptfix cannot remap ({'a flat buffer' if flat else 'not a moment it knows the layout of'}): it "
                     "would stay at the old size", "CKF131" if flat else "CKF130",
                     "--policy fresh (drop optimizer state, keep the schedule) or --policy reset")

    def _integer(self, path: tuple, value: int) -> Value | None:
        if value not in self.sizes and value not in self.int_sizes:
            return None
        rel = path[len(self.extras_at):]
        where = display(path)
        if rel in self.plan.recorded:
            return Value(where, str(value), CHANGED, f"set to {self.plan.recorded[rel]}")
        if where in self.keep:
            return Value(where, str(value), KEPT, "kept as asked (--keep)")
        key = next((k for k in reversed(path) if isinstance(k, str)), "")
        shape = self._recorded_shape(path, key, value)
        if shape:
            return Value(where, str(value), CHANGED if key in self.plan.weights else KEPT, shape)
        if not _VOCAB_KEY.search(key) and _COUNTER_KEY.search(key):
            return Value(where, str(value), KEPT, f"{key!r} counts something else: equal to a vocab size by chance")
        said = "names a vocab size" if _VOCAB_KEY.search(key) else "equals the vocab size and its name does not say what it counts"
        return Value(where, str(value), UNRESOLVED, f"a recorded integer that {said}; the plan does not change it",
                     "CKF132", "--keep PATH if it is not this model's vocab size")

    def _recorded_shape(self, path: tuple, key: str, value: int) -> str:
        """A model tensor's shape recorded beside it (DeepSpeed's `param_shapes`): changed with its tensor
        by the writer of that format, or kept with it; '' when `value` is not one."""
        t = self.ckpt.model.get(key)
        at = path[-1] if path and isinstance(path[-1], _Pos) and path[-2:-1] == (key,) else None
        if t is None or at is None or at >= len(t.shape) or t.shape[at] != value:
            return ""
        if key in self.plan.weights:
            return f"the recorded shape of {key}: written with its new shape {list(self.plan.weights[key].new_shape)}"
        return f"the recorded shape of {key}, which the plan leaves as it is"

    # --- where a value is ----------------------------------------------------------------------------

    def _in_extras(self, path: tuple) -> bool:
        """Integers are looked for in the configs, hparams, args and counters (extras), not in tensors'
        sections: a model, an optimizer's param ids and step counts, a schedule."""
        if not _one_file(self.ckpt):
            return bool(path) and not str(path[0]).startswith("<")
        if not path or path[0] not in self.ckpt.extras:
            return False
        shown = self.ckpt.extras[path[0]]  # Composer's "state" is rebuilt without its model and optimizers
        return shown is self.ckpt.raw.get(path[0]) or len(path) < 2 or (isinstance(shown, Mapping) and path[1] in shown)

    def _model_name(self, path: tuple) -> str | None:
        at = self.model_at
        if at is None or path[:len(at)] != at or len(path) == len(at):
            return None
        name = ".".join(str(k) for k in path[len(at):])
        return name if name in self.ckpt.model else None

    def _optimizer_entry(self, path: tuple) -> tuple | None:
        for k, at in enumerate(self.parts):
            if at is not None and path[:len(at)] == at and len(path) >= len(at) + 3 and path[len(at)] == "state":
                rest = path[len(at):]
                return (k, rest[1]), rest[2], rest[3:]
        at = self.optimizer_at
        if at is None or path[:len(at)] != at:
            return None
        rest = path[len(at):]
        if len(rest) >= 3 and rest[0] == "state":
            return rest[1], rest[2], rest[3:]
        if rest and rest[0] == "state" and len(rest) < 3:
            return None
        return ("param_groups", "", rest) if rest else None

    def _flat_totals(self) -> dict[int, str]:
        """Lengths of a buffer that flattens parameters including a vocab tensor: all of the model's float
        parameters, or one optimizer group's (when its parameters are named)."""
        ckpt, planned = self.ckpt, set(self.plan.weights)
        if not planned:
            return {}
        unique = {n: t for n, t in ckpt.model.items() if n not in ckpt.tied and t.is_float}
        out = {sum(t.numel for t in unique.values()): "all model parameters"}
        if ckpt.optimizer is not None and self.names:
            for i, g in enumerate(ckpt.optimizer.groups):
                names = [n for n in (self.names.get(p) for p in g.params) if isinstance(n, str) and n in ckpt.model]
                if len(names) == len(g.params) and planned.intersection(names):
                    out.setdefault(sum(ckpt.model[n].numel for n in names), f"param group {i}'s parameters")
        return {k: v for k, v in out.items() if k > max(self.sizes)}

    # --- the plan's own row counts -------------------------------------------------------------------

    def row_counts(self) -> list[Value]:
        """Vocab tensors the plan resizes from row counts that cannot all be the one vocabulary: a table far
        from the LM's rows (a second vocabulary with its own tokenizer: a Q-Former's BERT table), or an
        embedding with rows beyond the vocab the config records (Mllama's image tokens)."""
        plan = self.plan
        heads = [e for e in plan.weights.values() if e.role == "head"]
        main = max((e.plan.old_rows for e in heads), default=None)
        if main is None:
            main = max((e.plan.old_rows for e in plan.weights.values()), default=None)
        if main is None:
            return []
        recorded = recorded_rows(self.ckpt.extras)
        main_new = next((e.plan.new_rows for e in plan.weights.values() if e.plan.old_rows == main), None)
        out = []
        for name, e in plan.weights.items():
            rows = e.plan.old_rows
            if rows == main or (main_new is not None and e.plan.new_rows - main_new == rows - main):
                continue  # the LM's rows, or rows past them that the plan keeps past them (an offset)
            what = f"{list(e.source.shape)} {e.source.dtype}"
            if not near(rows, {main}):
                out.append(Value(name, what, UNRESOLVED, f"{rows} rows, far from the {main} rows of the LM's vocab: "
                                 "a second vocabulary with its own tokenizer would be resized as if it were this one",
                                 "CKF133", "--keep PATH (a separate vocabulary stays as it is)"))
            elif e.role == "embedding" and rows > main and main in recorded:
                out.append(Value(name, what, UNRESOLVED, f"{rows - main} row(s) beyond the {main} the config records "
                                 "as its vocab size (and the head has): rows the model adds past the vocab "
                                 f"would be cut or moved as token rows", "CKF133",
                                 "none yet: resize it with the model's own resize_token_embeddings"))
        return out + self.grown_embeddings(main, heads)

    def grown_embeddings(self, main: int, heads: list) -> list[Value]:
        """A table named like an embedding, as wide as the LM's head, with more rows than the LM's vocab, that
        the plan leaves alone (CPM-Ant's `input_embedding`: vocab_size + 1024 prompt rows): the model class
        builds it from the vocab size too, so written back at its old size the output does not load; which of
        its rows are token rows nothing in the file records (past MAX_OFFSET it is not taken as Mllama's)."""
        widths = {e.source.shape[1] for e in heads if len(e.source.shape) == 2}
        sized = other_sizes(self.ckpt.extras)  # Pix2Struct's row/column embedders: seq_len rows
        out = []
        for name, t in self.ckpt.model.items():
            if name in self.plan.weights or name in self.plan.kept or name in self.keep \
                    or not embedding_like(name, t) or t.shape[1] not in widths or t.shape[0] <= main \
                    or t.shape[0] in sized:
                continue
            out.append(Value(name, f"{list(t.shape)} {t.dtype}", UNRESOLVED,
                             f"named like an embedding, as wide as the head, with {t.shape[0] - main} row(s) past the "
                             f"LM's {main}: which of its rows are token rows is not recorded, and left at its size "
                             "the model built for the new vocab does not load", "CKF130",
                             "--keep PATH if its rows are not token ids; else resize it with the model's own "
                             "resize_token_embeddings"))
        return out


_PYTORCH = {
    "CKF130": "Written back at the old size: torch loads it without complaint (an optimizer's state is not "
              "checked against its parameter), and the first step raises a size mismatch, or a model built for "
              "the new vocab refuses it in load_state_dict.",
    "CKF131": "A flat buffer keeps its old length: the framework that unflattens it fails, or misreads every "
              "value after the vocab tensor.",
    "CKF132": "The framework rebuilds the model from the recorded size before loading the weights: a size mismatch.",
    "CKF133": "The rows are moved as token rows: the other vocabulary's table (or the rows past the vocab) is "
              "damaged, with no error from PyTorch.",
}


def findings(result: Audit | None) -> list:
    """inspect's findings for the unresolved values, one per code, each naming its values and resolutions."""
    if result is None:
        return []
    out = []
    for code in sorted({v.code for v in result.unresolved if v.code}):
        values = [v for v in result.unresolved if v.code == code]
        fixes = list(dict.fromkeys(v.resolve for v in values if v.resolve))
        out.append(finding(code, f"{len(values)} value(s) with the old vocab size that repair would not account "
                           f"for: {grouped(values)}", pytorch=_PYTORCH[code],
                           fix=" | ".join(fixes) + " (PATH: as listed under tensors)", tensors=[v.path for v in values]))
    return out
