"""Issue 42: what a real HF Trainer checkpoint-N/ lacks for resume_from_checkpoint (CKF310-CKF313)."""

from __future__ import annotations

import shutil

import pytest
from damage import cut, damage

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect

pytest.importorskip("transformers")
from test_latest import trainer_run as run_fixture  # noqa: E402 (the real Trainer run fixture)

trainer_run = run_fixture

EXPECT = {"optimizer.pt": "CKF310", "scheduler.pt": "CKF310", "trainer_state.json": "CKF311",
          "rng_state.pth": "CKF313"}


def _copy(trainer_run, tmp_path):
    d = tmp_path / "checkpoint-6"
    shutil.copytree(trainer_run / "checkpoint-6", d)
    return d


def test_healthy_checkpoint_has_no_new_finding(trainer_run, tmp_path):
    report = inspect(str(_copy(trainer_run, tmp_path)))
    assert not [f for f in report.findings if f.code in ("CKF310", "CKF311", "CKF312", "CKF313")]


@pytest.mark.parametrize("name", sorted(EXPECT))
@pytest.mark.parametrize("how", ["removed", "half", "zero"])
def test_damaged_file_is_named(trainer_run, tmp_path, name, how):
    d = _copy(trainer_run, tmp_path)
    damage(d / name, how)
    code = "CKF312" if (name, how) == ("rng_state.pth", "removed") else EXPECT[name]
    try:
        report = inspect(str(d))
    except CkptfixError as exc:  # a torn optimizer.pt / scheduler.pt is refused, naming the file
        assert how != "removed" and name in ("optimizer.pt", "scheduler.pt") and name in str(exc)
        return
    hits = [f for f in report.findings if f.code == code]
    assert hits and name in hits[0].message
    if code != "CKF312":
        assert report.exit_code == 1


# --- a PEFT model's Trainer checkpoint-N/ (read as peft-adapter): the same rules, the Trainer's resume run ------------


@pytest.fixture(scope="module")
def peft_run(tmp_path_factory):
    """A LoRA GPT-2 trained by the Trainer for 2 steps, saved at step 2 (adapter_model.safetensors beside the
    Trainer's files)."""
    pytest.importorskip("peft")
    out = tmp_path_factory.mktemp("peft_resume") / "run"
    _lora_trainer(out, 2).train()
    return out / "checkpoint-2"


def _lora_trainer(out, max_steps):
    import peft
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0,
                                  eos_token_id=0)
    model = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(
        r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True, task_type="CAUSAL_LM"))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=2, report_to=[], use_cpu=True, learning_rate=1e-3,
        per_device_train_batch_size=4, disable_tqdm=True, seed=0, logging_strategy="no", save_strategy="steps")
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    return transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])


def _optimizer_steps_after_resume(folder, tmp_path):
    """Resume the Trainer from `folder` for one more step: the optimizer's step count after it (3: resumed; 1: fresh)."""
    trainer = _lora_trainer(tmp_path / "again", 3)
    trainer.train(resume_from_checkpoint=str(folder))
    return int(next(iter(trainer.optimizer.state_dict()["state"].values()))["step"])


@pytest.mark.peft
def test_peft_trainer_checkpoint_healthy_has_no_new_finding(peft_run, tmp_path):
    d = tmp_path / "checkpoint-2"
    shutil.copytree(peft_run, d)
    report = inspect(str(d))
    assert report.ckpt.format == "peft-adapter"
    assert not [f for f in report.findings if f.code in ("CKF310", "CKF311", "CKF312", "CKF313")]
    assert _optimizer_steps_after_resume(d, tmp_path) == 3


@pytest.mark.peft
@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt"])
def test_peft_trainer_checkpoint_missing_optimizer_or_scheduler(peft_run, tmp_path, name):
    """Was no finding (the folder is read as a PEFT adapter); the Trainer resumes it with a fresh optimizer."""
    d = tmp_path / "checkpoint-2"
    shutil.copytree(peft_run, d)
    (d / name).unlink()
    hits = [f for f in inspect(str(d)).findings if f.code == "CKF310"]
    assert hits and name in hits[0].message and "fresh optimizer" in hits[0].pytorch
    assert _optimizer_steps_after_resume(d, tmp_path) == 1  # what CKF310 says: Adam restarted, no error


@pytest.mark.peft
@pytest.mark.parametrize("how", ["half", "zero"])
def test_peft_trainer_checkpoint_torn_rng_state(peft_run, tmp_path, how):
    d = tmp_path / "checkpoint-2"
    shutil.copytree(peft_run, d)
    f = d / "rng_state.pth"
    f.write_bytes(cut(f.read_bytes(), how))
    hits = [f for f in inspect(str(d)).findings if f.code == "CKF313"]
    assert hits and "rng_state.pth" in hits[0].message
    with pytest.raises((EOFError, OSError, RuntimeError)):  # what CKF313 says: torch.load dies, naming no file
        _optimizer_steps_after_resume(d, tmp_path)
