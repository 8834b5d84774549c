"""`repair --from-tokenizer OLD`: rows move by token string, with their Adam moments.

The new tokenizer.json is the old one with its ids shuffled (tokenizer_factory.reorder_tokenizer_json)
and new tokens appended (extend_tokenizer_json); a shrunk one is a smaller BPE on the same corpus,
also shuffled. Every token present in both must keep its trained row, exp_avg and exp_avg_sq exactly.
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
from tokenizer_factory import extend_tokenizer_json, reorder_tokenizer_json, train_bpe_tokenizer_json

import ckptfix
from ckptfix.tokenizers import load_tokenizer

EMBED, HEAD = "text_embedding.weight", "text_head.weight"
NEW_TOKENS = ["<img>", "<audio>", "zzqx"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("remap")
    old = train_bpe_tokenizer_json(d, 300, added=["<tool>", "<think>"], special=["<eos>"], name="old.json")
    shuffled = reorder_tokenizer_json(old, d / "shuffled.json", seed=3)
    grown = extend_tokenizer_json(shuffled, d / "grown.json", NEW_TOKENS)
    small = reorder_tokenizer_json(train_bpe_tokenizer_json(d, 250, name="small.json"), d / "small_shuffled.json",
                                   seed=5)
    vocab = load_tokenizer(old).size  # 303: 300 base + 3 added
    ckpt = save_checkpoint(train(new_run(vocab), 60), d / "ckpt.pth")
    return {"dir": d, "old": old, "grown": grown, "small": small, "vocab": vocab, "ckpt": ckpt,
            "src": torch.load(ckpt, weights_only=True)}


def expected_sources(old_path, new_path) -> list[int]:
    """For each new id: the old id of the same token string, or -1."""
    old_ids = load_tokenizer(old_path).token_to_id()
    return [old_ids.get(tok, -1) if tok is not None else -1 for tok in load_tokenizer(new_path).id_to_token()]


def check_rows(src, sd, sources, index_of):
    """Surviving tokens: weights and both moments are the old row of the same string, bit for bit.
    New tokens: exp_avg 0, exp_avg_sq the old per-column mean, weights near the old mean."""
    new_ids = [j for j, i in enumerate(sources) if i < 0]
    for name in (EMBED, HEAD):
        idx = index_of[name]
        tensors = {"weight": (src["model"][name], sd["model"][name])}
        for key in ("exp_avg", "exp_avg_sq"):
            tensors[key] = (src["optimizer"]["state"][idx][key], sd["optimizer"]["state"][idx][key])
        for key, (old, new) in tensors.items():
            assert new.shape == (len(sources), old.shape[1]), (name, key)
            for j, i in enumerate(sources):
                if i >= 0:
                    assert same_bits(new[j], old[i]), (name, key, j, i)
            if not new_ids:
                continue
            fresh = new[new_ids]
            if key == "exp_avg":
                assert torch.count_nonzero(fresh) == 0
            elif key == "exp_avg_sq":
                torch.testing.assert_close(fresh, old.mean(0).expand_as(fresh), rtol=1e-6, atol=0)
            else:
                torch.testing.assert_close(fresh, old.mean(0).expand_as(fresh), rtol=0, atol=1e-3)
                assert not any(same_bits(fresh[k], old[i]) for k in range(len(new_ids)) for i in range(len(old)))


def optimizer_indices(src) -> dict[str, int]:
    names = list(src["model"])  # untied TinyLM: optimizer order == state_dict order
    return {EMBED: names.index(EMBED), HEAD: names.index(HEAD)}


def test_permuted_and_extended_tokenizer_moves_rows_by_token(setup, tmp_path):
    src, old_vocab = setup["src"], setup["vocab"]
    digest = sha256(setup["ckpt"])
    out = tmp_path / "remapped.pth"
    result = ckptfix.repair(setup["ckpt"], setup["grown"], out, from_tokenizer=setup["old"],
                            init="mean")  # this test checks the mean fill; pieces: test_init_pieces.py
    assert sha256(setup["ckpt"]) == digest
    sources = expected_sources(setup["old"], setup["grown"])
    assert len(sources) == old_vocab + len(NEW_TOKENS)
    assert sorted(i for i in sources if i >= 0) == list(range(old_vocab))  # a pure permutation + new ones
    new_tokens = [tok for tok, i in zip(load_tokenizer(setup["grown"]).id_to_token(), sources) if i < 0]
    assert sorted(new_tokens) == sorted(NEW_TOKENS)  # only the appended tokens count as new

    sd = torch.load(out, weights_only=True)
    check_rows(src, sd, sources, optimizer_indices(src))
    kept = sum(i == j for j, i in enumerate(sources))
    moved = sum(i >= 0 and i != j for j, i in enumerate(sources))
    assert moved > 250  # the shuffle really moved rows
    for change in sd["ckptfix"]["changes"]:
        assert (change["kept"], change["moved"], change["new"], change["dropped"]) == (kept, moved, 3, 0), change
        assert change["dropped_ids"] == []
    assert sd["ckptfix"]["from_tokenizer"]["size"] == old_vocab
    assert result.to_json()["from_tokenizer"]["size"] == old_vocab
    # Every other tensor is untouched.
    for name, t in src["model"].items():
        if name not in (EMBED, HEAD):
            assert same_bits(sd["model"][name], t), name

    model, opt, sched, scaler = resume(sd, len(sources))
    assert_trains(train_steps(model, opt, sched, scaler, len(sources), 30))


def test_only_a_shuffle_keeps_every_row_and_initialises_none(setup, tmp_path):
    shuffled = setup["dir"] / "shuffled.json"
    out = tmp_path / "shuffled.pth"
    ckptfix.repair(setup["ckpt"], shuffled, out, from_tokenizer=setup["old"])
    sources = expected_sources(setup["old"], shuffled)
    sd = torch.load(out, weights_only=True)
    check_rows(setup["src"], sd, sources, optimizer_indices(setup["src"]))
    for change in sd["ckptfix"]["changes"]:
        assert change["new"] == 0 and change["dropped"] == 0 and change["kept"] + change["moved"] == setup["vocab"]


def test_shrinking_by_token_reports_the_dropped_ids(setup, tmp_path):
    out = tmp_path / "small.pth"
    result = ckptfix.repair(setup["ckpt"], setup["small"], out, from_tokenizer=setup["old"])
    sources = expected_sources(setup["old"], setup["small"])
    assert len(sources) == 250
    lost = sorted(set(range(setup["vocab"])) - set(sources))
    assert lost == list(range(250, 303))  # the BPE's last 50 merges and the 3 added tokens
    sd = torch.load(out, weights_only=True)
    check_rows(setup["src"], sd, sources, optimizer_indices(setup["src"]))
    for change in sd["ckptfix"]["changes"]:
        assert change["new"] == sum(i < 0 for i in sources)
        assert change["dropped"] == len(lost) and change["dropped_ids"] == ["250-302"]
        assert change["kept"] + change["moved"] == 250 - change["new"]
    assert any("token ids lost: 250-302" in note for note in result.to_json()["notes"])


def test_shrinking_by_id_reports_the_dropped_ids(setup, tmp_path):
    """Without --from-tokenizer rows are kept by id: the tail is cut, and which ids is said."""
    result = ckptfix.repair(setup["ckpt"], setup["small"], None, dry_run=True)
    data = result.to_json()
    embed = next(c for c in data["changes"] if c["tensor"] == EMBED)
    assert (embed["kept"], embed["moved"], embed["new"], embed["dropped"]) == (250, 0, 0, 53)
    assert embed["dropped_ids"] == ["250-302"]
    assert any("token ids lost: 250-302" in note for note in data["notes"])
