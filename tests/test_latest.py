"""`ckptfix latest RUN_DIR` (issue 42 item 2): the newest whole checkpoint of a run, a save cut short skipped.

A real Trainer run saves checkpoint-2, -4 and -6; crashes are simulated at each file boundary of the Trainer's
save order (`Trainer._save_checkpoint`: model files, optimizer.pt, scheduler.pt, rng_state.pth, then
trainer_state.json last), and inside files (a truncated optimizer.pt, a zero-byte model.safetensors)."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_cli_ux import run_cli

from ckptfix.latest import latest_checkpoint

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory):
    from test_repair_hf import dataset

    d = tmp_path_factory.mktemp("latest") / "out"
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=str(d), max_steps=6, save_steps=2, report_to=[], use_cpu=True, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args,
                         train_dataset=dataset(100, 24, 0)).train()
    assert sorted(os.listdir(d)) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    return d


# The Trainer's save order (transformers' Trainer._save_checkpoint): save_model's files, then these, in order.
SAVE_ORDER = ["optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"]


def _run_with_newest(trainer_run, tmp_path, files):
    """A copy of the run whose checkpoint-6 holds only `files` (names in checkpoint-6)."""
    run = tmp_path / "out"
    shutil.copytree(trainer_run, run)
    newest = run / "checkpoint-6"
    for name in os.listdir(newest):
        if name not in files:
            os.remove(newest / name)
    return run


def _model_files(trainer_run):
    return [n for n in os.listdir(trainer_run / "checkpoint-6") if n not in SAVE_ORDER]


def test_the_whole_run_names_the_newest(trainer_run, capsys):
    code, out, err = run_cli(["latest", str(trainer_run)], capsys)
    assert (code, out, err) == (0, f"{trainer_run / 'checkpoint-6'}\n", "")
    assert latest_checkpoint(trainer_run).path == str(trainer_run / "checkpoint-6")


@pytest.mark.parametrize("saved", range(len(SAVE_ORDER) + 1))
def test_a_save_cut_at_each_file_boundary_is_skipped(trainer_run, tmp_path, capsys, saved):
    """0: the folder only; 1: the model files; 2: + optimizer.pt; ... 4: all but trainer_state.json."""
    files = ([] if saved == 0 else _model_files(trainer_run)) + SAVE_ORDER[:max(saved - 1, 0)]
    run = _run_with_newest(trainer_run, tmp_path, files)
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-4'}\n"
    (line,) = err.splitlines()
    assert line.startswith(f"ckptfix: skipped {run / 'checkpoint-6'}: ") and "no trainer_state.json" in line
    for missing in SAVE_ORDER[max(saved - 1, 0):-1]:
        if missing != "rng_state.pth":
            assert f"no {missing}" in line
    if saved == 0:
        assert "no model weights" in line


def test_truncated_optimizer_is_skipped(trainer_run, tmp_path, capsys):
    run = _run_with_newest(trainer_run, tmp_path, os.listdir(trainer_run / "checkpoint-6"))
    opt = run / "checkpoint-6" / "optimizer.pt"
    os.truncate(opt, opt.stat().st_size // 2)
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-4'}\n"
    assert "optimizer.pt:" in err and "zip" in err and len(err.splitlines()) == 1


def test_zero_byte_and_truncated_safetensors_are_skipped(trainer_run, tmp_path, capsys):
    run = _run_with_newest(trainer_run, tmp_path, os.listdir(trainer_run / "checkpoint-6"))
    (run / "checkpoint-6" / "model.safetensors").write_bytes(b"")
    weights = run / "checkpoint-4" / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1)
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-2'}\n"
    six, four = err.splitlines()
    assert "checkpoint-6: model.safetensors is empty (0 bytes)" in six
    assert "checkpoint-4: model.safetensors:" in four


def test_sharded_weights_need_every_shard(trainer_run, tmp_path, capsys):
    run = _run_with_newest(trainer_run, tmp_path, os.listdir(trainer_run / "checkpoint-6"))
    newest = run / "checkpoint-6"
    os.rename(newest / "model.safetensors", newest / "model-00001-of-00002.safetensors")
    (newest / "model.safetensors.index.json").write_text(
        '{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", '
        '"b": "model-00002-of-00002.safetensors"}}')
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-4'}\n" and "no model-00002-of-00002.safetensors" in err
    shutil.copy(newest / "model-00001-of-00002.safetensors", newest / "model-00002-of-00002.safetensors")
    assert latest_checkpoint(run).path == str(newest)


def test_missing_rng_state_is_whole_with_a_note(trainer_run, tmp_path, capsys):
    run = _run_with_newest(trainer_run, tmp_path,
                           [n for n in os.listdir(trainer_run / "checkpoint-6") if n != "rng_state.pth"])
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-6'}\n"
    assert err.startswith("ckptfix: note: ") and "no rng_state*.pth" in err and len(err.splitlines()) == 1


def test_numeric_order_not_lexical(trainer_run, tmp_path, capsys):
    """checkpoint-10 is newer than checkpoint-6 (get_last_checkpoint compares the numbers)."""
    run = tmp_path / "out"
    shutil.copytree(trainer_run, run)
    shutil.copytree(run / "checkpoint-2", run / "checkpoint-10")
    (run / "checkpoint-7x").mkdir()  # not a checkpoint name: ignored
    assert latest_checkpoint(run).path == str(run / "checkpoint-10")


def test_none_whole_exits_1_naming_each(trainer_run, tmp_path, capsys):
    run = tmp_path / "out"
    shutil.copytree(trainer_run, run)
    for n in (2, 4, 6):
        os.remove(run / f"checkpoint-{n}" / "trainer_state.json")
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert [line.split(":")[1].strip() for line in lines[:3]] == [
        f"skipped {run / f'checkpoint-{n}'}" for n in (6, 4, 2)]
    assert lines[3] == f"ckptfix: no whole checkpoint in {run}"


def test_bad_input_exits_2_in_one_line(tmp_path, capsys):
    code, out, err = run_cli(["latest", str(tmp_path / "nope")], capsys)
    assert code == 2 and out == "" and len(err.splitlines()) == 1 and "not a folder" in err
    code, out, err = run_cli(["latest", str(tmp_path)], capsys)  # a folder without checkpoints
    assert code == 1 and out == "" and err.startswith("ckptfix: no checkpoint (") and len(err.splitlines()) == 1


def test_latest_reads_structure_only(trainer_run, tmp_path, capsys, monkeypatch):
    """No tensor bytes without --scan: a record of optimizer.pt overwritten with other bytes of its length is
    still whole (no tensor reader is called); --scan reads them and skips it (CRC-32)."""
    import zipfile

    from ckptfix.checkpoint import TensorInfo

    run = _run_with_newest(trainer_run, tmp_path, os.listdir(trainer_run / "checkpoint-6"))
    opt = run / "checkpoint-6" / "optimizer.pt"
    with zipfile.ZipFile(opt) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(opt.read_bytes())
    start = info.header_offset + 30 + len(info.orig_filename.encode()) + len(info.extra)
    data[start:start + info.file_size] = bytes(255 - b for b in data[start:start + info.file_size])
    opt.write_bytes(bytes(data))
    monkeypatch.setattr(TensorInfo, "read", lambda *a, **k: pytest.fail("read tensor bytes"))
    assert latest_checkpoint(run).path == str(run / "checkpoint-6")
    code, out, err = run_cli(["latest", str(run), "--scan"], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-4'}\n" and "CRC-32" in err


# -- the other frameworks -----------------------------------------------------------------------------------------


def test_lightning_last_ckpt_then_steps(tmp_path, capsys):
    state = {"state_dict": {"w": torch.zeros(4, 4)}, "optimizer_states": [], "lr_schedulers": [], "global_step": 0,
             "pytorch-lightning_version": "2.6.6", "loops": {}, "callbacks": {}}
    for name in ("epoch=0-step=10.ckpt", "epoch=1-step=20.ckpt", "last.ckpt"):
        torch.save(state, tmp_path / name)
    assert latest_checkpoint(tmp_path).path == str(tmp_path / "last.ckpt")
    os.truncate(tmp_path / "last.ckpt", 100)
    code, out, err = run_cli(["latest", str(tmp_path)], capsys)
    assert code == 0 and out == f"{tmp_path / 'epoch=1-step=20.ckpt'}\n" and "last.ckpt" in err


def test_dcp_step_folders(tmp_path, capsys):
    import torch.distributed.checkpoint as dcp

    for n in (2, 4, 6):
        dcp.save({"model": {"w": torch.ones(8, 8) * n}}, checkpoint_id=str(tmp_path / f"step-{n}"), no_dist=True)
    os.remove(tmp_path / "step-6" / ".metadata")
    data = next(f for f in os.listdir(tmp_path / "step-4") if f.endswith(".distcp"))
    os.truncate(tmp_path / "step-4" / data, 10)
    code, out, err = run_cli(["latest", str(tmp_path)], capsys)
    assert code == 0 and out == f"{tmp_path / 'step-2'}\n"
    six, four = err.splitlines()
    assert "no .metadata" in six and "truncated" in four


def test_megatron_legacy_iterations_and_tracker(tmp_path, capsys):
    for n in (2, 4):
        (tmp_path / f"iter_{n:07d}" / "mp_rank_00").mkdir(parents=True)
        torch.save({"model": {"w": torch.zeros(2)}, "iteration": n},
                   tmp_path / f"iter_{n:07d}" / "mp_rank_00" / "model_optim_rng.pt")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    assert latest_checkpoint(tmp_path).path == str(tmp_path / "iter_0000004")
    (tmp_path / "iter_0000004" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"")
    code, out, err = run_cli(["latest", str(tmp_path)], capsys)
    assert code == 0 and out == f"{tmp_path / 'iter_0000002'}\n"
    assert "empty" in err and "latest_checkpointed_iteration.txt names 'iter_0000004'" in err


def test_deepspeed_global_steps(tmp_path, capsys):
    for n in (2, 4):
        d = tmp_path / f"global_step{n}"
        d.mkdir()
        torch.save({"module": {"w": torch.zeros(2)}}, d / "mp_rank_00_model_states.pt")
        torch.save({"optimizer_state_dict": {}}, d / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    (tmp_path / "latest").write_text("global_step4")
    assert latest_checkpoint(tmp_path).path == str(tmp_path / "global_step4")
    os.remove(tmp_path / "global_step4" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    code, out, err = run_cli(["latest", str(tmp_path)], capsys)
    assert code == 0 and out == f"{tmp_path / 'global_step2'}\n" and "no *optim_states.pt" in err


def test_torn_trainer_state_json_is_skipped(trainer_run, tmp_path, capsys):
    run = _run_with_newest(trainer_run, tmp_path, os.listdir(trainer_run / "checkpoint-6"))
    state = run / "checkpoint-6" / "trainer_state.json"
    state.write_bytes(state.read_bytes()[:50])
    code, out, err = run_cli(["latest", str(run)], capsys)
    assert code == 0 and out == f"{run / 'checkpoint-4'}\n" and "trainer_state.json:" in err and "JSON" in err


def test_the_trainer_resumes_from_what_latest_names(trainer_run, tmp_path):
    """The point of it all: `resume_from_checkpoint=$(ckptfix latest out)` after a crash mid-save."""
    from test_repair_hf import dataset

    run = _run_with_newest(trainer_run, tmp_path, _model_files(trainer_run) + SAVE_ORDER[:2])
    path = latest_checkpoint(run).path
    assert path == str(run / "checkpoint-4")
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "again"), max_steps=6, save_steps=2, report_to=[], use_cpu=True,
        per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args,
                                   train_dataset=dataset(100, 24, 0))
    trainer.train(resume_from_checkpoint=path)
    assert trainer.state.global_step == 6


def test_the_python_api(trainer_run):
    import ckptfix

    result = ckptfix.latest_checkpoint(trainer_run)
    assert isinstance(result, ckptfix.Latest) and result.path == str(trainer_run / "checkpoint-6")
    assert [c.kind for c in result.checked] == ["hf-trainer"] and result.chosen is result.checked[0]
    assert callable(ckptfix.latest_checkpoint) and "latest_checkpoint" in ckptfix.__all__
