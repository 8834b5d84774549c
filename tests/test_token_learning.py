"""`ckptfix diff A B --tokenizer TOK`: did the new tokens learn? (issue 45 items 1, 3, 4, 5)

Real runs: a tiny Llama (untied head), a BPE tokenizer trained here (300 tokens) plus 5 added tokens,
`resize_token_embeddings`, then the HF Trainer (AdamW, weight decay 0.01, lr 1e-2) for 12 steps on pseudo-text
holding the new tokens. A is saved right after the resize (`Trainer.save_model`, before any step), B is
checkpoint-12 (and checkpoint-6 for A where two Trainer folders are compared). One module-scoped run per kind.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from tokenizer_factory import corpus_lines, make_hf_tokenizer_folder

from ckptfix.cli import main
from ckptfix.compare import diff
from ckptfix.render import render_diff

pytestmark = pytest.mark.transformers

NEW = ["<n0>", "<n1>", "<n2>", "<n3>", "<n4>"]
STEPS = 12


def _run(root, kind: str, present=NEW, tied: bool = False):
    """Train one run of `kind` (full | lora | lora-mts | lora-tti); returns (A, checkpoint-6, checkpoint-12,
    tokenizer folder, the trained model, the Trainer)."""
    transformers = pytest.importorskip("transformers")
    tok_dir = make_hf_tokenizer_folder(root, vocab_size=300, added=NEW, name="tok")
    tok = transformers.AutoTokenizer.from_pretrained(str(tok_dir))
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
    model.resize_token_embeddings(len(tok))
    rng = random.Random(0)
    data = []
    for i, line in enumerate(corpus_lines(96)):
        words = line.split()
        words.insert(rng.randrange(len(words)), present[i % len(present)])
        ids = tok(" ".join(words), truncation=True, max_length=24)["input_ids"]
        data.append({"input_ids": ids, "labels": ids})
    if kind.startswith("lora"):
        peft = pytest.importorskip("peft")
        extra: dict = {}
        if kind == "lora-mts":
            extra["modules_to_save"] = ["embed_tokens", "lm_head"]
        if kind == "lora-tti":
            extra["trainable_token_indices"] = tok.convert_tokens_to_ids(NEW)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra))
    args = transformers.TrainingArguments(
        output_dir=str(root / "out"), max_steps=STEPS, save_steps=STEPS // 2, report_to=[], use_cpu=True,
        per_device_train_batch_size=8, disable_tqdm=True, learning_rate=1e-2, weight_decay=0.01, logging_steps=100)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True))
    trainer.save_model(str(root / "A"))
    trainer.train()
    out = root / "out"
    return root / "A", out / f"checkpoint-{STEPS // 2}", out / f"checkpoint-{STEPS}", tok_dir, model, trainer


@pytest.fixture(scope="module")
def lora(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora"), "lora")


@pytest.fixture(scope="module")
def lora_mts(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora_mts"), "lora-mts")


@pytest.fixture(scope="module")
def lora_tti(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("lora_tti"), "lora-tti")


@pytest.fixture(scope="module")
def absent(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("absent"), "full", present=NEW[:3])


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("healthy"), "full")


def _cli(args: list[str], capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exc:
        main(args)
    return exc.value.code, capsys.readouterr().out


def _learned(report) -> dict[str, bool | None]:
    return {t.token: t.learned for t in report.tokens.tokens}


def test_lora_without_modules_to_save_names_the_tokens_cause_and_fix(lora, capsys):
    """LoRA on q/v only: the adapter neither saves nor trains embed_tokens/lm_head, so the 5 new tokens
    (which occur in every batch) cannot learn: named, cause 'frozen', the exact PEFT fixes, exit 1."""
    a, _, b, tok, _, _ = lora
    report = diff(a, b, tokenizer=tok)
    assert _learned(report) == {t: False for t in NEW}
    assert {t.cause for t in report.tokens.tokens} == {"frozen"} and report.tokens.severity == "error"
    assert report.exit_code == 1
    assert report.tokens.fixes[0] == 'LoraConfig(..., modules_to_save=["embed_tokens", "lm_head"])  (trains and ' \
                                     "saves both tables whole)"
    assert "trainable_token_indices=[300, 301, 302, 303, 304]" in report.tokens.fixes[1]
    assert "q_proj, v_proj" in report.tokens.causes[0]
    code, out = _cli(["diff", str(a), str(b), "--tokenizer", str(tok)], capsys)
    assert code == 1 and "5 of 5 new token(s) did not learn: '<n0>' (300)" in out
    assert "'<n4>' (304)  NOT learned: embedding frozen; head frozen" in out
    assert "frozen by mistake" not in out  # the LoRA matrices all moved: no tensor-level false alarm


def test_modules_to_save_learns_without_a_warning(lora_mts, capsys):
    """modules_to_save=[embed_tokens, lm_head]: the adapter saves and trains both tables; the new rows moved
    (relative change well above weight decay's) and their exp_avg_sq rows are positive: exit 0, no warning."""
    a, _, b, tok, _, _ = lora_mts
    report = diff(a, b, tokenizer=tok)
    assert _learned(report) == {t: True for t in NEW} and report.exit_code == 0
    for t in report.tokens.tokens:
        assert t.embedding.moment_zero is False and t.embedding.rel_change > 0.01
        assert t.head.status == "learned"
    assert report.known and "frozen" not in report.verdict
    code, out = _cli(["diff", str(a), str(b), "--tokenizer", str(tok), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["tokens"]["severity"] == "" and data["tokens"]["summary"].startswith("the 5 new")


def test_trainable_token_indices_learns_without_a_warning(lora_tti):
    """trainable_token_indices: the delta rows (row k = id indices[k]) moved; the untied head's rows are not the
    adapter's (a note, not a finding)."""
    a, _, b, tok, _, _ = lora_tti
    report = diff(a, b, tokenizer=tok)
    assert _learned(report) == {t: True for t in NEW} and report.exit_code == 0
    assert all(t.embedding.tensor.endswith("token_adapter.trainable_tokens_delta") for t in report.tokens.tokens)
    assert all(t.head.status == "frozen" for t in report.tokens.tokens)
    assert any("not trained by the adapter" in n for n in report.tokens.notes)


def test_full_fine_tune_names_the_two_tokens_never_in_the_data(absent, capsys):
    """Full fine-tune, 2 of the 5 new tokens absent from the data: their embedding rows changed by weight decay
    alone (B = A x c, c the product of 1 - lr_t x wd over the steps) and their exp_avg_sq rows are exactly 0;
    the other 3 learned. Checked against the rows and moments read with torch."""
    a, mid, b, tok, model, trainer = absent
    report = diff(a, b, tokenizer=tok)
    assert _learned(report) == {"<n0>": True, "<n1>": True, "<n2>": True, "<n3>": False, "<n4>": False}
    bad = report.tokens.not_learning
    assert {t.cause for t in bad} == {"never-in-data"} and report.tokens.severity == "warning"
    assert report.exit_code == 1
    emb = model.get_input_embeddings().weight.detach()
    state = torch.load(b / "optimizer.pt", weights_only=True)["state"]
    v = next(s["exp_avg_sq"] for s in state.values() if s["exp_avg_sq"].shape == emb.shape
             and (s["exp_avg_sq"] == 0).all(dim=1).any())
    for t in report.tokens.tokens:
        assert t.embedding.moment_zero is bool((v[t.id] == 0).all())
    from safetensors.torch import load_file

    a_rows = load_file(a / "model.safetensors")["model.embed_tokens.weight"]
    for t in bad:
        ratio = float(emb[t.id] @ a_rows[t.id] / (a_rows[t.id] @ a_rows[t.id]))
        assert t.embedding.decay_factor == pytest.approx(ratio, rel=1e-6) and 0.99 < ratio < 1
        assert torch.allclose(emb[t.id], a_rows[t.id] * ratio, rtol=0, atol=1e-6)
    code, out = _cli(["diff", str(mid), str(b), "--tokenizer", str(tok)], capsys)
    assert code == 1 and "2 of 5 new token(s) did not learn: '<n3>' (303), '<n4>' (304)" in out
    assert "never in the data: '<n3>' (303), '<n4>' (304)" in out
    assert "trainable tensors changed" in out and "not known" not in out.split("tokens")[0]


def test_healthy_full_fine_tune(healthy, capsys):
    """Every new token in the data: all learned, exit 0, and the line saying so."""
    a, mid, b, tok, _, _ = healthy
    for older in (a, mid):
        report = diff(older, b, tokenizer=tok)
        assert _learned(report) == {t: True for t in NEW} and report.exit_code == 0
    code, out = _cli(["diff", str(mid), str(b), "--tokenizer", str(tok)], capsys)
    assert code == 0 and "tokens     the 5 new token(s) learned" in out


def test_trainer_folders_name_the_trainable_set(healthy):
    """Item 3: two Trainer folders (sorted safetensors, state by index): the optimizer's 21 entries have the
    shapes of exactly the 21 parameters, so every parameter is trained and diff says so from optimizer state."""
    _, mid, b, _, model, _ = healthy
    report = diff(mid, b)
    n = len(list(model.parameters()))
    assert report.known and report.trainable_from == "optimizer state"
    assert report.summary_line == f"{n} of {n} trainable tensors changed between step 6 and step 12"
    assert any(f"the {n} tensors it trains are certain" in note for note in report.notes)


def test_peft_state_dict_hint_never_names_frozen_copies(lora_mts, tmp_path):
    """Item 4: a PeftModel's whole state_dict saved with the Trainer's optimizer (torch files): the optimizer's
    entries in order would land on the frozen original_module copies; the trainable set is PEFT's trained
    tensors, so the 'did not change' hint names none of original_module/base_layer, and the tokens learned."""
    _, _, _, tok, model, trainer = lora_mts
    a = tmp_path / "a.pth"
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    b = tmp_path / "b.pth"
    torch.save({"model": state, "optimizer": trainer.optimizer.state_dict()}, b)
    for k, v in state.items():  # A: every trained tensor as it was before (lora_B, the copies) or nudged
        if "modules_to_save" in k or "lora_" in k:
            state[k] = v - 0.01
    torch.save({"model": state}, a)
    report = diff(a, b, tokenizer=tok)
    text = render_diff(report)
    trained = {t.name for t in report.tensors if t.trainable}
    assert trained and not any("original_module" in n or "base_layer" in n for n in trained)
    assert "frozen by mistake" not in report.verdict and "original_module" not in text.split("tokens")[0]
    assert _learned(report) == {t: True for t in NEW}


def test_peft_state_dict_without_modules_to_save_is_frozen(lora, tmp_path):
    """The same LoRA-only run saved as a PeftModel's whole state_dict: embed_tokens/lm_head are in the file,
    bit-identical A -> B and outside the optimizer's trained set: frozen, with the PEFT fix (not requires_grad)."""
    _, _, _, tok, model, trainer = lora
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({"model": state, "optimizer": trainer.optimizer.state_dict()}, tmp_path / "b.pth")
    torch.save({"model": {k: v - 0.01 if "lora_" in k else v for k, v in state.items()}}, tmp_path / "a.pth")
    report = diff(tmp_path / "a.pth", tmp_path / "b.pth", tokenizer=tok)
    assert report.known and not any("embed_tokens" in t.name for t in report.tensors if t.trainable)
    assert _learned(report) == {t: False for t in NEW} and report.exit_code == 1
    assert {t.cause for t in report.tokens.tokens} == {"frozen"}
    assert report.tokens.fixes[0].startswith('LoraConfig(..., modules_to_save=["embed_tokens", "lm_head"])')


def test_inspect_ckf114_names_added_tokens_never_trained(absent, healthy, capsys):
    """Item 2: one checkpoint carries the evidence: at step 12 the embedding's exp_avg_sq rows of the 2 absent
    added tokens are exactly 0 while the other rows are not (CKF114, a warning); the healthy run has none.
    `ckptfix explain CKF114` comes from the registry."""
    from ckptfix.inspect import inspect

    _, _, b, tok, _, _ = absent
    found = [f for f in inspect(str(b), tokenizer=str(tok)).findings if f.code == "CKF114"]
    assert len(found) == 1 and found[0].severity == "warning"
    assert "2 of 5 added token(s)" in found[0].message and "'<n3>' (303), '<n4>' (304)" in found[0].message
    assert found[0].tensors == ["model.embed_tokens.weight"]
    _, _, b, tok, _, _ = healthy
    assert not [f for f in inspect(str(b), tokenizer=str(tok)).findings if f.code == "CKF114"]
    try:
        main(["explain", "CKF114"])
    except SystemExit as exc:
        assert exc.code in (0, None)
    assert "added tokens whose embedding rows never received a gradient" in capsys.readouterr().out
