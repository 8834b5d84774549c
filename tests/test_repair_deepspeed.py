"""`ckptfix repair` refuses DeepSpeed checkpoints with one line naming DeepSpeed's own conversion tool.

ZeRO flattens and partitions parameters and moments across ranks; rewriting them is DeepSpeed's
universal-checkpoint job (`ds_to_universal`), so `_writer_for("deepspeed", path)` raises RepairError
with `deepspeed_folder.repair_unsupported(path)` before anything is written.

The folder is the layout `engine.save_checkpoint` writes at ZeRO stage 0 (`latest`, `global_stepN/
mp_rank_00_model_states.pt` holding `module`, a plain `optimizer` state dict, `param_shapes`, ...),
built with torch.save: a real DeepSpeed run needs a subprocess and most of this test's time budget
(test_formats_deepspeed.py covers the real files).
"""

from __future__ import annotations

import os
from collections import OrderedDict

import pytest
import torch
from ckpt_factory import new_run, train
from test_repair_common import snapshot
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix
from ckptfix.cli import main
from ckptfix.errors import RepairError
from ckptfix.formats import detect, read_checkpoint
from ckptfix.surgery import _writer_for

OLD = 48


@pytest.fixture(scope="module")
def ds_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    folder, tag = root / "ckpt", "global_step3"
    (folder / tag).mkdir(parents=True)
    (folder / "latest").write_text(tag)
    run = train(new_run(OLD), 3)
    module = run.model.state_dict()
    torch.save({
        "module": module, "buffer_names": [], "optimizer": run.optimizer.state_dict(),
        "param_shapes": [OrderedDict((n, p.shape) for n, p in run.model.named_parameters())],
        "frozen_param_shapes": None, "shared_params": {}, "frozen_param_fragments": None,
        "lr_scheduler": run.scheduler.state_dict(), "data_sampler": None, "random_ltd": None,
        "sparse_tensor_module_names": set(), "skipped_steps": 0, "global_steps": 3, "global_samples": 24,
        "dp_world_size": 1, "mp_world_size": 1, "ds_config": {"train_micro_batch_size_per_gpu": 8},
        "ds_version": "0.19.8",
    }, folder / tag / "mp_rank_00_model_states.pt")
    tok = train_bpe_tokenizer_json(root, 64)
    return folder, tok


def test_the_folder_reads_as_deepspeed(ds_folder):
    folder, _ = ds_folder
    assert detect(str(folder)) == "deepspeed"
    ckpt = read_checkpoint(folder)
    assert ckpt.format == "deepspeed" and ckpt.model["text_embedding.weight"].shape == (OLD, 16)


def test_writer_for_deepspeed_raises_with_the_universal_checkpoint_hint(ds_folder):
    folder, _ = ds_folder
    with pytest.raises(RepairError, match="ds_to_universal") as info:
        _writer_for("deepspeed", str(folder))
    assert str(folder / "global_step3") in str(info.value)
    with pytest.raises(RepairError, match="ds_to_universal"):
        _writer_for("deepspeed")


def test_cli_repair_exits_2_with_one_line_and_writes_nothing(ds_folder, tmp_path, capsys):
    folder, tok = ds_folder
    before = snapshot(folder)
    out = tmp_path / "fixed"
    with pytest.raises(SystemExit) as exc:
        main(["repair", str(folder), "--tokenizer", str(tok), "-o", str(out)])
    assert exc.value.code == 2
    stdout, stderr = capsys.readouterr()
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ckptfix: error: "), stderr
    assert "DeepSpeed" in lines[0] and "ds_to_universal" in lines[0] and "global_step3" in lines[0]
    assert "Traceback" not in stderr and stdout == ""
    assert not out.exists() and os.listdir(tmp_path) == []
    assert snapshot(folder) == before


def test_dry_run_refuses_what_the_real_run_refuses(ds_folder):
    """A dry run never says "would write" for a checkpoint the real run refuses; the hint carries the flag
    that makes ds_to_universal accept an engine.save_checkpoint folder of a ZeRO-1/2 run."""
    folder, tok = ds_folder
    with pytest.raises(RepairError, match="ds_to_universal .*--inject_missing_state"):
        ckptfix.repair(folder, tok, dry_run=True)
