"""`ResumeGuardCallback` for PyTorch Lightning: the same guarantees as the Hugging Face one.

    trainer = lightning.Trainer(..., callbacks=[ResumeGuardCallback(steps=3)])
    trainer.fit(module, ckpt_path="last.ckpt")

Lightning restores the model, the optimizers and the schedulers from `ckpt_path` before the fit loop
starts; at `on_train_start` (before the first training step) this callback runs `check_training_setup`
and checks every restored optimizer moment against its parameter (CKF822 shape, CKF823 dtype/device):
PyTorch does not, and `AdamW(fused=True)` turns a wrong-shaped moment into NaN weights or a heap
crash at the first step. It then probes the first `steps` optimizer steps with a `StepProbe`
(`on_before_optimizer_step` -> `on_train_batch_end`, automatic optimization).

Importing this module needs lightning; `ckptfix` itself never imports it.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "ckptfix.integrations.lightning needs the 'lightning' package, which is not installed "
        "(pip install lightning); without it, use ckptfix.ResumeGuard in your own loop."
    ) from exc

from ckptfix.guard import ResumeError, StepProbe, check_training_setup
from ckptfix.guard.problems import Problem, raise_or_warn
from ckptfix.guard.setup import check_live_state

__all__ = ["ResumeGuardCallback"]


class ResumeGuardCallback(Callback):
    """Fail before the first step when a (resumed) Lightning run cannot learn or its optimizer state
    does not fit the parameters. Raises `ResumeError` / `TrainingSetupError` out of `trainer.fit()`."""

    def __init__(self, steps: int = 3, *, unused_ok: Iterable[str] = ()):
        self.steps = steps
        self.unused_ok = tuple(unused_ok)
        self.probe: StepProbe | None = None
        self.setup_problems: list[Problem] = []  # what the setup check found and let through (warnings, info)
        self._stepping = False  # a probed optimizer step is in progress (before_step ran)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.probe = None
        self.setup_problems = []
        schedulers = [c.scheduler for c in getattr(trainer, "lr_scheduler_configs", [])]
        for i, optimizer in enumerate(trainer.optimizers):
            # restored state first: its errors are a ResumeError (the setup check would find them too)
            raise_or_warn(check_live_state(pl_module, optimizer), lambda found: ResumeError(found), stacklevel=4)
            self.setup_problems += check_training_setup(pl_module, optimizer,
                                                        scheduler=schedulers[i] if i < len(schedulers) else None)
        if self.steps > 0 and len(trainer.optimizers) == 1:
            self.probe = StepProbe(pl_module, trainer.optimizers[0], steps=self.steps, unused_ok=self.unused_ok)

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        if self.probe is not None and self.probe.active:
            self.probe.before_step()
            self._stepping = True

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.probe is not None and self._stepping:
            self._stepping = False
            self.probe.after_step()
