"""The README's "Guard your training loop" example, executed verbatim.

README_LOOP below (a raw string) is the exact text of the README code block: keep the two identical.
"""

from __future__ import annotations

import math

import pytest
import torch

README_LOOP = r'''
import os

import torch
from torch import nn

from ckptfix.guard import ResumeGuard, check_training_setup


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        return self.lm_head(h + self.mlp(h))


def batches(vocab: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:  # sequences that count up modulo the vocabulary: easy to learn
        yield (torch.randint(0, vocab, (8, 1), generator=g) + torch.arange(17)) % vocab


def train(ckpt_path: str, tokenizer, total_steps: int, device: str = "cpu") -> list[float]:
    torch.manual_seed(0)
    model = TinyLM(len(tokenizer)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    scaler = torch.amp.GradScaler(device)

    # strict: refuse a checkpoint that does not fit; remap: resize vocab rows and their Adam
    # moments like `ckptfix repair`; fresh: drop mismatched optimizer state and re-warm
    guard = ResumeGuard(model, optimizer, scheduler, scaler, tokenizer=tokenizer,
                        policy="remap", rewarm_steps=20)
    step = 0
    if os.path.exists(ckpt_path):
        report = guard.load(ckpt_path)  # checks, loads, then runs check_training_setup
        step = report.extras["step"]
        print("\n".join(report.actions))
    else:
        check_training_setup(model, optimizer, scaler, scheduler=scheduler)

    losses = []
    data = batches(len(tokenizer), seed=step)
    while step < total_steps:
        ids = next(data).to(device)
        optimizer.zero_grad(set_to_none=True)
        logits = model(ids[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
        scaler.scale(loss).backward()
        guard.before_step()  # first steps: every trainable parameter got a finite, non-zero grad
        scaler.step(optimizer)
        scaler.update()
        guard.after_step()  # first steps: the optimizer step really changed the weights
        scheduler.step()
        step += 1
        losses.append(loss.item())
        if step % 10 == 0 or step == total_steps:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                        "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                        "step": step, "ckptfix": guard.record()}, ckpt_path)
    return losses
'''


# Paid at collection, as test_hf_callback.py does for transformers: one-off imports that take
# seconds and would otherwise be billed to this test (the first optimizer built in a process
# imports torch._dynamo, ~2 s; the first transformers import, ~2 s).
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
try:
    import transformers

    transformers.PreTrainedTokenizerFast  # noqa: B018 - force the lazy import
except ImportError:
    transformers = None


def hf_tokenizer(size: int):
    """A real transformers tokenizer with exactly `size` tokens."""
    if transformers is None:
        pytest.skip("transformers is not installed")
    from tokenizers import Tokenizer, models

    vocab = {f"t{i}": i for i in range(size)}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")))


def test_readme_loop_trains_resumes_and_survives_a_tokenizer_change(tmp_path, capsys):
    namespace: dict = {}
    exec(compile(README_LOOP, "README.md", "exec"), namespace)
    train = namespace["train"]
    ckpt = str(tmp_path / "last.pth")
    tok = hf_tokenizer(100)

    first = train(ckpt, tok, 20)
    assert len(first) == 20 and all(math.isfinite(x) for x in first)
    assert sum(first[-5:]) / 5 < sum(first[:5]) / 5 - 0.5

    second = train(ckpt, tok, 30)  # resumes at step 20
    out = capsys.readouterr().out
    assert len(second) == 10
    assert "loaded optimizer state (matched by names (recorded))" in out
    assert "loaded scheduler state" in out and "loaded GradScaler state" in out
    assert second[0] < first[0] - 1.0  # continues from the trained weights, not from scratch
    assert sum(second[-3:]) / 3 < sum(first[-3:]) / 3

    # the tokenizer gained a token: remap resizes the embedding/head rows and their moments
    with pytest.warns(Warning, match="CKF825"):
        third = train(ckpt, hf_tokenizer(101), 35)
    out = capsys.readouterr().out
    assert "resized embed.weight [100, 32] -> [101, 32]" in out
    assert "resized lm_head.weight [100, 32] -> [101, 32]" in out
    assert "resized the optimizer moments" in out
    assert len(third) == 5 and all(math.isfinite(x) for x in third)
    assert max(third) < first[0] - 1.0
