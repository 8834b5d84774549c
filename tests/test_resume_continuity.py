"""Issue 42 item 5: the HF callback compares the first loss logged after a resume with where the run stood
(its restored log_history): a healthy resume continues (no CKF830); a checkpoint whose weights were replaced by
a fresh initialisation (what a load that silently skipped them gives) jumps, and is named."""

from __future__ import annotations

import shutil
import warnings

import pytest
import torch

from ckptfix.guard import TrainingSetupWarning
from ckptfix.guard.continuity import Baseline, baseline, jump

transformers = pytest.importorskip("transformers")


def _cfg():
    return transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                   bos_token_id=0, eos_token_id=0)


def _data():
    g = torch.Generator().manual_seed(0)
    ids = (torch.arange(12).repeat(96, 1) + torch.randint(0, 4, (96, 1), generator=g)) % 64  # learnable
    return [{"input_ids": row, "labels": row} for row in ids]


def _args(out, max_steps):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=20, report_to=[], use_cpu=True, logging_steps=1,
        per_device_train_batch_size=8, learning_rate=3e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("continuity") / "out"
    torch.manual_seed(0)
    transformers.Trainer(model=transformers.GPT2LMHeadModel(_cfg()), args=_args(out, 20),
                         train_dataset=_data()).train()
    return out


def _resume(run, tmp_path, damage=None):
    from ckptfix.integrations.transformers import ResumeGuardCallback

    out = tmp_path / "out"
    shutil.copytree(run, out)
    if damage is not None:
        damage(out / "checkpoint-20")
    callback = ResumeGuardCallback(steps=0)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(_cfg()), args=_args(out, 24),
                                   train_dataset=_data(), callbacks=[callback])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-20"))
    return callback, [str(w.message) for w in seen if issubclass(w.category, TrainingSetupWarning)]


def test_a_healthy_resume_continues(run, tmp_path):
    callback, said = _resume(run, tmp_path)
    assert callback.continuity_problems == [] and not [s for s in said if "CKF830" in s]


def test_weights_replaced_by_a_fresh_initialisation_are_named(run, tmp_path):
    def fresh_weights(folder):
        torch.manual_seed(1)
        transformers.GPT2LMHeadModel(_cfg()).save_pretrained(folder)  # the optimizer and schedule stay

    callback, said = _resume(run, tmp_path, fresh_weights)
    (problem,) = callback.continuity_problems
    assert problem.code == "CKF830" and "the run did not continue where it stopped: loss" in problem.message
    assert "after resuming from step 20" in problem.message and any("CKF830" in s for s in said)


def test_baseline_and_jump_on_numbers():
    history = [{"step": s, "loss": 3.0 - 0.01 * s} for s in range(1, 21)] + [{"step": 20, "train_runtime": 1.0}]
    base = baseline(history, 20)
    assert base == Baseline(20, pytest.approx(2.81), pytest.approx(0.01))
    assert jump(base, 21, 2.83) is None  # within the spread and the 5 % floor
    assert jump(base, 21, float("nan")) is not None and jump(base, 21, 3.5) is not None
    assert baseline(history[:3], 20) is None  # too little history to say anything
