"""Vocab sizes a checkpoint records about itself, besides its tensors' shapes.

Frameworks rebuild the model from a recorded size before they load the weights: HF `config.json`'s
`vocab_size`, nanoGPT's `model_args['vocab_size']` (`init_from='resume'`), Lightning's
`hyper_parameters`, litgpt's `padded_vocab_size`, and any `vocab_size`-like entry of a saved config or
args dict. A recorded size that disagrees with the rows makes that rebuild fail to load the weights, so
inspect checks them (CKF115) and repair updates them with the rows.

A composite HF config (a vision-language or audio model) builds its text model from one sub-config, the one
transformers' `PreTrainedConfig.get_text_config(decoder=True)` returns: `decoder`, `generator` or
`text_config`, else the one sub-config that itself holds one (a wrapper: ColPali's `vlm_config`), else the
config itself (a flat encoder-decoder's decoder size under `decoder_vocab_size`/`tgt_vocab_size`, the encoder's
`vocab_size`/`src_vocab_size` then separate). That `vocab_size` is the LM's; a composite's own top-level `vocab_size`
beside a text sub-config (PaliGemma's default 257152) is unused by the model, and the other sub-configs' sizes
(a Q-Former's, a protein or speech encoder's) are separate vocabularies with their own tokenizers: listed,
never checked or resized against the LM tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

# Keys that record the number of vocab rows (litgpt's `vocab_size` is the tokenizer's, next to
# `padded_vocab_size`, the rows: see `_row_keys`).
VOCAB_KEYS = ("vocab_size", "padded_vocab_size", "n_vocab", "ntoken", "ntokens", "num_tokens", "decoder_vocab_size",
              "tgt_vocab_size", "src_vocab_size")
# A flat encoder-decoder config that names its decoder's (target's) vocabulary apart: transformers'
# `get_text_config(decoder=True)` reads `decoder_<key>` as the decoder's `<key>` (Marian's `decoder_vocab_size`),
# FSMT maps `vocab_size` to `tgt_vocab_size`. That one is the LM's rows; the encoder's (source's) is separate.
DECODER_VOCAB_KEYS = ("decoder_vocab_size", "tgt_vocab_size")
ENCODER_VOCAB_KEYS = ("src_vocab_size", "vocab_size")
# A bare `vocab` (a LightningModule's `__init__(vocab)` saved by `save_hyperparameters`): role "follow", updated
# with the rows when it equals them, but too generic a name to be the fit rule's evidence or CKF115's subject.
FOLLOW_KEYS = ("vocab",)
# transformers' `get_text_config(decoder=True)` names, in its order: the sub-config the text model is built from
TEXT_CONFIG_KEYS = ("decoder", "generator", "text_config", "text_encoder")
_MAX_DEPTH = 8  # configs nest a few levels (Composer: state.integrations.huggingface.model.config.content)


@dataclass(frozen=True)
class Recorded:
    """One recorded size: where it is (keys from the checkpoint's top level) and its value."""

    path: tuple[Any, ...]
    value: int
    role: str  # rows | tokens (litgpt's tokenizer-sized `vocab_size`) | separate (another vocabulary) | unused
    # | follow (a FOLLOW_KEYS entry)

    @property
    def rows_key(self) -> bool:
        """This value records the LM's rows (what repair keeps equal to them)."""
        return self.role == "rows"

    @property
    def where(self) -> str:
        return ".".join(str(k) for k in self.path)


def find_recorded(extras: dict[str, Any]) -> list[Recorded]:
    """Every vocab-size entry in the non-tensor parts of a checkpoint (dicts only; objects stay unread)."""
    return list(_walk(extras, (), set(), None))


def separate_vocabularies(extras: dict[str, Any]) -> list[Recorded]:
    """Vocab sizes of other vocabularies than the LM's (a composite config's other sub-configs)."""
    return [r for r in find_recorded(extras) if r.role == "separate"]


def _walk(node: Any, path: tuple[Any, ...], seen: set[int], role: str | None) -> Iterator[Recorded]:
    """`role` forces the role of every size below (inside a composite config's non-text sub-config)."""
    # each dict once: a pickle can share one dict under many keys (a DAG exponential as a tree)
    if len(path) > _MAX_DEPTH or not isinstance(node, dict) or id(node) in seen:
        return
    seen.add(id(node))
    rows_keys = _row_keys(node)
    text = (text_config_key(node) or wrapped_text_key(node)) if role is None else None
    composite = role is None and (text is not None or "model_type" in node)
    encoder_side = ENCODER_VOCAB_KEYS if any(k in node for k in DECODER_VOCAB_KEYS) else ("src_vocab_size",)
    for key, value in node.items():
        if key in VOCAB_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            own = "separate" if key in encoder_side else "rows" if key in rows_keys else "tokens"
            yield Recorded(path + (key,), value, role or ("unused" if text is not None else own))
        elif _other_vocabulary(key) and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            yield Recorded(path + (key,), value, role or "separate")
        elif key in FOLLOW_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            yield Recorded(path + (key,), value, role or "follow")
        elif isinstance(value, dict):
            other = composite and key != text and _is_sub_config(key, value)
            yield from _walk(value, path + (key,), seen, "separate" if other else role)


def _is_sub_config(key: Any, value: dict) -> bool:
    """A model's config nested in another's (`vision_config`, `qformer_config`, `protein_encoder_config`,
    an encoder-decoder's `encoder`): transformers builds another model from it, with its own vocabulary."""
    return "model_type" in value or str(key).endswith("_config") or key in ("encoder", "decoder", "generator")


def text_config_key(node: dict) -> str | None:
    """The key of the sub-config a composite HF config builds its text model from (`get_text_config(decoder=True)`),
    when it records a vocab size; None for a flat config, or when several candidates make it ambiguous (as
    transformers itself raises), and then every size in it is taken as the LM's. A decoder over audio
    codebooks (`num_codebooks`: MusicGen's, its vocab_size the codebook's 2048) is not a text model: there the
    text vocabulary is the `text_encoder`'s (T5's, the processor's tokenizer), and the codes are separate."""
    keys = [k for k in TEXT_CONFIG_KEYS if isinstance(node.get(k), dict)
            and any(v in node[k] for v in VOCAB_KEYS) and "num_codebooks" not in node[k]]
    return keys[0] if len(keys) == 1 else None


CODEBOOK_KEYS = ("num_embeddings", "codebook_size")  # a VQ image tokenizer's codebook (GLM-Image's, Chameleon's vq_config)


def _other_vocabulary(key: Any) -> bool:
    """A size the config itself names as another vocabulary's (`<name>_vocab_size`: Pop2Piano's
    `composer_vocab_size`, its composer embedding; a VQ codebook's size): separate. Token-type, segment and
    position tables are not vocabularies (BERT's `type_vocab_size`), nor rows the LM's own vocabulary adds
    (Molmo2's and Idefics' `additional_vocab_size`: ids past vocab_size, in the same table or one beside it)
    or leaves out (Inkling's `unpadded_vocab_size`)."""
    return isinstance(key, str) and (key in CODEBOOK_KEYS or key.endswith("_vocab_size") and key not in VOCAB_KEYS
                                     and not any(word in key for word in ("type", "segment", "position"))
                                     and not key.startswith(("additional_", "unpadded_")))


def wrapped_text_key(node: dict, memo: dict[int, str | None] | None = None) -> str | None:
    """The one sub-config that is itself a composite with a text config, when a config wraps a whole model's
    (ColPali's `vlm_config`: its `get_text_config` is `vlm_config.get_text_config()`; PI0's `vlm_config` beside
    its action expert's flat `dit_config`): the LM lives in it. None when no sub-config, or several, hold one.
    Each dict is looked at once (`memo`): a pickled dict may contain itself, or one dict many times."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = None
    keys = [k for k, v in node.items() if isinstance(v, dict) and _is_sub_config(k, v)
            and (text_config_key(v) or wrapped_text_key(v, memo))]
    memo[id(node)] = keys[0] if len(keys) == 1 else None
    return memo[id(node)]


def _row_keys(node: dict) -> set[str]:
    """The keys of `node` that must equal the rows: litgpt records both the tokenizer's `vocab_size` and the
    `padded_vocab_size` the model is built with; only the latter is the rows."""
    keys = {k for k in VOCAB_KEYS if k in node}
    if "padded_vocab_size" in keys:
        keys.discard("vocab_size")
    return keys


def recorded_rows(extras: dict[str, Any]) -> set[int]:
    """The row counts a checkpoint records for its model (config.json `vocab_size`, nanoGPT's model_args,
    openai-whisper's dims `n_vocab`, a composite config's text sub-config's, ...): the fit rule's evidence that rows above the tokenizer are the
    model's own size."""
    return {r.value for r in find_recorded(extras) if r.rows_key}


def recorded_padding(extras: dict[str, Any], rows: int) -> int | None:
    """The padding multiple a checkpoint records beside its row count (litgpt's `padding_multiple`, with
    `padded_vocab_size` equal to the rows): the multiple the framework itself rounds a vocab size up to.
    Found where `find_recorded` finds that `padded_vocab_size`."""
    for r in find_recorded(extras):
        if r.path[-1] == "padded_vocab_size" and r.value == rows:
            node: Any = extras
            for key in r.path[:-1]:
                node = node[key]
            multiple = node.get("padding_multiple")
            if isinstance(multiple, int) and not isinstance(multiple, bool) and 1 < multiple <= rows:
                return multiple
    return None


def megatron_padding(extras: dict[str, Any], rows: int) -> tuple[int, str] | None:
    """Megatron-LM's vocab padding recorded in its `args` (`_vocab_size_with_padding`): the tokenizer's size
    rounded up to make_vocab_size_divisible_by x tensor_model_parallel_size, when `padded_vocab_size` is the
    rows. (multiple, how it was found), or None."""
    args = extras.get("args")
    if not isinstance(args, dict) or args.get("padded_vocab_size") != rows:
        return None
    divisible, tp = args.get("make_vocab_size_divisible_by"), args.get("tensor_model_parallel_size", 1)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (divisible, tp)):
        return None
    return divisible * tp, (f"Megatron's make_vocab_size_divisible_by {divisible} x tensor_model_parallel_size "
                            f"{tp}, from the checkpoint's args")


def disagreeing(recorded: list[Recorded], rows: set[int]) -> list[Recorded]:
    """Recorded row counts that no vocab tensor has."""
    return [r for r in recorded if r.rows_key and r.value not in rows]


def updates(recorded: list[Recorded], old_rows: set[int], new_rows: int, tokens: int) -> dict[tuple, int]:
    """path -> new value for a repair to `new_rows` rows and a `tokens`-id tokenizer."""
    out = {}
    for r in recorded:
        # a separate vocabulary the LM's size: its tensors cannot be told from the LM's and are resized with them
        if r.role in ("rows", "separate", "follow") and r.value in old_rows and r.value != new_rows:
            out[r.path] = new_rows
        elif r.role == "tokens" and r.value != tokens:  # litgpt's vocab_size: the tokenizer's size
            out[r.path] = min(tokens, new_rows)
    return out


def apply(tree: Any, changes: dict[tuple, int]) -> Any:
    """A copy of `tree` with the recorded sizes changed; the dicts on each changed path are copied, the rest
    shared (and so written back verbatim)."""
    if not changes:
        return tree
    out = type(tree)(tree) if isinstance(tree, dict) else tree
    for path, value in changes.items():
        node = out
        for key in path[:-1]:
            child = node[key]
            copy = type(child)(child)
            if hasattr(child, "_metadata"):
                copy._metadata = child._metadata
            node[key] = copy
            node = copy
        node[path[-1]] = value
    return out


def _config_items(extras: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """Every (key, value) of every dict in the non-tensor parts, each dict once, bounded (depth, 10,000 dicts)."""
    stack: list[tuple[Any, int]] = [(extras, 0)]
    seen: set[int] = set()
    while stack and len(seen) < 10_000:
        node, depth = stack.pop()
        if not isinstance(node, dict) or id(node) in seen or depth > _MAX_DEPTH:
            continue
        seen.add(id(node))
        for key, value in node.items():
            yield key, value
            if isinstance(value, dict):
                stack.append((value, depth + 1))


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def model_token_ids(extras: dict[str, Any]) -> set[int]:
    """Token ids a config names as the model's own (`image_token_index`, `boi_token_id`, ...: keys ending
    in `_token_index`, `_token_id` or `_token_ids`), anywhere in the non-tensor parts."""
    out: set[int] = set()
    for key, value in _config_items(extras):
        if isinstance(key, str) and key.endswith(("_token_index", "_token_id", "_token_ids")):
            out.update(v for v in (value if isinstance(value, list) else [value]) if _int(v))
    return out


def other_sizes(extras: dict[str, Any]) -> set[int]:
    """The integers a config records under other names than a vocab size's (`seq_len`, `max_position_embeddings`,
    ...): a table with that many rows is sized by that, not by the vocabulary."""
    return {v for k, v in _config_items(extras) if _int(v) and k not in VOCAB_KEYS and not _other_vocabulary(k)}
