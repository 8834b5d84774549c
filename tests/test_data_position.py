"""Issue 42 (topology and data position): a Trainer checkpoint resumed with other samples per optimizer step.

Real Trainer runs on CPU (tiny GPT-2, a dataset of 64 indexed samples, AdamW, linear schedule with a 0.1 warm-up
ratio, 2 epochs, max_steps unset): every micro-batch's sample indices are recorded in `compute_loss` (skipped
batches never reach it), so the samples a resumed run trains are compared with the uninterrupted run's stream.
CKF314's numbers (inspect and the callback) must be what the resumed Trainer then does.
"""

from __future__ import annotations

import json
import shutil
import warnings

import pytest
import torch

from ckptfix.cli import main
from ckptfix.data_position import ResumeWith, lr_lambda
from ckptfix.inspect import inspect

transformers = pytest.importorskip("transformers")
from test_latest import trainer_run as latest_run  # noqa: E402 (a fixture: test_latest's real Trainer run)

trainer_run = latest_run

N, SAVE = 64, 10  # batch 4: 16 steps per epoch, 32 in all; checkpoint-10 has drawn 40 samples


def _dataset():
    ids = torch.randint(0, 64, (N, 8), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row, "idx": i} for i, row in enumerate(ids)]


def _collate(rows):
    return {"input_ids": torch.stack([r["input_ids"] for r in rows]),
            "labels": torch.stack([r["labels"] for r in rows]), "idx": torch.tensor([r["idx"] for r in rows])}


class _Recording(transformers.Trainer):
    """Records the indices of every micro-batch it trains (skipped batches never reach compute_loss)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.trained: list[int] = []

    def compute_loss(self, model, inputs, *args, **kwargs):
        self.trained += inputs.pop("idx").tolist()
        return super().compute_loss(model, inputs, *args, **kwargs)


class _Rates(transformers.TrainerCallback):
    """The lr each optimizer step runs at (step numbers as global_step after it), and a stop after `stop` steps."""

    def __init__(self, stop: int | None = None):
        self.lr: dict[int, float] = {}
        self.stop = stop

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.lr[state.global_step + 1] = optimizer.param_groups[0]["lr"]

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop is not None and state.global_step >= self.stop:
            control.should_training_stop = True


def _train(out, batch=4, accum=1, resume=None, callbacks=(), stop=None):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=16,
                                  bos_token_id=0, eos_token_id=0)
    args = transformers.TrainingArguments(
        output_dir=str(out), num_train_epochs=2, save_steps=SAVE, per_device_train_batch_size=batch,
        gradient_accumulation_steps=accum, learning_rate=1e-3, warmup_steps=0.1, lr_scheduler_type="linear",
        report_to=[], use_cpu=True, logging_strategy="no", disable_tqdm=True, seed=0, dataloader_num_workers=0,
        remove_unused_columns=False, save_total_limit=None)
    rates = _Rates(stop)
    trainer = _Recording(model=transformers.GPT2LMHeadModel(cfg), args=args, train_dataset=_dataset(),
                         data_collator=_collate, callbacks=[rates, *callbacks])
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer, rates


@pytest.fixture(scope="module")
def original(tmp_path_factory):
    """The uninterrupted run (batch 4, grad accum 1, 1 process): its sample stream and lr per step."""
    out = tmp_path_factory.mktemp("dp") / "run"
    trainer, rates = _train(out)
    assert len(trainer.trained) == 2 * N and trainer.state.global_step == 32
    return out, trainer.trained, rates.lr


def _checkpoint(original, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(original[0] / f"checkpoint-{SAVE}", out / f"checkpoint-{SAVE}")
    return out, out / f"checkpoint-{SAVE}"


def _resume(original, tmp_path, batch, accum, stop=None):
    """inspect's CKF314 for (batch, accum), then the real resume with the guard callback."""
    from ckptfix.integrations.transformers import ResumeGuardCallback

    out, ckpt = _checkpoint(original, tmp_path)
    report = inspect(str(ckpt), resume=ResumeWith(batch_size=batch, grad_accum=accum, dataset_length=N))
    found = [f for f in report.findings if f.code == "CKF314"]
    guard = ResumeGuardCallback(steps=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, rates = _train(out, batch, accum, resume=ckpt, callbacks=[guard], stop=stop)
    warned = [str(w.message) for w in caught if str(w.message).startswith("CKF314")]
    return report, found, guard, warned, trainer, rates


@pytest.mark.parametrize("batch, accum", [(8, 1), (4, 2)])
def test_more_samples_per_step_skips_what_the_warning_says(original, tmp_path, batch, accum):
    _, stream, lr = original
    report, found, guard, warned, trainer, rates = _resume(original, tmp_path, batch, accum)
    assert len(found) == 1 and found[0].severity == "warning"
    pos = guard.data_position
    assert pos.seen == (40, 40) and pos.skipped == (80, 80) and pos.difference == (40, 40)
    assert "at global_step 10 the saved run had drawn 40 samples; the resumed Trainer skips 80" in found[0].message
    assert "40 samples are never trained" in found[0].message
    # the callback warned before the first step, with inspect's numbers
    assert len(warned) == 1 and "skips 80 (1 epoch(s)" in warned[0] and "40 samples are never trained" in warned[0]
    # what the resumed Trainer then did: the stream from sample 80 on; samples 40..79 were never trained
    assert stream[:40] == stream[:pos.seen[0]]
    assert trainer.trained == stream[80:]
    assert 40 + len(trainer.trained) == 2 * N - pos.difference[0]  # 88 of the 128 samples of two epochs
    # the LR: the first resumed step at the lr optimizer.pt holds, then the rebuilt 16-step schedule
    assert pos.total_steps == (32, (16, 16)) and trainer.state.global_step == 16
    assert rates.lr[11] == pytest.approx(lr[11]) == pytest.approx(1e-3 * 22 / 28)
    assert rates.lr[12] == pytest.approx(pos.lr_resumed[0]) == pytest.approx(1e-3 * 5 / 14)
    assert lr[12] == pytest.approx(pos.lr_original) == pytest.approx(1e-3 * 21 / 28)
    assert "then step 12 at 0.0003571 where the original run had 0.00075" in found[0].message
    assert "gradient_accumulation_steps=1" in found[0].fix or "per_device_train_batch_size=4" in found[0].fix


def test_fewer_samples_per_step_trains_samples_twice(original, tmp_path):
    """Batch 4 -> 2 at step 10: the Trainer skips 10 batches of 2 (20 samples) where the run had drawn 40."""
    _, stream, lr = original
    report, found, guard, warned, trainer, rates = _resume(original, tmp_path, 2, 1, stop=SAVE + 12)
    pos = guard.data_position
    assert pos.seen == (40, 40) and pos.skipped == (20, 20) and pos.difference == (-20, -20)
    assert "20 samples are trained a second time" in found[0].message and len(warned) == 1
    assert trainer.trained == stream[20:20 + 2 * 12]  # samples 20..39 again
    assert set(trainer.trained[:20]) <= set(stream[:40])
    assert pos.total_steps == (32, (64, 64))
    assert rates.lr[12] == pytest.approx(pos.lr_resumed[0]) == pytest.approx(1e-3 * (64 - 11) / (64 - 7))
    assert found[0].fix.startswith("Resume with gradient_accumulation_steps=2")


def test_a_rebuilt_run_that_ends_before_the_resume_trains_nothing(original, tmp_path):
    """Batch 16: 4 steps per epoch, the 2-epoch schedule rebuilt over 8 steps, below global_step 10."""
    report, found, guard, warned, trainer, rates = _resume(original, tmp_path, 16, 1)
    assert trainer.trained == [] and trainer.state.global_step == SAVE
    assert guard.data_position.ends_before_start and guard.data_position.difference == (88, 88)
    assert "past the end of its rebuilt run at sample 128, and trains nothing more: 88 samples are never " \
        "trained" in found[0].message and "nothing is left to train" in found[0].message and len(warned) == 1


def test_same_samples_per_step_no_finding_and_the_stream_goes_on(original, tmp_path):
    _, stream, lr = original
    report, found, guard, warned, trainer, rates = _resume(original, tmp_path, 4, 1)
    assert found == [] and warned == [] and guard.resume_findings == []
    assert any("samples per optimizer step unchanged" in n for n in report.notes)
    assert trainer.trained == stream[40:]
    assert rates.lr[12] == pytest.approx(lr[12])


def test_same_product_is_no_finding(original, tmp_path):
    """Batch 2 x grad accum 2 keeps 4 samples per step: the steps per epoch and the position are the same."""
    _, ckpt = _checkpoint(original, tmp_path)
    report = inspect(str(ckpt), resume=ResumeWith(batch_size=2, grad_accum=2))
    assert not [f for f in report.findings if f.code == "CKF314"]


def test_dataset_length_from_trainer_state(original, tmp_path):
    """Without the length, trainer_state's epoch (0.625 at step 10) bounds it: 61..64 samples (16 batches of 4)."""
    _, ckpt = _checkpoint(original, tmp_path)
    report = inspect(str(ckpt), resume=ResumeWith(batch_size=8))
    (found,) = [f for f in report.findings if f.code == "CKF314"]
    assert "37 to 40 samples are never trained" in found.message
    assert "the dataset length is known only to lie in 61 to 64" in found.message
    note = next(n for n in report.notes if n.startswith("data position"))
    assert "gradient_accumulation_steps 1" in note and "1 process(es) at save (rng_state.pth)" in note


def test_two_processes_to_one(original, tmp_path):
    """Compute only: rng_state_0.pth and rng_state_1.pth say 2 processes at save (batch 4 each, 8 per step); at
    global_step 20 of a 256-sample set the run had drawn 160; one process skips 20 batches of 4: 80 twice."""
    _, ckpt = _checkpoint(original, tmp_path)
    rng = ckpt / "rng_state.pth"
    shutil.copy(rng, ckpt / "rng_state_0.pth")
    rng.rename(ckpt / "rng_state_1.pth")
    state = json.loads((ckpt / "trainer_state.json").read_text())
    state.update(global_step=20, epoch=20 / 32, max_steps=64)  # 32 batches of 4 per process and epoch
    (ckpt / "trainer_state.json").write_text(json.dumps(state))
    report = inspect(str(ckpt), resume=ResumeWith(world_size=1, dataset_length=256))
    (found,) = [f for f in report.findings if f.code == "CKF314"]
    assert "from 8 (batch 4 x grad accum 1 x 2 processes) to 4 (batch 4 x grad accum 1 x 1 process)" in found.message
    assert "had drawn 160 samples; the resumed Trainer skips 80" in found.message
    assert "80 samples are trained a second time" in found.message
    assert found.fix.startswith("Resume with gradient_accumulation_steps=2")
    assert "rebuilt over 128 steps instead of 64" in found.message
    same = inspect(str(ckpt), resume=ResumeWith(world_size=2))
    assert not [f for f in same.findings if f.code == "CKF314"]


def test_too_little_recorded_is_said(original, tmp_path):
    _, ckpt = _checkpoint(original, tmp_path)
    (ckpt / "training_args.bin").unlink()
    report = inspect(str(ckpt), resume=ResumeWith(grad_accum=2))
    (found,) = [f for f in report.findings if f.code == "CKF314"]
    assert found.severity == "info" and "cannot compute" in found.message and "training_args.bin" in found.message
    (ckpt / "rng_state.pth").unlink()
    report = inspect(str(ckpt), resume=ResumeWith(world_size=1))
    (found,) = [f for f in report.findings if f.code == "CKF314"]
    assert found.severity == "info" and "number of processes at save" in found.message


def test_healthy_checkpoints_have_no_new_finding(original, trainer_run):
    """No flags: no CKF314 on this run's checkpoint, test_latest's Trainer run, and the fixture corpus."""
    from pathlib import Path

    corpus = Path(__file__).resolve().parents[1] / "fixtures"
    paths = [original[0] / f"checkpoint-{SAVE}", trainer_run / "checkpoint-6", corpus / "clean" / "ckpt.pth",
             *sorted(corpus.glob("frameworks/*/*"))]
    for path in paths:
        assert not [f for f in inspect(str(path)).findings if f.code == "CKF314"], path


def test_cli_flags_and_explain(original, capsys):
    ckpt = str(original[0] / f"checkpoint-{SAVE}")
    with pytest.raises(SystemExit) as done:
        main(["inspect", ckpt, "--batch-size", "8", "--dataset-length", "64"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and "warning CKF314" in out and "40 samples are never trained" in out
    with pytest.raises(SystemExit) as done:
        main(["inspect", ckpt, "--batch-size", "4", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert not [f for f in data["findings"] if f["code"] == "CKF314"]
    assert any("samples per optimizer step unchanged" in n for n in data["notes"])
    main(["explain", "CKF314"])  # returns: exit 0
    assert "CKF314 (warning): Trainer resume with other samples per optimizer step" in capsys.readouterr().out


@pytest.mark.parametrize("kind, kwargs", [("linear", {}), ("cosine", {}), ("cosine", {"num_cycles": 1.5}),
                                          ("cosine_with_restarts", {"num_cycles": 3}), ("constant", {}),
                                          ("constant_with_warmup", {}), ("polynomial", {"power": 2.0})])
def test_lr_lambdas_are_transformers(kind, kwargs):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = transformers.get_scheduler(kind, opt, num_warmup_steps=7, num_training_steps=64,
                                       scheduler_specific_kwargs=kwargs)
    for step in (0, 3, 7, 11, 40, 63, 64, 70):
        ours = lr_lambda(kind, step, 64, 7, kwargs, lr_init=1e-3)
        assert ours == pytest.approx(sched.lr_lambdas[0](step)), (kind, step)


def test_max_steps_run_keeps_its_schedule_and_a_lengthless_dataset_has_no_epochs():
    """Compute only: with max_steps set the schedule's length is the argument (nothing rebuilt); a dataset without
    __len__ (trainer_state's num_train_epochs = sys.maxsize) is one endless epoch: no wrap."""
    import sys

    from ckptfix.data_position import Layout, Saved, position

    saved = Saved(Layout(4, 1, 1), global_step=10, epoch=0.625, max_steps=100, state_epochs=7, args_max_steps=100,
                  args_epochs=3.0, scheduler_type="linear", warmup=0.0, base_lr=1e-3)
    pos = position(saved, Layout(8, 1, 1), 64)
    assert (pos.seen, pos.skipped, pos.difference) == ((40, 40), (80, 80), (40, 40))
    assert not pos.schedule_rebuilt and pos.lr_resumed is None
    saved.state_epochs, saved.epoch = sys.maxsize, 10 / 100
    pos = position(saved, Layout(4, 1, 2))
    assert pos.lengthless and (pos.seen, pos.skipped, pos.difference) == ((40, 40), (80, 80), (40, 40))
