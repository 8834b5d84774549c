"""The tiny LM, DeepSpeed config and full-state view shared by the scripts that train, save and resume real
DeepSpeed ZeRO runs on CPU ranks (`test_formats_deepspeed_ranks`, `test_repair_deepspeed_universal`). The
rank processes (`python -c SCRIPT`) import it with this folder put first on `sys.path` by `PRELUDE`."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

PRELUDE = f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"


class LM(nn.Module):
    """An embedding, one hidden layer and an untied head: every vocab-sized tensor a repair touches."""

    def __init__(self, vocab: int, dim: int = 8):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, dim)
        self.mlp = nn.Linear(dim, dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.relu(self.mlp(self.embed_tokens(ids))))


def config(stage: int, **extra) -> dict:
    """AdamW (torch's, no C++ build) with a WarmupLR schedule under ZeRO `stage`, 2 sequences per rank."""
    return {"train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01, "torch_adam": True}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}},
            "zero_optimization": {"stage": stage}, **extra}


def full_view(engine) -> dict[str, dict[str, torch.Tensor]]:
    """DeepSpeed's own view of every parameter, gathered across ranks: fp32 master weight and both moments."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {n: {"fp32": safe_get_full_fp32_param(p).clone(),
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
            for n, p in engine.module.named_parameters()}
