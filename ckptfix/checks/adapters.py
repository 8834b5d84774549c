"""LoRA/PEFT adapters: adapters that never trained, trainable token rows the tokenizer no longer matches."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:
    import numpy as np
else:
    from ckptfix.lazy_numpy import np

from ckptfix.checkpoint import distinct_stored, widen_stored
from ckptfix.checks.codes import Context, Finding, check, finding

LORA_B_MARKERS = ("lora_B", "lora_embedding_B")


@check("CKF601", "error", "LoRA adapters still exactly zero",
       "Every lora_B tensor is exactly zero: the adapters never received an update.")
def lora_never_trained(ctx: Context) -> Iterator[Finding]:
    # lora_B starts at zero (so the adapted model starts equal to the base). After one real update it is
    # not zero any more. These tensors are small (rank x width), so reading them is cheap even without --scan.
    names = [n for n in ctx.ckpt.model if any(m in n for m in LORA_B_MARKERS)]
    if not names:
        return
    zero = [n for n in names if _all_zero(ctx.ckpt.model[n])]
    if len(zero) != len(names):
        if zero:
            yield finding("CKF601", f"{len(zero)} of {len(names)} lora_B tensors are exactly zero", severity="warning",
                          pytorch="Those adapters never changed; their modules may be frozen or unused.",
                          tensors=zero[:20])
        return
    yield finding(
        "CKF601", f"all {len(names)} lora_B tensors are exactly zero: the adapter never trained",
        pytorch="A LoRA update is B @ A with B initialised to zero; zero B after training means no optimizer step "
        "touched it (0 trainable parameters, adapters frozen after get_peft_model, or the loss graph cut).",
        fix="Run ckptfix.check_training_setup(model, optimizer) before training, or add "
        "ckptfix.integrations.transformers.ResumeGuardCallback() to the Trainer.", tensors=zero[:20])


def _all_zero(tensor) -> bool:
    try:
        # the distinct stored values: a stride-0 view of a few values must not be walked element by element
        return not np.any(widen_stored(distinct_stored(tensor.read_stored())[0], tensor.dtype))
    except Exception:  # unreadable bytes are reported by --verify, not here
        return False


def _token_rows(ctx: Context) -> list[tuple[str, int]]:
    from ckptfix.vocab import trainable_token_rows

    return [(module, i) for module, ids in trainable_token_rows(ctx.ckpt).items() for i in ids]


@check("CKF111", "error", "PEFT trainable token rows for ids the tokenizer does not have",
       "A PEFT adapter's trainable_token_indices name ids at or past the tokenizer's size: those trained rows "
       "belong to tokens the tokenizer no longer has.")
def trainable_tokens_out_of_range(ctx: Context) -> Iterator[Finding]:
    if ctx.tokenizer is None:
        return
    from ckptfix.vocab import id_list

    outside = sorted({i for _, i in _token_rows(ctx) if i >= ctx.tokenizer.size})
    if outside:
        yield finding(
            "CKF111", f"the adapter trains rows for token ids {id_list(outside)}, but the tokenizer has "
            f"{ctx.tokenizer.size} tokens", tensors=_delta_tensors(ctx),
            pytorch="PeftModel.from_pretrained on a base resized to this tokenizer raises IndexError ('index "
            f"{outside[0]} is out of bounds for dimension 0 with size {ctx.tokenizer.size}').",
            fix=ctx.repair_command())


@check("CKF112", "error", "PEFT trainable token ids moved to other tokens",
       "The tokenizer the adapter was trained with is known and the new tokenizer gives the tokens of its "
       "trainable_token_indices other ids (or drops them): the adapter's rows would train and apply to other tokens.")
def trainable_tokens_moved(ctx: Context) -> Iterator[Finding]:
    old = ctx.old_tokenizer
    if ctx.tokenizer is None or old is None or ctx.tokenizer.id_to_token() is None or old.info.id_to_token() is None:
        return
    before, after = old.info.id_to_token(), ctx.tokenizer.token_to_id()
    moved = []
    for _, i in _token_rows(ctx):
        token = before[i] if i < len(before) else None
        if token is not None and after.get(token) != i:
            moved.append(f"{token!r} {i} -> {after.get(token, 'gone')}")
    if moved:
        yield finding(
            "CKF112", f"{len(moved)} trainable token(s) of the adapter change id in the new tokenizer: "
            f"{', '.join(moved[:5])}", tensors=_delta_tensors(ctx),
            pytorch="PEFT applies trainable_tokens_delta row k to id trainable_token_indices[k], whatever token "
            "has that id now: no error, the rows silently belong to other tokens.", fix=ctx.repair_command())


def _delta_tensors(ctx: Context) -> list[str]:
    return [n for n in ctx.ckpt.model if "trainable_tokens_delta" in n][:20]
