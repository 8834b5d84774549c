"""New tokens that cannot learn, seen before the first step (issue 45 item 2): the tokenizer holds tokens past
its base vocabulary (added tokens), and nothing that trains covers the input embedding's rows: the table is
frozen and no adapter trains a copy of it or its rows (PEFT LoRA without `modules_to_save` or
`trainable_token_indices`, peft #334). Their rows stay as initialised for the whole run."""

from __future__ import annotations

from typing import Any

from ckptfix.guard.problems import Problem, format_names


def added_ids(tokenizer: Any) -> list[int]:
    """Ids past a Hugging Face tokenizer's base vocabulary (`vocab_size` excludes added tokens), the padding
    token aside (it is masked out of the loss)."""
    try:
        base, size = int(tokenizer.vocab_size), len(tokenizer)
    except (AttributeError, TypeError, ValueError):
        return []
    pad = getattr(tokenizer, "pad_token_id", None)
    return [i for i in range(base, size) if i != pad]


def frozen_new_rows(model: Any, tokenizer: Any) -> Problem | None:
    """CKF831 when the added tokens' embedding rows cannot change: no trainable parameter in the input
    embedding module (PEFT's wrappers hold their trained copy or row deltas inside it)."""
    new = added_ids(tokenizer)
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not new or embedding is None or any(p.requires_grad for p in embedding.parameters()):
        return None
    names = [str(t) for t in tokenizer.convert_ids_to_tokens(new)]
    return Problem(
        "CKF831", "warning",
        f"{len(new)} added token(s) cannot learn: the input embedding is frozen and nothing trains its rows "
        f"({format_names(names)}, ids {new[0]}-{new[-1]}); their rows stay as initialised for the whole run. "
        "With PEFT LoRA: LoraConfig(..., modules_to_save=[\"embed_tokens\", \"lm_head\"]) trains copies of the "
        f"tables, or LoraConfig(..., trainable_token_indices={new}) trains just these rows.")
