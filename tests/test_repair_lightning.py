"""Repair round trip for PyTorch Lightning `.ckpt` files, resumed by Lightning itself.

A LightningModule (TinyLM: embedding + LM head, AdamW + warmup LambdaLR from configure_optimizers) is
trained by a real `Trainer` on CPU and saved with `trainer.save_checkpoint`; the run then switches to a
tokenizer of another size. The repaired `.ckpt` (written by `write_torch_checkpoint`: the sections
`state_dict`, `optimizer_states[0]`, `lr_schedulers[0]` edited, everything else verbatim, plus the
top-level `ckptfix` record) must resume with `Trainer.fit(model, ckpt_path=...)` into a module built
for the new vocab: weights, moments, Adam's step, the schedule and the loop position restored, and the
loss finite and falling.

Measured on Lightning 2.6: the extra top-level `ckptfix` key is ignored by `fit(ckpt_path=...)` and by
`load_from_checkpoint` (also with `weights_only=True`: the record is plain JSON data), so no sidecar
is needed. `load_from_checkpoint` rebuilds the module from the saved `hyper_parameters`, which still
hold the old vocab size: pass the new one as an override (`load_from_checkpoint(path, vocab=...)`).
"""

from __future__ import annotations

import math

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, warmup_lambda
from test_repair_common import (
    LR,
    WARMUP,
    WD,
    assert_trains,
    same_bits,
    sha256,
)
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix

L = pytest.importorskip("lightning")
pytestmark = pytest.mark.lightning

OLD, STEPS, MORE = 48, 8, 32
EMBED, HEAD = "lm.text_embedding.weight", "lm.text_head.weight"


class LitLM(L.LightningModule):
    def __init__(self, vocab: int = OLD):
        super().__init__()
        self.save_hyperparameters()
        self.lm = TinyLM(vocab)
        self.losses: list[float] = []
        self.at_start: dict = {}

    def training_step(self, batch, batch_idx):
        (ids,) = batch
        loss = lm_loss(self.lm, ids)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_lambda(WARMUP))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def on_train_start(self):
        """After Lightning restored the checkpoint, before the first step: what resumed."""
        opt = self.trainer.optimizers[0]
        emb = self.lm.embedding.weight
        self.at_start = {
            "global_step": self.trainer.global_step,
            "embedding": emb.detach().clone(),
            "head": self.lm.head.weight.detach().clone(),
            "state": {k: (v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[emb].items()},
            "lr": opt.param_groups[0]["lr"],
            "last_epoch": self.trainer.lr_scheduler_configs[0].scheduler.last_epoch,
        }


def loader(vocab: int, batches: int, seed: int = 0):
    data = torch.cat(make_batches(vocab, batches, seed=seed))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=8)


def trainer(root, max_steps: int) -> "L.Trainer":
    return L.Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                     enable_model_summary=False, enable_checkpointing=False, default_root_dir=root)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    root = tmp_path_factory.mktemp("lit")
    torch.manual_seed(0)
    module = LitLM(OLD)
    t = trainer(root, STEPS)
    t.fit(module, loader(OLD, 16, seed=1))
    path = root / "last.ckpt"
    t.save_checkpoint(path)
    sd = torch.load(path, weights_only=True)
    assert float(sd["optimizer_states"][0]["state"][0]["step"]) == STEPS
    return path, sha256(path), sd


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return {n: train_bpe_tokenizer_json(folder, n, name=f"bpe{n}.json") for n in (40, 64)}


def resume(tmp_path, ckpt, vocab: int, seed: int = 5) -> LitLM:
    """Build the module for the new vocab and let Lightning resume the repaired file and train on."""
    torch.manual_seed(seed)  # the fresh init must not matter: everything comes from the checkpoint
    module = LitLM(vocab)
    trainer(tmp_path / "resume", STEPS + MORE).fit(module, loader(vocab, 64, seed=7), ckpt_path=ckpt,
                                                   weights_only=True)
    return module


@pytest.mark.parametrize("new_vocab", [64, 40], ids=["grow", "shrink"])
def test_remap_resumes_with_trainer_fit(source, tokenizers, tmp_path, new_vocab):
    path, digest, src = source
    out = tmp_path / "fixed.ckpt"
    result = ckptfix.repair(path, tokenizers[new_vocab], out)
    assert sha256(path) == digest and result.plan.ckpt.format == "lightning"

    sd = torch.load(out, weights_only=True)
    assert set(sd) == set(src) | {"ckptfix"}
    for key in ("epoch", "global_step", "loops", "callbacks", "pytorch-lightning_version"):
        assert sd[key] == src[key], key
    # LitLM(vocab) saves its vocab as an hparam: LitLM.load_from_checkpoint rebuilds the module from it
    assert sd["hyper_parameters"] == {**src["hyper_parameters"], "vocab": new_vocab}
    assert sd["lr_schedulers"] == src["lr_schedulers"]
    rec = sd["ckptfix"]
    assert rec["format"] == "lightning" and rec["optimizer_state"] == "remapped" and rec["source_sha256"] == digest
    assert {c["tensor"] for c in rec["changes"]} == {EMBED, HEAD} | {f"{n}:{k}" for n in (EMBED, HEAD)
                                                                      for k in ("exp_avg", "exp_avg_sq")}

    module = resume(tmp_path, out, new_vocab)
    start, keep = module.at_start, min(OLD, new_vocab)
    assert start["global_step"] == STEPS and start["last_epoch"] == STEPS
    assert start["lr"] == src["optimizer_states"][0]["param_groups"][0]["lr"] == LR * warmup_lambda(WARMUP)(STEPS)
    assert start["embedding"].shape == (new_vocab, 16)
    assert same_bits(start["embedding"][:keep], src["state_dict"][EMBED][:keep])
    assert same_bits(start["head"][:keep], src["state_dict"][HEAD][:keep])
    old_state = src["optimizer_states"][0]["state"][0]  # the embedding is parameter 0
    assert float(start["state"]["step"]) == STEPS  # Adam's bias correction continues
    for key in ("exp_avg", "exp_avg_sq"):
        assert same_bits(start["state"][key][:keep], old_state[key][:keep]), key
    if new_vocab > OLD:
        assert torch.count_nonzero(start["state"]["exp_avg"][OLD:]) == 0
        assert (start["state"]["exp_avg_sq"][OLD:] > 0).all()

    opt = module.trainer.optimizers[0]
    assert module.trainer.global_step == STEPS + MORE
    assert float(opt.state[module.lm.embedding.weight]["step"]) == STEPS + MORE
    assert len(module.losses) == MORE and all(math.isfinite(x) for x in module.losses)
    assert_trains(module.losses)


def test_fresh_resumes_with_empty_adam_state_and_the_schedule_kept(source, tokenizers, tmp_path):
    path, _, src = source
    out = tmp_path / "fresh.ckpt"
    ckptfix.repair(path, tokenizers[64], out, policy="fresh")
    sd = torch.load(out, weights_only=True)
    assert sd["optimizer_states"][0]["state"] == {} and sd["lr_schedulers"] == src["lr_schedulers"]
    assert sd["ckptfix"]["rewarm"] is True

    module = resume(tmp_path, out, 64)
    start = module.at_start
    assert start["state"] == {} and start["last_epoch"] == STEPS and start["global_step"] == STEPS
    assert start["lr"] == src["optimizer_states"][0]["param_groups"][0]["lr"]  # where the schedule stopped
    assert float(module.trainer.optimizers[0].state[module.lm.embedding.weight]["step"]) == MORE  # Adam restarted
    assert_trains(module.losses)


def test_reset_restarts_the_schedule(source, tokenizers, tmp_path):
    """`lr_schedulers` becomes [] (Lightning then loads no scheduler state, and needs the key present).

    Measured: Lightning builds the scheduler in configure_optimizers (lr = base * lambda(0)) and only
    then loads `optimizer_states`, whose groups hold `lr = initial_lr` after a reset; so the first step
    after resuming runs at the base LR, and the warmup applies from the scheduler's first step on."""
    path, _, src = source
    out = tmp_path / "reset.ckpt"
    ckptfix.repair(path, tokenizers[40], out, policy="reset")
    sd = torch.load(out, weights_only=True)
    assert sd["lr_schedulers"] == [] and sd["optimizer_states"][0]["state"] == {}
    assert all(g["lr"] == g["initial_lr"] == LR for g in sd["optimizer_states"][0]["param_groups"])

    module = resume(tmp_path, out, 40)
    start = module.at_start
    assert start["last_epoch"] == 0 and start["state"] == {} and start["global_step"] == STEPS
    assert start["lr"] == LR
    sched = module.trainer.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == MORE and sched.get_last_lr()[0] == pytest.approx(LR * warmup_lambda(WARMUP)(MORE))
    assert_trains(module.losses)


def test_load_from_checkpoint_rebuilds_at_the_new_vocab(source, tokenizers, tmp_path):
    """hyper_parameters' `vocab` equals the rows: repair sets it with them (the audit would refuse to leave it),
    so load_from_checkpoint rebuilds the module at the new vocab with no override."""
    path, _, _ = source
    out = tmp_path / "fixed.ckpt"
    ckptfix.repair(path, tokenizers[64], out)
    for module in (LitLM.load_from_checkpoint(out, vocab=64, weights_only=True),
                   LitLM.load_from_checkpoint(out, weights_only=True)):
        assert module.lm.embedding.weight.shape == (64, 16)


def test_lightning_record_is_plain_data(source, tokenizers, tmp_path):
    """What makes `weights_only=True` loading work: the record holds only JSON types."""
    path, _, _ = source
    out = tmp_path / "fixed.ckpt"
    ckptfix.repair(path, tokenizers[64], out)
    rec = torch.load(out, weights_only=True)["ckptfix"]

    def plain(x):
        if isinstance(x, dict):
            return all(isinstance(k, str) and plain(v) for k, v in x.items())
        if isinstance(x, list):
            return all(plain(v) for v in x)
        return x is None or isinstance(x, (str, int, float, bool))

    assert plain(rec) and rec["param_names"][0] == EMBED
