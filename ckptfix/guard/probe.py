"""First-step probe: `StepProbe` watches the first few real optimizer steps (gradients arrived,
are finite and non-zero, the weights actually changed, the GradScaler did not skip every step)
and then turns itself into a no-op."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ckptfix.guard.problems import Problem, report_problems
from ckptfix.guard.ranks import counts_once, gather, is_dtensor, local
from ckptfix.guard.setup import (
    _lr_by_param,
    _param_ids_in,
    _scaler_of,
    named_params,
    scaler_enabled,
    unwrap_optimizer,
)

__all__ = ["StepProbe"]


def _dense(grad: torch.Tensor) -> torch.Tensor:
    """Values of a gradient, sparse ones (nn.Embedding(sparse=True)) included."""
    return grad.coalesce().values() if grad.is_sparse else grad


_LORA_PAIRS = (("lora_A", "lora_B"), ("lora_embedding_A", "lora_embedding_B"))


def _lora_partner(name: str) -> str | None:
    """The name of the LoRA B matrix paired with the A matrix `name` (None: `name` is no LoRA A)."""
    segments = name.split(".")
    for a, b in _LORA_PAIRS:
        if a in segments:
            return ".".join(b if s == a else s for s in segments)
    return None


def _lora_a_zero_expected(name: str, params: dict[str, torch.nn.Parameter], nonzero_weights: set[str]) -> bool:
    """True if `name` is a LoRA A matrix whose B partner is still all zero (`nonzero_weights`: the
    partners whose weights are not, agreed over ranks).

    peft initialises lora_B to zero, so the gradient of lora_A (dL/dA = B^T ...) is exactly
    zero on the first step; it becomes non-zero once lora_B has moved. That is correct training.
    """
    partner = _lora_partner(name)
    return partner is not None and partner in params and partner not in nonzero_weights


def _merge(values: Sequence[int], sharded: bool) -> int:
    """One number from every rank's: a sharded tensor's pieces add up; a replica's (DDP) are the same
    number on every rank, and where they are not, the worst rank's is the one to report."""
    return sum(values) if sharded else max(values)


@dataclass
class _Grads:
    """One step's gradients as every rank sees them after the agreement (global counts)."""

    trainable: list[str]
    present: set[str] = field(default_factory=set)  # got a gradient (on some rank)
    nonfinite: dict[str, tuple[int, int]] = field(default_factory=dict)  # name -> (non-finite, elements)
    nonzero: set[str] = field(default_factory=set)  # a non-zero gradient element (on some rank)
    nonzero_weights: set[str] = field(default_factory=set)  # LoRA B partners not all zero


def _grad_row(p: torch.nn.Parameter) -> list[int]:
    """This rank's numbers for one gradient: present, non-finite, elements (both counted once per
    element of the whole tensor), any non-zero. Local piece only: nothing here is a collective."""
    if p.grad is None:
        return [0, 0, 0, 0]
    piece = _dense(local(p.grad))
    once = counts_once(p.grad)
    bad = int((~torch.isfinite(piece)).sum()) if once else 0
    return [1, bad, piece.numel() if once else 0, int(bool(piece.any()))]


def _grad_stats(trainable: dict[str, torch.nn.Parameter], params: dict[str, torch.nn.Parameter]) -> _Grads:
    """The gradient facts of this step, agreed over ranks in one all_reduce (`ranks.gather`)."""
    names = list(trainable)
    partners = sorted({b for n in names if (b := _lora_partner(n)) is not None and b in params})
    row = [v for n in names for v in _grad_row(trainable[n])]
    row += [int(bool(local(params[b].detach()).any())) for b in partners]
    column = list(zip(*gather(row)))  # column[i]: every rank's value i
    out = _Grads(names)
    for k, name in enumerate(names):
        sharded = is_dtensor(trainable[name])
        if max(column[4 * k]):
            out.present.add(name)
            bad, elements = _merge(column[4 * k + 1], sharded), _merge(column[4 * k + 2], sharded)
            if bad:
                out.nonfinite[name] = (bad, elements)
        if max(column[4 * k + 3]):
            out.nonzero.add(name)
    out.nonzero_weights = {b for j, b in enumerate(partners) if max(column[4 * len(names) + j])}
    return out


class StepProbe:
    """Watch the first `steps` optimizer steps of a real loop, then do nothing.

    Call the hooks around each step::

        probe = StepProbe(model, optimizer, scaler, steps=3)
        for batch in loader:
            scaler.scale(loss_fn(model, batch)).backward()
            probe.after_backward()   # optional: before_step runs it if you don't
            probe.before_step()
            scaler.step(optimizer); scaler.update()
            probe.after_step()
            optimizer.zero_grad()

    Checks: every trainable parameter got a gradient (CKF810 none did / CKF811 some did not),
    gradients are finite (CKF812), not all zero (CKF813), the step changed the weights (CKF814),
    the GradScaler did not skip every step (CKF815), lr was not 0 on every step (CKF807).
    Error-level findings raise `TrainingSetupError` at once (unless `raise_on_error=False`);
    everything found is kept in `.problems`.

    Cost, only during the first `steps` steps: one pass over the gradients (a few reductions
    per parameter, each synchronising with the device), and a full copy of the trainable
    parameters that received a non-zero gradient, taken in `before_step` one parameter at a
    time and freed in `after_step`. A full copy is needed because only an element-by-element
    comparison proves that a step changed nothing; for LoRA it is tiny, for full fine-tuning it
    is one extra copy of the weights, on their device, for the duration of one optimizer step.
    After the window every hook returns immediately.

    On several ranks (torchrun: FSDP2's DTensors, DDP) every rank must call the hooks, as it calls
    optimizer.step(): each tests its own piece (a DTensor's local shard), and after_backward and
    after_step each agree over ranks in one all_reduce, so every rank reports the same findings with
    counts over the whole tensor. The snapshot is of the local piece only.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        scaler: Any = None,
        *,
        steps: int = 3,
        unused_ok: Iterable[str] = (),
        raise_on_error: bool = True,
    ):
        """`unused_ok`: name substrings of trainable parameters that may legitimately get no
        gradient (e.g. a head the loss does not use); better still, freeze them."""
        self.model = model
        self.optimizer = optimizer
        self.scaler = _scaler_of(optimizer, scaler)
        self.steps = steps
        self.unused_ok = tuple(unused_ok)
        self.raise_on_error = raise_on_error
        self.problems: list[Problem] = []
        self.steps_done = 0
        self._skipped = 0
        self._lr_all_zero: list[bool] = []
        self._always_zero: set[str] | None = None  # zero-grad params, intersected over steps
        self._backward_checked = False
        self._snapshot: dict[str, torch.Tensor] = {}
        self._step_before: dict[int, float] = {}
        self._scale_before: float | None = None

    @property
    def active(self) -> bool:
        """True while the probe is still watching steps."""
        return self.steps_done < self.steps

    # -- hooks ----------------------------------------------------------------------------------

    def after_backward(self) -> list[Problem]:
        """Check the gradients of this step (call after backward, before the optimizer step)."""
        if not self.active or self._backward_checked:
            return []
        self._backward_checked = True
        params = named_params(self.model)
        trainable = {n: p for n, p in params.items() if p.requires_grad}
        with torch.no_grad():
            grads = _grad_stats(trainable, params)
        problems = self._check_grads_present(grads)
        problems += self._check_grads_finite(grads)
        problems += self._check_grads_nonzero(grads, params)
        return self._emit(problems)

    def before_step(self) -> None:
        """Snapshot what the optimizer step should change (call right before optimizer.step)."""
        if not self.active:
            return
        self.after_backward()
        opt = unwrap_optimizer(self.optimizer)
        self._lr_all_zero.append(all(float(g["lr"]) == 0.0 for g in opt.param_groups))
        self._snapshot = self._take_snapshot(opt)
        self._step_before = self._step_counters(opt)
        self._scale_before = (float(self.scaler.get_scale())
                              if scaler_enabled(self.scaler) else None)

    def after_step(self) -> list[Problem]:
        """Check that the optimizer step changed the weights (call after optimizer.step)."""
        if not self.active:
            return []
        problems: list[Problem] = []
        skipped, stuck = self._step_outcome()
        if skipped:
            self._skipped += 1
            why = ("the GradScaler found inf/NaN gradients and lowered its scale; normal for the "
                   "first steps while the scale calibrates" if scaler_enabled(self.scaler)
                   else "the optimizer did not advance its step counters")
            problems.append(Problem(
                "CKF815", "warning", f"optimizer step {self.steps_done + 1} was skipped ({why}).",
            ))
        else:
            problems += self._check_weights_changed(stuck)
        self._snapshot, self._step_before = {}, {}
        self._backward_checked = False
        self.steps_done += 1
        if not self.active:
            problems += self._window_summary()
        return self._emit(problems)

    # -- gradient checks ------------------------------------------------------------------------

    def _check_grads_present(self, grads: _Grads) -> list[Problem]:
        """CKF810: no gradient at all (graph cut); CKF811: some trainable params got none."""
        trainable = grads.trainable
        missing = [n for n in trainable if n not in grads.present]
        if trainable and len(missing) == len(trainable):
            return [Problem(
                "CKF810", "error",
                f"none of the {len(trainable)} trainable parameters received a gradient: the "
                "loss graph was cut before backward (loss.detach(), a tensor rebuilt from "
                "loss.item(), the forward run under torch.no_grad()/inference_mode), backward() "
                "was not called, or gradient checkpointing (use_reentrant=True) saw inputs that "
                "do not require grad ('None of the inputs have requires_grad=True'; call "
                "model.enable_input_require_grads()).",
                tuple(missing),
            )]
        missing = [n for n in missing if not any(s in n for s in self.unused_ok)]
        if not missing:
            return []
        return [Problem(
            "CKF811", "error",
            f"{len(missing)} of {len(trainable)} trainable parameters received no gradient: they "
            "are not used by the loss, or gradient checkpointing cut them off ('None of the "
            "inputs have requires_grad=True'; call model.enable_input_require_grads()). Freeze "
            "parameters that are unused on purpose, or list them in unused_ok.",
            tuple(missing),
        )]

    def _check_grads_finite(self, grads: _Grads) -> list[Problem]:
        """CKF812: NaN/Inf gradients (counts over the whole tensor, all ranks' shards). Under an enabled
        GradScaler an overflow only skips the step (a warning here; CKF815 turns it into an error if
        every probed step is skipped)."""
        bad = [f"{name} ({count} of {elements})" for name, (count, elements) in grads.nonfinite.items()]
        if not bad:
            return []
        if scaler_enabled(self.scaler):
            return [Problem(
                "CKF812", "warning",
                f"{len(bad)} parameter(s) have NaN/Inf (scaled) gradients; the GradScaler will "
                "skip this step.",
                tuple(bad),
            )]
        return [Problem(
            "CKF812", "error",
            f"{len(bad)} parameter(s) have NaN/Inf gradients (count of non-finite elements "
            "shown): the step would write NaN into the weights. Look for NaN weights or inputs, "
            "log/sqrt of non-positive values, division by zero, or fp16 overflow.",
            tuple(bad),
        )]

    def _check_grads_nonzero(self, grads: _Grads, params: dict[str, torch.nn.Parameter]) -> list[Problem]:
        """CKF813 (error): every gradient of this step is exactly zero.

        Single parameters with a zero gradient are *not* judged per step: peft's lora_A has an
        exactly-zero gradient on the first step because lora_B starts at zero, which is correct.
        They are only reported (as a warning) at the end of the window if their gradient was
        zero, for no such known reason, on every probed step; see `_window_summary`.
        """
        with_grad = [n for n in grads.trainable if n in grads.present]
        nonzero = grads.nonzero
        unexplained = {n for n in with_grad
                       if n not in nonzero and not _lora_a_zero_expected(n, params, grads.nonzero_weights)}
        self._always_zero = (unexplained if self._always_zero is None
                             else self._always_zero & unexplained)
        if not with_grad or nonzero:
            return []
        return [Problem(
            "CKF813", "error",
            f"every gradient is exactly zero ({len(with_grad)} parameters): the loss does not "
            "depend on the trainable parameters (constant or masked-out loss, all labels "
            "ignored (-100), zero-initialised adapters on both sides).",
            tuple(with_grad),
        )]

    # -- step checks ----------------------------------------------------------------------------

    def _take_snapshot(self, opt: Any) -> dict[str, torch.Tensor]:
        """Copy this rank's piece of every trainable parameter whose step must visibly change it.

        A parameter qualifies if it has a non-zero gradient, a group lr > 0 (or is outside the
        optimizer, which is itself a bug), and at least one element whose plain-SGD update
        lr*|g| is at least one ulp of the weight: smaller updates can round away legitimately,
        so no claim is made about them. Adaptive optimizers move by about lr per element, which
        is more than lr*|g| whenever |g| < 1, so this never flags a healthy Adam step.
        Judged on the local piece (a DTensor's shard), so no collective here; `_step_outcome` agrees.
        """
        lrs = _lr_by_param(opt)
        snap: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, p in named_params(self.model).items():
                if not p.requires_grad or p.grad is None or p.grad.is_sparse:
                    continue
                lr = lrs.get(id(p), 1.0)
                weight, grad = local(p.detach()), local(p.grad)
                if lr == 0.0 or not p.is_floating_point() or not bool(grad.any()):
                    continue
                ulp = torch.finfo(p.dtype).eps * weight.abs()
                if bool((lr * grad.abs() >= ulp).any()):
                    snap[name] = weight.clone()
        return snap

    def _step_outcome(self) -> tuple[bool, list[str]]:
        """Was the step skipped (on any rank), and which snapshotted parameters did it leave unchanged
        on every rank that took a snapshot of its piece? One all_reduce whatever the data."""
        params = named_params(self.model)
        names = [n for n, p in params.items() if p.requires_grad]  # the same list on every rank
        row = [int(self._was_skipped())]
        with torch.no_grad():
            for name in names:
                before = self._snapshot.get(name)
                changed = before is not None and not torch.equal(before, local(params[name].detach()))
                row += [int(before is not None), int(changed)]
        ranks = gather(row)
        stuck = [n for k, n in enumerate(names)
                 if any(r[1 + 2 * k] for r in ranks) and not any(r[2 + 2 * k] for r in ranks)]
        return any(r[0] for r in ranks), stuck

    def _check_weights_changed(self, stuck: list[str]) -> list[Problem]:
        """CKF814: parameters with a non-zero gradient and lr > 0 that the step left unchanged."""
        params = named_params(self.model)
        in_opt = _param_ids_in(unwrap_optimizer(self.optimizer))
        if not stuck:
            return []
        outside = [n for n in stuck if id(params[n]) not in in_opt]
        detail = (f" {len(outside)} of them are not in the optimizer at all (it was built "
                  "before the model's parameters were replaced)." if outside else "")
        return [Problem(
            "CKF814", "error",
            f"optimizer step {self.steps_done + 1} did not change {len(stuck)} parameter(s) "
            "although they had non-zero gradients and lr > 0: the optimizer is not updating "
            "the model you train (stale optimizer, params re-created after it was built, a "
            "no-op optimizer step, or updates below the precision of the weight dtype)."
            + detail,
            tuple(stuck),
        )]

    def _step_counters(self, opt: Any) -> dict[int, float]:
        """Adam-style per-parameter `step` counters (0 where no state exists yet)."""
        counters: dict[int, float] = {}
        for group in opt.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    step = opt.state.get(p, {}).get("step", 0)
                    counters[id(p)] = float(local(step) if isinstance(step, torch.Tensor) else step)
        return counters

    def _was_skipped(self) -> bool:
        """Did the optimizer skip this step? Several signals, most direct first."""
        skipped = getattr(self.optimizer, "step_was_skipped", None)  # accelerate
        if isinstance(skipped, bool):
            return skipped
        opt = unwrap_optimizer(self.optimizer)
        if scaler_enabled(self.scaler):
            # Before scaler.update(): the scaler still holds this step's found_inf per device.
            states = getattr(self.scaler, "_per_optimizer_states", {})
            for key in (id(self.optimizer), id(opt)):
                found = states.get(key, {}).get("found_inf_per_device")
                if found:
                    return sum(float(v) for v in found.values()) > 0
            # After scaler.update(): a skipped step halved the scale.
            if self._scale_before is not None and self.scaler.get_scale() < self._scale_before:
                return True
        # Without a scaler signal: Adam-style step counters that did not advance.
        before = self._step_before
        after = self._step_counters(opt)
        if before and (any(after.values()) or any(before.values())):
            return all(after.get(k, 0) <= v for k, v in before.items())
        return False

    def _window_summary(self) -> list[Problem]:
        """Findings that need the whole probe window rather than one step."""
        problems: list[Problem] = []
        if self._skipped and self._skipped == self.steps_done:
            problems.append(Problem(
                "CKF815", "error",
                f"all {self.steps_done} probed optimizer steps were skipped by the GradScaler "
                "(inf/NaN gradients every time): nothing is being learned. Look for NaN weights "
                "or loss, or fp16 overflow.",
            ))
        if len(self._lr_all_zero) > 1 and all(self._lr_all_zero):
            problems.append(Problem(
                "CKF807", "error",
                f"the learning rate was 0 in every param group on all {len(self._lr_all_zero)} "
                "probed steps: a warmup would have raised it by now; nothing is being learned.",
            ))
        never = sorted(self._always_zero or ())
        if never:
            problems.append(Problem(
                "CKF813", "warning",
                f"{len(never)} parameter(s) had an all-zero gradient on every probed step; "
                "they are not learning yet.",
                tuple(never),
            ))
        return problems

    def _emit(self, problems: list[Problem]) -> list[Problem]:
        self.problems += problems
        return report_problems(problems, self.raise_on_error, stacklevel=4)  # the caller of the hook
