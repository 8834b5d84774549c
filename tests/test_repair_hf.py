"""`repair` on a real `transformers.Trainer` checkpoint folder, then a real `Trainer` resume from it.

A tiny random-init GPT-2 is trained by the Trainer (max_steps 6, a checkpoint every 3 steps); the
run then gains tokens. `ckptfix repair checkpoint-3 --tokenizer NEW -o fixed` must give a folder the
Trainer resumes from (weights, optimizer.pt moments, scheduler, rng state) up to step 9.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from test_repair_common import (
    same_bits,
    snapshot,
)
from tokenizer_factory import make_hf_tokenizer_folder

import ckptfix

pytestmark = pytest.mark.transformers
transformers = pytest.importorskip("transformers")
transformers.Trainer, transformers.GPT2LMHeadModel  # noqa: B018 - the lazy imports, once, at collection

ADDED = ["<tool>", "<think>"]
SPECIAL = ["<eos>"]


def targs(out, max_steps, **kw):
    return transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=3, report_to=[], use_cpu=True, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=2, disable_tqdm=True,
        dataloader_num_workers=0, seed=0, **kw)


def dataset(vocab: int, n: int, seed: int):
    ids = torch.randint(0, vocab, (n, 12), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    old = make_hf_tokenizer_folder(d, 300, name="old_tok")
    new = make_hf_tokenizer_folder(d, 300, added=ADDED, special=SPECIAL, name="new_tok")
    old_tok = transformers.AutoTokenizer.from_pretrained(old)
    new_tok = transformers.AutoTokenizer.from_pretrained(new)
    assert len(new_tok) == len(old_tok) + 3 == 303
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(old_tok), n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    trainer = transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=targs(d / "out", 6),
                                   train_dataset=dataset(len(old_tok), 24, 0), processing_class=old_tok)
    trainer.train()
    ckpt = d / "out" / "checkpoint-3"
    assert (ckpt / "optimizer.pt").exists() and (ckpt / "model.safetensors").exists()
    return {"dir": d, "ckpt": ckpt, "new": new, "new_tok": new_tok, "old_size": len(old_tok)}


def test_trainer_resumes_from_the_repaired_checkpoint(run, tmp_path):
    ckpt, new_tok = run["ckpt"], run["new_tok"]
    before = snapshot(ckpt)
    fixed = tmp_path / "fixed"
    result = ckptfix.repair(ckpt, run["new"], fixed)
    assert snapshot(ckpt) == before  # the source folder is untouched
    assert result.plan.ckpt.format == "hf-trainer"

    # Folder contents: same files + ckptfix.json; config and tokenizer follow the new vocab.
    assert set(os.listdir(fixed)) == set(os.listdir(ckpt)) | {"ckptfix.json"}
    config = json.loads((fixed / "config.json").read_text())
    assert config["vocab_size"] == len(new_tok) == 303
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == 300
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (fixed / name).read_bytes() == (run["new"] / name).read_bytes()
    for name in ("trainer_state.json", "training_args.bin", "rng_state.pth", "scheduler.pt"):
        assert (fixed / name).read_bytes() == (ckpt / name).read_bytes(), name
    record = json.loads((fixed / "ckptfix.json").read_text())
    assert record["policy"] == "remap" and record["format"] == "hf-trainer" and record["target_rows"] == 303
    assert record["tokenizer"]["size"] == 303 and record["optimizer_state"] == "remapped"
    assert {c["tensor"] for c in record["changes"]} == {
        "transformer.wte.weight", "transformer.wte.weight:exp_avg", "transformer.wte.weight:exp_avg_sq"}

    # Weights and moments: old rows bit-identical.
    from safetensors.torch import load_file

    old_w, new_w = load_file(ckpt / "model.safetensors"), load_file(fixed / "model.safetensors")
    assert set(old_w) == set(new_w)
    for name, t in old_w.items():
        if name == "transformer.wte.weight":
            assert new_w[name].shape == (303, 16) and same_bits(new_w[name][:300], t)
        else:
            assert same_bits(new_w[name], t), name
    old_opt = torch.load(ckpt / "optimizer.pt", weights_only=True)
    new_opt = torch.load(fixed / "optimizer.pt", weights_only=True)
    wte = next(i for i, s in old_opt["state"].items() if s["exp_avg"].shape == (300, 16))
    for key in ("exp_avg", "exp_avg_sq"):
        assert new_opt["state"][wte][key].shape == (303, 16)
        assert same_bits(new_opt["state"][wte][key][:300], old_opt["state"][wte][key])

    # Resume with the real Trainer: the model resized for the new tokenizer, to step 9.
    model = transformers.GPT2LMHeadModel.from_pretrained(ckpt)
    model.resize_token_embeddings(len(new_tok))
    out = tmp_path / "resumed"
    trainer = transformers.Trainer(model=model, args=targs(out, 9), train_dataset=dataset(303, 40, 1),
                                   processing_class=new_tok)
    trainer.train(resume_from_checkpoint=str(fixed))
    assert trainer.state.global_step == 9
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > 3]
    assert len(losses) == 6 and all(torch.isfinite(torch.tensor(losses)))
    state = trainer.optimizer.state[model.transformer.wte.weight]
    assert state["exp_avg"].shape == (303, 16) and float(state["step"]) == 9
    assert model.lm_head.weight is model.transformer.wte.weight
    assert (out / "checkpoint-9" / "model.safetensors").exists()


def test_unrepaired_checkpoint_does_not_resume(run, tmp_path):
    """The control: the same resume from the original checkpoint-3 fails on the row count."""
    model = transformers.GPT2LMHeadModel.from_pretrained(run["ckpt"])
    model.resize_token_embeddings(len(run["new_tok"]))
    trainer = transformers.Trainer(model=model, args=targs(tmp_path / "out", 9), train_dataset=dataset(303, 40, 1))
    with pytest.raises(RuntimeError, match="size mismatch for transformer.wte.weight"):
        trainer.train(resume_from_checkpoint=str(run["ckpt"]))


def test_safetensors_only(run, tmp_path):
    src = run["ckpt"] / "model.safetensors"
    before = src.read_bytes()
    out = tmp_path / "model.safetensors"
    result = ckptfix.repair(src, run["new"], out)
    assert src.read_bytes() == before
    assert result.plan.ckpt.format == "safetensors"
    from safetensors import safe_open
    from safetensors.torch import load_file

    old_w, new_w = load_file(src), load_file(out)
    assert new_w["transformer.wte.weight"].shape == (303, 16)
    assert same_bits(new_w["transformer.wte.weight"][:300], old_w["transformer.wte.weight"])
    for name, t in old_w.items():
        if name != "transformer.wte.weight":
            assert same_bits(new_w[name], t), name
    with safe_open(src, "pt") as a, safe_open(out, "pt") as b:
        assert b.metadata() == a.metadata()
    record = json.loads((tmp_path / "model.safetensors.ckptfix.json").read_text())
    assert record["format"] == "safetensors" and record["target_rows"] == 303
    assert record["source_sha256"] == __import__("hashlib").sha256(before).hexdigest()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors", "model.safetensors.ckptfix.json"]

    cfg = transformers.GPT2Config.from_pretrained(run["ckpt"])
    cfg.vocab_size = 303
    model = transformers.GPT2LMHeadModel(cfg)
    missing, unexpected = model.load_state_dict(new_w, strict=False)
    assert unexpected == [] and missing == ["lm_head.weight"]  # tied: HF does not store it
    model.tie_weights()
    assert same_bits(model.lm_head.weight.detach(), new_w["transformer.wte.weight"])


@pytest.mark.parametrize("policy", ["fresh", "reset"])
def test_trainer_resumes_after_fresh_and_reset(run, tmp_path, policy):
    fixed = tmp_path / "fixed"
    ckptfix.repair(run["ckpt"], run["new"], fixed, policy=policy)
    record = json.loads((fixed / "ckptfix.json").read_text())
    assert record["policy"] == policy and record["rewarm"] is True and record["optimizer_state"] == "dropped"
    if policy == "fresh":  # state dropped, groups (lr, initial_lr) and the schedule kept
        opt = torch.load(fixed / "optimizer.pt", weights_only=True)
        src = torch.load(run["ckpt"] / "optimizer.pt", weights_only=True)
        assert opt["state"] == {} and opt["param_groups"] == src["param_groups"]
        assert (fixed / "scheduler.pt").read_bytes() == (run["ckpt"] / "scheduler.pt").read_bytes()
        assert record["scheduler_state"] == "kept"
    else:  # both gone: the Trainer builds a fresh optimizer and schedule
        assert not (fixed / "optimizer.pt").exists() and not (fixed / "scheduler.pt").exists()
        assert record["scheduler_state"] == "reset"

    model = transformers.GPT2LMHeadModel.from_pretrained(run["ckpt"])
    model.resize_token_embeddings(len(run["new_tok"]))
    trainer = transformers.Trainer(model=model, args=targs(tmp_path / "out", 9), train_dataset=dataset(303, 40, 1))
    trainer.train(resume_from_checkpoint=str(fixed))
    assert trainer.state.global_step == 9
    assert float(trainer.optimizer.state[model.transformer.wte.weight]["step"]) == 6  # Adam restarted at step 3
    lrs = {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "loss" in h}
    if policy == "fresh":
        assert lrs[4] == pytest.approx(7.5e-4)  # the schedule continues where it was
    else:
        assert lrs[4] == 0.0  # warmup from the start again
