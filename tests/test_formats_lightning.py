"""PyTorch Lightning `.ckpt` files written by a real `Trainer` (CPU, a few steps, AdamW + LambdaLR).

Both the ModelCheckpoint callback's file and `trainer.save_checkpoint` are read by `torch_file`
through the allowlist unpickler; Lightning 2.6 writes only dicts, lists, OrderedDicts and tensors
(hyper_parameters is a plain dict), so no global outside the allowlist is needed.
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest
import torch
from torch import nn

from ckptfix.formats import read_checkpoint
from ckptfix.inspect import inspect

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.lightning

STEPS = 5


class TinyModule(L.LightningModule):
    def __init__(self, dim: int = 8, lr: float = 1e-3, out_dir: object = None):
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(4, dim), nn.LayerNorm(dim), nn.Linear(dim, 2))

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 10))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def _fit(root: pathlib.Path, module: TinyModule) -> tuple[L.Trainer, TinyModule]:
    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 4)), batch_size=4)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", logger=False, enable_checkpointing=True,
                        default_root_dir=root, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(module, data)
    return trainer, module


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lightning")
    trainer, module = _fit(root, TinyModule())
    trainer.save_checkpoint(root / "manual.ckpt")
    callback_file = next((root / "checkpoints").glob("*.ckpt"))
    return root / "manual.ckpt", callback_file, trainer, module


def test_model_optimizer_scheduler(run):
    manual, _, trainer, module = run
    ckpt = read_checkpoint(manual)
    assert ckpt.format == "lightning"
    want = module.state_dict()
    assert {n: t.shape for n, t in ckpt.model.items()} == {n: tuple(t.shape) for n, t in want.items()}
    for name, tensor in want.items():
        np.testing.assert_array_equal(ckpt.model[name].read(), tensor.numpy())
    opt = ckpt.optimizer
    assert ckpt.sections["optimizer"] == "optimizer_states[0]" and opt.kind == "AdamW"
    assert len(opt.state) == len(want) and {ps.step for ps in opt.state.values()} == {float(STEPS)}
    live = trainer.optimizers[0].state_dict()["state"]
    for index, ps in opt.state.items():
        np.testing.assert_array_equal(ps.tensors["exp_avg_sq"].read(), live[index]["exp_avg_sq"].numpy())
    assert ckpt.sections["scheduler"] == "lr_schedulers[0]" and ckpt.scheduler["last_epoch"] == STEPS


def test_lightning_state_stays_verbatim_in_extras(run):
    manual, callback_file, _, _ = run
    for file in (manual, callback_file):
        extras = read_checkpoint(file).extras
        assert {"epoch", "global_step", "pytorch-lightning_version", "loops", "callbacks",
                "hyper_parameters"} <= set(extras)
        assert extras["global_step"] == STEPS
        assert extras["hyper_parameters"] == {"dim": 8, "lr": 1e-3, "out_dir": None}
        assert extras["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] == STEPS
        assert any(k.startswith("ModelCheckpoint") for k in extras["callbacks"])


def test_inspect_reports_a_clean_checkpoint(run):
    data = inspect(run[1]).to_json()
    assert data["format"] == "lightning" and data["summary"]["error"] == 0
    assert data["optimizer"]["mapping"] == "position" and data["scheduler"]["type"].startswith("LambdaLR")


def test_path_in_hyper_parameters_is_read_as_inert_data(tmp_path):
    """A pathlib.Path hyperparameter pickles as `pathlib.PosixPath`: outside the allowlist, read as an inert
    record of a known data class (issue 21: was refused before; nothing is imported either way)."""
    trainer, _ = _fit(tmp_path, TinyModule(out_dir=pathlib.Path("/data/run")))
    trainer.save_checkpoint(tmp_path / "path.ckpt")
    strict = read_checkpoint(tmp_path / "path.ckpt")
    assert strict.extras["hyper_parameters"]["out_dir"].cls == "pathlib.PosixPath"
    assert strict.extras["hyper_parameters"]["out_dir"].args == ("/", "data", "run")
    ckpt = read_checkpoint(tmp_path / "path.ckpt", trust_pickle=True)
    assert ckpt.extras["hyper_parameters"]["out_dir"].cls.startswith("pathlib.")
    assert ckpt.optimizer.kind == "AdamW"
