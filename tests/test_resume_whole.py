"""Issue 42 item 2: inspect, ResumeGuard and the HF callback refuse a run folder or a checkpoint the Trainer
cannot resume from whole, naming the newest whole checkpoint (as `ckptfix latest` finds it)."""

from __future__ import annotations

import shutil

import pytest
import torch

from ckptfix.errors import UnreadableCheckpoint
from ckptfix.guard import ResumeError, ResumeGuard
from ckptfix.inspect import inspect

transformers = pytest.importorskip("transformers")
from test_latest import trainer_run as run_fixture  # noqa: E402 (a real Trainer run: checkpoint-2, -4, -6)
from test_repair_hf import run as hf_run_fixture  # noqa: E402 (a Trainer run at checkpoint-3, a grown tokenizer)

trainer_run = run_fixture
hf_run = hf_run_fixture


def _run_without(trainer_run, tmp_path, name: str):
    run = tmp_path / "out"
    shutil.copytree(trainer_run, run)
    (run / "checkpoint-6" / name).unlink()
    return run


def _model():
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg)


def test_inspect_of_a_run_folder_names_its_newest_whole_checkpoint(trainer_run, tmp_path):
    run = _run_without(trainer_run, tmp_path, "trainer_state.json")
    with pytest.raises(UnreadableCheckpoint) as exc:
        inspect(str(run))
    assert str(exc.value) == (f"{run}: a run folder, not one checkpoint: the newest whole checkpoint in it is "
                              f"{run / 'checkpoint-4'} (checkpoint-6 is not whole: no trainer_state.json (the "
                              "Trainer writes it last: the save did not finish)) (`ckptfix latest` prints it for "
                              "scripts)")


def test_guard_refuses_a_run_folder(trainer_run):
    model = _model()
    with pytest.raises(ResumeError) as exc:
        ResumeGuard(model, torch.optim.AdamW(model.parameters())).load(trainer_run)
    assert [p.code for p in exc.value.problems] == ["CKF829"]
    assert f"the newest whole checkpoint in it is {trainer_run / 'checkpoint-6'}" in str(exc.value)


def test_guard_refuses_a_save_that_did_not_finish(trainer_run, tmp_path):
    name = "trainer_state.json"  # the Trainer writes it last
    run = _run_without(trainer_run, tmp_path, name)
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ResumeError) as exc:
        ResumeGuard(model, torch.optim.AdamW(model.parameters())).load(run / "checkpoint-6")
    problems = [p for p in exc.value.problems if p.code == "CKF829"]
    assert len(problems) == 1 and name in problems[0].message
    assert f"Resume from {run / 'checkpoint-4'} instead" in problems[0].message
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())  # nothing loaded


def test_guard_loads_a_checkpoint_without_scheduler_pt_and_says_so(trainer_run, tmp_path):
    """The Trainer's both-or-neither rule (CKF310) is not ResumeGuard's: it loads the optimizer that is there and
    warns that the scheduler state is on one side only (CKF827)."""
    run = _run_without(trainer_run, tmp_path, "scheduler.pt")
    model = _model()
    named = list(model.named_parameters())  # the Trainer's two groups: weights decayed, biases and norms not
    decay = [n.endswith("weight") and ".ln_" not in n and not n.startswith("transformer.ln_f") for n, _ in named]
    opt = torch.optim.AdamW([{"params": [p for (_, p), d in zip(named, decay) if d]},
                             {"params": [p for (_, p), d in zip(named, decay) if not d], "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    with pytest.warns(Warning, match="CKF827 warning: the checkpoint has no scheduler state"):
        report = ResumeGuard(model, opt, sched, probe_steps=0).load(run / "checkpoint-6")
    assert "CKF829" not in [p.code for p in report.problems]
    assert {float(s["step"]) for s in opt.state.values()} == {6.0}  # the optimizer state was loaded


def test_hf_callback_refuses_a_resume_that_restarted_the_schedule(trainer_run, tmp_path):
    """The Trainer resumes from a checkpoint-6 without optimizer.pt: a fresh AdamW and the schedule at 0."""
    from test_repair_hf import dataset

    from ckptfix.integrations.transformers import ResumeGuardCallback

    run = _run_without(trainer_run, tmp_path, "optimizer.pt")
    args = transformers.TrainingArguments(
        output_dir=str(run), max_steps=8, save_steps=2, report_to=[], use_cpu=True, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=dataset(100, 24, 0),
                                   callbacks=[ResumeGuardCallback()])
    with pytest.raises(ResumeError) as exc:
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-6"))
    (problem,) = exc.value.problems
    assert problem.code == "CKF829" and "resumed at step 6 with the LR schedule back at step 0" in problem.message
    assert f"Resume from {run / 'checkpoint-4'} instead" in problem.message
    assert trainer.state.global_step == 6  # stopped before the first resumed step


def test_hf_callback_lets_a_whole_resume_run(trainer_run, tmp_path):
    from test_repair_hf import dataset

    from ckptfix.integrations.transformers import ResumeGuardCallback

    run = tmp_path / "out"
    shutil.copytree(trainer_run, run)
    args = transformers.TrainingArguments(
        output_dir=str(run), max_steps=8, save_steps=2, report_to=[], use_cpu=True, logging_steps=1,
        per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, dataloader_num_workers=0, seed=0)
    trainer = transformers.Trainer(model=_model(), args=args, train_dataset=dataset(100, 24, 0),
                                   callbacks=[ResumeGuardCallback()])
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-6"))
    assert trainer.state.global_step == 8




def test_a_reset_repair_is_neither_a_finding_nor_refused(hf_run, tmp_path):
    """`repair --policy reset` removes optimizer.pt and scheduler.pt on purpose (its record says so): inspect
    has no CKF310 and the callback lets the Trainer resume from it (the re-warm warning only)."""
    from test_repair_hf import dataset, targs

    import ckptfix
    from ckptfix.guard import TrainingSetupWarning
    from ckptfix.integrations.transformers import ResumeGuardCallback

    run = hf_run
    fixed = tmp_path / "out" / "checkpoint-3"  # where the Trainer's own save of step 3 would be
    fixed.parent.mkdir()
    ckptfix.repair(run["ckpt"], run["new"], fixed, policy="reset")
    assert not [f for f in inspect(str(fixed)).findings if f.code in ("CKF310", "CKF311")]
    model = transformers.GPT2LMHeadModel.from_pretrained(run["ckpt"])
    model.resize_token_embeddings(len(run["new_tok"]))
    trainer = transformers.Trainer(model=model, args=targs(tmp_path / "out", 5), train_dataset=dataset(303, 40, 1),
                                   callbacks=[ResumeGuardCallback()])
    with pytest.warns(TrainingSetupWarning, match="re-warming"):
        trainer.train(resume_from_checkpoint=str(fixed))
    assert trainer.state.global_step == 5
