"""One vocabulary of policies for `ckptfix repair` and `ResumeGuard`.

  strict  (guard only) every structural mismatch is an error; nothing is resized or dropped.
  remap   vocab-sized tensors are resized and every optimizer state follows their rows by what it
          means (`ckptfix.optim_state`); matched to parameters by name where names are known. The
          default: where a state cannot follow its rows, repair stops and names it.
  fresh   as remap for the weights; the optimizer state is dropped (param-group options and the
          scheduler position kept) and the LR re-warms.
  reset   drop optimizer and scheduler state: the schedule starts again.

`fresh-optimizer` (the guard's spelling before the two vocabularies were merged) is accepted
everywhere as an alias of `fresh`.
"""

from __future__ import annotations

REPAIR_POLICIES = ("remap", "fresh", "reset")
GUARD_POLICIES = ("strict", *REPAIR_POLICIES)
ALIASES = {"fresh-optimizer": "fresh"}


def canonical(policy: str) -> str:
    """The policy's one spelling (aliases resolved; unknown names returned as they are)."""
    return ALIASES.get(policy, policy)
