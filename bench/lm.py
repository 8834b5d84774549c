"""Synthetic but real LM training checkpoints for the benchmark.

`make_checkpoint(path, size_bytes)` builds a decoder-shaped model (token embedding, N transformer-ish
blocks, final norm, untied LM head) in float32, runs one real AMP-style training step on a tiny
batch (GradScaler.scale -> backward -> scaler.step(AdamW) -> scaler.update -> LambdaLR.step), and
`torch.save`s the usual resume dict. AdamW therefore holds exp_avg, exp_avg_sq and a per-parameter
`step` tensor, exactly as a training loop writes them.

Memory: the params (P) + grads (P) + two moments (2P) exist at once, i.e. about 4/3 of the file
size, and `torch.save` writes storages without copying them: an 8 GB file needs ~11 GB of RAM.
`make_many_tensors` builds small checkpoints with a chosen number of tensors (the scaling table).
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import asdict, dataclass

VOCAB = 32000
EMBED = "embed_tokens.weight"
HEAD = "lm_head.weight"


@dataclass
class LMConfig:
    vocab: int
    dim: int
    layers: int

    @property
    def params(self) -> int:
        d, per_block = self.dim, 12 * self.dim * self.dim + 13 * self.dim
        return 2 * self.vocab * d + self.layers * per_block + 2 * d

    @property
    def file_bytes(self) -> int:  # fp32 param + exp_avg + exp_avg_sq (+ small metadata)
        return 12 * self.params


def config_for(size_bytes: int, vocab: int = VOCAB, layers: int = 8) -> LMConfig:
    """A fixed layer count (so every size has the same ~400 tensors: the benchmark varies bytes, not
    tensor count); the width solves 12 * (2*V*d + L*(12*d^2 + 13*d)) = size, rounded to 16."""
    params = size_bytes / 12
    a, b = 12 * layers, 2 * vocab + 13 * layers
    dim = (-b + math.sqrt(b * b + 4 * a * params)) / (2 * a)
    return LMConfig(vocab, max(16, int(round(dim / 16)) * 16), layers)


def build_model(cfg: LMConfig, seed: int = 0):
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.qkv = nn.Linear(d, 3 * d)
            self.proj = nn.Linear(d, d)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            return self.proj(nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))

    class Block(nn.Module):
        def __init__(self, d: int):
            super().__init__()
            self.ln_1, self.attn, self.ln_2 = nn.LayerNorm(d), Attention(d), nn.LayerNorm(d)
            self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            return x + self.mlp(self.ln_2(x))

    class LM(nn.Module):
        def __init__(self, c: LMConfig):
            super().__init__()
            self.embed_tokens = nn.Embedding(c.vocab, c.dim)
            self.layers = nn.ModuleList(Block(c.dim) for _ in range(c.layers))
            self.norm = nn.LayerNorm(c.dim)
            self.lm_head = nn.Linear(c.dim, c.vocab, bias=False)

        def forward(self, ids):
            h = self.embed_tokens(ids)
            for block in self.layers:
                h = block(h)
            return self.lm_head(self.norm(h))

    with torch.device("meta"):
        model = LM(cfg)
    model = model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # layer by layer, in place: no second copy of the weights
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "ln" in name or name.startswith("norm"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model


def train_step_and_save(model, path: str, vocab: int, seed: int = 0, steps: int = 1) -> None:
    import torch

    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, foreach=False)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
    scaler = torch.amp.GradScaler("cpu")
    for _ in range(steps):
        ids = torch.randint(0, vocab, (1, 16))
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        opt.zero_grad(set_to_none=True)  # free the grads before saving
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "scaler": scaler.state_dict(), "epoch": 0, "step": steps}, path)


def make_checkpoint(path: str, size_bytes: int, seed: int = 0, layers: int = 8) -> dict:
    cfg = config_for(size_bytes, layers=layers)
    model = build_model(cfg, seed)
    train_step_and_save(model, path, cfg.vocab, seed)
    return {**asdict(cfg), "params": cfg.params, "bytes": os.path.getsize(path),
            "model_tensors": len(model.state_dict()), "embed": EMBED, "head": HEAD}


def make_many_tensors(path: str, tensors: int, width: int = 64, seed: int = 0) -> dict:
    """A small real checkpoint with about `tensors` tensors (each param: weight, exp_avg, exp_avg_sq, step)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    params = max(4, tensors // 4)
    layers = params - 2  # + embedding + head
    model = nn.Module()
    model.embed_tokens = nn.Embedding(1000, width)
    model.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
    model.lm_head = nn.Linear(width, 1000, bias=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 1e-3
    opt.step()
    sched.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "scaler": torch.amp.GradScaler("cpu").state_dict(), "epoch": 0, "step": 1}, path)
    sd = model.state_dict()
    return {"tensors": len(sd) + sum(len(s) for s in opt.state_dict()["state"].values()),
            "bytes": os.path.getsize(path)}


def make_tokenizer_json(path: str, size: int) -> str:
    """A WordLevel tokenizer.json with exactly `size` ids (0..size-1)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, **{f"tok{i}": i for i in range(1, size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(path)
    return path


if __name__ == "__main__":  # python -m bench.lm PATH SIZE_BYTES [LAYERS] | --many PATH TENSORS  (prints JSON)
    if sys.argv[1] == "--many":
        print(json.dumps(make_many_tensors(sys.argv[2], int(sys.argv[3]))))
    else:
        layers = int(sys.argv[3]) if len(sys.argv) > 3 else 8
        print(json.dumps(make_checkpoint(sys.argv[1], int(float(sys.argv[2])), layers=layers)))
