"""The Hugging Face flow end to end with the guard callback on (issue 18): train with `Trainer`, grow the
tokenizer, repair, resume; grow again, repair the repaired folder, resume again; then, at the last
checkpoint of a finished schedule (lr 0), resume with a longer schedule. Also: a `--policy fresh` repair
resumed under the callback re-warms the LR.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from tokenizer_factory import make_hf_tokenizer_folder

import ckptfix
from ckptfix.guard import TrainingSetupWarning

pytestmark = pytest.mark.transformers
transformers = pytest.importorskip("transformers")


def trainer(tok_folder, out, max_steps, callback):
    tok = transformers.AutoTokenizer.from_pretrained(tok_folder)
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=32,
                                  bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=max_steps, save_steps=3, report_to=[], use_cpu=True,
        per_device_train_batch_size=4, learning_rate=1e-3, warmup_steps=1, disable_tqdm=True, seed=0,
        optim="adamw_torch_fused")
    ids = torch.randint(0, len(tok), (24, 12), generator=torch.Generator().manual_seed(0))
    return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args, processing_class=tok,
                                train_dataset=[{"input_ids": r, "labels": r} for r in ids], callbacks=[callback])


def test_train_grow_repair_resume_twice_then_extend_a_finished_schedule(tmp_path):
    from ckptfix.integrations.transformers import ResumeGuardCallback

    tok0 = make_hf_tokenizer_folder(tmp_path, 300, name="tok0")
    t = trainer(tok0, tmp_path / "run0", 3, ResumeGuardCallback())
    t.train()
    ckpt = tmp_path / "run0" / "checkpoint-3"
    for hop, added in enumerate((["<a>", "<b>"], ["<a>", "<b>", "<c>", "<d>"]), 1):
        tok = make_hf_tokenizer_folder(tmp_path, 300, added=added, name=f"tok{hop}")
        fixed = tmp_path / f"fixed{hop}"
        result = ckptfix.repair(ckpt, tok, fixed)
        assert result.to_json()["optimizer_state"] == "remapped"
        callback = ResumeGuardCallback()
        t = trainer(tok, tmp_path / f"run{hop}", 3 * (hop + 1), callback)
        t.train(resume_from_checkpoint=str(fixed))  # the guard callback lets it through, and it trains
        assert t.state.global_step == 3 * (hop + 1) and callback.probe is not None and callback.probe.problems == []
        ckpt = tmp_path / f"run{hop}" / f"checkpoint-{3 * (hop + 1)}"  # the repaired folder's run saved again

    # The repaired folder itself repaired again (its record and its own tokenizer name the rows): every Adam
    # state kept, and the Trainer resumes from it through the guard.
    again = ckptfix.repair(tmp_path / "fixed1", tmp_path / "tok2", tmp_path / "fixed1-again")
    assert again.to_json()["optimizer_state"] == "remapped" and again.plan.changes[0]["kept"] == 302
    callback = ResumeGuardCallback()
    t = trainer(tmp_path / "tok2", tmp_path / "run-again", 6, callback)
    t.train(resume_from_checkpoint=str(tmp_path / "fixed1-again"))
    assert t.state.global_step == 6 and callback.probe is not None and callback.probe.problems == []

    # The final checkpoint of a finished schedule (linear decay to lr 0): inspect says info, and a longer
    # schedule resumes through the guard: CKF807 as information (issue 18 asks for this change; it was a
    # warning): the first step runs at lr 0, then it trains.
    report = ckptfix.inspect(ckpt, tmp_path / "tok2")
    assert [(f.code, f.severity) for f in report.findings if f.code == "CKF302"] == [("CKF302", "info")]
    assert report.exit_code == 0
    callback = ResumeGuardCallback()
    t = trainer(tmp_path / "tok2", tmp_path / "run3", 12, callback)
    with warnings.catch_warnings():
        warnings.simplefilter("error", TrainingSetupWarning)
        t.train(resume_from_checkpoint=str(ckpt))
    assert [(p.code, p.severity) for p in callback.setup_problems] == [("CKF807", "info")]
    assert t.state.global_step == 12 and callback.probe is not None and callback.probe.problems == []


def test_policy_fresh_rewarms_under_the_callback(tmp_path):
    from ckptfix.integrations.transformers import ResumeGuardCallback

    tok0 = make_hf_tokenizer_folder(tmp_path, 300, name="tok0")
    trainer(tok0, tmp_path / "run0", 3, ResumeGuardCallback()).train()
    tok1 = make_hf_tokenizer_folder(tmp_path, 300, added=["<a>"], name="tok1")
    ckptfix.repair(tmp_path / "run0" / "checkpoint-3", tok1, tmp_path / "fresh", policy="fresh")
    callback = ResumeGuardCallback(rewarm_steps=4)
    t = trainer(tok1, tmp_path / "run1", 9, callback)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t.train(resume_from_checkpoint=str(tmp_path / "fresh"))
    assert any("re-warming the LR" in str(w.message) for w in caught)
    assert callback.rewarm_done == 4 and t.state.global_step == 9


@pytest.mark.peft
def test_peft_trainer_checkpoint_of_a_finished_schedule_is_information(tmp_path):
    """Issue 45: a PEFT LoRA run through the Trainer, saved at its last step (adapter_model.safetensors,
    optimizer.pt, scheduler.pt, trainer_state.json with global_step == max_steps): lr 0 there is the end of the
    schedule (CKF302 info, as for a full model's Trainer folder), and the Trainer resumed with a longer schedule
    trains on above lr 0. The same folder whose trainer_state.json says the run goes on: lr 0 stays an error."""
    import json
    import shutil

    peft = pytest.importorskip("peft")

    def lora_trainer(out, max_steps):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32,
                                      bos_token_id=0, eos_token_id=0)
        model = peft.get_peft_model(transformers.GPT2LMHeadModel(cfg), peft.LoraConfig(
            r=2, lora_alpha=4, target_modules=["c_attn"], lora_dropout=0.0, fan_in_fan_out=True,
            task_type="CAUSAL_LM"))
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=max_steps, save_steps=2, report_to=[], use_cpu=True,
            per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, seed=0, logging_strategy="no")
        ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
        return transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids])

    lora_trainer(tmp_path / "run", 4).train()
    last = tmp_path / "run" / "checkpoint-4"
    assert {"adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= {
        p.name for p in last.iterdir()}
    state = json.loads((last / "trainer_state.json").read_text())
    assert state["global_step"] == state["max_steps"] == 4
    report = ckptfix.inspect(last)
    assert report.ckpt.format == "peft-adapter"
    (f,) = [f for f in report.findings if f.code == "CKF302"]
    assert f.severity == "info" and report.exit_code == 0
    assert f.message == ("param group(s) [0, 1] have lr=0 at step 4: the Trainer run's schedule finished "
                         "(global_step 4 = max_steps)")
    assert not [f for f in ckptfix.inspect(tmp_path / "run" / "checkpoint-2").findings if f.code == "CKF302"]

    # what the finding says the Trainer does: resumed with a larger max_steps, the LR continues above 0
    longer = lora_trainer(tmp_path / "run2", 8)
    lrs = []
    longer.add_callback(type("LrSeen", (transformers.TrainerCallback,), {
        "on_step_begin": lambda self, args, state, control, optimizer=None, **kw: lrs.append(
            optimizer.param_groups[0]["lr"])})())
    longer.train(resume_from_checkpoint=str(last))
    assert longer.state.global_step == 8 and lrs and all(lr > 0 for lr in lrs[1:])

    # the negative: the same folder, its trainer_state.json saying the run goes on to step 8 (lr 0 mid-schedule)
    mid = tmp_path / "mid"
    shutil.copytree(last, mid)
    (mid / "trainer_state.json").write_text(json.dumps({**state, "max_steps": 8}))
    report = ckptfix.inspect(mid)
    (f,) = [f for f in report.findings if f.code == "CKF302"]
    assert f.severity == "error" and report.exit_code == 1 and f.message == "param group(s) [0, 1] have lr=0 at scheduler step 4"
