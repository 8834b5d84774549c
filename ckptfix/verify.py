"""Verify: after writing, read OUT back with ckptfix's own readers and compare it with the plan.

Every change the plan prints must be in OUT (each resized tensor's shape, each recorded size set, the
optimizer state dropped when it says so, the scaler reset) and nothing else may differ in what is compared
(every other tensor's name, shape and dtype; every other recorded size). Metadata only: the index, the
configs, the optimizer state's shapes; tensor bytes are not read. On a difference `repair` removes what it
wrote (or puts the backup back) and exits 3: ckptfix wrote something other than what it said.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckptfix.checkpoint import Checkpoint
    from ckptfix.surgery.plan import RepairPlan


class VerifyFailed(Exception):
    """OUT does not hold what the plan says was written (a bug in ckptfix, not bad input: exit 3)."""


def differences(plan: RepairPlan, out: Checkpoint) -> list[str]:
    """What OUT holds that the plan did not say, or lacks that it did; [] when they agree."""
    return _model(plan, out) + _optimizer(plan, out) + _recorded(plan, out) + _scaler(plan, out)


def _model(plan: RepairPlan, out: Checkpoint) -> list[str]:
    src, diffs = plan.ckpt, []
    for name, t in src.model.items():
        owner = src.tied.get(name, name)
        want = (tuple(plan.weights[owner].new_shape) if owner in plan.weights else tuple(t.shape), t.dtype)
        got_t = out.model.get(name)
        if got_t is None:
            diffs.append(f"model tensor {name} is missing from OUT")
            continue
        got = (tuple(got_t.shape), got_t.dtype)
        if got != want:
            said = "the plan resizes it to" if owner in plan.weights else "the plan leaves it at"
            diffs.append(f"model tensor {name} is {list(got[0])} {got[1]} in OUT; {said} {list(want[0])} {want[1]}")
    diffs += [f"model tensor {name} is in OUT but not in the input" for name in out.model if name not in src.model]
    return diffs


def _optimizer(plan: RepairPlan, out: Checkpoint) -> list[str]:
    src = plan.ckpt.optimizer
    if src is None or (plan.drop_optimizer_state and out.optimizer is None):  # dropped: some writers drop the file
        return []
    if out.optimizer is None:
        return ["the optimizer state is missing from OUT"]
    got = out.optimizer
    if plan.drop_optimizer_state:
        left = [f"{i}.{k}" for i, k, _ in got.tensors()]
        return [f"the plan drops the optimizer state, but OUT holds {len(left)} state tensor(s) ({', '.join(left[:3])})"] \
            if left else []
    diffs = []
    for index, key, t in src.tensors():
        edit = plan.moments.get((index, key))
        want = (tuple(edit.new_shape) if edit is not None else tuple(t.shape), t.dtype)
        ps = got.state.get(index)
        have = ps.tensors.get(key) if ps is not None else None
        if have is None:
            diffs.append(f"optimizer state {index}.{key} is missing from OUT")
        elif (tuple(have.shape), have.dtype) != want:
            said = "the plan resizes it to" if edit is not None else "the plan leaves it at"
            diffs.append(f"optimizer state {index}.{key} is {list(have.shape)} {have.dtype} in OUT; {said} "
                         f"{list(want[0])} {want[1]}")
    return diffs


def _recorded(plan: RepairPlan, out: Checkpoint) -> list[str]:
    from ckptfix.recorded import find_recorded

    want = {r.path: plan.recorded.get(r.path, r.value) for r in find_recorded(plan.ckpt.extras)}
    have = {r.path: r.value for r in find_recorded(out.extras)}
    diffs = []
    for path, value in want.items():
        where = ".".join(map(str, path))
        if have.get(path) != value:
            said = "the plan sets it to" if path in plan.recorded else "the plan leaves it at"
            diffs.append(f"recorded {where} is {have.get(path, 'missing')} in OUT; {said} {value}")
    diffs += [f"recorded {'.'.join(map(str, p))} = {v} is in OUT but not in the input" for p, v in have.items()
              if p not in want]
    return diffs


def _scaler(plan: RepairPlan, out: Checkpoint) -> list[str]:
    from ckptfix.surgery.plan import DEFAULT_SCALE

    if not plan.reset_scaler:
        return []
    scale = (out.scaler or {}).get("scale")
    return [] if scale == DEFAULT_SCALE else [f"the plan resets the GradScaler scale to {DEFAULT_SCALE:g}; OUT holds {scale}"]


def verify_output(plan: RepairPlan, out: str, *, trust_pickle: bool = False) -> None:
    """Read OUT back and compare it with the plan; VerifyFailed naming every difference."""
    from ckptfix.checkpoint import release_maps
    from ckptfix.errors import CkptfixError
    from ckptfix.formats import read_checkpoint

    try:
        written = read_checkpoint(out, trust_pickle=trust_pickle)
    except CkptfixError as exc:
        raise VerifyFailed(f"{out}: ckptfix cannot read back what it wrote: {exc}") from None
    try:
        diffs = differences(plan, written)
    finally:
        release_maps()  # OUT may be removed below: no map of it stays cached
    if diffs:
        raise VerifyFailed(f"{out}: OUT does not match the plan ({len(diffs)} difference(s)): " + "; ".join(diffs[:6])
                           + (f"; and {len(diffs) - 6} more" if len(diffs) > 6 else ""))


def undo_write(out: str, backup: str | None, *, same_path: bool, sidecar: str | None) -> str:
    """Take back what a failed repair wrote: a new OUT (and its sidecar) removed, or the input that OUT
    replaced (with --force) put back from its backup. Returns what was done, for the error message."""
    if same_path and backup is not None and os.path.lexists(backup):
        _remove(out)
        os.replace(backup, out)
        return f"the input was put back from {backup}"
    _remove(out)
    if sidecar is not None and os.path.lexists(sidecar):
        os.remove(sidecar)
    return "OUT was removed"


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)
