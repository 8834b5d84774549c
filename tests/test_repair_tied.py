"""A GPT-2-style tied TinyLM (`wte` / `lm_head` share one Parameter): the tie survives repair.

`torch.save` writes the tied pair as two entries over one storage; the repaired file must do the
same (one resized storage, not two copies that a strict load would silently untie), and the optimizer
has one moment set for the shared weight.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from test_repair_common import (
    assert_trains,
    resume,
    same_bits,
    sha256,
    train_steps,
)
from tokenizer_factory import train_sentencepiece

import ckptfix

OLD = 500
NAMES = {"embed_name": "wte", "head_name": "lm_head"}


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    d = tmp_path_factory.mktemp("tied")
    run = train(new_run(OLD, tied=True, **NAMES), 60)
    assert run.model.lm_head.weight is run.model.wte.weight
    path = save_checkpoint(run, d / "gpt2ish.pth")
    return path, torch.load(path, weights_only=True), {n: train_sentencepiece(d, n, name=f"sp{n}") for n in (400, 600)}


def shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.data_ptr() == b.data_ptr()


@pytest.mark.parametrize("new_vocab", [400, 600], ids=["shrink", "grow"])
@pytest.mark.parametrize("policy", ["remap", "fresh"])
def test_tie_survives_repair(tied, tmp_path, new_vocab, policy):
    path, src, toks = tied
    assert shares_storage(src["model"]["wte.weight"], src["model"]["lm_head.weight"])
    digest = sha256(path)
    out = tmp_path / "fixed.pth"
    result = ckptfix.repair(path, toks[new_vocab], out, policy=policy)
    assert sha256(path) == digest

    sd = torch.load(out, weights_only=True)
    wte, head = sd["model"]["wte.weight"], sd["model"]["lm_head.weight"]
    assert wte.shape == head.shape == (new_vocab, 16)
    assert shares_storage(wte, head)
    assert wte.untyped_storage().nbytes() == new_vocab * 16 * 4  # one storage, exactly the new size
    keep = min(OLD, new_vocab)
    assert same_bits(wte[:keep], src["model"]["wte.weight"][:keep])
    # Only the shared weight is edited, once.
    assert [c["tensor"] for c in result.plan.changes if ":" not in c["tensor"]] == ["wte.weight"]

    # One moment set for the tied weight: state entries == unique parameters.
    state = sd["optimizer"]["state"]
    src_state = src["optimizer"]["state"]
    n_params = len(sd["optimizer"]["param_groups"][0]["params"])
    assert n_params == len(src_state) == len(list(dict.fromkeys(
        t.untyped_storage().data_ptr() for t in src["model"].values())))
    if policy == "remap":
        assert len(state) == n_params
        vocab_sized = [i for i, s in state.items() if s["exp_avg"].shape[0] == new_vocab]
        assert vocab_sized == [0]  # wte is parameter 0; lm_head has no state of its own
        for key in ("exp_avg", "exp_avg_sq"):
            assert same_bits(state[0][key][:keep], src_state[0][key][:keep])
        assert sd["ckptfix"]["param_names"][0] == "wte.weight" and "lm_head.weight" not in sd["ckptfix"]["param_names"]
    else:
        assert state == {}

    model, opt, sched, scaler = resume(sd, new_vocab, tied=True, names=NAMES)
    assert model.lm_head.weight is model.wte.weight  # load_state_dict(strict=True) kept the tie
    assert same_bits(model.wte.weight.detach()[:keep], src["model"]["wte.weight"][:keep])
    assert len(opt.param_groups[0]["params"]) == n_params
    assert_trains(train_steps(model, opt, sched, scaler, new_vocab, 30))
    assert model.lm_head.weight is model.wte.weight
