"""Find the vocab-sized tensors of a checkpoint: embeddings, LM heads (tied or not), their moments."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.checkpoint import Checkpoint, TensorInfo, split_tables
from ckptfix.errors import RepairError
from ckptfix.mapping import ParamMapping
from ckptfix.recorded import find_recorded, recorded_rows, separate_vocabularies

EMBEDDING_NAMES = re.compile(
    r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|text_embedding|token_embedding|tok_emb|"
    r"shared|embed_in|word_emb|token_emb|tok_embed|embedding|embeddings|word_embedding)\.weight$")
HEAD_NAMES = re.compile(
    r"((^|\.)(lm_head|output|embed_out|text_head|head|decoder|generator|lm_logits)\.(weight|bias)$)"
    r"|((^|\.)lm_head\.bias$)|(final_logits_bias$)")
# Tables indexed by something other than a token id, shaped like an embedding when their size happens to
# equal the vocab's: never resized as vocab tensors.
NOT_VOCAB_NAMES = re.compile(r"(position|pos_emb|wpe|token_type|segment|relative|rel_attn|rel_emb)", re.IGNORECASE)
PER_LAYER = re.compile(r"\.\d+\.")  # inside a stack of blocks (layers.3.): vocab tensors are never per layer
PADDING_MULTIPLES = (8, 16, 32, 64, 128, 256)
MAX_OFFSET = 256  # the most rows a model class adds past its LM vocabulary that are taken as its own (Mllama: 8)


@dataclass
class VocabTensor:
    name: str
    role: str  # embedding | head | head-bias (rows on the last axis: a bias, (1, rows), (k, rows)) | lookup (ids)
    rows: int
    shape: tuple[int, ...]
    tied_to: str | None = None  # the embedding this head shares storage with
    moments: dict[str, TensorInfo] = field(default_factory=dict)  # exp_avg -> its TensorInfo
    optimizer_index: Any = None
    index_known: bool = True  # False: paired with a same-shape entry (the moments' row plan is the same either way)
    offset: int = 0  # rows past the LM vocabulary the model class itself adds (Mllama: vocab_size + 8 image rows)
    parts: tuple[str, ...] = ()  # a table saved in parts (a `JoinedTensor`): the saved tensors, in row order

    @property
    def token_rows(self) -> int:
        """The rows token ids of the LM vocabulary index: the tokenizer's counterpart (rows = tokens + offset)."""
        return self.rows - self.offset

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "rows": self.rows, "shape": list(self.shape),
                "tied_to": self.tied_to, "offset": self.offset, "optimizer_index": self.optimizer_index if self.index_known else None,
                "moments": {k: list(t.shape) for k, t in self.moments.items()}, "parts": list(self.parts)}


def vocab_rows(vocab: list[VocabTensor]) -> int | None:
    """The checkpoint's vocab row count: the input embedding's, else the first vocab tensor's."""
    embed = next((v for v in vocab if v.role == "embedding"), vocab[0] if vocab else None)
    return embed.token_rows if embed is not None else None


def padded_size(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def padding_multiple(rows: int, tokens: int) -> int | None:
    """The multiple the rows were rounded up to from `tokens`, if they were (e.g. 32128 from 32100)."""
    return next((m for m in PADDING_MULTIPLES if rows > tokens and padded_size(tokens, m) == rows), None)


def find_vocab_tensors(ckpt: Checkpoint, mapping: ParamMapping, tokenizer_size: int | None = None,
                       notes: list[str] | None = None, own_rows: int | None = None) -> list[VocabTensor]:
    """Vocab tensors by structure: every float tensor with the vocab's row count along a dimension in the
    place a vocab tensor has it, whatever its name: (rows, width) embeddings and heads, (rows,) head and
    MLM decoder biases, (1, rows) `final_logits_bias`. The rows and the model width come from the named
    embeddings, else from the 2-D tensor whose rows are nearest the tokenizer's size. A tensor that has
    the rows elsewhere (a (width, rows) matrix, a table named like positions) is reported in `notes` as
    ambiguous and left alone: a size can match by accident (an attention projection is not a vocab tensor).
    `own_rows`: the user's word for rows the embedding's class adds past its vocab (`declare_own_rows`)."""
    separate, kept = _separate_rows(ckpt), separate_tensors(ckpt)  # another vocabulary's tensors: never the LM's
    stated = stated_offsets(ckpt.extras)
    rows, widths = _vocab_dims(ckpt, tokenizer_size, set(separate), stated)
    found: dict[str, VocabTensor] = {}
    _note_separate(ckpt, separate, notes)
    if not rows:
        return []
    other_dims = {d for name, t in ckpt.model.items() if not _vocab_shaped(t.shape, rows, widths)
                  for d in t.shape}
    first = True
    for name, t in ckpt.model.items():
        role = None if name in kept else _role(name, t, rows, widths, other_dims)
        if role is None:
            if notes is not None and t.is_float and any(d in rows for d in t.shape) and t.shape not in ((), (1,)) \
                    and name not in kept:
                notes.append(f"{name} {list(t.shape)} has a dimension of the vocab size ({'/'.join(map(str, sorted(rows)))} "
                             "rows) but not in a vocab tensor's place; left alone (ambiguous)")
            continue
        if role == "embedding" and not EMBEDDING_NAMES.search(name) and not first:
            role = "head"
        first = first and role not in ("embedding", "head")
        n = t.shape[-1] if role == "head-bias" else t.shape[0]
        found[name] = VocabTensor(name, role, n, t.shape, tied_to=ckpt.tied.get(name))
    found.update(_head_columns(ckpt, found, rows, kept))
    found.update(_token_lookups(ckpt, rows, kept))
    found = {**_offset_tables(ckpt, found, widths, kept, stated), **found}
    for v in found.values():  # a table saved in parts: named by them too (the report, --json)
        v.parts = tuple(p.name for p in getattr(ckpt.model[v.name], "parts", ()))
    _set_offsets(ckpt, found, stated)
    if own_rows is not None:
        declare_own_rows(ckpt, list(found.values()), own_rows)
    _attach_moments(ckpt, mapping, found)
    return list(found.values())


EMBEDDING_LIKE = re.compile(r"embed", re.IGNORECASE)  # a table looked up by ids, whatever its prefix


def embedding_like(name: str, t: TensorInfo) -> bool:
    """A float table named like an embedding, whatever its prefix (`input_embedding`), not a position or
    segment table and not inside a stack of layers."""
    return t.is_float and len(t.shape) == 2 and bool(EMBEDDING_LIKE.search(name)) \
        and not NOT_VOCAB_NAMES.search(name) and not PER_LAYER.search(name)


def _head_columns(ckpt: Checkpoint, found: dict[str, VocabTensor], rows: set[int],
                  kept: dict[str, str]) -> dict[str, VocabTensor]:
    """A (k, rows) matrix in the module that holds a head's bias: the head's extra output columns, one per
    token (MobileBERT's `cls.predictions.dense.weight`, (hidden - embedding_size, vocab): the logits are
    h @ [decoder.weight.T; dense.weight]). Role "head-bias": rows on the last axis. Anywhere else such a
    matrix stays ambiguous (`find_vocab_tensors`' note)."""
    modules = {v.name.rpartition(".")[0] for v in found.values() if v.role == "head-bias" and len(v.shape) == 1}
    out = {}
    for name, t in ckpt.model.items():
        if name in found or name in kept or not t.is_float or len(t.shape) != 2 or t.shape[1] not in rows \
                or t.shape[0] in rows or PER_LAYER.search(name) or NOT_VOCAB_NAMES.search(name):
            continue
        if name.rsplit(".", 2)[0] in modules:
            out[name] = VocabTensor(name, "head-bias", t.shape[1], t.shape)
    return out


LOOKUP_DTYPES = ("int32", "int64")  # ids, not quantized weights (int8/uint8)
MAX_LOOKUP_WIDTH = 64


def _token_lookups(ckpt: Checkpoint, rows: set[int], kept: dict[str, str]) -> dict[str, VocabTensor]:
    """An integer table with the vocab's rows and a few ids per token, per layer or not: DeepSeek-V4's
    hash-routing `tid2eid` (token id -> its top-k expert ids, in each hash-MoE layer). Role "lookup": its rows
    follow the tokens like an embedding's; a new token's ids are drawn (`rows.drawn_ids`)."""
    return {name: VocabTensor(name, "lookup", t.shape[0], t.shape) for name, t in ckpt.model.items()
            if name not in kept and t.dtype in LOOKUP_DTYPES and len(t.shape) == 2 and t.shape[0] in rows
            and 0 < t.shape[1] <= MAX_LOOKUP_WIDTH and not NOT_VOCAB_NAMES.search(name)}


def _offset_tables(ckpt: Checkpoint, found: dict[str, VocabTensor], widths: set[int],
                   kept: dict[str, str], stated: dict[int, set[int]]) -> dict[str, VocabTensor]:
    """When no table by an embedding's usual name was found (the rows came from the head): a table named
    like an embedding, as wide as the head, whose rows are the head's plus an offset the model adds
    (CPM-Ant's `input_embedding`: vocab_size + prompt_types x prompt_length); `_set_offsets` keeps the offset
    only where the config records the head's rows."""
    if any(v.role == "embedding" for v in found.values()):
        return {}
    heads = {v.rows for v in found.values() if v.role == "head"}
    out: dict[str, VocabTensor] = {}
    for name, t in ckpt.model.items():
        if name in found or name in kept or not embedding_like(name, t) or t.shape[1] not in widths:
            continue
        if any(0 < t.shape[0] - lm <= MAX_OFFSET or t.shape[0] - lm in stated.get(lm, ()) for lm in heads):
            out[name] = VocabTensor(name, "embedding", t.shape[0], t.shape, tied_to=ckpt.tied.get(name))
    return out


def _separate_rows(ckpt: Checkpoint) -> dict[int, str]:
    """Row count -> where the config records it, for the vocabularies that are not the LM's (a composite
    config's Q-Former or speech sub-config: `recorded.separate_vocabularies`), unless the LM has that size
    too (then rows cannot tell them apart and both follow the LM)."""
    lm = recorded_rows(ckpt.extras)
    return {r.value: f"{r.where} = {r.value}" for r in separate_vocabularies(ckpt.extras) if r.value not in lm}


def separate_tensors(ckpt: Checkpoint) -> dict[str, str]:
    """The tensors of another vocabulary than the LM's (rows a non-text sub-config records), each with the
    reason it is kept: the one answer `find_vocab_tensors` leaves them out by, the plan keeps them by
    (`RepairPlan.kept`) and the audit reports them with."""
    separate = _separate_rows(ckpt)
    return {name: f"a separate vocabulary ({separate[t.shape[0]]}: its own tokenizer), not indexed by this "
            "tokenizer's ids" for name, t in ckpt.model.items() if _separate_tensor(t, separate)}


def _separate_tensor(t: TensorInfo, separate: dict[int, str]) -> bool:
    return bool(separate) and len(t.shape) in (1, 2) and t.shape[0] in separate and t.is_float


def _note_separate(ckpt: Checkpoint, separate: dict[int, str], notes: list[str] | None) -> None:
    """List every separate vocabulary and its tensors: seen and deliberately kept, never resized here."""
    if notes is None:
        return
    for rows, where in separate.items():
        tensors = [n for n, t in ckpt.model.items() if _separate_tensor(t, {rows: where})]
        held = f"its tensors {', '.join(tensors[:4])}{' ...' if len(tensors) > 4 else ''}" if tensors \
            else "no tensor of the model has its rows"
        notes.append(f"separate vocabulary: {where} (its own tokenizer; {held}): kept, not checked or resized "
                     "against the LM tokenizer")


def _set_offsets(ckpt: Checkpoint, found: dict[str, VocabTensor], stated: dict[int, set[int]]) -> None:
    """A model class that adds rows past its LM vocabulary (Mllama's embedding: vocab_size + 8 image-token
    rows, its head vocab_size; CPM-Ant's: vocab_size + 1024 prompt rows): the config's LM size is the head's
    rows, and the embedding's extra rows are the model's own. Read from the checkpoint itself: a recorded LM
    size equal to an untied head's rows and an embedding a few rows above it, or as many rows above it as
    its config states (`stated_offsets`; without a head, only those: a config left at an old size looks the
    same)."""
    recorded = recorded_rows(ckpt.extras)
    heads = {v.rows for v in found.values() if v.role == "head" and v.tied_to is None and v.rows in recorded}
    if len(heads) > 1:
        return
    for v in found.values():
        if v.role != "embedding" or v.tied_to is not None:
            continue
        for lm in sorted(heads or recorded):
            extra = v.rows - lm
            if 0 < extra and ((heads and extra <= MAX_OFFSET) or extra in stated.get(lm, ())):
                v.offset = extra
                break


def rows_past_recorded(ckpt: Checkpoint, vocab: list[VocabTensor]) -> tuple[VocabTensor, int] | None:
    """(embedding, recorded LM size) when the only embedding has a few rows (<= MAX_OFFSET) past the one size
    the config records and no head tells whether they are the model's own (MllamaModel: vocab_size + 8 image
    rows, with no head to hold vocab_size) or the config was left at an old size: which rows are tokens is not
    recorded (CKF107 in inspect; repair refuses)."""
    embeds = [v for v in vocab if v.role == "embedding" and v.tied_to is None]
    if len(embeds) != 1 or embeds[0].offset or any(v.role == "head" and v.tied_to is None for v in vocab):
        return None
    recorded = recorded_rows(ckpt.extras)
    if len(recorded) != 1:
        return None
    (lm,) = recorded
    return (embeds[0], lm) if 0 < embeds[0].rows - lm <= MAX_OFFSET else None


def rows_on_last_axis(role: str, shape: tuple[int, ...]) -> bool:
    """Whether a vocab tensor's rows lie on its last axis: a (k, vocab) head bias (BART's `final_logits_bias`
    (1, vocab), MobileBERT's head columns). Every other vocab tensor, a 1-D bias included, has them on axis 0."""
    return role == "head-bias" and len(shape) == 2


def split_table(ckpt: Checkpoint) -> tuple[TensorInfo, TensorInfo] | None:
    """An embedding saved in two parts that the loader concatenates, left unjoined by its reader (in a torch
    file; an HF folder of safetensors reads it as one `JoinedTensor`): neither part's rows are the vocab's."""
    found = split_tables(ckpt.model)
    return found[0] if found else None


def declare_own_rows(ckpt: Checkpoint, vocab: list[VocabTensor], own_rows: int) -> None:
    """`--own-rows N`: the user says the embedding's last N rows are the model class's own (MllamaModel:
    vocab_size + 8), which no head tells here (`rows_past_recorded`). It must be exactly the rows past the
    recorded size: anything else is a bad flag (exit 2), never a guess."""
    past = rows_past_recorded(ckpt, vocab)
    if past is None:
        raise RepairError(f"--own-rows {own_rows}: no embedding here has rows past its recorded vocab size "
                           "without a head to hold that size; drop the flag")
    v, lm = past
    if own_rows != v.rows - lm:
        raise RepairError(f"--own-rows {own_rows}: {v.name} has {v.rows} rows, {v.rows - lm} past the vocab size "
                           f"{lm} its config records; pass --own-rows {v.rows - lm} if the class adds them")
    v.offset = own_rows


_GENERIC_WORDS = {"num", "n", "max", "min", "total", "use", "is"}
# rows the model's own table holds past vocab_size, as its config names them (Molmo2's embedding and Idefics'
# decoupled one: vocab_size + additional_vocab_size; ids past vocab_size are its image and special tokens)
ADDED_ROWS_KEY = "additional_vocab_size"


def stated_offsets(extras: dict[str, Any]) -> dict[int, set[int]]:
    """For each LM size a config records, the rows past it that config states: its `additional_vocab_size`
    (Molmo2), or the product of two of its integers named for one thing (CPM-Ant builds `input_embedding` with
    vocab_size + prompt_types x prompt_length rows, its prompt ids vocab_size + k), past MAX_OFFSET (a smaller
    product needs a head to tell it from a stale size). Another integer alone (a width, a layer count) or two of
    different things state no rows."""
    out: dict[int, set[int]] = {}
    for r in find_recorded(extras):
        if not r.rows_key:
            continue
        offsets = out.setdefault(r.value, set())
        node: Any = extras
        for key in r.path[:-1]:
            node = node[key]
        added = node.get(ADDED_ROWS_KEY)
        if isinstance(added, int) and not isinstance(added, bool) and 0 < added < 1 << 32:
            offsets.add(added)
        by_word: dict[str, list[int]] = {}
        for k, v in list(node.items())[:512]:
            if isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and 0 < v < 1 << 32:
                by_word.setdefault(k.split("_")[0], []).append(v)
        for word, ints in by_word.items():
            if word not in _GENERIC_WORDS and len(ints) <= 16:  # a few fields about one thing
                offsets.update(a * b for i, a in enumerate(ints) for b in ints[i + 1:] if a * b > MAX_OFFSET)
    return out


def _vocab_dims(ckpt: Checkpoint, tokenizer_size: int | None, separate: set[int],
                stated: dict[int, set[int]]) -> tuple[set[int], set[int]]:
    """(vocab row counts, model widths): from named embeddings, else the 2-D tensor nearest the tokenizer."""
    named = [t.shape for n, t in ckpt.model.items() if t.is_float and len(t.shape) == 2 and EMBEDDING_NAMES.search(n)
             and not NOT_VOCAB_NAMES.search(n) and t.shape[0] not in separate]
    if not named and tokenizer_size:
        near = max(16, tokenizer_size // 8)
        candidates = [t.shape for n, t in ckpt.model.items() if t.is_float and len(t.shape) == 2
                      and t.shape[0] > t.shape[1] and abs(t.shape[0] - tokenizer_size) <= near
                      and t.shape[0] not in separate
                      and not NOT_VOCAB_NAMES.search(n) and not PER_LAYER.search(n)]
        named = sorted(candidates, key=lambda s: abs(s[0] - tokenizer_size))[:1]
    if not named:  # no embedding to go by: heads by name (their rows are the vocab's)
        named = [t.shape for n, t in ckpt.model.items() if t.is_float and len(t.shape) == 2 and HEAD_NAMES.search(n)
                 and not PER_LAYER.search(n) and t.shape[0] not in separate][:1]
    if not named:  # nor a head: a table named like one whose rows are the recorded LM size plus stated rows
        named = [(t.shape[0], t.shape[1]) for n, t in ckpt.model.items() if embedding_like(n, t)
                 and any(t.shape[0] - lm in offsets for lm, offsets in stated.items())][:1]
    rows = {s[0] for s in named}
    widths = {s[1] for s in named}
    # a factorised or projected head has another width (ALBERT, DeBERTa-v2's embedding_size): its name says so
    widths |= {t.shape[1] for n, t in ckpt.model.items() if len(t.shape) == 2 and t.shape[0] in rows
               and HEAD_NAMES.search(n) and not PER_LAYER.search(n) and t.shape[1] not in rows}
    return rows, widths


def near(n: int, rows: set[int]) -> bool:
    """`n` within the rows a resize plausibly adds or removes (a head resized apart from its embedding)."""
    return any(abs(n - r) <= max(16, r // 8) for r in rows)


def _vocab_shaped(shape: tuple[int, ...], rows: set[int], widths: set[int]) -> bool:
    return (len(shape) == 2 and shape[0] in rows and shape[1] in widths) or (len(shape) == 1 and shape[0] in rows) \
        or (len(shape) == 2 and shape[0] == 1 and shape[1] in rows)


def _role(name: str, t: TensorInfo, rows: set[int], widths: set[int], other_dims: set[int]) -> str | None:
    """embedding | head | head-bias, or None when `t` is not (certainly) a vocab tensor."""
    if not t.is_float or NOT_VOCAB_NAMES.search(name):
        return None
    shape = t.shape
    named = bool(EMBEDDING_NAMES.search(name) or HEAD_NAMES.search(name))
    if len(shape) == 2 and shape[0] in rows and shape[1] in widths:
        if shape[0] in widths and not named:  # a square matrix when the vocab equals the width: names only
            return None
        if PER_LAYER.search(name) and not EMBEDDING_NAMES.search(name):
            return None
        return "embedding" if EMBEDDING_NAMES.search(name) or not HEAD_NAMES.search(name) else "head"
    if len(shape) == 2 and EMBEDDING_NAMES.search(name) and shape[1] in widths:
        return "embedding"  # another embedding with its own vocab (FSMT's source and target tables)
    if HEAD_NAMES.search(name) and not PER_LAYER.search(name) and len(shape) in (1, 2) and near(shape[0], rows) \
            and (len(shape) == 1 or shape[1] in widths):  # a head resized apart from its embedding (CKF104)
        return "head" if len(shape) == 2 else "head-bias"
    bias_like = name.endswith("bias") or "logit" in name
    if len(shape) == 1 and shape[0] in rows and (bias_like or shape[0] not in other_dims | widths):
        return None if PER_LAYER.search(name) else "head-bias"
    if len(shape) == 2 and shape[0] == 1 and shape[1] in rows and (bias_like or shape[1] not in other_dims):
        return "head-bias"
    return None


def _attach_moments(ckpt: Checkpoint, mapping: ParamMapping, found: dict[str, VocabTensor]) -> None:
    if ckpt.optimizer is None:
        return
    unmatched = []
    for vt in found.values():
        index = mapping.index_of(vt.tied_to or vt.name)
        if index is None:
            if vt.tied_to is None:
                unmatched.append(vt)
            continue
        _attach(ckpt, vt, index)
    _attach_by_shape(ckpt, mapping, unmatched)


def _attach(ckpt: Checkpoint, vt: VocabTensor, index) -> None:
    vt.optimizer_index = index
    assert ckpt.optimizer is not None
    ps = ckpt.optimizer.state.get(index)
    if ps is not None:
        # shaped like the parameter, or a factored statistic's row factor ((rows,) / (rows, 1): Adafactor, CAME)
        vt.moments = {k: t for k, t in ps.tensors.items() if t.shape and (
            len(t.shape) == len(vt.shape) or (len(vt.shape) == 2 and t.shape in ((vt.rows,), (vt.rows, 1))))}


def _attach_by_shape(ckpt: Checkpoint, mapping: ParamMapping, unmatched: list[VocabTensor]) -> None:
    """An untied embedding and head share their shape, so names cannot be recovered by shape when the
    parameter order is lost (safetensors stores tensors by name). They do share a row plan, so pairing
    k same-shape vocab tensors with the k unmapped same-shape state entries is enough for the surgery:
    every one of those moments follows the same row moves whichever tensor it belongs to. Fewer entries than
    tensors: the entries are paired with the first ones, the others have none (`surgery.plan` says so)."""
    from ckptfix.mapping import moment_shape

    assert ckpt.optimizer is not None
    free = [i for i in ckpt.optimizer.indices() if i not in mapping.names]
    groups: dict[tuple, list[VocabTensor]] = {}
    for vt in unmatched:
        groups.setdefault(vt.shape, []).append(vt)
    for shape, tensors in groups.items():
        candidates = [i for i in free if moment_shape(ckpt.optimizer.state.get(i)) == shape]
        # fewer entries than tensors: the rest are buffers or frozen (IBert's `weight_integer` beside its
        # embedding); which tensor holds which entry does not matter either: the rows move the same way
        if 0 < len(candidates) <= len(tensors):
            for vt, index in zip(tensors, candidates):
                _attach(ckpt, vt, index)
                vt.index_known = len(tensors) == 1


def tied_head_missing(ckpt: Checkpoint) -> bool:
    """HF drops a tied lm_head from safetensors; config.json says whether it is tied.

    `safetensors.torch.save_model` drops it too and records the alias in the file's metadata
    (dropped name -> kept name), which says the same without a config.
    """
    config = ckpt.extras.get("config")
    has_head = any(v for v in ckpt.model if v.startswith("lm_head") or v.endswith("lm_head.weight"))
    if isinstance(config, dict) and bool(config.get("tie_word_embeddings", False)) and not has_head:
        return True
    metadata = ckpt.extras.get("__metadata__")
    return isinstance(metadata, dict) and any(
        isinstance(kept, str) and kept in ckpt.model and dropped not in ckpt.model and HEAD_NAMES.search(dropped)
        and EMBEDDING_NAMES.search(kept) for dropped, kept in metadata.items())


def quantized_vocab_tensors(ckpt: Checkpoint, vocab: list[VocabTensor]) -> list[str]:
    """Quantized model tensors with a vocab tensor's row count as their first dimension (a torch.ao
    quantized embedding's `_packed_weight`, a quantized head): vocab tensors repair cannot resize."""
    from ckptfix.dtypes import QUANTIZED_DTYPES

    rows = {v.rows for v in vocab}
    return [n for n, t in ckpt.model.items() if t.dtype in QUANTIZED_DTYPES and t.shape and t.shape[0] in rows]


def trainable_token_rows(ckpt: Checkpoint) -> dict[str, list[int]]:
    """A PEFT adapter's `trainable_token_indices` (PEFT >= 0.15: only these rows of the embedding train, saved
    as `<module>.token_adapter.trainable_tokens_delta`, one row per id, in this order): module -> token ids.
    A bare list is for the input embedding (PEFT names it `embed_tokens`)."""
    config = ckpt.extras.get("config") if ckpt.format == "peft-adapter" else None
    raw = config.get("trainable_token_indices") if isinstance(config, dict) else None
    if isinstance(raw, list):
        raw = {"embed_tokens": raw}
    if not isinstance(raw, dict):
        return {}
    return {str(k): [i for i in v if isinstance(i, int) and not isinstance(i, bool)]
            for k, v in raw.items() if isinstance(v, list) and v}


def id_list(ids: list[int]) -> str:
    """At most 8 token ids, then how many more."""
    return ", ".join(map(str, ids[:8])) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")
