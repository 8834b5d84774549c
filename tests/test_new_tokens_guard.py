"""Issue 45 item 2: the HF callback says before the first step that added tokens cannot learn (CKF831):
PEFT LoRA without modules_to_save or trainable_token_indices freezes the input embedding. Real runs: a tiny
Llama, a BPE tokenizer trained here plus 5 added tokens, resize_token_embeddings, one Trainer step."""

from __future__ import annotations

import warnings

import pytest
import torch
from tokenizer_factory import corpus_lines, make_hf_tokenizer_folder

from ckptfix.guard import TrainingSetupWarning

transformers = pytest.importorskip("transformers")
NEW = ["<n0>", "<n1>", "<n2>", "<n3>", "<n4>"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = make_hf_tokenizer_folder(tmp_path_factory.mktemp("tok"), vocab_size=300, added=NEW, name="tok")
    return transformers.AutoTokenizer.from_pretrained(str(folder))


def _train(tok, tmp_path, kind: str):
    from ckptfix.integrations.transformers import ResumeGuardCallback

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(config)
    model.resize_token_embeddings(len(tok))
    if kind != "full":
        peft = pytest.importorskip("peft")
        extra: dict = {"lora": {}, "mts": {"modules_to_save": ["embed_tokens", "lm_head"]},
                       "tti": {"trainable_token_indices": tok.convert_tokens_to_ids(NEW)}}[kind]
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **extra))
    data = [{"input_ids": ids, "labels": ids} for ids in
            (tok(f"{line} {NEW[i % 5]}", truncation=True, max_length=16)["input_ids"]
             for i, line in enumerate(corpus_lines(16)))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], use_cpu=True,
                                          per_device_train_batch_size=8, disable_tqdm=True, save_strategy="no")
    callback = ResumeGuardCallback(steps=0)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, processing_class=tok,
                                   data_collator=transformers.DataCollatorForSeq2Seq(tok, padding=True),
                                   callbacks=[callback])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.train()
    return [str(w.message) for w in seen if issubclass(w.category, TrainingSetupWarning) and "CKF831" in str(w.message)]


def test_lora_without_modules_to_save_is_named_before_the_first_step(tok, tmp_path):
    (said,) = _train(tok, tmp_path, "lora")
    ids = tok.convert_tokens_to_ids(NEW)
    assert said.startswith("CKF831 warning: 5 added token(s) cannot learn: the input embedding is frozen")
    assert "<n0>, <n1>, <n2>, <n3>, <n4>" in said and f"LoraConfig(..., trainable_token_indices={ids})" in said
    assert 'modules_to_save=["embed_tokens", "lm_head"]' in said


@pytest.mark.parametrize("kind", ["mts", "tti", "full"])
def test_runs_whose_new_rows_train_are_not_named(tok, tmp_path, kind):
    assert _train(tok, tmp_path, kind) == []
