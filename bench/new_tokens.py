"""New tokens after a vocab change: HF resize_token_embeddings vs ckptfix `mean` vs ckptfix `pieces`.

Not a test: `nice -n 10 python -m bench.new_tokens` prints the README "New tokens" tables (on a shared
2-core machine: 35 min for both heads and 3 seeds; `--reuse-base` skips the base training).

Setup. Text: this Python's standard library sources (offline, real). Old tokenizer: a byte-level BPE
(`tokenizers`, 1024 tokens) trained on them. New tokenizer: the old one plus NEW_WORDS frequent
identifiers that the old one spells in 2+ pieces, added as " word" tokens (single_word), plus 3 new special
tokens. Model: `transformers` GPT-2, 2 layers, width 64, trained from scratch with AdamW (+ a warm-up
LambdaLR) for BASE_STEPS steps to a stable loss, saved as a resume dict (model, optimizer, scheduler, step),
once with a tied head and once untied. Each method then resumes on the same batches (new tokenizer) for
200 steps, for each seed (the seed picks phase-2 batches and any random init):

  hf-mean      model.resize_token_embeddings(n, mean_resizing=True) (transformers' default)
  hf-random    model.resize_token_embeddings(n, mean_resizing=False) (the model's random init)
  ckf-mean     ckptfix repair --init mean
  ckf-pieces   ckptfix repair (default with --from-tokenizer: --init pieces; rows that produce logits
               pulled towards the mean by HEAD_SHRINK)
  ckf-pieces-full     as ckf-pieces with HEAD_SHRINK = 1: every row the plain mean of its pieces' rows
  ckf-pieces+v-median as ckf-pieces, new rows' exp_avg_sq the old rows' column median (not mean)

Moments are remapped by ckptfix in every case (new rows: exp_avg 0, exp_avg_sq the old rows' mean); the
HF rows only replace the model's weights. Reported (mean ± sd over seeds):
  KL      KL(before || after) of next-token distributions on held-out text with no new token, right
          after the resize (nats per position)
  new@k   held-out loss at positions whose target is a new token after k steps
  old@200 held-out loss on text with no new token after 200 steps
  upd     new rows' per-coordinate |update| over the first 50 steps, over the old rows' median
"""

from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # tokenizer_factory
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ckptfix
import ckptfix.surgery.plan as plan_module
import ckptfix.surgery.rows as rows_module

OLD_VOCAB, NEW_WORDS, SPECIALS = 1024, 100, ["<|tool|>", "<|endturn|>", "<|image|>"]
DIM, LAYERS, HEADS, SEQ, BATCH = 64, 2, 4, 128, 8
BASE_STEPS, STEPS, LR, WD, WARMUP = 1200, 200, 2e-3, 0.01, 100
EVAL_AT = (0, 50, 200)


def corpus() -> tuple[list[str], list[str]]:
    """Standard-library sources, sorted by path: every 10th file is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size < 200_000)
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    return [t for i, t in enumerate(texts) if i % 10], [t for i, t in enumerate(texts) if i % 10 == 0]


def train_tokenizers(train: list[str], tmp: Path) -> tuple[Path, Path, list[str]]:
    from tokenizer_factory import train_byte_level
    from tokenizers import AddedToken

    tok = train_byte_level(train, OLD_VOCAB)
    old = tmp / "old.json"
    tok.save(str(old))
    counts = Counter(w for t in train for w in re.findall(r"(?<![\w.])[A-Za-z_]\w{3,}(?!\w)", t))
    words = [w for w, _ in counts.most_common(2000) if len(tok.encode(" " + w).ids) >= 2][:NEW_WORDS]
    tok.add_tokens([AddedToken(" " + w, single_word=True, normalized=False) for w in words])
    tok.add_special_tokens(SPECIALS)
    new = tmp / "new.json"
    tok.save(str(new))
    return old, new, words


def encode(path: Path, texts: list[str]) -> torch.Tensor:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return torch.tensor([i for t in texts for i in tok.encode(t).ids], dtype=torch.long)


def old_only_paragraphs(new_tok: Path, texts: list[str]) -> list[str]:
    """Paragraphs of `texts` in which the new tokenizer emits no new token (both tokenizers agree there)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(new_tok))
    paragraphs = [p + "\n\n" for t in texts for p in t.split("\n\n")]
    return [p for p in paragraphs if max(tok.encode(p).ids, default=0) < OLD_VOCAB]


def windows(ids: torch.Tensor, count: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - SEQ - 1, (count, BATCH), generator=g)
    return [torch.stack([ids[s:s + SEQ + 1] for s in row.tolist()]) for row in starts]


def make_model(vocab: int, tied: bool, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=vocab, n_embd=DIM, n_layer=LAYERS, n_head=HEADS, n_positions=SEQ,
                     bos_token_id=0, eos_token_id=0, tie_word_embeddings=tied)
    return GPT2LMHeadModel(cfg)


def make_optimizer(model):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / WARMUP))
    return opt, sched


def train_step(model, opt, sched, batch: torch.Tensor) -> float:
    logits = model(batch[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def train_base(train_ids: torch.Tensor, tied: bool, path: Path) -> float:
    model = make_model(OLD_VOCAB, tied)
    opt, sched = make_optimizer(model)
    losses = [train_step(model, opt, sched, b) for b in windows(train_ids, BASE_STEPS, seed=12345)]
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                "step": BASE_STEPS}, path)
    return statistics.mean(losses[-100:])


def load_resumed(path: Path, vocab: int, tied: bool, weights: dict | None = None):
    sd = torch.load(path, weights_only=True)
    model = make_model(vocab, tied)
    model.load_state_dict(weights if weights is not None else sd["model"], strict=True)
    opt, sched = make_optimizer(model)
    opt.load_state_dict(sd["optimizer"])
    sched.load_state_dict(sd["scheduler"])
    return model, opt, sched


def hf_resized(base: Path, vocab: int, tied: bool, mean_resizing: bool, seed: int) -> dict:
    model = make_model(OLD_VOCAB, tied)
    model.load_state_dict(torch.load(base, weights_only=True)["model"])
    torch.manual_seed(seed)
    model.resize_token_embeddings(vocab, mean_resizing=mean_resizing)
    return model.state_dict()


@torch.no_grad()
def log_probs(model, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.log_softmax(model(b[:, :-1]).logits.float(), -1) for b in batches]


@torch.no_grad()
def evaluate(model, new_batches: list[torch.Tensor], old_batches: list[torch.Tensor], old_vocab: int) -> tuple[float, float]:
    """(loss on positions whose target is a new token, loss on old-only text)."""
    model.eval()
    total, n = 0.0, 0
    for b, lp in zip(new_batches, log_probs(model, new_batches)):
        target = b[:, 1:]
        mask = target >= old_vocab
        total += -lp.gather(-1, target.unsqueeze(-1)).squeeze(-1)[mask].sum().item()
        n += int(mask.sum())
    old = statistics.mean(-lp.gather(-1, b[:, 1:].unsqueeze(-1)).mean().item()
                          for b, lp in zip(old_batches, log_probs(model, old_batches)))
    model.train()
    return total / max(n, 1), old


@torch.no_grad()
def kl_before_after(before: list[torch.Tensor], model, old_batches: list[torch.Tensor], old_vocab: int) -> float:
    model.eval()
    kls = []
    for p, q in zip(before, log_probs(model, old_batches)):
        kls.append((p.exp() * (p - q[..., :old_vocab])).sum(-1).mean().item())
    model.train()
    return statistics.mean(kls)


def resume_run(model, opt, sched, batches, evals, old_vocab: int) -> dict:
    emb = model.get_input_embeddings().weight
    start, moved = emb.detach().clone(), torch.zeros(emb.shape[0])
    out = {}
    for k, batch in enumerate(batches, 1):
        prev = emb.detach().clone()
        train_step(model, opt, sched, batch)
        if k <= 50:
            moved += (emb.detach() - prev).abs().mean(1)
        if k in EVAL_AT:
            out[f"new@{k}"], out[f"old@{k}"] = evaluate(model, *evals, old_vocab)
    assert emb.shape[0] == start.shape[0]
    out["upd"] = (moved[old_vocab:old_vocab + NEW_WORDS].median() / moved[:old_vocab].median()).item()
    return out


def methods(tied: bool) -> list[str]:
    return ["hf-mean", "hf-random", "ckf-mean", "ckf-pieces", "ckf-pieces-full", "ckf-pieces+v-median"]


def run_method(name: str, base: Path, tok: tuple[Path, Path], vocab: int, tied: bool, seed: int, tmp: Path,
               batches, evals, before) -> dict:
    old_tok, new_tok = tok
    out = tmp / f"{name.replace('/', '_')}-{tied}-{seed}.pth"
    init = "mean" if name in ("ckf-mean", "hf-mean", "hf-random") else None  # None: the default (pieces)
    saved = rows_module.HEAD_SHRINK, plan_module.new_rows_for
    if name == "ckf-pieces-full":
        rows_module.HEAD_SHRINK = 1.0
    if name.endswith("v-median"):
        # The optimizer's rule (optim_state.SECOND) names the second moments' fill in the plan; the variant
        # swaps it where the plan turns a fill into values (AdamW has no other column-mean state).
        def median_fill(rows, dtype, row_plan, fill, std, rng):
            return saved[1](rows, dtype, row_plan, "column-median" if fill == "column-mean" else fill, std, rng)
        plan_module.new_rows_for = median_fill
    try:
        ckptfix.repair(base, new_tok, out, from_tokenizer=old_tok, init=init, seed=seed, force=True)
    finally:
        rows_module.HEAD_SHRINK, plan_module.new_rows_for = saved
    weights = hf_resized(base, vocab, tied, name == "hf-mean", seed) if name.startswith("hf-") else None
    model, opt, sched = load_resumed(out, vocab, tied, weights)
    result = {"KL": kl_before_after(before, model, evals[1], OLD_VOCAB)}
    result["new@0"], result["old@0"] = evaluate(model, *evals, OLD_VOCAB)
    result.update(resume_run(model, opt, sched, batches, evals, OLD_VOCAB))
    return result


def table(results: dict[str, list[dict]]) -> str:
    cols = ["KL", "new@0", "new@50", "new@200", "old@200", "upd"]
    lines = ["| method | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    for name, runs in results.items():
        cells = []
        for c in cols:
            vals = [r[c] for r in runs]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            cells.append(f"{statistics.mean(vals):.4f} ± {sd:.4f}" if c == "KL" else f"{statistics.mean(vals):.3f} ± {sd:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def llama3_tiktoken_pieces(train: list[str], tmp: Path) -> None:
    """--init pieces with Llama 3's `original/tokenizer.model` (tiktoken ranks) as the old tokenizer, which had no
    segmenter before ckptfix encoded through the libraries (every new row fell back to the mean). New tokens:
    the NEW_WORDS most frequent identifiers of the training text that Llama 3 spells in 2+ pieces, added as
    " word" to Llama 3.1's tokenizer.json. Needs the tokenizer corpus (python fixtures/tokenizer_corpus.py)."""
    from tokenizers import AddedToken, Tokenizer

    from ckptfix.surgery.pieces import piece_rows
    from ckptfix.tokenizers import load_tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    import tokenizer_corpus as tc

    old_path = tc.cached(next(e for e in tc.ENTRIES if e.name == "llama3"))
    folder = tc.cached(next(e for e in tc.ENTRIES if e.name == "llama3_1-folder"))
    if old_path is None or folder is None:
        print("# Llama 3 files not cached: run python fixtures/tokenizer_corpus.py")
        return
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    counts = Counter(w for t in train for w in re.findall(r"(?<![\w.])[A-Za-z_]\w{3,}(?!\w)", t))
    words = [w for w, _ in counts.most_common(5000) if len(tok.encode(" " + w, add_special_tokens=False).ids) >= 2][:NEW_WORDS]
    spelled_by_library = {w: tok.encode(" " + w, add_special_tokens=False).ids for w in words}
    tok.add_tokens([AddedToken(" " + w, single_word=True, normalized=False) for w in words])
    tok.save(str(tmp / "llama3-new.json"))
    old, new = load_tokenizer(old_path), load_tokenizer(tmp / "llama3-new.json")
    source = np.where(np.arange(new.size) < old.size, np.arange(new.size), -1)
    t0 = time.time()
    rows = piece_rows(source, new, old, old.size)
    ids = new.token_to_id()
    same = sum(list(rows.get(ids[" " + w], ())) == spelled_by_library[w] for w in words)
    print(f"# Llama 3 tiktoken (original/tokenizer.model) as the old tokenizer: {len(rows)} of {len(words)} new "
          f"tokens get pieces ({time.time() - t0:.1f}s; before: 0, no segmenter for tiktoken files); "
          f"{same} of {len(words)} equal Llama 3.1 tokenizer.json's own encoding. First: "
          + ", ".join(f"{w}={len(spelled_by_library[w])}" for w in words[:8]), flush=True)


def main() -> None:
    global BASE_STEPS, STEPS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--base-steps", type=int, default=BASE_STEPS)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--heads", choices=["tied", "untied", "both"], default="both")
    ap.add_argument("--reuse-base", type=Path, help="a folder with base-True.pth / base-False.pth of an earlier run")
    ap.add_argument("--llama3-only", action="store_true", help="only the Llama 3 tiktoken pieces count")
    args = ap.parse_args()
    BASE_STEPS, STEPS = args.base_steps, args.steps
    torch.set_num_threads(1)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        train_text, held_text = corpus()
        llama3_tiktoken_pieces(train_text, tmp)
        if args.llama3_only:
            return
        old_tok, new_tok, words = train_tokenizers(train_text, tmp)
        from ckptfix.tokenizers import load_tokenizer

        vocab = load_tokenizer(new_tok).size
        train_new, held_new = encode(new_tok, train_text), encode(new_tok, held_text)
        held_old_only = old_only_paragraphs(new_tok, held_text)
        old_ids = encode(old_tok, held_old_only)
        new_evals = [b for b in windows(held_new, 48, seed=7) if (b[:, 1:] >= OLD_VOCAB).any()]
        evals = (new_evals, windows(old_ids, 12, seed=8))
        n_new = sum(int((b[:, 1:] >= OLD_VOCAB).sum()) for b in new_evals)
        print(f"# old tokenizer {OLD_VOCAB}, new {vocab} (+{len(words)} words, +{len(SPECIALS)} specials); "
              f"{len(train_new)} training tokens; eval: {n_new} new-token targets, {len(old_ids)} old-only tokens; "
              f"uniform guess ln({vocab}) = {math.log(vocab):.2f}", flush=True)
        print("# new words:", " ".join(words[:30]), "...", flush=True)
        heads = {"tied": [True], "untied": [False], "both": [True, False]}[args.heads]
        for tied in heads:
            base = tmp / f"base-{tied}.pth"
            if args.reuse_base is not None and (args.reuse_base / base.name).is_file():
                base, loss = args.reuse_base / base.name, math.nan
            else:
                loss = train_base(encode(old_tok, train_text), tied, base)
            model = make_model(OLD_VOCAB, tied)
            model.load_state_dict(torch.load(base, weights_only=True)["model"])
            before = log_probs(model, evals[1])
            _, old_loss = evaluate(model, [], evals[1], OLD_VOCAB)
            print(f"# {'tied' if tied else 'untied'} head: base trained {BASE_STEPS} steps, last-100 train loss "
                  f"{loss:.3f}, held-out old-text loss {old_loss:.3f} ({time.time() - t0:.0f}s)", flush=True)
            results: dict[str, list[dict]] = {m: [] for m in methods(tied)}
            for seed in range(args.seeds):
                batches = windows(train_new, STEPS, seed=100 + seed)
                for name in methods(tied):
                    results[name].append(run_method(name, base, (old_tok, new_tok), vocab, tied, seed, tmp,
                                                    batches, evals, before))
                    print(f"#   seed {seed} {name}: " + ", ".join(f"{k}={v:.4f}" for k, v in results[name][-1].items()),
                          flush=True)
            print(f"\n{'Tied' if tied else 'Untied'} head (GPT-2, {LAYERS} layers, width {DIM}), {args.seeds} seeds:\n")
            print(table(results), flush=True)
    print(f"\n# total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
