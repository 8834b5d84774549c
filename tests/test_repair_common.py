"""Shared helpers for the repair tests (imported by test_repair_*.py): load a repaired `.pth` the way a
training loop does, compare tensors bit for bit. Named test_* only so that it lives with them."""

from __future__ import annotations

import copy
import hashlib
import math
import os
from pathlib import Path

import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, warmup_lambda

LR, WD, WARMUP = 3e-3, 0.01, 10



def sha256(path: str | os.PathLike) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor, for bit-exact comparison (NaN == NaN, -0.0 != 0.0)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def snapshot(path: str | os.PathLike) -> dict[str, tuple[int, str]]:
    """name -> (size, sha256) of every file in a folder (recursively): proves nothing else was written."""
    out = {}
    for root, _, files in os.walk(path):
        for name in files:
            p = os.path.join(root, name)
            out[os.path.relpath(p, path)] = (os.path.getsize(p), sha256(p))
    return out


def resume(sd: dict, vocab: int, *, tied: bool = False, names: dict | None = None, scheduler: bool = True):
    """Build model/optimizer/scheduler/scaler for `vocab` and load `sd` into them, strictly.

    `sd` is copied first: Optimizer.load_state_dict keeps the very tensors it is given (no cast needed),
    so stepping would otherwise change the caller's state dict in place."""
    sd = copy.deepcopy(sd)
    torch.manual_seed(123)
    model = TinyLM(vocab, 16, 2, tied, **(names or {}))
    model.load_state_dict(sd["model"], strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    if scheduler:
        # Built before the optimizer state is loaded: building a scheduler sets the groups' lr to
        # step 0's, and LRScheduler.load_state_dict does not set it back.
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP))
        opt.load_state_dict(sd["optimizer"])
        sched.load_state_dict(sd["scheduler"])
    else:  # no scheduler state (policy reset): a new schedule starts from the groups' initial_lr
        opt.load_state_dict(sd["optimizer"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP))
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(sd["scaler"])
    return model, opt, sched, scaler


def train_steps(model, opt, sched, scaler, vocab: int, steps: int, seed: int = 7) -> list[float]:
    """The training loop of ckpt_factory.train, on batches that use every id up to `vocab`."""
    losses = []
    model.train()
    for ids in make_batches(vocab, steps, seed=seed):
        opt.zero_grad(set_to_none=True)
        loss = lm_loss(model, ids)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        losses.append(loss.item())
        assert math.isfinite(losses[-1])
    return losses


def assert_trains(losses: list[float]) -> None:
    k = max(1, len(losses) // 4)
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    assert all(math.isfinite(x) for x in losses)
    assert last < first, f"loss did not decrease: first {first:.3f}, last {last:.3f}"


def test_same_bits_is_bit_exact():
    assert same_bits(torch.tensor([float("nan")]), torch.tensor([float("nan")]))
    assert not same_bits(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not same_bits(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert same_bits(torch.tensor(3.0), torch.tensor(3.0))  # 0-d step tensors
