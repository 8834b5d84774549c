"""An HF `checkpoint-N/` folder carries the tokenizer it was trained with; a retrained tokenizer (two more
special tokens trained in first: every learned token's id shifted by 2) must be caught by inspect and repaired
by token string by default, with no --from-tokenizer (issue 18: the default repair misplaced 796 of 800 rows).
A real `transformers.Trainer` run on text encoded with the real old tokenizer; losses printed with -s.
"""

from __future__ import annotations

import pytest
import torch
from tokenizer_factory import corpus_lines, train_tokenizer

import ckptfix

pytestmark = pytest.mark.transformers
transformers = pytest.importorskip("transformers")

SEQ = 32


def hf_folder(d, name, **kw):
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=train_tokenizer(**kw), unk_token="[UNK]",
                                              pad_token="[PAD]")
    hf.save_pretrained(str(d / name))
    return d / name


def windows(tok, lines, n, seed):
    stream = torch.tensor([i for e in tok(lines)["input_ids"] for i in e])
    g = torch.Generator().manual_seed(seed)
    return [stream[s:s + SEQ] for s in torch.randint(0, len(stream) - SEQ, (n,), generator=g).tolist()]


@torch.no_grad()
def eval_loss(model, tok_folder) -> float:
    tok = transformers.AutoTokenizer.from_pretrained(tok_folder)
    batch = torch.stack(windows(tok, corpus_lines()[-200:], 64, seed=99))
    model.eval()
    return float(model(input_ids=batch, labels=batch).loss)


def make_run(d, steps: int, width: int = 16, layers: int = 1) -> dict:
    old = hf_folder(d, "old", vocab_size=300)
    new = hf_folder(d, "new", vocab_size=302, base_special=("[UNK]", "[PAD]", "<s>", "</s>"))
    tok = transformers.AutoTokenizer.from_pretrained(old)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=len(tok), n_positions=SEQ,
                                  bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    args = transformers.TrainingArguments(
        output_dir=str(d / "out"), max_steps=steps, save_steps=steps, report_to=[], use_cpu=True,
        per_device_train_batch_size=16, learning_rate=3e-3, disable_tqdm=True, seed=0, lr_scheduler_type="constant")
    data = [{"input_ids": w, "labels": w} for w in windows(tok, corpus_lines()[:1200], 16 * steps, seed=1)]
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=data,
                                   processing_class=tok)
    trainer.train()
    return {"d": d, "old": old, "new": new, "ckpt": d / "out" / f"checkpoint-{steps}",
            "before": eval_loss(trainer.model, old), "wte": trainer.model.transformer.wte.weight.detach().clone()}


def misplaced(folder, run) -> int:
    """Rows of shared tokens that do not hold that token's trained row."""
    old, new = (transformers.AutoTokenizer.from_pretrained(run[k]).get_vocab() for k in ("old", "new"))
    wte = transformers.GPT2LMHeadModel.from_pretrained(folder).transformer.wte.weight
    return sum(1 for t, i in old.items() if not torch.equal(wte[new[t]], run["wte"][i]))


def test_the_folder_tokenizer_is_the_old_one(tmp_path):
    run = make_run(tmp_path, steps=3)
    old, new = (transformers.AutoTokenizer.from_pretrained(run[k]).get_vocab() for k in ("old", "new"))
    assert sum(new[t] == i + 2 for t, i in old.items()) == 298  # every learned token moved by 2
    report = ckptfix.inspect(run["ckpt"], run["new"])
    moved = [f for f in report.findings if f.code == "CKF120"]
    assert len(moved) == 1 and moved[0].severity == "error" and int(moved[0].message.split()[0]) >= 298
    assert report.exit_code == 1
    fixed, by_id = tmp_path / "fixed", tmp_path / "by_id"
    ckptfix.repair(run["ckpt"], run["new"], fixed)  # the default path: no --from-tokenizer
    ckptfix.repair(run["ckpt"], run["new"], by_id, keep_ids=True)
    assert misplaced(fixed, run) == 0 and misplaced(by_id, run) >= 298


@pytest.mark.long
def test_the_loss_after_the_default_repair(tmp_path):
    run = make_run(tmp_path, steps=300, width=64, layers=2)
    fixed, by_id = tmp_path / "fixed", tmp_path / "by_id"
    ckptfix.repair(run["ckpt"], run["new"], fixed)
    ckptfix.repair(run["ckpt"], run["new"], by_id, keep_ids=True)
    after = eval_loss(transformers.GPT2LMHeadModel.from_pretrained(fixed), run["new"])
    kept_by_id = eval_loss(transformers.GPT2LMHeadModel.from_pretrained(by_id), run["new"])
    print({"hf folder before save": round(run["before"], 3), "after default repair": round(after, 3),
           "rows kept by id": round(kept_by_id, 3)})
    assert after <= run["before"] * 1.05 and kept_by_id > after
