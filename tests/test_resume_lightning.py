"""Issue 42: what a real Lightning `.ckpt` lacks for `Trainer.fit(ckpt_path=...)` (CKF317).

One module-scoped run (a Linear, AdamW + StepLR, a callback with state, 3 steps; `trainer.save_checkpoint`, and once
with `weights_only=True`); each key fit reads is then removed (the rest saved again with torch.save), the file halved
and emptied, Lightning's own `fit(ckpt_path=..., max_steps=5)` is run on it, and ckptfix's finding (or one-line
refusal) must name the key or file and say what fit did. Measured (Lightning 2.6.6, torch 2.13):

    removed key                 fit(ckpt_path=...)
    state_dict                  KeyError: 'state_dict'
    pytorch-lightning_version   KeyError: 'pytorch-lightning_version'
    optimizer_states            KeyError: 'Trying to restore optimizer state but checkpoint contains only the model ...'
    lr_schedulers               KeyError: 'Trying to restore learning rate scheduler state ...'
    loops                       resumes silently; global_step restarts at 0: max_steps trained again (3 + 5 steps)
    callbacks                   resumes silently; the callbacks' state restarts
    epoch, global_step          resumes as if whole (the loops' state is what is restored)
    (weights_only=True save)    KeyError: 'Trying to restore optimizer state ...'
    file halved / emptied       RuntimeError 'PytorchStreamReader failed reading zip archive' / EOFError
"""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from damage import cut
from torch import nn

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect
from ckptfix.latest import latest_checkpoint

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.lightning

SAVED_STEPS = 3
MAX_STEPS = 5
KEYS = ("state_dict", "pytorch-lightning_version", "optimizer_states", "lr_schedulers", "loops", "callbacks")


class Module(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(4, 1)

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5),
                                                   "interval": "step"}}


class Counter(L.Callback):
    """A callback with state (as ModelCheckpoint's best paths, EarlyStopping's patience count)."""

    def __init__(self) -> None:
        self.batches = 0

    def on_train_batch_end(self, *args) -> None:
        self.batches += 1

    def state_dict(self) -> dict:
        return {"batches": self.batches}

    def load_state_dict(self, state: dict) -> None:
        self.batches = state["batches"]


def _fit(steps, ckpt_path=None):
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=2)
    counter = Counter()
    trainer = L.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[counter])
    trainer.fit(Module(), data, ckpt_path=ckpt_path)
    return trainer, counter


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning_resume")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    trainer, _ = _fit(SAVED_STEPS)
    trainer.save_checkpoint(root / "whole.ckpt")
    trainer.save_checkpoint(root / "weights.ckpt", weights_only=True)
    return root


def _resume(path):
    """Lightning's own resume: ('ok', what it restored) or (exception name, message)."""
    try:
        trainer, counter = _fit(MAX_STEPS, ckpt_path=str(path))
    except Exception as exc:  # noqa: BLE001 (what fit raises is the measurement)
        return type(exc).__name__, str(exc)
    opt_step = next(iter(trainer.optimizers[0].state.values()))["step"].item()
    return "ok", {"global_step": trainer.global_step, "optimizer_steps": int(opt_step), "callback": counter.batches,
                  "lr_epoch": trainer.lr_scheduler_configs[0].scheduler.last_epoch}


def _without(saved, tmp_path, key):
    tree = torch.load(saved / "whole.ckpt", weights_only=False)
    del tree[key]
    path = tmp_path / "cut.ckpt"
    torch.save(tree, path)
    return path


def test_healthy_checkpoint_has_no_finding_and_resumes(saved):
    assert not [f for f in inspect(str(saved / "whole.ckpt")).findings if f.code == "CKF317"]
    assert _resume(saved / "whole.ckpt") == ("ok", {"global_step": MAX_STEPS, "optimizer_steps": MAX_STEPS,
                                                    "callback": MAX_STEPS, "lr_epoch": MAX_STEPS})


@pytest.mark.parametrize("key", KEYS)
def test_missing_key_is_named_with_what_fit_does(saved, tmp_path, key):
    path = _without(saved, tmp_path, key)
    outcome, details = _resume(path)
    report = inspect(str(path))
    hits = [f for f in report.findings if f.code == "CKF317"]
    assert len(hits) == 1 and f"'{key}'" in hits[0].message, [(f.code, f.message) for f in report.findings]
    hit = hits[0]
    if key == "loops":  # silently trained max_steps again on top of the restored optimizer
        assert outcome == "ok" and details["global_step"] == MAX_STEPS
        assert details["optimizer_steps"] == SAVED_STEPS + MAX_STEPS
        assert hit.severity == "error" and "restart" in hit.pytorch
    elif key == "callbacks":  # resumed, the callback's count started again
        assert outcome == "ok" and details["callback"] == MAX_STEPS - SAVED_STEPS
        assert details["optimizer_steps"] == MAX_STEPS and hit.severity == "warning"
        assert "callbacks' state fresh" in hit.pytorch or "callback's state fresh" in hit.pytorch
    else:
        assert outcome == "KeyError" and hit.severity == "error" and report.exit_code == 1
        assert details.strip("'\"")[:40] in hit.pytorch


@pytest.mark.parametrize("key", ["epoch", "global_step"])
def test_keys_fit_does_not_read_are_no_finding(saved, tmp_path, key):
    path = _without(saved, tmp_path, key)
    assert _resume(path)[0] == "ok"
    assert not [f for f in inspect(str(path)).findings if f.code == "CKF317"]


def test_weights_only_save_is_a_warning(saved):
    outcome, details = _resume(saved / "weights.ckpt")
    hits = [f for f in inspect(str(saved / "weights.ckpt")).findings if f.code == "CKF317"]
    assert outcome == "KeyError" and "contains only the model" in details
    assert len(hits) == 1 and hits[0].severity == "warning" and "save_weights_only" in hits[0].message
    assert "contains only the model" in hits[0].pytorch


@pytest.mark.parametrize("how", ["half", "zero"])
def test_torn_file_is_refused_with_what_fit_does(saved, tmp_path, how):
    path = tmp_path / "torn.ckpt"
    path.write_bytes(cut((saved / "whole.ckpt").read_bytes(), how))
    outcome, details = _resume(path)
    with pytest.raises(CkptfixError) as refused:
        inspect(str(path))
    text = str(refused.value)
    assert "\n" not in text and "torn.ckpt" in text and "fit(ckpt_path=...)" in text
    assert outcome in text and (how == "zero" or details[:40] in text)


def test_latest_skips_checkpoints_fit_would_not_resume(saved, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    shutil.copy(saved / "whole.ckpt", run / "epoch=0-step=3.ckpt")
    tree = torch.load(saved / "whole.ckpt", weights_only=False)
    del tree["loops"]
    torch.save(tree, run / "epoch=0-step=6.ckpt")
    shutil.copy(saved / "weights.ckpt", run / "last.ckpt")
    result = latest_checkpoint(run)
    assert result.path == str(run / "epoch=0-step=3.ckpt")
    assert result.checked[0].reasons == ["saved with save_weights_only=True: fit(ckpt_path=...) raises KeyError on it"]
    assert result.checked[1].reasons == ["no 'loops' key (fit(ckpt_path=...) restarts epoch and global_step at 0)"]
