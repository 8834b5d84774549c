"""StepProbe on real training loops: real models, real AdamW steps, real GradScaler on CPU."""

from __future__ import annotations

import warnings
from collections.abc import Callable

import pytest
import torch
from torch import nn

from ckptfix.guard import StepProbe, TrainingSetupError, TrainingSetupWarning


class MLP(nn.Module):
    def __init__(self, extra_head: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 1)
        if extra_head:
            self.unused_head = nn.Linear(8, 3)  # trainable but never used by the loss

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


@pytest.fixture
def peft():
    return pytest.importorskip("peft")


def mse(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return (model(x) - 1.0).pow(2).mean()


def run_loop(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    probe: StepProbe,
    *,
    steps: int = 3,
    loss_fn: Callable[[nn.Module, torch.Tensor], torch.Tensor] = mse,
    scaler: torch.amp.GradScaler | None = None,
    autocast: bool = False,
    after_step_before_update: bool = False,
) -> None:
    """A normal training loop with the probe hooks in place."""
    torch.manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_fn(model, x).float()
        (scaler.scale(loss) if scaler else loss).backward()
        probe.after_backward()
        probe.before_step()
        if scaler:
            scaler.step(opt)
            if after_step_before_update:
                probe.after_step()
            scaler.update()
            if not after_step_before_update:
                probe.after_step()
        else:
            opt.step()
            probe.after_step()
        opt.zero_grad()


def run_clean(*args, **kwargs) -> None:
    """A correct loop: the probe must neither raise nor warn."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        run_loop(*args, **kwargs)


# -- correct loops: no false alarms -------------------------------------------------------------


def test_plain_correct_loop_then_probe_goes_quiet():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt, steps=3)
    run_clean(model, opt, probe)
    assert probe.problems == [] and not probe.active and probe.steps_done == 3

    # After the window the hooks are no-ops, even for a broken step.
    run_loop(model, opt, probe, steps=1, loss_fn=lambda m, x: mse(m, x).detach().requires_grad_())
    assert probe.problems == [] and probe.steps_done == 3


@pytest.mark.peft
@pytest.mark.parametrize("steps", [1, 3])
def test_correct_peft_lora_loop_is_not_flagged(peft, steps):
    """peft starts lora_B at 0, so dL/d(lora_A) is exactly 0 on step 1. That is healthy."""
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=2, lora_alpha=4, target_modules=["fc1", "fc2"], lora_dropout=0.0)
    model = peft.get_peft_model(MLP(), cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)

    # Real first-step gradients:
    mse(model, torch.randn(8, 4)).backward()
    grads = {n.split("model.")[-1]: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert not grads["fc1.lora_A.default.weight"].any()
    assert grads["fc1.lora_B.default.weight"].any()
    opt.zero_grad()

    probe = StepProbe(model, opt, steps=steps)
    run_clean(model, opt, probe, steps=steps)
    assert probe.problems == []


def test_amp_fp32_model_with_cpu_gradscaler_and_bf16_autocast():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    probe = StepProbe(model, opt, scaler, steps=3)
    run_clean(model, opt, probe, scaler=scaler, autocast=True)
    assert probe.problems == []


def test_unused_parameter_can_be_allowed():
    model = MLP(extra_head=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt, steps=2, unused_ok=["unused_head"])
    run_clean(model, opt, probe, steps=2)


# -- gradients ----------------------------------------------------------------------------------


def test_detached_loss_is_caught():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt)
    loss = mse(model, torch.randn(8, 4)).detach().requires_grad_()
    loss.backward()  # PyTorch itself says nothing
    assert all(p.grad is None for p in model.parameters())

    with pytest.raises(TrainingSetupError) as info:
        probe.after_backward()
    (problem,) = info.value.problems
    assert problem.code == "CKF810" and len(problem.params) == 4
    assert "loss graph was cut" in problem.message and ".detach()" in problem.message


def test_trainable_parameter_without_gradient():
    model = MLP(extra_head=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt)
    with pytest.raises(TrainingSetupError) as info:
        run_loop(model, opt, probe)
    (problem,) = info.value.problems
    assert problem.code == "CKF811"
    assert problem.params == ("unused_head.weight", "unused_head.bias")


def test_nan_gradient_names_the_parameters():
    model = MLP()
    with torch.no_grad():
        model.fc2.weight[0, 3] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt)
    with pytest.raises(TrainingSetupError) as info:
        run_loop(model, opt, probe)
    (problem,) = info.value.problems
    assert problem.code == "CKF812" and problem.severity == "error"
    assert "fc2.weight (8 of 8)" in problem.params
    assert "fc2.weight (8 of 8)" in str(info.value)
    assert probe.steps_done == 0  # raised before any step ran


def test_log_of_negative_values_gives_nan_loss_but_finite_grads():
    """Measured: log(u) of u < 0 is NaN, but its gradient 1/u is finite, so nothing to flag."""
    model = MLP()
    loss = torch.log(model(torch.randn(8, 4)) - 100.0).mean()
    loss.backward()
    assert loss.isnan() and all(p.grad.isfinite().all() for p in model.parameters())


def test_nan_from_sqrt_of_negative_values():
    """sqrt(u) of u < 0: NaN value *and* NaN gradient 0.5/sqrt(u) in every parameter."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt)
    with pytest.raises(TrainingSetupError, match="CKF812") as info:
        run_loop(model, opt, probe, loss_fn=lambda m, x: torch.sqrt(m(x) - 100.0).mean())
    assert {n.split(" ")[0] for n in info.value.problems[0].params} == {
        "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}


def test_all_zero_gradients():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt)
    with pytest.raises(TrainingSetupError, match="every gradient is exactly zero") as info:
        run_loop(model, opt, probe, loss_fn=lambda m, x: mse(m, x) * 0.0)
    assert info.value.problems[0].code == "CKF813"


def test_parameter_with_zero_gradient_on_every_step_is_a_warning():
    model = MLP()
    model.gate = nn.Parameter(torch.ones(1))  # multiplied by 0 below: always a zero gradient
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt, steps=2)
    with pytest.warns(TrainingSetupWarning, match="CKF813"):
        run_loop(model, opt, probe, steps=2, loss_fn=lambda m, x: mse(m, x) + 0.0 * m.gate.sum())
    assert [(p.code, p.severity, p.params) for p in probe.problems] == [
        ("CKF813", "warning", ("gate",))]


# -- the optimizer step -------------------------------------------------------------------------


def test_optimizer_updating_stale_tensors_is_caught():
    """load_state_dict(assign=True) after building the optimizer: it updates orphaned tensors."""
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    probe = StepProbe(model, opt)
    with pytest.raises(TrainingSetupError) as info:
        run_loop(model, opt, probe)
    (problem,) = info.value.problems
    assert problem.code == "CKF814" and len(problem.params) == 4
    assert "not in the optimizer at all" in problem.message


def test_lr_zero_on_every_probed_step():
    model = MLP()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    probe = StepProbe(model, opt, steps=2)
    with pytest.raises(TrainingSetupError, match="CKF807"):
        run_loop(model, opt, probe, steps=2)


# -- GradScaler skipped steps -------------------------------------------------------------------


@pytest.mark.parametrize("after_step_before_update", [False, True])
def test_one_skipped_step_while_scale_calibrates_is_only_a_warning(after_step_before_update):
    """A huge initial scale overflows on step 1; the scaler backs off and steps 2-3 are fine."""
    torch.manual_seed(0)
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127, backoff_factor=2.0**-100)
    probe = StepProbe(model, opt, scaler, steps=3)
    with pytest.warns(TrainingSetupWarning):
        run_loop(model, opt, probe, scaler=scaler, autocast=True,
                 loss_fn=lambda m, x: (m(x) - 10.0).pow(2).mean(),
                 after_step_before_update=after_step_before_update)
    assert [(p.code, p.severity) for p in probe.problems] == [
        ("CKF812", "warning"), ("CKF815", "warning")]
    assert "step 1 was skipped" in probe.problems[1].message
    assert scaler.get_scale() == 2.0**27


def test_every_probed_step_skipped_is_an_error():
    model = MLP()
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    probe = StepProbe(model, opt, scaler, steps=3)
    with pytest.warns(TrainingSetupWarning), pytest.raises(TrainingSetupError) as info:
        run_loop(model, opt, probe, scaler=scaler, autocast=True)
    assert [(p.code, p.severity) for p in info.value.problems] == [
        ("CKF815", "warning"), ("CKF815", "error")]
    assert "all 3 probed optimizer steps were skipped" in str(info.value)
    assert len(opt.state) == 0  # really: AdamW never stepped


def test_report_mode_collects_without_raising():
    model = MLP()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    probe = StepProbe(model, opt, steps=2, raise_on_error=False)
    run_loop(model, opt, probe, steps=2, loss_fn=lambda m, x: mse(m, x).detach().requires_grad_())
    assert [p.code for p in probe.problems] == ["CKF810", "CKF810"]
