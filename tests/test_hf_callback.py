"""ResumeGuardCallback inside a real (tiny) transformers.Trainer run on the CPU."""

from __future__ import annotations

import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from ckptfix.guard import TrainingSetupError, TrainingSetupWarning

pytestmark = pytest.mark.transformers

REPO = Path(__file__).resolve().parents[1]

# Import once at collection: the first `transformers.Trainer` import alone takes ~5 s, which
# would otherwise be billed to whichever test runs first.
try:
    import transformers

    transformers.Trainer, transformers.GPT2LMHeadModel  # noqa: B018 - force the lazy imports
except ImportError:  # the import-error test below still runs
    transformers = None


@pytest.fixture
def hf():
    """The transformers module, or skip (the integration is optional)."""
    if transformers is None:
        pytest.skip("transformers is not installed")
    return transformers


def tiny_gpt2(hf):
    torch.manual_seed(0)
    cfg = hf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                        bos_token_id=0, eos_token_id=0)
    return hf.GPT2LMHeadModel(cfg)


def train(hf, model, tmp_path, trainer_cls=None, **args):
    """Three real optimizer steps with the guard callback; returns the callback."""
    from ckptfix.integrations.transformers import ResumeGuardCallback

    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    targs = hf.TrainingArguments(
        output_dir=str(tmp_path), max_steps=3, report_to=[], use_cpu=True,
        per_device_train_batch_size=4, save_strategy="no", logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, **args,
    )
    guard = ResumeGuardCallback(steps=3)
    trainer = (trainer_cls or hf.Trainer)(model=model, args=targs, train_dataset=dataset,
                                          callbacks=[guard])
    trainer.train()
    return guard


def test_correct_model_trains_without_findings(hf, tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        guard = train(hf, tiny_gpt2(hf), tmp_path)
    assert guard.probe is not None and guard.probe.steps_done == 3
    assert guard.probe.problems == [] and not guard.probe.active


def test_warmup_from_lr_zero_is_not_an_error(hf, tmp_path):
    # issue 18 asks for this change: a warm-up from lr 0 is information, no longer a CKF807 warning
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        guard = train(hf, tiny_gpt2(hf), tmp_path, warmup_steps=2)
    assert [(p.code, p.severity) for p in guard.setup_problems] == [("CKF807", "info")]
    assert guard.probe.problems == []


@pytest.mark.peft
def test_correct_peft_lora_model_trains_without_findings(hf, tmp_path):
    peft = pytest.importorskip("peft")
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0,
                          fan_in_fan_out=True, task_type="CAUSAL_LM")
    model = peft.get_peft_model(tiny_gpt2(hf), cfg)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        guard = train(hf, model, tmp_path)
    assert guard.probe.steps_done == 3 and guard.probe.problems == []


def test_all_parameters_frozen_raises_before_training(hf, tmp_path):
    """Without the guard this run dies later with 'element 0 of tensors does not require grad'
    (or, with some trainers, 'trains' with loss 0.0)."""
    model = tiny_gpt2(hf)
    model.requires_grad_(False)
    with pytest.raises(TrainingSetupError) as info:
        train(hf, model, tmp_path)
    assert [p.code for p in info.value.problems] == ["CKF801"]
    assert "get_peft_model" in str(info.value)


def test_detached_loss_in_a_custom_trainer_is_caught_at_the_first_step(hf, tmp_path):
    class DetachingTrainer(hf.Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            return loss.detach().requires_grad_()  # the bug: graph cut, backward still "works"

    with pytest.raises(TrainingSetupError) as info:
        train(hf, tiny_gpt2(hf), tmp_path, trainer_cls=DetachingTrainer)
    assert [p.code for p in info.value.problems] == ["CKF810"]


def test_import_without_transformers_says_what_to_install():
    """`ckptfix.integrations.transformers` must fail with a helpful message when transformers
    is missing (simulated in a subprocess by blocking the import)."""
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "import ckptfix.guard\n"
        "try:\n"
        "    import ckptfix.integrations.transformers\n"
        "except ImportError as e:\n"
        "    print('IMPORTERROR', e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO)
    assert "IMPORTERROR" in out.stdout and "pip install transformers" in out.stdout
