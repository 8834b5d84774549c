"""The LR re-warm after optimizer state was dropped (see `ckptfix.guard.resume`)."""

from __future__ import annotations

from typing import Any

from ckptfix.guard.setup import unwrap_optimizer


class Rewarm:
    """Scale every param group's lr by min(1, (k+1)/steps) for the duration of optimizer step k."""

    def __init__(self, optimizer: Any, steps: int):
        self.opt = unwrap_optimizer(optimizer)
        self.steps = steps
        self.done = 0
        self._saved: list[Any] | None = None
        self._handles = [self.opt.register_step_pre_hook(lambda *_: self.apply()),
                         self.opt.register_step_post_hook(lambda *_: self.restore(stepped=True))]

    @property
    def active(self) -> bool:
        return self.done < self.steps

    @property
    def factor(self) -> float:
        return min(1.0, (self.done + 1) / self.steps) if self.active else 1.0

    def apply(self) -> None:
        if self._saved is not None or not self.active:
            return
        self._saved = [g["lr"] for g in self.opt.param_groups]
        factor = self.factor
        for g in self.opt.param_groups:
            g["lr"] = g["lr"] * factor  # a new object: a tensor lr is not modified in place

    def restore(self, stepped: bool) -> None:
        if self._saved is None:
            return
        for g, lr in zip(self.opt.param_groups, self._saved):
            g["lr"] = lr
        self._saved = None
        if stepped:
            self.done += 1
            if not self.active:
                self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
