"""Wrong-shaped Adam moments are stopped before the first step, whatever the AdamW implementation.

What PyTorch itself does (torch 2.13, CPU, measured here): `Optimizer.load_state_dict` accepts moments of
another shape without a word. The for-loop and `foreach=True` AdamW then raise at the first `step()`
("The size of tensor a ... must match"); `fused=True` (the Trainer's `adamw_torch_fused`) does not: with
fewer moment rows than parameter rows it reads past the moment's storage (NaN weights, then heap
corruption such as "corrupted size vs. prev_size"); with more it silently uses other rows' history.

The checkpoint here is what a hand fix gives: the embedding and head resized to the new tokenizer (300 -> 303
rows), the optimizer state saved as it was. The guard, the Hugging Face callback and the Lightning
callback must each stop it with CKF822 and the fix, before any optimizer step.
"""

from __future__ import annotations

import shutil

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches

import ckptfix
from ckptfix.guard.resume import ResumeError

OLD, NEW = 300, 303
IMPLS = [{"fused": True}, {"foreach": True}]


def grown_weights(state: dict) -> dict:
    """The model's vocab tensors padded to NEW rows (a hand resize), everything else as it was."""
    out = dict(state)
    for name in ("text_embedding.weight", "text_head.weight"):
        out[name] = torch.cat([state[name], state[name].mean(0, keepdim=True).expand(NEW - OLD, -1)])
    return out


@pytest.fixture(scope="module", params=IMPLS, ids=["fused", "foreach"])
def hand_resized(request, tmp_path_factory):
    torch.manual_seed(0)
    model = TinyLM(OLD)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **request.param)
    for ids in make_batches(OLD, 3):
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()
    path = tmp_path_factory.mktemp("fused") / "ckpt.pth"
    torch.save({"model": grown_weights(model.state_dict()), "optimizer": opt.state_dict()}, path)
    return path, request.param


def test_pytorch_loads_them_without_a_word(hand_resized):
    path, impl = hand_resized
    model = TinyLM(NEW)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **impl)
    sd = torch.load(path, weights_only=True)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optimizer"])  # no error: this is what the guard must catch
    assert opt.state[model.text_embedding.weight]["exp_avg"].shape[0] == OLD


@pytest.mark.parametrize("policy", ["strict", "remap"])
def test_the_guard_stops_them_before_the_first_step(hand_resized, policy):
    path, impl = hand_resized
    model = TinyLM(NEW)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **impl)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ResumeError, match="CKF822") as err:
        ckptfix.ResumeGuard(model, opt, policy=policy).load(path)
    assert "policy='fresh'" in str(err.value) or "ckptfix repair" in str(err.value)  # the fix
    assert not opt.state or all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_the_guard_passes_the_repaired_checkpoint(hand_resized, tmp_path):
    """The same run repaired by ckptfix from its original save: moments follow the rows, the step runs."""
    path, impl = hand_resized
    sd = torch.load(path, weights_only=True)
    model = TinyLM(NEW)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, **impl)
    model.load_state_dict(sd["model"])
    guard = ckptfix.ResumeGuard(model, opt, policy="remap", probe_steps=0)
    torch.save({"model": {k: (v[:OLD] if k.startswith("text_") else v) for k, v in sd["model"].items()},
                "optimizer": sd["optimizer"]}, tmp_path / "orig.pth")
    guard.load(tmp_path / "orig.pth")
    for ids in make_batches(NEW, 2):
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


transformers = pytest.importorskip("transformers")


@pytest.mark.transformers
@pytest.mark.parametrize("optim", ["adamw_torch_fused", "adamw_torch", "foreach"])
def test_the_hf_callback_stops_them_before_the_first_step(tmp_path, optim):
    """adamw_torch_fused is AdamW(fused=True); adamw_torch on CPU the for-loop; `foreach` AdamW(foreach=True)
    through the Trainer's optimizer_cls_and_kwargs."""
    from ckptfix.integrations.transformers import ResumeGuardCallback

    custom = {"optimizer_cls_and_kwargs": (torch.optim.AdamW, {"lr": 1e-3, "foreach": True})} if optim == "foreach" else {}

    def trainer(vocab, out, steps, callbacks=()):
        torch.manual_seed(0)
        cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=vocab, n_positions=32,
                                      tie_word_embeddings=False)
        args = transformers.TrainingArguments(
            output_dir=str(out), max_steps=steps, save_steps=3, report_to=[], use_cpu=True,
            optim="adamw_torch" if optim == "foreach" else optim,
            per_device_train_batch_size=4, learning_rate=1e-3, disable_tqdm=True, seed=0)
        ids = torch.randint(0, OLD, (16, 12), generator=torch.Generator().manual_seed(0))
        return transformers.Trainer(model=transformers.GPT2LMHeadModel(cfg), args=args,
                                    train_dataset=[{"input_ids": r, "labels": r} for r in ids],
                                    callbacks=list(callbacks), **custom)

    trainer(OLD, tmp_path / "run", 3).train()
    ckpt = tmp_path / "run" / "checkpoint-3"
    from tokenizer_factory import make_hf_tokenizer_folder

    tok = make_hf_tokenizer_folder(tmp_path, OLD, added=["<a>", "<b>", "<c>"], name="tok")
    fixed = tmp_path / "fixed"
    ckptfix.repair(ckpt, tok, fixed)
    broken = tmp_path / "broken"
    shutil.copytree(fixed, broken)
    shutil.copy(ckpt / "optimizer.pt", broken / "optimizer.pt")  # the moments of the old rows, by hand

    t = trainer(NEW, tmp_path / "resumed", 6, [ResumeGuardCallback()])
    with pytest.raises(ResumeError, match="CKF822") as err:
        t.train(resume_from_checkpoint=str(broken))
    assert "ckptfix repair" in str(err.value) and t.state.global_step == 3  # no step was taken
    flags = {k: t.optimizer.defaults.get(k) for k in ("fused", "foreach")}
    assert flags == {"adamw_torch_fused": {"fused": True, "foreach": None},
                     "adamw_torch": {"fused": None, "foreach": None},
                     "foreach": {"fused": None, "foreach": True}}[optim], flags
    t = trainer(NEW, tmp_path / "resumed2", 6, [ResumeGuardCallback()])
    t.train(resume_from_checkpoint=str(fixed))  # the repaired folder passes and trains
    assert t.state.global_step == 6


lightning = pytest.importorskip("lightning")


@pytest.mark.lightning
@pytest.mark.parametrize("impl", IMPLS, ids=["fused", "foreach"])
def test_the_lightning_callback_stops_them_before_the_first_step(tmp_path, impl):
    from ckptfix.integrations.lightning import ResumeGuardCallback

    class Lit(lightning.LightningModule):
        def __init__(self, vocab):
            super().__init__()
            self.lm = TinyLM(vocab)
            self.steps = 0

        def training_step(self, batch, batch_idx):
            self.steps += 1
            return lm_loss(self.lm, batch[0])

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, **impl)

    def fit(vocab, steps, ckpt_path=None, callbacks=()):
        torch.manual_seed(0)
        data = torch.utils.data.TensorDataset(torch.stack([b[0] for b in make_batches(OLD, 8)]))
        module = Lit(vocab)
        t = lightning.Trainer(max_steps=steps, accelerator="cpu", logger=False, enable_checkpointing=False,
                              enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks))
        t.fit(module, torch.utils.data.DataLoader(data, batch_size=2), ckpt_path=ckpt_path)
        return t, module

    t, _ = fit(OLD, 3)
    t.save_checkpoint(tmp_path / "old.ckpt")
    sd = torch.load(tmp_path / "old.ckpt", weights_only=False)
    sd["state_dict"] = {f"lm.{k}": v for k, v in grown_weights(
        {k[3:]: v for k, v in sd["state_dict"].items()}).items()}
    torch.save(sd, tmp_path / "broken.ckpt")
    steps_seen = []

    class CountSteps(lightning.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            steps_seen.append(trainer.global_step)

    with pytest.raises(ResumeError, match="CKF822") as err:
        fit(NEW, 6, tmp_path / "broken.ckpt", [ResumeGuardCallback(), CountSteps()])
    assert "ckptfix repair" in str(err.value) and steps_seen == []  # the fix printed; no step was taken
