"""Vocab sizes a checkpoint records about itself, besides its tensors' shapes.

Frameworks rebuild the model from a recorded size before they load the weights: HF `config.json`'s
`vocab_size`, nanoGPT's `model_args['vocab_size']` (`init_from='resume'`), Lightning's
`hyper_parameters`, litgpt's `padded_vocab_size`, and any `vocab_size`-like entry of a saved config or
args dict. A recorded size that disagrees with the rows makes that rebuild fail to load the weights, so
inspect checks them (CKF115) and repair updates them with the rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

# Keys that record the number of vocab rows (litgpt's `vocab_size` is the tokenizer's, next to
# `padded_vocab_size`, the rows: see `_row_keys`).
VOCAB_KEYS = ("vocab_size", "padded_vocab_size", "n_vocab", "ntoken", "ntokens", "num_tokens")
_MAX_DEPTH = 8  # configs nest a few levels (Composer: state.integrations.huggingface.model.config.content)


@dataclass(frozen=True)
class Recorded:
    """One recorded size: where it is (keys from the checkpoint's top level) and its value."""

    path: tuple[Any, ...]
    value: int
    rows_key: bool  # this key records the rows (False: litgpt's tokenizer-sized `vocab_size`)

    @property
    def where(self) -> str:
        return ".".join(str(k) for k in self.path)


def find_recorded(extras: dict[str, Any]) -> list[Recorded]:
    """Every vocab-size entry in the non-tensor parts of a checkpoint (dicts only; objects stay unread)."""
    return list(_walk(extras, (), set()))


def _walk(node: Any, path: tuple[Any, ...], seen: set[int]) -> Iterator[Recorded]:
    # each dict once: a pickle can share one dict under many keys (a DAG exponential as a tree)
    if len(path) > _MAX_DEPTH or not isinstance(node, dict) or id(node) in seen:
        return
    seen.add(id(node))
    rows_keys = _row_keys(node)
    for key, value in node.items():
        if key in VOCAB_KEYS and isinstance(value, int) and not isinstance(value, bool) and value > 0:
            yield Recorded(path + (key,), value, key in rows_keys)
        elif isinstance(value, dict):
            yield from _walk(value, path + (key,), seen)


def _row_keys(node: dict) -> set[str]:
    """The keys of `node` that must equal the rows: litgpt records both the tokenizer's `vocab_size` and the
    `padded_vocab_size` the model is built with; only the latter is the rows."""
    keys = {k for k in VOCAB_KEYS if k in node}
    if "padded_vocab_size" in keys:
        keys.discard("vocab_size")
    return keys


def recorded_rows(extras: dict[str, Any]) -> set[int]:
    """The row counts a checkpoint records for its model (config.json `vocab_size`, nanoGPT's model_args,
    openai-whisper's dims `n_vocab`, ...): the fit rule's evidence that rows above the tokenizer are the
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
        if r.rows_key and r.value in old_rows and r.value != new_rows:
            out[r.path] = new_rows
        elif not r.rows_key and r.value != tokens:  # litgpt's vocab_size: the tokenizer's size
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
