"""The resize script users write by hand (the baseline `ckptfix repair` is compared with).

    python -m bench.naive_resize SRC OUT NEW_ROWS [EMBED_NAME HEAD_NAME]

Loads the whole checkpoint with `torch.load(weights_only=True)`, grows the embedding and the LM head
and their AdamW moments with `torch.cat` (new rows zero, i.e. like `ckptfix repair --init zeros`
for the weights and exp_avg), and `torch.save`s it all again. The optimizer index of a parameter is
its position in the model's state_dict (the bench model has no buffers, so that order is
`model.parameters()`'s, which is the order torch.optim numbers state by).
"""

from __future__ import annotations

import sys


def grow(t, rows: int):
    import torch

    if rows <= t.shape[0]:
        return t[:rows].clone()
    return torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))])


def main(argv: list[str]) -> None:
    import torch

    src, out, rows = argv[0], argv[1], int(argv[2])
    names = tuple(argv[3:5]) or ("embed_tokens.weight", "lm_head.weight")
    ckpt = torch.load(src, weights_only=True)
    model = ckpt["model"]
    order = list(model)
    for name in names:
        model[name] = grow(model[name], rows)
        state = ckpt["optimizer"]["state"][order.index(name)]
        for key in ("exp_avg", "exp_avg_sq"):
            state[key] = grow(state[key], rows)
    torch.save(ckpt, out)


if __name__ == "__main__":
    main(sys.argv[1:])
