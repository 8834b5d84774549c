"""Real checkpoints for tests: a tiny language model trained with real torch.optim, schedulers and AMP state.

Everything here runs real PyTorch code (AdamW steps, LambdaLR/OneCycleLR, GradScaler.state_dict()),
so the files tests inspect and repair are exactly what a training loop writes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


class TinyLM(nn.Module):
    """Embedding -> a couple of MLP blocks with LayerNorm -> LM head, optionally tied (GPT-2 style)."""

    def __init__(self, vocab: int, dim: int = 16, layers: int = 2, tied: bool = False,
                 embed_name: str = "text_embedding", head_name: str = "text_head"):
        super().__init__()
        self.embed_name, self.head_name = embed_name, head_name
        setattr(self, embed_name, nn.Embedding(vocab, dim))
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        setattr(self, head_name, nn.Linear(dim, vocab, bias=False))
        if tied:
            self.head.weight = self.embedding.weight

    @property
    def embedding(self) -> nn.Embedding:
        return getattr(self, self.embed_name)

    @property
    def head(self) -> nn.Linear:
        return getattr(self, self.head_name)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embedding(ids)
        for block in self.blocks:
            h = h + block(h)
        return self.head(self.norm(h))


def warmup_lambda(warmup: int):
    return lambda step: min(1.0, (step + 1) / warmup)


@dataclass
class Run:
    model: TinyLM
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler
    step: int = 0
    losses: list | None = None


def make_batches(vocab: int, n: int, seq: int = 16, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """A learnable toy corpus: sequences that count up modulo the vocab, from random starts."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, vocab, (n, batch, 1), generator=g)
    return [((s + torch.arange(seq)) % vocab) for s in starts]


def lm_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def new_run(vocab: int, *, dim: int = 16, layers: int = 2, tied: bool = False, lr: float = 3e-3,
            warmup: int = 10, scheduler: str = "lambda", total_steps: int = 1000, seed: int = 0, **names) -> Run:
    torch.manual_seed(seed)
    model = TinyLM(vocab, dim, layers, tied, **names)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    if scheduler == "onecycle":
        sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=total_steps)
    else:
        sched = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_lambda(warmup))
    return Run(model, optimizer, sched, torch.amp.GradScaler("cpu"), 0, [])


def train(run: Run, steps: int, *, vocab: int | None = None, seed: int = 1, batches=None) -> Run:
    """Real AMP-style steps: scaler.scale(loss).backward(), scaler.step, scaler.update, scheduler.step."""
    vocab = vocab or run.model.embedding.num_embeddings
    batches = batches if batches is not None else make_batches(vocab, steps, seed=seed)
    run.model.train()
    for ids in batches[:steps]:
        run.optimizer.zero_grad(set_to_none=True)
        loss = lm_loss(run.model, ids)
        run.scaler.scale(loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.scheduler.step()
        run.step += 1
        run.losses.append(loss.item())
        assert math.isfinite(float(loss))
    return run


def save_checkpoint(run: Run, path: Path, *, epoch: int = 1, keys: dict | None = None, **extra) -> Path:
    """torch.save a resume checkpoint with the usual keys (spellings overridable)."""
    k = {"model": "model", "optimizer": "optimizer", "scheduler": "scheduler", "scaler": "scaler", **(keys or {})}
    obj = {k["model"]: run.model.state_dict(), k["optimizer"]: run.optimizer.state_dict(),
           k["scheduler"]: run.scheduler.state_dict(), k["scaler"]: run.scaler.state_dict(),
           "epoch": epoch, "step": run.step, **extra}
    torch.save(obj, path)
    return Path(path)


def trained_checkpoint(path: Path, vocab: int, steps: int = 20, **kw) -> Path:
    """The common case in one call: a TinyLM trained `steps` steps, saved at `path`."""
    run = train(new_run(vocab, **kw), steps)
    return save_checkpoint(run, path)
