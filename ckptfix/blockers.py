"""Why `ckptfix repair` would refuse a checkpoint's vocab tensors, decided from the model alone (inspect prints it
instead of a repair command that would fail). Apart from `vocab.py` because it asks a format (litgpt's folder),
and finding vocab tensors must not import the formats."""

from __future__ import annotations

from ckptfix.checkpoint import Checkpoint
from ckptfix.vocab import (
    VocabTensor,
    id_list,
    quantized_vocab_tensors,
    rows_past_recorded,
    split_table,
    trainable_token_rows,
)


def repair_blocker(ckpt: Checkpoint, vocab: list[VocabTensor]) -> str | None:
    """Why `ckptfix repair` would refuse this checkpoint's vocab tensors, decided from the model alone; inspect
    prints it instead of a repair command that would fail."""
    import os

    from ckptfix.formats import litgpt_folder

    folder = os.path.dirname(ckpt.path)
    if ckpt.format == "torch" and os.path.basename(ckpt.path) == litgpt_folder.WEIGHTS and \
            litgpt_folder.sniff(folder or "."):
        return (f"{ckpt.path} is a litgpt checkpoint whose vocab size is recorded in the {litgpt_folder.CONFIG} "
                f"beside it: inspect and repair the folder {folder or '.'} instead, so both change together")
    tokens = trainable_token_rows(ckpt)
    if tokens:
        ids = sorted({i for rows in tokens.values() for i in rows})
        return (f"the PEFT adapter trains rows for token ids {id_list(ids)} of {', '.join(sorted(tokens))} "
                "(trainable_token_indices); ckptfix does not rewrite those rows or their ids: re-create the adapter "
                "for the new tokenizer with the new ids of those tokens")
    split = split_table(ckpt) if not vocab else None
    if split is not None:
        first, second = split
        return (f"the embedding is saved in two parts that its loader concatenates, {first.name} ({first.shape[0]} "
                f"rows) and {second.name} ({second.shape[0]}): {first.shape[0] + second.shape[0]} rows in all "
                "(Molmo2: vocab_size + additional_vocab_size), split at a row the save chose; ckptfix does not "
                "resize a table saved in parts: grow it with the model's own code")
    past = rows_past_recorded(ckpt, vocab)
    if past is not None:
        v, lm = past
        return (f"{v.name} has {v.rows} rows, {v.rows - lm} past the vocab size {lm} its config records, and the "
                "model has no head to tell whether they are rows the class adds past its vocab (MllamaModel: "
                "vocab_size + 8) or the config was left at an old size: which rows are tokens is not recorded. "
                f"If the class adds them, pass --own-rows {v.rows - lm}; if not, set the recorded vocab size to "
                f"{v.rows} and repair again")
    quantized = quantized_vocab_tensors(ckpt, vocab)
    if quantized:
        return (f"{quantized[0]} is a quantized vocab tensor ({ckpt.model[quantized[0]].dtype}"
                f"{f' and {len(quantized) - 1} more' if len(quantized) > 1 else ''}): ckptfix does not resize "
                "quantized tensors (new rows and per-channel scales cannot be computed from the integers); "
                "resize the float model, then quantize it again")
    return None
