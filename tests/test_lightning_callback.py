"""The Lightning `ResumeGuardCallback` on the schedules of issue 18: a warm-up that starts at lr 0, and the
last checkpoint of a schedule that decayed to lr 0 resumed with a longer one, are information (CKF807 info,
no warning), and the run trains; a resume whose live schedule keeps lr 0 is stopped before the first step."""

from __future__ import annotations

import warnings

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches

from ckptfix.guard import TrainingSetupError, TrainingSetupWarning

lightning = pytest.importorskip("lightning")
pytestmark = pytest.mark.lightning
VOCAB = 64


class Lit(lightning.LightningModule):
    def __init__(self, total: int, warmup: int = 0):
        super().__init__()
        self.lm, self.total, self.warmup = TinyLM(VOCAB), total, warmup
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
        return lm_loss(self.lm, batch[0])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-3)
        total, warmup = self.total, self.warmup

        def linear(step: int) -> float:  # transformers' get_linear_schedule_with_warmup
            if step < warmup:
                return step / max(1, warmup)
            return max(0.0, (total - step) / max(1, total - warmup))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, linear)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def fit(module, steps, callback, ckpt_path=None):
    from ckptfix.integrations.lightning import ResumeGuardCallback  # noqa: F401  (the import the README shows)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.cat(make_batches(VOCAB, 4)))
    t = lightning.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                          enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        t.fit(module, torch.utils.data.DataLoader(data, batch_size=4), ckpt_path=ckpt_path)
    return t


def test_warmup_from_lr_zero_and_a_longer_schedule_after_a_finished_one(tmp_path):
    from ckptfix.integrations.lightning import ResumeGuardCallback

    callback = ResumeGuardCallback()
    module = Lit(total=4, warmup=2)
    t = fit(module, 4, callback)
    assert [(p.code, p.severity) for p in callback.setup_problems] == [("CKF807", "info")]  # warm-up from 0
    assert module.lrs[0] == 0.0 and module.lrs[1] > 0
    t.save_checkpoint(tmp_path / "last.ckpt")
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["optimizer_states"][0]["param_groups"][0]["lr"] == 0

    callback = ResumeGuardCallback()
    longer = Lit(total=8, warmup=2)
    t = fit(longer, 8, callback, ckpt_path=tmp_path / "last.ckpt")  # Lightning rebuilds the schedule: lr > 0 next
    assert [(p.code, p.severity) for p in callback.setup_problems] == [("CKF807", "info")]
    assert "Lightning" in callback.setup_problems[0].message
    assert t.global_step == 8 and longer.lrs[0] == 0.0 and all(lr > 0 for lr in longer.lrs[1:])
    assert callback.probe is not None and callback.probe.problems == []


def test_a_schedule_that_stays_at_zero_is_stopped(tmp_path):
    from ckptfix.integrations.lightning import ResumeGuardCallback

    t = fit(Lit(total=4), 4, ResumeGuardCallback())
    t.save_checkpoint(tmp_path / "last.ckpt")
    same = Lit(total=4)  # the same schedule, more steps: the lambda keeps lr 0
    with pytest.raises(TrainingSetupError, match="CKF807 error"):
        fit(same, 8, ResumeGuardCallback(), ckpt_path=tmp_path / "last.ckpt")
    assert same.lrs == []  # stopped before the first step
