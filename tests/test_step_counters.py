"""Issue 42 item 4: the loop's saved step against the optimizer's (CKF303), on real Trainer and Lightning
runs: healthy runs (gradient accumulation included) have no finding; an optimizer.pt from another save of the
same run is named with both numbers."""

from __future__ import annotations

import shutil

import pytest
import torch

from ckptfix.inspect import inspect

transformers = pytest.importorskip("transformers")
from test_latest import trainer_run as run_fixture  # noqa: E402 (a real Trainer run: checkpoint-2, -4, -6)

trainer_run = run_fixture


def _codes(path) -> dict[str, list]:
    found: dict[str, list] = {}
    for f in inspect(str(path)).findings:
        found.setdefault(f.code, []).append(f)
    return found


def test_a_healthy_trainer_checkpoint_has_no_finding(trainer_run):
    for n in (2, 4, 6):
        assert "CKF303" not in _codes(trainer_run / f"checkpoint-{n}")


def test_an_optimizer_from_another_save_is_named(trainer_run, tmp_path):
    mixed = tmp_path / "checkpoint-6"
    shutil.copytree(trainer_run / "checkpoint-6", mixed)
    shutil.copy(trainer_run / "checkpoint-4" / "optimizer.pt", mixed / "optimizer.pt")
    (f,) = _codes(mixed)["CKF303"]
    assert (f.severity, f.message) == ("warning", "trainer_state.json global_step is 6 but the optimizer has taken "
                                       "4 steps")


def test_gradient_accumulation_counts_optimizer_steps(tmp_path):
    from test_repair_hf import dataset

    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), max_steps=3, save_steps=3, report_to=[], use_cpu=True,
        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3, disable_tqdm=True,
        dataloader_num_workers=0, seed=0)
    torch.manual_seed(0)
    transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=dataset(100, 24, 0)).train()
    assert "CKF303" not in _codes(tmp_path / "out" / "checkpoint-3")


def test_lightning_with_gradient_accumulation(tmp_path):
    L = pytest.importorskip("lightning")
    from test_formats_lightning import TinyModule

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(32, 4)), batch_size=4)
    trainer = L.Trainer(max_steps=3, accumulate_grad_batches=2, accelerator="cpu", logger=False,
                        default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(TinyModule(), data)
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    assert trainer.global_step == 3
    assert "CKF303" not in _codes(tmp_path / "last.ckpt")
