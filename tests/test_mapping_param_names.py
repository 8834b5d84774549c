"""One answer to "which parameter owns optimizer state i", for inspect, repair and the guard alike.

A real AdamW built from `model.named_parameters()` (torch stores `param_names` in each param group),
its groups in another order than the model (no-decay first) and, inside them, two pairs of
same-shaped parameters swapped (the two MLP input layers; the untied embedding and head). Mapping by
position and shape cannot tell those apart; every consumer must map them by torch's names.
"""

from __future__ import annotations

import pytest
import torch
from ckpt_factory import Run, TinyLM, save_checkpoint, train, warmup_lambda
from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json

import ckptfix
from ckptfix.guard import ResumeGuard
from ckptfix.mapping import map_optimizer
from ckptfix.policies import canonical
from ckptfix.tokenizers import load_tokenizer

EMBED, HEAD = "text_embedding.weight", "text_head.weight"
SWAPPED = ("blocks.0.1.weight", "blocks.1.1.weight")  # both [32, 16]


def _scrambled_groups(model: torch.nn.Module) -> list[dict]:
    named = dict(model.named_parameters())
    no_decay = [n for n in named if named[n].ndim == 1]  # biases and norm weights
    decay = [n for n in named if n not in no_decay]
    a, b = decay.index(SWAPPED[0]), decay.index(SWAPPED[1])
    decay[a], decay[b] = decay[b], decay[a]
    e, h = decay.index(EMBED), decay.index(HEAD)
    decay[e], decay[h] = decay[h], decay[e]
    return [{"params": [(n, named[n]) for n in reversed(no_decay)], "weight_decay": 0.0},
            {"params": [(n, named[n]) for n in decay], "weight_decay": 0.01}]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("named")
    old = train_bpe_tokenizer_json(d, 120, name="old.json")
    grown = extend_tokenizer_json(old, d / "grown.json", ["<img>", "<audio>", "zzqx"])
    vocab, size = load_tokenizer(old).size, load_tokenizer(grown).size
    assert size == vocab + 3
    torch.manual_seed(0)
    model = TinyLM(vocab)
    opt = torch.optim.AdamW(_scrambled_groups(model), lr=3e-3)
    run = train(Run(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(5)),
                    torch.amp.GradScaler("cpu"), 0, []), 12)
    path = save_checkpoint(run, d / "ckpt.pth")
    src = torch.load(path, weights_only=True)
    names = [n for g in src["optimizer"]["param_groups"] for n in g["param_names"]]
    assert list(dict(model.named_parameters())) != names  # the optimizer's order is not the model's
    # truth: the state torch holds for each parameter, by name
    by_name = {n: run.optimizer.state[p] for n, p in model.named_parameters()}
    return {"dir": d, "path": path, "src": src, "truth": by_name, "grown": grown, "size": size}


def _index_of(sd: dict) -> dict[str, int]:
    names = [n for g in sd["param_groups"] for n in g["param_names"]]
    indices = [i for g in sd["param_groups"] for i in g["params"]]
    return dict(zip(names, indices))


def test_inspect_maps_by_torch_param_names(saved):
    report = ckptfix.inspect(saved["path"])
    assert report.mapping.method == "torch" and report.mapping.by_name
    index_of = _index_of(saved["src"]["optimizer"])
    assert report.mapping.names == {i: n for n, i in index_of.items()}
    assert not [f for f in report.findings if f.code in ("CKF201", "CKF202", "CKF204")]
    mapping = map_optimizer(ckptfix.read_checkpoint(str(saved["path"])))
    assert mapping.index_of(SWAPPED[0]) == index_of[SWAPPED[0]]
    vocab = {v.name: v.optimizer_index for v in report.vocab}
    assert vocab[EMBED] == index_of[EMBED] and vocab[HEAD] == index_of[HEAD]


def test_repair_moves_each_moment_with_its_named_parameter(saved, tmp_path):
    out = tmp_path / "fixed.pth"
    ckptfix.repair(saved["path"], saved["grown"], out)
    fixed = torch.load(out, weights_only=True)
    index_of = _index_of(fixed["optimizer"])
    for name, state in saved["truth"].items():
        got = fixed["optimizer"]["state"][index_of[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            rows = state[key].shape[0]
            assert torch.equal(got[key][:rows], state[key]), (name, key)
            if name in (EMBED, HEAD):
                assert got[key].shape[0] == saved["size"]


def test_guard_loads_each_parameter_its_own_state(saved):
    torch.manual_seed(1)
    model = TinyLM(saved["size"])
    # the same group layout, but each group in the model's order and without names
    named = dict(model.named_parameters())
    order = list(named)
    groups = [{**g, "params": [named[n] for n in sorted((n for n, _ in g["params"]), key=order.index)]}
              for g in _scrambled_groups(model)]
    opt = torch.optim.AdamW(groups, lr=3e-3)
    report = ResumeGuard(model, opt, tokenizer=saved["grown"], policy="remap", probe_steps=0).load(saved["path"])
    assert report.optimizer_matched_by == "names (torch)", report
    live = dict(model.named_parameters())
    for name, state in saved["truth"].items():
        got = opt.state[live[name]]
        for key in ("exp_avg", "exp_avg_sq"):
            rows = state[key].shape[0]
            assert torch.equal(got[key][:rows], state[key]), (name, key)


def test_one_policy_vocabulary_with_the_old_guard_spelling_as_an_alias():
    assert canonical("fresh-optimizer") == "fresh"
    guard = ResumeGuard(torch.nn.Linear(2, 2), policy="fresh-optimizer")
    assert guard.policy == "fresh"
    from ckptfix.guard import POLICIES
    from ckptfix.surgery.plan import POLICIES as REPAIR

    assert set(REPAIR) < set(POLICIES) and set(POLICIES) - set(REPAIR) == {"strict"}
