"""Sharded DCP saves from real FSDP2 training on CPU ranks (gloo), repaired offline and resumed with DCP.

`fsdp_factory.save_run` trains a TinyLM under `fully_shard` on N spawned ranks and saves with `dcp.save`
(nested `get_state_dict` layout, torchtitan's flattened layout, Lightning ModelParallel's, a tied head).
ckptfix repairs the folder in this one process, with no process group; `resume_run` loads the result on
M ranks with `dcp.load` + `set_state_dict` into a model built for the new vocab and takes one real step.
Old rows and Adam moments must equal what training held (gathered by rank 0 at save time), Adam's step
and the schedule carry on, the step is finite.

The default slice runs 2 ranks (resume on 2 and on 1); 4 ranks, every layout and the cross-world-size
resumes run with `pytest -m long`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import warnings

import pytest
import torch
from fsdp_factory import resume_run, save_run
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix
from ckptfix.errors import RepairError
from ckptfix.formats import read_checkpoint
from ckptfix.inspect import inspect

OLD, STEPS = 48, 3
EMBED, HEAD = "text_embedding.weight", "text_head.weight"


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return {n: train_bpe_tokenizer_json(folder, n, name=f"bpe{n}.json") for n in (40, 64)}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fsdp2") / "nested"
    return folder, save_run(folder, world=2, layout="nested", steps=STEPS)


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def assert_resumed(res: dict, ref: dict, vocab: int, *, tied: bool = False) -> None:
    """What the resumed ranks held after dcp.load + set_state_dict, against the saved run's full state."""
    keep = min(OLD, vocab)
    loaded, was = res["loaded"], ref
    names = [EMBED] if tied else [EMBED, HEAD]
    for name, tensor in loaded["model"].items():
        if name in (EMBED, HEAD):
            assert tensor.shape == (vocab, 16)
            assert torch.equal(tensor[:keep], was["model"][name][:keep]), name
        else:
            assert torch.equal(tensor, was["model"][name]), name
    for name, state in loaded["optim"]["state"].items():
        old = was["optim"]["state"][name]
        assert float(state["step"]) == float(old["step"]) == STEPS, name
        for key in ("exp_avg", "exp_avg_sq"):
            if name in names:
                assert torch.equal(state[key][:keep], old[key][:keep]), (name, key)
                if vocab > OLD:
                    assert torch.count_nonzero(state[key][OLD:]) == 0 or key == "exp_avg_sq"
            else:
                assert torch.equal(state[key], old[key]), (name, key)
    assert set(loaded["optim"]["state"]) == set(was["optim"]["state"])  # no optimizer state lost
    assert res["step"] == STEPS and res["last_epoch"] == STEPS + 1
    assert res["lr"] == pytest.approx(was["optim"]["param_groups"][0]["lr"])
    assert math.isfinite(res["loss"])
    assert all(torch.isfinite(t).all() for t in res["after"]["model"].values())


def test_inspect_reports_world_size_and_chunking(two_ranks):
    folder, _ = two_ranks
    report = inspect(folder)
    found = {f.code: f for f in report.findings}
    assert "CKF720" in found and "saved by 2 rank(s)" in found["CKF720"].message
    assert f"{EMBED} 2 pieces along dim 0" in found["CKF720"].message
    assert "CKF721" not in found and not report.ckpt.tied
    ckpt = report.ckpt
    assert ckpt.optimizer is not None and len(ckpt.optimizer.state) == len(ckpt.model)
    assert ckpt.model[EMBED].shape == (OLD, 16)
    assert (ckpt.model[EMBED].read() == two_ranks[1]["model"][EMBED].numpy()).all()  # assembled from 2 pieces


@pytest.mark.parametrize("vocab", [64, 40], ids=["grow", "shrink"])
def test_two_rank_save_repaired_offline_resumes_on_two_and_one_ranks(two_ranks, tokenizers, tmp_path, vocab):
    folder, ref = two_ranks
    before = files(folder)
    out = tmp_path / "fixed"
    result = ckptfix.repair(folder, tokenizers[vocab], out)
    assert files(folder) == before, "the source was modified"
    assert result.to_json()["optimizer_state"] == "remapped"
    assert any("copied (" in n for n in result.to_json()["notes"])  # the copy method is named
    assert read_checkpoint(out).model[EMBED].shape == (vocab, 16)
    worlds = (2, 1) if vocab == 64 else (2,)
    for world in worlds:
        assert_resumed(resume_run(out, world=world, vocab=vocab), ref, vocab)


def test_new_folder_copies_only_the_records_still_referenced(two_ranks, tokenizers, tmp_path):
    """Without reflink, each rank file's kept records are copied at their own offsets (bit-identical) and
    the replaced vocab records are left as holes: zeros, never read from the source nor written."""
    folder, _ = two_ranks
    out = tmp_path / "fixed"
    result = ckptfix.repair(folder, tokenizers[64], out)
    source, fixed = read_checkpoint(folder).raw, read_checkpoint(out).raw
    notes = " ".join(result.to_json()["notes"])
    replaced = [fqn for fqn, item in fixed.items.items() if item.blobs[0][0].endswith("__ckptfix0_0.distcp")]
    assert len(replaced) == 6, replaced  # embedding, head and their two moments each
    kept_bytes = left_out = 0
    for fqn, item in source.items.items():
        for file, offset, length, _ in item.blobs:
            name = os.path.basename(file)
            with open(file, "rb") as a, open(out / name, "rb") as b:
                a.seek(offset)
                b.seek(offset)
                was, now = a.read(length), b.read(length)
            if fqn in replaced:
                left_out += length
                assert now == bytes(length) or "reflink" in notes, fqn
            else:
                kept_bytes += length
                assert now == was, fqn
    assert all(os.path.getsize(out / n) == os.path.getsize(folder / n) for n in os.listdir(folder)
               if n.endswith(".distcp"))
    assert "reflink" in notes or "left out as holes" in notes and left_out > 0, notes


def test_in_place_writes_only_the_changed_pieces_and_restore_undoes_it(two_ranks, tokenizers, tmp_path):
    """`--in-place`: a new data file and a swapped `.metadata`; the rank files are not touched; undo restores."""
    import torch.distributed.checkpoint as dcp
    from ckpt_factory import TinyLM

    folder = tmp_path / "ckpt"
    shutil.copytree(two_ranks[0], folder)
    before = files(folder)
    result = ckptfix.repair(folder, tokenizers[64], in_place=True)
    after = files(folder)
    assert {n: after[n] for n in before if n.endswith(".distcp")} == {n: b for n, b in before.items()
                                                                     if n.endswith(".distcp")}
    added = sorted(set(after) - set(before))
    assert added == [".metadata.ckptfix-bak", "__ckptfix0_0.distcp", "ckptfix-restore.json", "ckptfix.json"]
    assert after[".metadata.ckptfix-bak"] == before[".metadata"] and after[".metadata"] != before[".metadata"]
    assert result.backup and result.backup.endswith(".metadata.ckptfix-bak")
    written = sum(len(after[n]) for n in added) + len(after[".metadata"])
    assert written < sum(len(b) for b in before.values())  # only the vocab tensors and their moments

    model = TinyLM(64)  # a plain module in this process: dcp.load without a process group
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(state, checkpoint_id=str(folder), planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    assert torch.equal(state["model"][EMBED][:OLD], two_ranks[1]["model"][EMBED])

    with pytest.raises(RepairError, match="earlier in-place repair"):
        ckptfix.repair(folder, tokenizers[64], in_place=True, policy="fresh")
    from ckptfix.surgery.undo import restore

    restore(str(folder))
    assert files(folder) == before


@pytest.mark.long
@pytest.mark.parametrize("layout,tied", [("nested", False), ("titan", False), ("nested", True),
                                         ("lightning", False)], ids=["nested", "titan", "tied", "lightning"])
def test_four_rank_layouts_repaired_and_resumed_across_world_sizes(tmp_path, tokenizers, layout, tied):
    folder = tmp_path / layout
    ref = save_run(folder, world=4, layout=layout, tied=tied, steps=STEPS)
    found = {f.code: f for f in inspect(folder).findings}
    assert "saved by 4 rank(s)" in found["CKF720"].message
    assert ("CKF721" in found) == tied
    for vocab in (64, 40):
        out = tmp_path / f"{layout}-{vocab}"
        result = ckptfix.repair(folder, tokenizers[vocab], out)
        rec = json.loads((out / "ckptfix.json").read_text())
        assert rec["optimizer_state"] == "remapped" == result.to_json()["optimizer_state"]
        for world in (4, 2, 3):
            assert_resumed(resume_run(out, world=world, layout=layout, tied=tied, vocab=vocab), ref, vocab,
                           tied=tied)


@pytest.mark.long
def test_tied_head_two_ranks_keeps_optimizer_state(tmp_path, tokenizers):
    folder = tmp_path / "tied"
    ref = save_run(folder, world=2, layout="nested", tied=True, steps=STEPS)
    report = inspect(folder)
    assert report.ckpt.tied == {HEAD: EMBED}
    result = ckptfix.repair(folder, tokenizers[64], tmp_path / "out")
    assert result.to_json()["optimizer_state"] == "remapped"
    assert_resumed(resume_run(tmp_path / "out", world=1, tied=True, vocab=64), ref, 64, tied=True)
    assert os.path.exists(tmp_path / "out" / "ckptfix.json")
