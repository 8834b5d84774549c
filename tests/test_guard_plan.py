"""`plan_resume` decides without a torch model: the live side is a `Live` written by hand.

The checkpoint is real (a TinyLM trained with AdamW and saved with torch.save); the live objects are
described as data, as `Live.capture` would describe a model built for another tokenizer.
"""

from __future__ import annotations

import copy

import pytest
from ckpt_factory import trained_checkpoint

from ckptfix.formats import read_checkpoint
from ckptfix.guard.live import Live, LiveTensor
from ckptfix.guard.resume_plan import plan_resume
from ckptfix.inspect import analyse

VOCAB = 50
EMBED, HEAD = "text_embedding.weight", "text_head.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = trained_checkpoint(tmp_path_factory.mktemp("plan") / "ckpt.pth", VOCAB, steps=4)
    return read_checkpoint(str(path))


def live_like(ckpt, rows: int = VOCAB, groups: list[int] | None = None, scheduler: bool = True) -> Live:
    """The live objects of the checkpoint's model rebuilt for `rows` tokens: one optimizer over every
    parameter in model order (or split into `groups` of those sizes)."""
    state = {}
    for i, (name, t) in enumerate(ckpt.model.items()):
        shape = (rows, *t.shape[1:]) if name in (EMBED, HEAD) else tuple(t.shape)
        state[name] = LiveTensor(name, shape, t.dtype, ident=i + 1)
    params = list(state.values())
    sizes = groups or [len(params)]
    split, start = [], 0
    for n in sizes:
        split.append(params[start:start + n])
        start += n
    return Live(state=state, model_order=[p.ident for p in params], optimizer=split, has_scheduler=scheduler,
                has_scaler=True, scaler_enabled=False, tokenizer_size=rows, embedding=(EMBED, rows))


def codes(plan, severity=None):
    return sorted({p.code for p in plan.problems if severity is None or p.severity == severity})


def test_a_fitting_checkpoint_loads_everything_by_inferred_names(ckpt):
    plan = plan_resume(ckpt, analyse(ckpt), live_like(ckpt), "strict")
    assert plan.ok and codes(plan, "error") == []
    assert plan.model.load == {k: k for k in ckpt.model}
    assert plan.optimizer_action == "load" and plan.matched_by == "names (inferred)"
    assert plan.scheduler_action == "load" and not plan.rewarm


def test_grown_vocab_is_an_error_under_strict_and_a_resize_under_remap(ckpt):
    live = live_like(ckpt, rows=VOCAB + 6)
    strict = plan_resume(ckpt, analyse(ckpt), live, "strict")
    assert "CKF825" in codes(strict, "error") and strict.model.load == {}
    remap = plan_resume(ckpt, analyse(ckpt), live, "remap")
    assert remap.ok and "CKF825" in codes(remap, "warning")
    assert remap.model.used_edits == {EMBED, HEAD}
    index = next(i for i, n in analyse(ckpt).mapping.names.items() if n == EMBED)
    edit = remap.model.moment_edit(index, "exp_avg")
    assert edit.owner == EMBED and edit.new_shape[0] == VOCAB + 6  # the moment carries its owner
    assert remap.optimizer_action == "load"


def test_another_group_layout_is_refused_or_dropped_by_policy(ckpt):
    n = len(list(ckpt.optimizer.indices()))
    live = live_like(ckpt, groups=[n - 2, 2])
    assert "CKF822" in codes(plan_resume(ckpt, analyse(ckpt), live, "remap"), "error")
    fresh = plan_resume(ckpt, analyse(ckpt), live, "fresh")
    assert fresh.ok and fresh.optimizer_action == "fresh" and fresh.rewarm and fresh.sync_lr
    assert fresh.matched_by == "dropped"
    kept = plan_resume(ckpt, analyse(ckpt), live_like(ckpt), "fresh", reset_scheduler=True)
    assert kept.optimizer_action == "load"  # nothing mismatched: nothing dropped


def test_tokenizer_past_the_embedding_and_reset_policy(ckpt):
    live = live_like(ckpt)
    live.tokenizer_size = VOCAB + 1
    assert "CKF824" in codes(plan_resume(ckpt, analyse(ckpt), live, "remap"), "error")
    reset = plan_resume(ckpt, analyse(ckpt), live_like(ckpt), "reset")
    assert reset.optimizer_action == "none" and reset.scheduler_action == "keep" and not reset.load_scaler


def test_planning_changes_nothing(ckpt):
    live = live_like(ckpt, rows=VOCAB + 6)
    before_live, before_notes = copy.deepcopy(live), list(ckpt.notes)
    before = {k: (t.shape, t.dtype) for k, t in ckpt.model.items()}
    for policy in ("strict", "remap", "fresh", "reset"):
        plan_resume(ckpt, analyse(ckpt), live, policy)
    assert live == before_live and ckpt.notes == before_notes
    assert {k: (t.shape, t.dtype) for k, t in ckpt.model.items()} == before
