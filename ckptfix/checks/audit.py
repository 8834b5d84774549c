"""CKF130-CKF133: values that carry the old vocab size and that nobody accounts for.

Made by `ckptfix.audit` after the repair plan (inspect builds the plan repair would make), so they are
declared here rather than checked: `run_checks` runs before there is a plan."""

from __future__ import annotations

from ckptfix.checks.codes import declare

declare("CKF130", "error", "a tensor with the vocab size that repair would not resize",
        "A tensor outside the plan (an optimizer state ckptfix has no reader for: nested dicts, lists of state "
        "tensors, a second optimizer, bitsandbytes' 8-bit state; a model tensor that is not a vocab tensor by name "
        "or place) has the old vocab size along an axis: written back unchanged, it breaks the first step.")
declare("CKF131", "error", "a flat buffer whose length includes a vocab tensor",
        "A 1-D tensor as long as the parameters it flattens, a vocab tensor among them: its layout is not known, "
        "so it cannot be resized with the rows.")
declare("CKF132", "error", "a recorded integer equal to the vocab size that repair would not change",
        "An integer in a saved config, hparams or args (nested configs included) equals the old row count or the old "
        "tokenizer's size, and neither the plan changes it nor its name says what else it counts.")
declare("CKF133", "error", "vocab tensors whose row counts are not one vocabulary",
        "A table far from the LM's rows (a second vocabulary with its own tokenizer, a Q-Former's BERT table), or "
        "an embedding with rows beyond the vocab size the config records (image tokens): resizing them as the LM's "
        "vocab damages the model.")
