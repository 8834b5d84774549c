"""Megatron-Core `torch_dist` checkpoints written by Megatron's own code (fixtures/megatron.py, committed small copies
under fixtures/megatron/): inspect, repair into a new folder and in place, read back; the dp_reshardable refusal.

The committed copies: a tiny GPTModel (2 stacked layers, width 8), 200 tokens padded to 256 rows, 2 Adam steps on
CPU/gloo with every token id in each step (so rows 200..255 are exactly the never-trained ones), saved by
`dist_checkpointing.save` in Megatron-LM's layout. `-m long` tests (tests/test_megatron_resume.py) load the repaired
folders with Megatron's own `dist_checkpointing.load` and train a step, where the megatron venv exists.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json

import ckptfix
from ckptfix.cli import main
from ckptfix.formats import detect, read_checkpoint

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "megatron"
ADAM_TP2 = FIXTURES / "small-tp2-dp2-adam"  # plain optimizer, TP 2 (vocab in 2 row pieces), DP 2
FULLY_TP1 = FIXTURES / "small-tp1-dp2-dist-fully"  # distributed optimizer, fully_reshardable, TP 1, DP 2
DP_TP2 = FIXTURES / "small-tp2-dp1-dist-dp"  # distributed optimizer, dp_reshardable (flat buckets)
EMBED, HEAD = "embedding.word_embeddings.weight", "output_layer.weight"
OLD_TOKENS, ROWS = 200, 256


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    folder = tmp_path_factory.mktemp("megatron-tok")
    old = train_bpe_tokenizer_json(folder, OLD_TOKENS, name="tok-200.json")
    new = extend_tokenizer_json(old, folder / "tok-300.json", [f"new{i}" for i in range(100)])
    return str(old), str(new)


@dataclass
class Result:
    exit_code: int
    output: str  # stdout and stderr


def run(*args: object) -> Result:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Result(code, out.getvalue() + err.getvalue())


def test_committed_copies_are_what_the_fixture_script_built():
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_fixtures", FIXTURES.parent / "megatron.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.MEGATRON_CORE == "0.16.1"
    for name in script.COMMIT:
        assert script.values_sha256(FIXTURES / name) == script.SHA256[name], name


def test_reads_the_save_folder_and_the_iteration_folder():
    for path in (ADAM_TP2, ADAM_TP2 / "iter_0000002"):
        assert detect(str(path)) == "megatron"
    ckpt = read_checkpoint(ADAM_TP2)
    assert ckpt.raw.iteration_dir.endswith("iter_0000002") and ckpt.raw.parent == str(ADAM_TP2)
    assert ckpt.model[EMBED].shape == (ROWS, 8) and ckpt.model[HEAD].shape == (ROWS, 8)
    assert len(ckpt.raw.items[EMBED].pieces) == 2  # one row range per TP rank
    assert ckpt.model["decoder.layers.mlp.linear_fc1.weight"].shape == (2, 32, 8)  # layers stacked
    opt = ckpt.optimizer
    assert opt.kind.lower() == "adamw" and set(opt.state[EMBED].tensors) == {"exp_avg", "exp_avg_sq"}
    assert opt.state[EMBED].step == 2.0
    no_wd = next(g for g in opt.groups if g.options["wd_mult"] == 0.0)
    assert "decoder.final_layernorm.weight" in no_wd.params and EMBED not in no_wd.params
    assert ckpt.extras["args"]["padded_vocab_size"] == ROWS and ckpt.extras["iteration"] == 2


def test_fully_reshardable_master_copy_is_not_a_moment():
    ckpt = read_checkpoint(FULLY_TP1)
    assert set(ckpt.optimizer.state[EMBED].tensors) == {"exp_avg", "exp_avg_sq"}
    assert ckpt.raw.master_items[EMBED] == f"optimizer.state.param.{EMBED}"
    assert ckpt.optimizer.state[EMBED].step == 2.0


def test_inspect_fits_the_padding_rule(toks):
    result = run("inspect", ADAM_TP2, "-t", toks[0])
    assert result.exit_code == 0, result.output
    assert "(megatron)" in result.output
    assert "CKF103" in result.output and "256 rows for 200 tokens: padded to a multiple of 256" in result.output
    report = ckptfix.inspect(str(FULLY_TP1), toks[0])
    assert [f.code for f in report.findings] == ["CKF103"]
    assert "padded to a multiple of 128" in report.findings[0].message


def test_inspect_grown_tokenizer(toks):
    result = run("inspect", ADAM_TP2, "-t", toks[1])
    assert result.exit_code == 1, result.output
    codes = {f.code: f for f in ckptfix.inspect(str(ADAM_TP2), toks[1]).findings}
    assert {"CKF101", "CKF161", "CKF110"} <= set(codes)
    assert "has 512 vocab rows (Megatron's make_vocab_size_divisible_by 128 x tensor_model_parallel_size 2" \
        in codes["CKF161"].message
    assert "rows 256..511 of the weights and exp_avg_sq start at zero" in codes["CKF161"].message
    assert f"{EMBED}: rows 200..255 never received a gradient" in codes["CKF110"].message
    assert "uses ids 200..255" in codes["CKF110"].message


@pytest.mark.parametrize("source", [ADAM_TP2, FULLY_TP1], ids=["adam-tp2", "fully-tp1"])
def test_repair_into_a_new_folder(source, toks, tmp_path):
    out = tmp_path / "fixed"
    result = run("repair", source, "-t", toks[1], "-o", out)
    assert result.exit_code == 0, result.output
    old, new = read_checkpoint(source), read_checkpoint(out)
    tp = old.extras["args"]["tensor_model_parallel_size"]
    rows = 512 if tp == 2 else 384  # 300 tokens padded to 128 x TP
    assert f"rows: {rows} for 300 tokens (padding rule: Megatron's make_vocab_size_divisible_by 128 x " \
           f"tensor_model_parallel_size {tp}" in result.output
    assert sorted(os.listdir(out)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]
    assert new.extras["args"]["padded_vocab_size"] == rows and new.extras["args"]["vocab_size"] == 300
    assert {k: v for k, v in new.extras["args"].items() if "vocab_size" not in k} == \
        {k: v for k, v in old.extras["args"].items() if "vocab_size" not in k}
    # rows 0..199 trained: kept bit for bit; 200..255 never trained (CKF110) and now used by the new
    # tokenizer, and 256.. new: initialised (weights not zero, exp_avg 0, exp_avg_sq the old rows' mean)
    for name in (EMBED, HEAD):
        before, after = old.model[name].read_stored(), new.model[name].read_stored()
        assert after.shape == (rows, 8) and after.dtype == before.dtype
        np.testing.assert_array_equal(after[:OLD_TOKENS], before[:OLD_TOKENS])
        assert (np.abs(after[ROWS:]).sum(axis=1) > 0).all()
        for key in ("exp_avg", "exp_avg_sq"):
            m_before = old.optimizer.state[name].tensors[key].read_stored()
            m_after = new.optimizer.state[name].tensors[key].read_stored()
            np.testing.assert_array_equal(m_after[:OLD_TOKENS], m_before[:OLD_TOKENS])
            assert (m_after[ROWS:] == 0).all() if key == "exp_avg" else (m_after[ROWS:] > 0).all()
        assert new.optimizer.state[name].step == 2.0
    emb_before, emb_after = old.model[EMBED].read_stored(), new.model[EMBED].read_stored()
    assert not np.array_equal(emb_after[OLD_TOKENS:ROWS], emb_before[OLD_TOKENS:ROWS])
    for name, info in old.model.items():  # everything else as saved
        if name not in (EMBED, HEAD):
            np.testing.assert_array_equal(new.model[name].read_stored(), info.read_stored())
    if source == FULLY_TP1:  # the fp32 master copy: its old rows kept, its new rows the new weights'
        for name in (EMBED, HEAD):
            master = new.raw.items[new.raw.master_items[name]]
            value = _item_array(new, master.fqn)
            np.testing.assert_array_equal(value[:OLD_TOKENS], _item_array(old, master.fqn)[:OLD_TOKENS])
            np.testing.assert_array_equal(value[OLD_TOKENS:], new.model[name].read_stored()[OLD_TOKENS:])
    report = ckptfix.inspect(str(out), toks[1])
    assert [f.code for f in report.findings] == ["CKF103"], [f.message for f in report.findings]


def _item_array(ckpt, fqn: str) -> np.ndarray:
    from ckptfix.formats.dcp_folder import tensor_info

    return tensor_info(ckpt.raw.iteration_dir, ckpt.raw.items[fqn], []).read_stored()


def test_repaired_metadata_and_common_load_with_torch(toks, tmp_path):
    """DCP's own Metadata (no cached save plans) and a common.pt torch.load reads, args changed and nothing else."""
    import torch

    out = tmp_path / "fixed"
    assert run("repair", ADAM_TP2, "-t", toks[1], "-o", out).exit_code == 0
    folder = out / "iter_0000002"
    with open(folder / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # our own output, written by DCP's types
    assert getattr(metadata, "all_local_plans", None) is None
    assert tuple(metadata.state_dict_metadata[EMBED].size) == (512, 8)
    before = torch.load(ADAM_TP2 / "iter_0000002" / "common.pt", weights_only=False)
    after = torch.load(folder / "common.pt", weights_only=False)
    meta = torch.load(folder / "common.pt", weights_only=False, map_location="meta", mmap=True)
    assert meta["args"].padded_vocab_size == 512
    assert vars(after["args"]) == {**vars(before["args"]), "padded_vocab_size": 512, "vocab_size": 300}
    assert after.keys() == before.keys()
    assert torch.equal(after["optimizer"]["state"]["common_step"], before["optimizer"]["state"]["common_step"])
    assert after["opt_param_scheduler"] == before["opt_param_scheduler"]


def test_repair_in_place_and_restore(toks, tmp_path):
    work = tmp_path / "save"
    shutil.copytree(ADAM_TP2, work)
    iteration = work / "iter_0000002"
    metadata, common = (iteration / ".metadata").read_bytes(), (iteration / "common.pt").read_bytes()
    result = run("repair", work, "-t", toks[1], "--in-place")
    assert result.exit_code == 0, result.output
    fixed = read_checkpoint(work)
    assert fixed.model[EMBED].shape == (512, 8) and fixed.extras["args"]["padded_vocab_size"] == 512
    assert fixed.record is not None and fixed.record.tokenizer.size == 300
    np.testing.assert_array_equal(fixed.model[EMBED].read_stored()[:OLD_TOKENS],
                                  read_checkpoint(ADAM_TP2).model[EMBED].read_stored()[:OLD_TOKENS])
    result = run("restore", iteration)
    assert result.exit_code == 0, result.output
    assert (iteration / ".metadata").read_bytes() == metadata and (iteration / "common.pt").read_bytes() == common
    assert read_checkpoint(work).model[EMBED].shape == (ROWS, 8)


def test_dp_reshardable_is_reported_and_refused(toks, tmp_path):
    codes = {f.code: f for f in ckptfix.inspect(str(DP_TP2), toks[1]).findings}
    assert codes["CKF160"].severity == "warning"
    assert "--dist-ckpt-optim-fully-reshardable" in codes["CKF160"].fix
    result = run("repair", DP_TP2, "-t", toks[1], "-o", tmp_path / "fixed")
    assert result.exit_code == 2
    assert "dp_reshardable layout" in result.output and "--dist-ckpt-optim-fully-reshardable" in result.output
    assert "--policy fresh" in result.output and "--trust-pickle" not in result.output
    assert not (tmp_path / "fixed").exists()
    result = run("repair", DP_TP2, "-t", toks[1], "-o", tmp_path / "fresh", "--policy", "fresh")
    assert result.exit_code == 0, result.output
    assert "--no-load-optim" in result.output
    fresh = read_checkpoint(tmp_path / "fresh")
    assert fresh.model[EMBED].shape == (512, 8)
    assert not [f for f in fresh.raw.items if f.startswith("optimizer.")]


def test_metadata_calling_a_planner_class_is_refused(tmp_path):
    """The save plans are data only: a `.metadata` that calls SavePlan (rather than constructing it) is refused,
    and --trust-pickle is not offered (it would change nothing)."""
    folder = tmp_path / "iter"
    shutil.copytree(ADAM_TP2 / "iter_0000002", folder)
    (folder / ".metadata").write_bytes(b"\x80\x02ctorch.distributed.checkpoint.planner\nSavePlan\n)R.")
    result = run("inspect", folder)
    assert result.exit_code == 2
    assert "SavePlan(...) called" in result.output
    assert "--trust-pickle does not apply" in result.output


@pytest.mark.parametrize("damage, expected", [
    ("tracker-missing-iteration", "latest_checkpointed_iteration.txt: names iteration 7, but iter_0000007/ is not a "
                                  "torch_dist checkpoint"),
    ("tracker-garbage", "latest_checkpointed_iteration.txt: expected an iteration number or 'release'"),
    ("common-truncated", "common.pt"),
    ("args-not-a-namespace", "common.pt: args is a int, not an argparse.Namespace"),
])
def test_bad_input_is_one_line_and_exit_2(damage, expected, toks, tmp_path):
    import torch

    work = tmp_path / "save"
    shutil.copytree(ADAM_TP2, work)
    common = work / "iter_0000002" / "common.pt"
    if damage == "tracker-missing-iteration":
        (work / "latest_checkpointed_iteration.txt").write_text("7")
    elif damage == "tracker-garbage":
        (work / "latest_checkpointed_iteration.txt").write_bytes(b"\xff\x00 seven")
    elif damage == "common-truncated":
        common.write_bytes(common.read_bytes()[:100])
    else:
        tree = torch.load(common, weights_only=False)
        torch.save({**tree, "args": 5}, common)
    for argv in (["inspect", work, "-t", toks[1]], ["repair", work, "-t", toks[1], "-o", tmp_path / "out"]):
        result = run(*argv)
        assert result.exit_code == 2, result.output
        assert expected in result.output and "Traceback" not in result.output
        assert len(result.output.strip().splitlines()) == 1, result.output
    assert not (tmp_path / "out").exists()


def test_megatron_enums_in_args_are_data(toks, tmp_path, monkeypatch):
    """Megatron-LM's args hold Megatron's enums (`attention_backend=AttnBackend.auto`, a call `AttnBackend(5)` in
    the pickle): inspect reads them without --trust-pickle, repair writes them back as read."""
    import enum
    import sys
    import types

    import torch

    class AttnBackend(enum.Enum):
        auto = 5

    names = ["megatron", "megatron.core", "megatron.core.transformer", "megatron.core.transformer.enums"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    AttnBackend.__module__, AttnBackend.__qualname__ = "megatron.core.transformer.enums", "AttnBackend"
    sys.modules["megatron.core.transformer.enums"].AttnBackend = AttnBackend  # type: ignore[attr-defined]
    work = tmp_path / "save"
    shutil.copytree(ADAM_TP2, work)
    common = work / "iter_0000002" / "common.pt"
    tree = torch.load(common, weights_only=False)
    tree["args"].attention_backend = AttnBackend.auto
    torch.save(tree, common)
    assert read_checkpoint(work).extras["args"]["padded_vocab_size"] == ROWS
    result = run("repair", work, "-t", toks[1], "-o", tmp_path / "fixed")
    assert result.exit_code == 0, result.output
    args = torch.load(tmp_path / "fixed" / "iter_0000002" / "common.pt", weights_only=False)["args"]
    assert args.attention_backend is AttnBackend.auto and args.padded_vocab_size == 512
