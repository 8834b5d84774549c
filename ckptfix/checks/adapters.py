"""LoRA/PEFT adapters that never trained."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ckptfix.checks import Context, Finding, check, finding

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
        return not np.any(tensor.read())
    except Exception:  # unreadable bytes are reported by --verify, not here
        return False
