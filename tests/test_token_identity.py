"""Rows belong to tokens, not ids: a tiny LM trained with a real tokenizer, then the tokenizer is retrained.

sentencepiece retrained with `user_defined_symbols` (seed 001's user) puts the new symbols right after the
control pieces, so nearly every id moves; a BPE `tokenizer.json` with a few tokens reordered moves a few.
These tests show: inspect flags the moved ids (with the old tokenizer) or the retrain (without it); the
printed fix is right when pasted; the default repair of a checkpoint whose record names its tokenizer is
right; the guard's remap with `from_tokenizer` is right; and the loss after the repair is within a few
percent of the loss before the save (rows kept by id give a loss near or above a random init's).
"""

from __future__ import annotations

import json
import math
import random
import shlex

import pytest
import torch
from ckpt_factory import TinyLM
from tokenizer_factory import corpus_lines, train_bpe_tokenizer_json, train_sentencepiece

import ckptfix
from ckptfix.cli import main as cli_main
from ckptfix.errors import RepairError
from ckptfix.guard.resume import ResumeError

spm = pytest.importorskip("sentencepiece")
tokenizers = pytest.importorskip("tokenizers")

SYMBOLS = [f"<sym{i}>" for i in range(10)]
SEQ, BATCH, STEPS, DIM = 32, 16, 300, 32
TRAIN_LINES, EVAL_LINES = 1200, 200
MEASURED: dict[str, float] = {}  # printed by test_report_numbers (pytest -s)


class Encoder:
    """A tokenizer as the training loop uses it: text -> ids, id -> token."""

    def __init__(self, path):
        self.path = str(path)
        if self.path.endswith(".model"):
            self.sp = spm.SentencePieceProcessor(model_file=self.path)
            self.size = self.sp.get_piece_size()
            self.tokens = [self.sp.id_to_piece(i) for i in range(self.size)]
        else:
            self.tk = tokenizers.Tokenizer.from_file(self.path)
            self.size = self.tk.get_vocab_size(with_added_tokens=True)
            vocab = self.tk.get_vocab(with_added_tokens=True)
            self.tokens = [None] * self.size
            for token, i in vocab.items():
                self.tokens[i] = token

    def stream(self, lines) -> torch.Tensor:
        ids = (self.sp.encode(lines) if hasattr(self, "sp") else [e.ids for e in self.tk.encode_batch(lines)])
        return torch.tensor([i for row in ids for i in row])


def windows(stream: torch.Tensor, n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - SEQ - 1, (n, BATCH), generator=g)
    return [torch.stack([stream[s:s + SEQ + 1] for s in row.tolist()]) for row in starts]


def loss_of(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


@torch.no_grad()
def eval_loss(model, enc: Encoder) -> float:
    batches = windows(enc.stream(corpus_lines()[-EVAL_LINES:]), 8, seed=99)
    return sum(loss_of(model, b).item() for b in batches) / len(batches)


def trained(enc: Encoder):
    torch.manual_seed(0)
    model = TinyLM(enc.size, DIM, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for ids in windows(enc.stream(corpus_lines()[:TRAIN_LINES]), STEPS, seed=1):
        opt.zero_grad()
        loss_of(model, ids).backward()
        opt.step()
    return model, opt


def model_from(path, vocab: int) -> TinyLM:
    model = TinyLM(vocab, DIM, 2)
    model.load_state_dict(torch.load(path, weights_only=True)["model"])
    return model


def misplaced(model, old_model, old: Encoder, new: Encoder) -> int:
    """Rows of shared tokens that do not hold that token's trained row."""
    old_id = {t: i for i, t in enumerate(old.tokens) if t is not None}
    w, w0 = model.text_embedding.weight, old_model.text_embedding.weight
    return sum(1 for j, t in enumerate(new.tokens) if t in old_id and not torch.equal(w[j], w0[old_id[t]]))


def retrained_sp(d):
    return train_sentencepiece(d, 500, name="old"), train_sentencepiece(d, 510, name="new",
                                                                     user_defined_symbols=SYMBOLS)


def reordered_bpe(d, swaps: int = 6, added=("<x>", "<y>", "<z>")):
    """The old BPE tokenizer.json with `swaps` pairs of ids exchanged and three tokens appended."""
    old = train_bpe_tokenizer_json(d, 300, name="old.json")
    doc = json.loads(old.read_text(encoding="utf-8"))
    vocab = doc["model"]["vocab"]
    rng = random.Random(0)
    ids = rng.sample(range(10, len(vocab)), 2 * swaps)
    by_id = {i: t for t, i in vocab.items()}
    for a, b in zip(ids[::2], ids[1::2]):
        vocab[by_id[a]], vocab[by_id[b]] = b, a
    doc["model"]["vocab"] = dict(sorted(vocab.items(), key=lambda kv: kv[1]))
    new = d / "new.json"
    new.write_text(json.dumps(doc), encoding="utf-8")
    tk = tokenizers.Tokenizer.from_file(str(new))
    tk.add_tokens(list(added))
    tk.save(str(new))
    return old, new


@pytest.fixture(scope="module", params=["sentencepiece", "bpe"])
def setup(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    old_path, new_path = retrained_sp(d) if request.param == "sentencepiece" else reordered_bpe(d)
    old, new = Encoder(old_path), Encoder(new_path)
    model, opt = trained(old)
    ckpt = d / "ckpt.pth"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": STEPS}, ckpt)
    torch.manual_seed(1)
    MEASURED[f"{request.param} before save"] = before = eval_loss(model, old)
    MEASURED[f"{request.param} random init"] = eval_loss(TinyLM(new.size, DIM, 2), new)
    return {"kind": request.param, "d": d, "old": old, "new": new, "model": model, "ckpt": ckpt, "before": before}


def test_inspect_names_moved_ids_and_the_printed_fix_is_right(setup, tmp_path):
    s = setup
    report = ckptfix.inspect(s["ckpt"], s["new"].path, from_tokenizer=s["old"].path)
    moved = [f for f in report.findings if f.code == "CKF120"]
    assert len(moved) == 1 and moved[0].severity == "error" and report.exit_code == 1
    count = int(moved[0].message.split()[0])
    assert count >= (400 if s["kind"] == "sentencepiece" else 12)
    fix = moved[0].fix.split("  (")[0]
    assert "--from-tokenizer" in fix
    try:
        cli_main(shlex.split(fix)[1:])  # the printed line, pasted
    except SystemExit as exc:
        assert exc.code in (0, None)
    out = s["ckpt"].with_name("ckpt.fixed.pth")
    fixed = model_from(out, s["new"].size)
    assert misplaced(fixed, s["model"], s["old"], s["new"]) == 0
    MEASURED[f"{s['kind']} after the printed fix"] = after = eval_loss(fixed, s["new"])
    assert after <= s["before"] * 1.05

    # What the fix prevents: the same repair keeping rows by id (the old default).
    ckptfix.repair(s["ckpt"], s["new"].path, tmp_path / "by_id.pth", keep_ids=True)
    by_id = model_from(tmp_path / "by_id.pth", s["new"].size)
    MEASURED[f"{s['kind']} rows misplaced by id"] = misplaced(by_id, s["model"], s["old"], s["new"])
    MEASURED[f"{s['kind']} rows kept by id"] = eval_loss(by_id, s["new"])
    assert MEASURED[f"{s['kind']} rows misplaced by id"] >= count


def test_without_the_old_tokenizer(setup, tmp_path):
    s = setup
    report = ckptfix.inspect(s["ckpt"], s["new"].path)
    if s["kind"] == "sentencepiece":  # the user-defined pieces at ids 3-12 prove the retrain
        retrained = [f for f in report.findings if f.code == "CKF122"]
        assert len(retrained) == 1 and retrained[0].severity == "error"
        assert "user-defined" in retrained[0].message and "--from-tokenizer" in retrained[0].fix
        with pytest.raises(RepairError, match="from_tokenizer=OLD"):
            ckptfix.repair(s["ckpt"], s["new"].path, tmp_path / "out.pth")
    else:  # nothing in a reordered BPE shows it: inspect says rows will be kept by id and when that is right
        assert any("keeps rows by id" in n and "--from-tokenizer" in n for n in report.notes)
        result = ckptfix.repair(s["ckpt"], s["new"].path, tmp_path / "out.pth")
        assert any("rows kept by id" in n for n in result.to_json()["notes"])


def test_fix_names_from_tokenizer_when_the_old_one_is_not_known(tmp_path):
    """Issue 46: a tokenizer retrained to the same base size (ids swapped) with tokens added, and no record of the
    old one: nothing shows the retrain, so inspect's fix names --from-tokenizer OLD_TOKENIZER as its note does;
    pasted with the old tokenizer in its place, every shared token keeps its row."""
    old_path, new_path = reordered_bpe(tmp_path)
    old, new = Encoder(old_path), Encoder(new_path)
    torch.manual_seed(0)
    model = TinyLM(old.size, DIM, 2)
    ckpt = tmp_path / "ckpt.pth"
    torch.save({"model": model.state_dict()}, ckpt)
    report = ckptfix.inspect(ckpt, new.path)
    (grown,) = [f for f in report.findings if f.code == "CKF101"]
    assert grown.fix == (f"ckptfix repair {ckpt} --tokenizer {new.path} --from-tokenizer OLD_TOKENIZER -o "
                         f"{tmp_path / 'ckpt.fixed.pth'}  (OLD_TOKENIZER: the tokenizer the checkpoint was trained "
                         "with; leave --from-tokenizer out only if the new one kept its ids and appended tokens: rows "
                         "are then kept by id)")
    assert any("otherwise pass --from-tokenizer OLD_TOKENIZER (the fix names it)" in n for n in report.notes)
    try:
        cli_main(shlex.split(grown.fix.split("  (")[0].replace("OLD_TOKENIZER", str(old_path)))[1:])
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert misplaced(model_from(tmp_path / "ckpt.fixed.pth", new.size), model, old, new) == 0


def test_default_repair_uses_the_tokenizer_the_record_names(setup, tmp_path):
    """A loop that saves `guard.record()` with its tokenizer: the default repair moves rows by token."""
    s = setup
    guard = ckptfix.ResumeGuard(s["model"], None, tokenizer=s["old"].path)
    sd = torch.load(s["ckpt"], weights_only=True)
    path = tmp_path / "recorded.pth"
    torch.save({**sd, "ckptfix": guard.record()}, path)
    report = ckptfix.inspect(path, s["new"].path)
    assert {f.code for f in report.findings if f.severity == "error"} == {"CKF101", "CKF120"}  # grown, and moved
    ckptfix.repair(path, s["new"].path, tmp_path / "fixed.pth")
    fixed = model_from(tmp_path / "fixed.pth", s["new"].size)
    assert misplaced(fixed, s["model"], s["old"], s["new"]) == 0
    MEASURED[f"{s['kind']} after the default repair (recorded tokenizer)"] = after = eval_loss(fixed, s["new"])
    assert after <= s["before"] * 1.05


def test_guard_remap_with_from_tokenizer(setup):
    s = setup
    torch.manual_seed(2)
    model = TinyLM(s["new"].size, DIM, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    guard = ckptfix.ResumeGuard(model, opt, tokenizer=s["new"].path, from_tokenizer=s["old"].path,
                                policy="remap", probe_steps=0)
    report = guard.load(s["ckpt"])
    assert misplaced(model, s["model"], s["old"], s["new"]) == 0
    # The report says what was done (issue 33): rows matched by token string, with the counts of the move.
    old_ids = {t: i for i, t in enumerate(s["old"].tokens)}
    kept = sum(old_ids.get(t) == i for i, t in enumerate(s["new"].tokens))
    moved = sum(t in old_ids and old_ids[t] != i for i, t in enumerate(s["new"].tokens))
    new = s["new"].size - kept - moved
    dropped = s["old"].size - kept - moved
    resized = [a for a in report.actions if a.startswith("resized ") and "moments" not in a]
    assert resized and moved > 0
    for action in resized:
        assert action.endswith(f"(rows matched by token string: {kept} kept at their id, {moved} moved to a new id; "
                               f"{dropped} dropped, {new} new initialised by 'pieces')"), action
        assert "kept by id" not in action
    MEASURED[f"{s['kind']} guard remap"] = resumed = eval_loss(model, s["new"])
    assert resumed <= s["before"] * 1.05
    # The resumed run keeps learning from there (moments followed their rows).
    for ids in windows(s["new"].stream(corpus_lines()[:TRAIN_LINES]), 20, seed=7):
        opt.zero_grad()
        loss_of(model, ids).backward()
        opt.step()
    MEASURED[f"{s['kind']} guard remap +20 steps"] = later = eval_loss(model, s["new"])
    assert math.isfinite(later) and later <= s["before"] * 1.05


def test_guard_stops_a_same_size_reorder(tmp_path):
    """Same row count, a few ids swapped: nothing resizes, so a load by id would be silent. The guard,
    told the old tokenizer, stops it before anything is loaded (CKF828)."""
    old_path, new_path = reordered_bpe(tmp_path, added=())
    old, new = Encoder(old_path), Encoder(new_path)
    assert old.size == new.size
    model, opt = trained(old)
    ckpt = tmp_path / "ckpt.pth"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, ckpt)
    live = TinyLM(new.size, DIM, 2)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    guard = ckptfix.ResumeGuard(live, None, tokenizer=new.path, from_tokenizer=old.path, policy="remap")
    with pytest.raises(ResumeError, match="CKF828") as err:
        guard.load(ckpt)
    assert "--from-tokenizer" in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in live.state_dict().items())  # nothing was loaded


def test_report_numbers(setup):
    """Prints the measured losses (pytest -s): before the save, random init, after repair, rows kept by id."""
    print({k: round(v, 3) for k, v in sorted(MEASURED.items()) if k.startswith(setup["kind"])})
