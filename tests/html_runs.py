"""Real runs for the HTML report's tests and its docs screenshots (bench/html_screenshots.py).

Each is a TinyLM trained with real AdamW steps (tests/ckpt_factory.py) on batches that never use some token ids:
those embedding rows get no gradient, so their exp_avg_sq rows stay exactly 0, as in a real run whose data never
holds a token.
"""

from __future__ import annotations

from pathlib import Path

import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import train_tokenizer_json

HOSTILE = ("<script>alert(1)</script>", '"><img src=x onerror=alert(2)>', "</style><a href='https://evil.example/'>x</a>")


def batches_without(vocab: int, skip: set[int], n: int, seq: int = 16, batch: int = 8, seed: int = 0) -> list[torch.Tensor]:
    """Random token sequences over range(vocab) that never hold an id in `skip`; the first batch holds every
    other id at an input position (not only last, where no gradient reaches its row)."""
    allowed = torch.tensor([i for i in range(vocab) if i not in skip])
    g = torch.Generator().manual_seed(seed)
    rows = -(-len(allowed) // (seq - 1))
    every = allowed[torch.randperm(len(allowed), generator=g)].repeat(2)[:rows * (seq - 1)].reshape(rows, seq - 1)
    first = torch.cat([every, allowed[torch.randint(0, len(allowed), (rows, 1), generator=g)]], dim=1)
    return [first] + [allowed[torch.randint(0, len(allowed), (batch, seq), generator=g)] for _ in range(n - 1)]


def dead_rows_checkpoint(path: Path, rows: int = 1000, dead: range = range(600, 700), steps: int = 8,
                         used: int | None = None) -> Path:
    """A checkpoint of `rows` rows whose batches never used the ids in `dead` (nor any id >= `used`)."""
    run = new_run(rows, dim=8)
    skip = set(dead) | set(range(rows if used is None else used, rows))
    train(run, steps, batches=batches_without(rows, skip, steps, seq=32, batch=32))  # every other id seen
    return save_checkpoint(run, path)


def hostile_tokenizer(folder: Path, base: int = 300) -> Path:
    """A BPE tokenizer.json whose added tokens are HTML (a script, an attribute break-out, a link)."""
    return train_tokenizer_json(folder, base, added=list(HOSTILE), special=["<|user|>"])


def showcase(folder: Path) -> tuple[Path, Path]:
    """(checkpoint, tokenizer) with every region: base tokens, added and special tokens, padding to 64, and a
    band of base ids (600-659) the data never held. The added tokens are trained; the padding rows are not."""
    from ckptfix.tokenizers import load_tokenizer

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer_json(folder, 1000, added=["<tool>", "<call>"], special=["<|user|>", "<|assistant|>"])
    size = load_tokenizer(tok).size
    rows = -(-size // 64) * 64
    ckpt = dead_rows_checkpoint(folder / "ckpt.pth", rows, range(600, 660), steps=12, used=size)
    return ckpt, tok


def new_tokens_pair(folder: Path, steps: int = 12) -> tuple[Path, Path]:
    """(A, B): A is a 300-row run repaired by ckptfix to a tokenizer with 3 more tokens (its record names them);
    B is A resumed and trained `steps` more steps on batches that use the new ids."""
    from tokenizer_factory import extend_tokenizer_json

    import ckptfix

    folder.mkdir(parents=True, exist_ok=True)
    base = train_tokenizer_json(folder / "old", 300)
    new = extend_tokenizer_json(base, folder / "new" / "tokenizer.json", ["<tool>", "<call>", "<result>"])
    run = train(new_run(300, dim=8), 10, batches=batches_without(300, set(), 10))
    save_checkpoint(run, folder / "base.pth")
    a = folder / "a.pth"
    ckptfix.repair(folder / "base.pth", new, a, from_tokenizer=base)
    resumed = new_run(303, dim=8)
    state = torch.load(a, weights_only=True)
    resumed.model.load_state_dict(state["model"])
    resumed.optimizer.load_state_dict(state["optimizer"])
    resumed.scheduler.load_state_dict(state["scheduler"])
    resumed.step = int(state["step"])
    train(resumed, steps, batches=batches_without(303, set(), steps, seed=5))
    assert all(torch.isfinite(torch.tensor(resumed.losses)))
    return a, save_checkpoint(resumed, folder / "b.pth")
