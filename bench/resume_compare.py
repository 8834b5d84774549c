"""Loss after resuming across a tokenizer change that adds tokens: ckptfix remap vs fresh vs no interruption.

Not a test: run `python bench/resume_compare.py` (about 20 s on an idle CPU) and read the table.

Setup (tests/ckpt_factory.py's TinyLM, AdamW lr 3e-3 wd 0.01, 10-step warmup LambdaLR then constant,
GradScaler state): phase 1 trains 200 steps on counting sequences over ids < OLD; the run then switches
to a tokenizer with NEW - OLD more tokens and phase 2 trains N steps on counting sequences over ids < NEW.

  uninterrupted  one model with NEW rows from the start (the same initial values for the shared rows
                 and every other tensor), one optimizer/scheduler/scaler through both phases
  remap          phase 1 at OLD rows, saved, `ckptfix repair` (default policy remap, mean init), resumed
  remap-zeros    as remap, but the new rows' exp_avg_sq zeroed after loading (a naive resize)
  fresh          `--policy fresh` (Adam state dropped, schedule kept) resumed with no re-warm
  fresh+rewarm   `--policy fresh` with a 10-step linear LR re-warm, as the record's `rewarm` asks
  reset          `--policy reset`: optimizer and scheduler state dropped, warmup runs again
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ckpt_factory import Run, TinyLM, make_batches, save_checkpoint, warmup_lambda  # noqa: E402
from tokenizer_factory import train_sentencepiece  # noqa: E402

import ckptfix  # noqa: E402

LR, WD, WARMUP, DIM = 3e-3, 0.01, 10, 16
SQ_RATIOS: dict[str, list[float]] = {}


def make_run(model: nn.Module) -> Run:
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    return Run(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP)),
               torch.amp.GradScaler("cpu"), 0, [])


def step(run: Run, ids: torch.Tensor, old_vocab: int, lr_scale: float = 1.0) -> tuple[float, float]:
    """One AMP-style step; returns (loss, loss on targets that are new tokens, nan if none)."""
    run.optimizer.zero_grad(set_to_none=True)
    logits = run.model(ids[:, :-1])
    targets = ids[:, 1:].reshape(-1)
    per_token = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets, reduction="none")
    loss = per_token.mean()
    new = targets >= old_vocab
    new_loss = per_token[new].mean().item() if new.any() else math.nan
    if lr_scale != 1.0:
        for g in run.optimizer.param_groups:
            g["lr"] *= lr_scale
    run.scaler.scale(loss).backward()
    run.scaler.step(run.optimizer)
    run.scaler.update()
    if lr_scale != 1.0:
        for g in run.optimizer.param_groups:
            g["lr"] /= lr_scale
    run.scheduler.step()
    run.step += 1
    return loss.item(), new_loss


def resume(path: str, vocab: int, *, zero_new_sq_from: int | None = None, scheduler: bool = True) -> Run:
    sd = torch.load(path, weights_only=True)
    model = TinyLM(vocab, DIM)
    model.load_state_dict(sd["model"], strict=True)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    if scheduler and "scheduler" in sd:
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP))
        opt.load_state_dict(sd["optimizer"])
        sched.load_state_dict(sd["scheduler"])
    else:
        opt.load_state_dict(sd["optimizer"])
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP))
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(sd["scaler"])
    if zero_new_sq_from is not None:
        for p in (model.embedding.weight, model.head.weight):
            opt.state[p]["exp_avg_sq"][zero_new_sq_from:] = 0
    return Run(model, opt, sched, scaler, sd["step"], [])


def one_seed(seed: int, old: int, new: int, phase1: int, phase2: int, tok: Path, tmp: Path) -> dict[str, list]:
    torch.manual_seed(seed)
    big = TinyLM(new, DIM)  # the uninterrupted model: NEW rows from the start
    small = TinyLM(old, DIM)
    state = {k: (v[:old].clone() if v.shape and v.shape[0] == new else v.clone()) for k, v in big.state_dict().items()}
    small.load_state_dict(state)  # identical initial values for every shared row and tensor
    batches1 = make_batches(old, phase1, seed=1000 + seed)
    batches2 = make_batches(new, phase2, seed=2000 + seed)

    runs: dict[str, Run] = {"uninterrupted": make_run(big)}
    interrupted = make_run(small)
    for ids in batches1:
        step(runs["uninterrupted"], ids, old)
        step(interrupted, ids, old)
    ref = runs["uninterrupted"]  # what the new rows' second moments look like had they been there all along
    for label, p in (("embedding", ref.model.embedding.weight), ("head", ref.model.head.weight)):
        sq = ref.optimizer.state[p]["exp_avg_sq"]
        SQ_RATIOS.setdefault(label, []).append((sq[old:].mean() / sq[:old].mean()).item())
    src = tmp / f"seed{seed}.pth"
    save_checkpoint(interrupted, src)
    for policy in ("remap", "fresh", "reset"):
        ckptfix.repair(src, tok, tmp / f"seed{seed}.{policy}.pth", policy=policy, force=True)
    runs["remap"] = resume(str(tmp / f"seed{seed}.remap.pth"), new)
    runs["remap-zeros"] = resume(str(tmp / f"seed{seed}.remap.pth"), new, zero_new_sq_from=old)
    runs["fresh"] = resume(str(tmp / f"seed{seed}.fresh.pth"), new)
    runs["fresh+rewarm"] = resume(str(tmp / f"seed{seed}.fresh.pth"), new)
    runs["reset"] = resume(str(tmp / f"seed{seed}.reset.pth"), new, scheduler=False)

    out = {}
    for name, run in runs.items():
        losses = []
        for k, ids in enumerate(batches2):
            scale = min(1.0, (k + 1) / WARMUP) if name == "fresh+rewarm" else 1.0
            losses.append(step(run, ids, old, scale))
        out[name] = losses
    return out


def summarize(results: list[dict[str, list]], windows: list[tuple[int, int]]) -> str:
    names = list(results[0])
    header = f"{'run':<14}" + "".join(f"{f'steps {a}-{b}':>16}" for a, b in windows) + \
             "".join(f"{f'new-tok {a}-{b}':>16}" for a, b in windows[1:])
    lines = [header, "-" * len(header)]
    for name in names:
        cells = []
        for col in (0, 1):
            for a, b in (windows if col == 0 else windows[1:]):
                per_seed = []
                for r in results:
                    vals = [x[col] for x in r[name][a - 1:b] if not math.isnan(x[col])]
                    per_seed.append(sum(vals) / len(vals))
                m = statistics.mean(per_seed)
                sd = statistics.stdev(per_seed) if len(per_seed) > 1 else 0.0
                cells.append(f"{m:>9.3f} ±{sd:5.3f}")
        a, b = windows[-1]
        diffs = [sum(r[name][k][0] - r["uninterrupted"][k][0] for k in range(a - 1, b)) / (b - a + 1) for r in results]
        cells.append(f"{statistics.mean(diffs):>+9.3f} ±{statistics.stdev(diffs) if len(diffs) > 1 else 0:5.3f}")
        lines.append(f"{name:<14}" + "".join(f"{c:>16}" for c in cells))
    lines[0] += f"{f'paired d {a}-{b}':>16}"
    lines[1] = "-" * len(lines[0])
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", type=int, default=1000)
    ap.add_argument("--new", type=int, default=1100)
    ap.add_argument("--phase1", type=int, default=200)
    ap.add_argument("--phase2", type=int, default=50)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is fastest, and keeps the numbers reproducible
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        tok = train_sentencepiece(tmp, args.new, name="new")
        results = [one_seed(s, args.old, args.new, args.phase1, args.phase2, tok, tmp) for s in range(args.seeds)]
    print(f"TinyLM dim {DIM}; {args.phase1} steps at {args.old} rows, then {args.phase2} steps after the switch to "
          f"{args.new} tokens; mean loss (± stdev over {args.seeds} seeds)")
    windows = [(1, 1), (1, 20), (21, args.phase2)]
    print(summarize(results, windows))
    print("paired d: mean over the window of (run's loss - uninterrupted loss) on the same batches")
    print("uninterrupted run at the switch: mean exp_avg_sq of the new rows / the old rows: " + ", ".join(
        f"{k} {statistics.mean(v):.3g}" for k, v in SQ_RATIOS.items()) + " (ckptfix mean init: 1 by construction)")


if __name__ == "__main__":
    main()
