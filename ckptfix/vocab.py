"""Find the vocab-sized tensors of a checkpoint: embeddings, LM heads (tied or not), their moments."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ckptfix.checkpoint import Checkpoint, TensorInfo
from ckptfix.mapping import ParamMapping

EMBEDDING_NAMES = re.compile(
    r"(^|\.)(embed_tokens|wte|word_embeddings|tok_embeddings|text_embedding|token_embedding|tok_emb|"
    r"shared|embed_in|word_emb|token_emb|tok_embed|embedding)\.weight$")
HEAD_NAMES = re.compile(
    r"((^|\.)(lm_head|output|embed_out|text_head|head|decoder|generator|lm_logits)\.(weight|bias)$)"
    r"|((^|\.)lm_head\.bias$)|(final_logits_bias$)")
PADDING_MULTIPLES = (8, 16, 32, 64, 128, 256)


@dataclass
class VocabTensor:
    name: str
    role: str  # embedding | head | head-bias | vocab-sized
    rows: int
    shape: tuple[int, ...]
    tied_to: str | None = None  # the embedding this head shares storage with
    moments: dict[str, TensorInfo] = field(default_factory=dict)  # exp_avg -> its TensorInfo
    optimizer_index: Any = None
    index_known: bool = True  # False: paired with a same-shape entry (the moments' row plan is the same either way)

    def to_json(self) -> dict:
        return {"name": self.name, "role": self.role, "rows": self.rows, "shape": list(self.shape),
                "tied_to": self.tied_to, "optimizer_index": self.optimizer_index if self.index_known else None,
                "moments": {k: list(t.shape) for k, t in self.moments.items()}}


def vocab_rows(vocab: list[VocabTensor]) -> int | None:
    """The checkpoint's vocab row count: the input embedding's, else the first vocab tensor's."""
    embed = next((v for v in vocab if v.role == "embedding"), vocab[0] if vocab else None)
    return embed.rows if embed is not None else None


def _role(name: str, t: TensorInfo) -> str | None:
    if not t.is_float:
        return None
    if len(t.shape) == 2 and EMBEDDING_NAMES.search(name):
        return "embedding"
    if HEAD_NAMES.search(name):
        return "head" if len(t.shape) == 2 and name.endswith("weight") else "head-bias"
    return None


def padded_size(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def padding_multiple(rows: int, tokens: int) -> int | None:
    """The multiple the rows were rounded up to from `tokens`, if they were (e.g. 32128 from 32100)."""
    return next((m for m in PADDING_MULTIPLES if rows > tokens and padded_size(tokens, m) == rows), None)


def find_vocab_tensors(ckpt: Checkpoint, mapping: ParamMapping, tokenizer_size: int | None = None) -> list[VocabTensor]:
    """Embedding/head tensors by name, then any other 2-D tensor with the same row count."""
    found: dict[str, VocabTensor] = {}
    for name, t in ckpt.model.items():
        role = _role(name, t)
        if role == "head-bias":
            rows = t.shape[-1] if t.shape else 0
        elif role is not None:
            rows = t.shape[0]
        else:
            continue
        found[name] = VocabTensor(name, role, rows, t.shape, tied_to=ckpt.tied.get(name))
    sizes = {v.rows for v in found.values() if v.role == "embedding"} or {v.rows for v in found.values()}
    if tokenizer_size:
        sizes.add(tokenizer_size)
    for name, t in ckpt.model.items():
        if name not in found and t.is_float and len(t.shape) == 2 and t.shape[0] in sizes and t.shape[0] > t.shape[1]:
            found[name] = VocabTensor(name, "vocab-sized", t.shape[0], t.shape, tied_to=ckpt.tied.get(name))
    _drop_non_vocab_heads(found)
    _attach_moments(ckpt, mapping, found)
    return list(found.values())


def _drop_non_vocab_heads(found: dict[str, VocabTensor]) -> None:
    # "head"/"output"/"decoder" also name classifier and attention projections: keep a head only when
    # its rows match an embedding's (or there is no embedding to compare with).
    embed_rows = {v.rows for v in found.values() if v.role == "embedding"}
    if not embed_rows:
        return
    for name in [n for n, v in found.items() if v.role in ("head", "head-bias") and v.rows not in embed_rows]:
        if found[name].rows < min(embed_rows) // 2:
            del found[name]


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
        vt.moments = {k: t for k, t in ps.tensors.items() if t.shape and len(t.shape) == len(vt.shape)}


def _attach_by_shape(ckpt: Checkpoint, mapping: ParamMapping, unmatched: list[VocabTensor]) -> None:
    """An untied embedding and head share their shape, so names cannot be recovered by shape when the
    parameter order is lost (safetensors stores tensors by name). They do share a row plan, so pairing
    k same-shape vocab tensors with the k unmapped same-shape state entries is enough for the surgery:
    every one of those moments follows the same row moves whichever tensor it belongs to."""
    from ckptfix.mapping import moment_shape

    assert ckpt.optimizer is not None
    free = [i for i in ckpt.optimizer.indices() if i not in mapping.names]
    groups: dict[tuple, list[VocabTensor]] = {}
    for vt in unmatched:
        groups.setdefault(vt.shape, []).append(vt)
    for shape, tensors in groups.items():
        candidates = [i for i in free if moment_shape(ckpt.optimizer.state.get(i)) == shape]
        if len(candidates) == len(tensors):
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
