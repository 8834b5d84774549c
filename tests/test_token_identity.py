"""Rows belong to tokens, not ids: a tiny LM trained with a real tokenizer, then the tokenizer is retrained.

sentencepiece retrained with `user_defined_symbols` (seed 001's user) puts the new symbols right after the
control pieces, so nearly every id moves; a BPE `tokenizer.json` with a few tokens reordered moves a few.
These tests show: inspect flags the moved ids (with the old tokenizer) or the retrain (without it); the
printed fix is right when pasted; the default repair of a checkpoint whose record names its tokenizer is
right; the guard's remap with `from_tokenizer` is right; and the loss after the repair is within a few
percent of the loss before the save (rows kept by id give a loss near or above a random init's).
"""

from __future__ import annotations

import inspect
import json
import math
import random
import re
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


# ---------------------------------------------------------------- the guard's messages (issue 46)

KEYWORD = re.compile(r"\b([a-z_][a-z0-9_]*)=(?!=)")


def guard_parameters() -> set[str]:
    return set(inspect.signature(ckptfix.ResumeGuard.__init__).parameters) | set(
        inspect.signature(ckptfix.ResumeGuard.load).parameters)


def said(report_or_error) -> list[str]:
    """Every message, note and action the guard produced."""
    if isinstance(report_or_error, ResumeError):
        return [p.message for p in report_or_error.problems]
    return [p.message for p in report_or_error.problems] + report_or_error.notes + report_or_error.actions


def assert_suggestions_accepted(messages: list[str]) -> None:
    """Each keyword argument a message names is one ResumeGuard takes (a message may quote one of another
    callable only where it names that callable: `load_state_dict(strict=False)`)."""
    accepted = guard_parameters()
    for message in messages:
        bare = re.sub(r"\b[A-Za-z_][\w.]*\([^()]*\)", "", message.replace("ResumeGuard(", "("))
        for name in KEYWORD.findall(bare):
            assert name in accepted, f"{name}= is not a ResumeGuard argument: {message}"


def _untrained(path, vocab):
    """A checkpoint of an untrained TinyLM after one AdamW step (rows and moments: what the guard resizes)."""
    torch.manual_seed(0)
    model = TinyLM(vocab, DIM, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loss_of(model, torch.randint(0, vocab, (2, 9))).backward()
    opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, path)
    return model


def _live(vocab):
    model = TinyLM(vocab, DIM, 2)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_guard_remap_without_the_old_tokenizer_says_rows_are_kept_by_id_unchecked(tmp_path):
    """A BPE retrained to the same base size, tokens added, no record: the guard resizes by id, and says that the
    ids are unchecked and that from_tokenizer= (which it takes) remaps by token; keep_ids=True says as asked."""
    old_path, new_path = reordered_bpe(tmp_path)
    old, new = Encoder(old_path), Encoder(new_path)
    trained_model = _untrained(tmp_path / "ckpt.pth", old.size)
    model, opt = _live(new.size)
    with pytest.warns(Warning, match="CKF825"):
        report = ckptfix.ResumeGuard(model, opt, tokenizer=new.path, policy="remap", probe_steps=0).load(
            tmp_path / "ckpt.pth")
    (resized,) = [p for p in report.problems if p.code == "CKF825"]
    assert resized.severity == "warning" and resized.message.endswith(
        "as `ckptfix repair --policy remap` would, rows kept by id, unchecked: the tokenizer the checkpoint's rows "
        "were trained with is not known, so a token whose id moved (a retrained tokenizer) gets another token's "
        "row. Pass from_tokenizer= (the old tokenizer; it and tokenizer= as paths or TokenizerInfos) to remap rows "
        "by token.")
    actions = [a for a in report.actions if a.startswith("resized text_embedding.weight")]
    assert actions == [f"resized text_embedding.weight [{old.size}, {DIM}] -> [{new.size}, {DIM}] (rows kept by id, "
                       "unchecked (the tokenizer the rows were trained with is not known; from_tokenizer= remaps them "
                       f"by token): {old.size}; 0 dropped, 3 new initialised by 'mean')"]
    assert any("pass from_tokenizer=OLD to move rows by token string" in n for n in report.notes)
    assert not any("--from-tokenizer" in m for m in said(report))
    assert misplaced(model, trained_model, old, new) > 0  # what "unchecked" warns of: swapped ids hold other rows
    assert_suggestions_accepted(said(report))

    model, opt = _live(new.size)  # what the message names, passed: every shared token keeps its row
    ckptfix.ResumeGuard(model, opt, tokenizer=new.path, policy="remap", probe_steps=0,
                        from_tokenizer=old.path).load(tmp_path / "ckpt.pth")
    assert misplaced(model, trained_model, old, new) == 0

    model, opt = _live(new.size)
    with pytest.warns(Warning, match="CKF825"):
        report = ckptfix.ResumeGuard(model, opt, tokenizer=new.path, policy="remap", probe_steps=0,
                                     keep_ids=True).load(tmp_path / "ckpt.pth")
    (resized,) = [p for p in report.problems if p.code == "CKF825"]
    assert resized.message.endswith("would, rows kept by id as asked (keep_ids=True).")
    assert any("rows kept by id as asked (keep_ids=True): 300" in a for a in report.actions)


def test_guard_refusal_names_arguments_it_takes(tmp_path):
    """sentencepiece retrained with user-defined pieces inside the old ids: the guard refuses to keep rows by id
    and names from_tokenizer= and keep_ids=True; both are ResumeGuard arguments and do what the message says."""
    old_path, new_path = retrained_sp(tmp_path)
    old, new = Encoder(old_path), Encoder(new_path)
    trained_model = _untrained(tmp_path / "ckpt.pth", old.size)
    model, opt = _live(new.size)
    with pytest.raises(ResumeError, match="CKF825") as err:
        ckptfix.ResumeGuard(model, opt, tokenizer=new.path, policy="remap", probe_steps=0).load(tmp_path / "ckpt.pth")
    (refused,) = [p for p in err.value.problems if p.code == "CKF825"]
    assert "Pass from_tokenizer=OLD" in refused.message and "or keep_ids=True if the ids really are unchanged" in \
        refused.message
    assert_suggestions_accepted(said(err.value))
    model, opt = _live(new.size)
    with pytest.warns(Warning, match="CKF825"):
        report = ckptfix.ResumeGuard(model, opt, tokenizer=new.path, policy="remap", probe_steps=0,
                                     keep_ids=True).load(tmp_path / "ckpt.pth")
    assert any("rows kept by id as asked (keep_ids=True)" in a for a in report.actions)
    model, opt = _live(new.size)
    ckptfix.ResumeGuard(model, opt, tokenizer=new.path, policy="remap", probe_steps=0,
                        from_tokenizer=old.path).load(tmp_path / "ckpt.pth")
    assert misplaced(model, trained_model, old, new) == 0


def test_keep_ids_turns_ckf828_into_a_warning(tmp_path):
    """Same row count, ids swapped, the old tokenizer named: CKF828 stops the load; keep_ids=True (as
    `repair --keep-ids`) loads by id as asked, and says that the moved tokens' rows belong to other tokens."""
    old_path, new_path = reordered_bpe(tmp_path, added=())
    old, new = Encoder(old_path), Encoder(new_path)
    trained_model = _untrained(tmp_path / "ckpt.pth", old.size)
    model, _ = _live(new.size)
    with pytest.warns(Warning, match="CKF828"):
        report = ckptfix.ResumeGuard(model, None, tokenizer=new.path, from_tokenizer=old.path, policy="remap",
                                     keep_ids=True).load(tmp_path / "ckpt.pth")
    (moved,) = [p for p in report.problems if p.code == "CKF828"]
    assert moved.severity == "warning" and moved.message.endswith(
        ": rows loaded by id as asked (keep_ids=True) belong to other tokens.")
    assert all(torch.equal(v, trained_model.state_dict()[k]) for k, v in model.state_dict().items())
    assert_suggestions_accepted(said(report))


def test_guard_sources_suggest_only_arguments_their_callable_takes():
    """Every `name=` in a string of the guard's modules: inside `Callable(...)` a parameter of that callable;
    otherwise a ResumeGuard argument, or one of the few arguments of other libraries the messages name as a
    cause (each checked against its own callable)."""
    import ast
    from pathlib import Path

    root = Path(ckptfix.__file__).parent
    named = {"ResumeGuard": ckptfix.ResumeGuard.__init__, "load_state_dict": torch.nn.Module.load_state_dict,
             "torch.autocast": torch.autocast.__init__}
    peft = pytest.importorskip("peft")
    named["LoraConfig"] = peft.LoraConfig.__init__  # CKF831's fix (guard/new_tokens.py)
    causes = {"requires_grad": torch.nn.Parameter, "use_reentrant": torch.utils.checkpoint.checkpoint,
              "fused": torch.optim.AdamW.__init__}
    accepted = guard_parameters()
    files = sorted((root / "guard").glob("*.py")) + [root / "checks" / "guard.py"]
    found = set()
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef)) and n.body
                      and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                text = node.value
            else:
                continue
            for call in re.finditer(r"\b([A-Za-z_][\w.]*)\(([^()]*)\)?", text):
                for name in KEYWORD.findall(call.group(2)):
                    assert call.group(1) in named, f"{path.name}:{node.lineno}: {call.group(0)!r}: which callable?"
                    assert name in inspect.signature(named[call.group(1)]).parameters, (path.name, call.group(0))
                    found.add(name)
            for name in KEYWORD.findall(re.sub(r"\b[A-Za-z_][\w.]*\([^()]*\)?", "", text)):
                ok = name in accepted or name in causes and name in inspect.signature(causes[name]).parameters
                assert ok, f"{path.name}:{node.lineno}: {name}= is not an argument of ResumeGuard: {text!r}"
                found.add(name)
    assert {"from_tokenizer", "keep_ids", "policy"} <= found  # the scan sees the messages it is about
