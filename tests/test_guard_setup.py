"""check_training_setup on real tiny models, real optimizers and real GradScalers.

Every failure is reproduced for real (and, where PyTorch itself fails later, that failure is
asserted too), and correct setups must produce no finding at all.
"""

from __future__ import annotations

import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn

from ckptfix.guard import (
    Problem,
    TrainingSetupError,
    TrainingSetupWarning,
    check_training_setup,
)


class MLP(nn.Module):
    """Two Linear layers with names peft can target (fc1, fc2)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.fixture
def peft():
    return pytest.importorskip("peft")


def codes(problems: list[Problem], severity: str | None = None) -> list[str]:
    return sorted(p.code for p in problems if severity in (None, p.severity))


def check_clean(*args, **kwargs) -> None:
    """Guard mode must neither raise nor warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        assert check_training_setup(*args, **kwargs) == []


def lora(peft, model: nn.Module) -> nn.Module:
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"], lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


# -- correct setups: no false alarms ------------------------------------------------------------


def test_plain_correct_setup_has_no_findings():
    model = MLP()
    check_clean(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


@pytest.mark.peft
def test_correct_peft_lora_setup_has_no_findings(peft):
    model = lora(peft, MLP())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    check_clean(model, opt)


def test_fp32_model_with_cpu_gradscaler_has_no_findings():
    model = MLP()
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()
    check_clean(model, torch.optim.AdamW(model.parameters()), scaler)


def test_deprecated_cuda_gradscaler_is_tolerated():
    """torch.cuda.amp.GradScaler is deprecated and, without CUDA, disabled: nothing to report."""
    model = MLP().half()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        warnings.simplefilter("ignore", UserWarning)
        scaler = torch.cuda.amp.GradScaler()
    check_clean(model, torch.optim.AdamW(model.parameters()), scaler, raise_on_error=True)


# -- CKF801: nothing trainable ------------------------------------------------------------------


@pytest.mark.peft
def test_lora_config_created_but_never_applied(peft):
    """The user froze the base model (as one does before LoRA) but never called get_peft_model."""
    model = MLP()
    model.requires_grad_(False)
    peft.LoraConfig(r=2, target_modules=["fc1", "fc2"])  # created ... and forgotten
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # all params, as many scripts do

    # What the user would see later, for real:
    with pytest.raises(RuntimeError, match="does not require grad"):
        model(torch.randn(2, 4)).sum().backward()

    with pytest.raises(TrainingSetupError) as info:
        check_training_setup(model, opt)
    err = info.value
    assert codes(err.problems, "error") == ["CKF801"]
    assert codes(err.problems, "warning") == ["CKF804"]  # frozen params in the optimizer
    text = str(err)
    assert text.splitlines()[0].startswith("training would not learn: 1 error(s), 1 warning(s)")
    assert "get_peft_model" in text and "0 trainable parameters" in text


# -- CKF802: adapters frozen --------------------------------------------------------------------


@pytest.mark.peft
def test_adapters_refrozen_after_get_peft_model(peft):
    model = lora(peft, MLP())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for name, p in model.named_parameters():  # what a "freeze the model" helper does later
        if "lora_" in name:
            p.requires_grad_(False)

    with pytest.raises(TrainingSetupError) as info:
        check_training_setup(model, opt)
    problems = info.value.problems
    assert codes(problems, "error") == ["CKF801", "CKF802"]
    adapters = next(p for p in problems if p.code == "CKF802")
    assert len(adapters.params) == 4 and all("lora_" in n for n in adapters.params)
    assert "re-froze" in adapters.message


@pytest.mark.peft
def test_some_adapters_frozen_is_a_warning(peft):
    model = lora(peft, MLP())
    model.base_model.model.fc1.lora_A["default"].weight.requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    with pytest.warns(TrainingSetupWarning, match="CKF802"):
        problems = check_training_setup(model, opt)
    assert [(p.code, p.severity) for p in problems] == [("CKF802", "warning")]
    assert problems[0].params == ("base_model.model.fc1.lora_A.default.weight",)


def test_vision_adapter_name_is_not_taken_for_a_peft_adapter():
    """Only dotted segments *starting* with a marker count: `vision_adapter` is a normal module."""
    model = nn.ModuleDict({"vision_adapter": nn.Linear(2, 2), "head": nn.Linear(2, 2)})
    model["vision_adapter"].requires_grad_(False)
    check_clean(model, torch.optim.AdamW(model["head"].parameters()))


# -- CKF803 / CKF804: optimizer coverage --------------------------------------------------------


@pytest.mark.peft
def test_optimizer_built_before_get_peft_model_misses_the_adapters(peft):
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # too early
    model = lora(peft, model)

    with pytest.raises(TrainingSetupError) as info:
        check_training_setup(model, opt)
    problems = info.value.problems
    assert codes(problems) == ["CKF803", "CKF804"]
    missing = next(p for p in problems if p.code == "CKF803")
    assert sorted(missing.params) == sorted(n for n, p in model.named_parameters()
                                            if p.requires_grad)

    # And really: a step leaves the adapters untouched.
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    model(torch.randn(3, 4)).pow(2).mean().backward()
    opt.step()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if n in before)


def test_load_state_dict_assign_leaves_optimizer_with_stale_tensors():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    with pytest.raises(TrainingSetupError, match="stale copies") as info:
        check_training_setup(model, opt)
    assert codes(info.value.problems) == ["CKF803"]
    assert len(info.value.problems[0].params) == 4


def test_frozen_params_in_optimizer_is_a_warning():
    model = MLP()
    model.fc1.requires_grad_(False)
    problems = check_training_setup(model, torch.optim.AdamW(model.parameters()),
                                    raise_on_error=False)
    assert [(p.code, p.severity, p.params) for p in problems] == [
        ("CKF804", "warning", ("fc1.weight", "fc1.bias"))]


def test_tied_parameters_are_reported_once():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied, like an LM head
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
    problems = check_training_setup(model, opt, raise_on_error=False)
    assert [(p.code, p.params) for p in problems] == [("CKF803", ("0.weight",))]


# -- CKF805: optimizer state on another device --------------------------------------------------


def test_optimizer_state_on_other_device():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    state = opt.state[model.fc1.weight]
    state["exp_avg"] = state["exp_avg"].to("meta")  # e.g. state restored onto the wrong device

    with pytest.raises(TrainingSetupError) as info:
        check_training_setup(model, opt)
    (problem,) = info.value.problems
    assert problem.code == "CKF805" and problem.params == ("fc1.weight",)
    assert "parameter on cpu, state on meta" in problem.message

    with pytest.raises(RuntimeError, match="device"):  # what torch does next step
        opt.step()


# -- CKF806: fp16 weights with an enabled GradScaler --------------------------------------------


def test_fp16_params_with_enabled_gradscaler_real_error_and_caught_before():
    model = MLP().half()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    assert scaler.is_enabled()

    with pytest.raises(TrainingSetupError) as info:
        check_training_setup(model, opt, scaler)
    (problem,) = info.value.problems
    assert problem.code == "CKF806" and len(problem.params) == 4
    assert "Attempting to unscale FP16 gradients" in problem.message
    assert "torch.autocast" in problem.message and "bfloat16" in problem.message

    # The real PyTorch failure it predicts (it does trigger on CPU):
    scaler.scale(model(torch.randn(2, 4).half()).float().sum()).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.step(opt)


def test_fp16_params_without_scaler_are_not_ckf806():
    model = MLP().half()
    check_clean(model, torch.optim.AdamW(model.parameters()))


# -- CKF807: learning rate 0 --------------------------------------------------------------------


def test_lr_zero_without_scheduler_is_an_error():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=0.0)
    with pytest.raises(TrainingSetupError, match="CKF807") as info:
        check_training_setup(model, opt)
    assert info.value.problems[0].params == ("fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")


def test_lr_zero_at_warmup_step_zero_is_information():
    """Issue 18 asks for this change (it was a warning): a warm-up from 0 whose next lr is above 0 is info,
    never a warning; a step-0 lr of 0 whose next lr is unknown or 0 stays a warning."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, step / 10))
    assert opt.param_groups[0]["lr"] == 0.0 and sched.last_epoch == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        found = check_training_setup(model, opt, scheduler=sched)
    assert [(p.code, p.severity) for p in found] == [("CKF807", "info")] and "0.0001" in found[0].message
    flat = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(model.parameters()), lambda step: 0.0 if step < 2 else 1)
    with pytest.warns(TrainingSetupWarning, match="CKF807"):
        check_training_setup(model, flat.optimizer, scheduler=flat)

    # A schedule stuck at 0 after it has stepped is an error again.
    stuck = torch.optim.lr_scheduler.LambdaLR(torch.optim.AdamW(model.parameters()), lambda s: 0)
    stuck.optimizer.step()
    stuck.step()
    with pytest.raises(TrainingSetupError, match="CKF807"):
        check_training_setup(model, stuck.optimizer, scheduler=stuck)


def test_lr_zero_at_the_end_of_a_finished_schedule():
    """A linear decay that reached 0 (HF's default), resumed with a longer schedule: info (the first step runs
    at lr 0, then it trains); resumed with the same schedule: an error (nothing left to train)."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 4))
    for _ in range(4):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == 0.0
    saved = opt.state_dict()  # a resume: the schedule is built, then both states loaded (lr 0 comes back)
    longer = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: max(0.0, 1 - s / 8))
    opt.load_state_dict(saved)
    longer.load_state_dict(sched.state_dict())
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        found = check_training_setup(model, opt, scheduler=longer)
    assert [(p.code, p.severity) for p in found] == [("CKF807", "info")]
    assert "the next ones train" in found[0].message and "Lightning" in found[0].message
    with pytest.raises(TrainingSetupError, match="CKF807 error.*keeps it at 0"):
        check_training_setup(model, opt, scheduler=sched)


# -- CKF808: GradScaler scale collapsed ---------------------------------------------------------


def _drive_scaler(model: nn.Module, scaler: torch.amp.GradScaler, steps: int) -> None:
    """Real AMP steps on a model whose weights hold a NaN: every step overflows and backs off."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(torch.randn(4, 4)).float().sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()


def test_collapsing_gradscaler_scale_warns_then_errors():
    model = MLP()
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")

    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    _drive_scaler(model, scaler, steps=4)  # 4 -> 0.25
    assert scaler.get_scale() == 0.25
    problems = check_training_setup(model, None, scaler, raise_on_error=False)
    assert [(p.code, p.severity) for p in problems] == [("CKF808", "warning")]

    _drive_scaler(model, scaler, steps=25)  # 2**-2 -> 2**-27
    with pytest.raises(TrainingSetupError, match="CKF808"):
        check_training_setup(model, None, scaler)


# -- the error message ----------------------------------------------------------------------------


def test_error_message_lists_at_most_ten_names():
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(8)])  # 16 parameters
    opt = torch.optim.AdamW(model[0].parameters())
    with pytest.raises(TrainingSetupError) as info:
        check_training_setup(model, opt)
    lines = str(info.value).splitlines()
    assert lines[0] == "training would not learn: 1 error(s), 0 warning(s)"
    assert len(lines) == 2 and lines[1].startswith("  CKF803 error: 14 trainable parameter(s)")
    assert lines[1].endswith("[1.weight, 1.bias, 2.weight, 2.bias, 3.weight, 3.bias, "
                             "4.weight, 4.bias, 5.weight, 5.bias and 4 more]")


# -- packaging ----------------------------------------------------------------------------------


def test_guard_does_not_import_transformers():
    code = "import sys, ckptfix.guard; print('transformers' in sys.modules, 'peft' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=_repo_root())
    assert out.stdout.split() == ["False", "False"]


def _repo_root() -> str:
    import pathlib

    return str(pathlib.Path(__file__).resolve().parents[1])
