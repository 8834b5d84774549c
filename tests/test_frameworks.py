"""Checkpoints in the layouts training frameworks write, inspected and repaired, then resumed with the
framework's own loading code (or, where the framework cannot be installed beside this torch, its exact
layout and loading steps written from its source, as each test says)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from arch_corpus import word_level_tokenizer

import ckptfix

VOCAB, NEW = 203, 216


def _tiny_llama(vocab: int):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _step(model, opt, vocab: int, seed: int) -> float:
    ids = torch.randint(3, vocab, (2, 10), generator=torch.Generator().manual_seed(seed))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


@pytest.mark.peft
def test_peft_adapter_with_modules_to_save_repairs_and_resumes(tmp_path):
    """The usual recipe when a LoRA run adds tokens: modules_to_save=["embed_tokens", "lm_head"]. inspect
    prints `ckptfix repair ...`; that command works, and PeftModel.from_pretrained on the resized base
    loads the repaired adapter, whose optimizer state then takes a step."""
    peft = pytest.importorskip("peft")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_tiny_llama(VOCAB), peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["embed_tokens", "lm_head"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    _step(model, opt, VOCAB, 1)
    src = tmp_path / "adapter"
    model.save_pretrained(src)
    torch.save(opt.state_dict(), src / "optimizer.pt")  # where the HF Trainer keeps it, beside the adapter
    tok = word_level_tokenizer(tmp_path / "tokenizer.json", NEW)

    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    fix = next(f.fix for f in report.findings if f.code == "CKF101")
    out = tmp_path / "fixed"
    assert fix.startswith("ckptfix repair") and str(src) in fix
    ckptfix.repair(str(src), str(tok), str(out))

    base = _tiny_llama(VOCAB)
    base.resize_token_embeddings(NEW, mean_resizing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = peft.PeftModel.from_pretrained(base, str(out), is_trainable=True)
    trained = dict(model.named_parameters())
    for name, p in resumed.named_parameters():
        if p.requires_grad:
            old = trained[name]
            assert torch.equal(p.detach()[:old.shape[0]] if p.shape != old.shape else p.detach(), old.detach()), name
    opt2 = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-3)
    opt2.load_state_dict(torch.load(out / "optimizer.pt", weights_only=True))
    assert math.isfinite(_step(resumed, opt2, NEW, 2))


class _NanoGPT(torch.nn.Module):
    """nanoGPT's `GPT` (karpathy/nanoGPT model.py), module for module: the names and tying its checkpoints
    have. nanoGPT is a script repository, not a package: its layout and `train.py`'s resume steps are
    written here from its source for where its own scripts are not cached (the test after this one runs
    them)."""

    def __init__(self, n_layer: int, n_head: int, n_embd: int, block_size: int, bias: bool, vocab_size: int,
                 dropout: float = 0.0):
        super().__init__()
        nn = torch.nn
        self.n_head = n_head
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList(nn.ModuleDict(dict(
                ln_1=nn.LayerNorm(n_embd, bias=bias),
                attn=nn.ModuleDict(dict(c_attn=nn.Linear(n_embd, 3 * n_embd, bias=bias),
                                        c_proj=nn.Linear(n_embd, n_embd, bias=bias))),
                ln_2=nn.LayerNorm(n_embd, bias=bias),
                mlp=nn.ModuleDict(dict(c_fc=nn.Linear(n_embd, 4 * n_embd, bias=bias),
                                       c_proj=nn.Linear(4 * n_embd, n_embd, bias=bias))))) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd, bias=bias)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # nanoGPT's weight tying

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        f = torch.nn.functional
        b, t = idx.shape
        x = self.transformer.wte(idx) + self.transformer.wpe(torch.arange(t))
        for blk in self.transformer.h:
            q, k, v = blk.attn.c_attn(blk.ln_1(x)).split(x.shape[-1], dim=2)
            q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
            y = f.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
            x = x + blk.attn.c_proj(y)
            x = x + blk.mlp.c_proj(f.gelu(blk.mlp.c_fc(blk.ln_2(x))))
        logits = self.lm_head(self.transformer.ln_f(x))
        return f.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    def configure_optimizers(self, weight_decay: float, learning_rate: float) -> torch.optim.AdamW:
        params = {n: p for n, p in self.named_parameters() if p.requires_grad}
        groups = [{"params": [p for p in params.values() if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params.values() if p.dim() < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=learning_rate, betas=(0.9, 0.95))


def _nano_step(model: _NanoGPT, opt, vocab: int, seed: int) -> float:
    ids = torch.randint(0, vocab, (2, 9), generator=torch.Generator().manual_seed(seed))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


# 11 fewer tokens fit the 203 rows model_args records (fit rule: reserved by the recorded size): repair keeps
# the model's size by default (issue #16) and shrinks to one row per token with --pad-to 1.
@pytest.mark.parametrize("new, pad_to, rows", [(NEW, None, NEW), (VOCAB - 11, None, VOCAB), (VOCAB - 11, 1, VOCAB - 11)])
def test_nanogpt_checkpoint_repairs_and_resumes_with_init_from_resume(tmp_path, new, pad_to, rows):
    model_args = dict(n_layer=2, n_head=2, n_embd=32, block_size=16, bias=False, vocab_size=VOCAB, dropout=0.0)
    torch.manual_seed(0)
    model = _NanoGPT(**model_args)
    opt = model.configure_optimizers(0.1, 1e-3)
    _nano_step(model, opt, VOCAB, 1)
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "model_args": model_args,
                "iter_num": 1, "best_val_loss": 9.9, "config": {"learning_rate": 1e-3, "batch_size": 2}}, src)
    tok = word_level_tokenizer(tmp_path / "tok.json", new)
    out = tmp_path / "fixed.pt"
    result = ckptfix.repair(str(src), str(tok), str(out), pad_to_multiple_of=pad_to).to_json()
    if rows == VOCAB:  # the model's size kept: nothing to change, nothing written; the checkpoint resumes as is
        assert result["output"] is None and not out.exists()
        out = src

    # train.py, init_from='resume'
    checkpoint = torch.load(out, map_location="cpu", weights_only=True)
    args = {k: checkpoint["model_args"][k] for k in ("n_layer", "n_head", "n_embd", "block_size", "bias",
                                                     "vocab_size")}
    assert args["vocab_size"] == rows
    resumed = _NanoGPT(**args)
    resumed.load_state_dict(checkpoint["model"])
    opt2 = resumed.configure_optimizers(0.1, 1e-3)
    opt2.load_state_dict(checkpoint["optimizer"])
    keep = min(new, VOCAB)
    assert torch.equal(resumed.lm_head.weight[:keep], model.lm_head.weight[:keep])
    m_old, m_new = opt.state[model.lm_head.weight], opt2.state[resumed.lm_head.weight]
    assert torch.equal(m_new["exp_avg_sq"][:keep], m_old["exp_avg_sq"][:keep])
    assert math.isfinite(_nano_step(resumed, opt2, new, 2))

    # and inspect checks the recorded size against the rows
    wrong = dict(torch.load(src, weights_only=True))
    wrong["model_args"] = {**model_args, "vocab_size": VOCAB + 1}
    torch.save(wrong, tmp_path / "wrong.pt")
    report = ckptfix.inspect(str(tmp_path / "wrong.pt"))
    assert [f.code for f in report.findings if f.code == "CKF115"] == ["CKF115"]


def _nanogpt_train(work, *args: str) -> list[float]:
    """Run nanoGPT's own train.py (tiny, CPU) in `work`; the losses of the iterations it logged."""
    import re
    import subprocess
    import sys

    cmd = [sys.executable, "train.py", "--dataset=tiny", "--device=cpu", "--compile=False", "--dtype=float32",
           "--eval_interval=2", "--eval_iters=1", "--log_interval=1", "--n_layer=1", "--n_head=2", "--n_embd=16",
           "--block_size=8", "--batch_size=2", "--gradient_accumulation_steps=1", "--always_save_checkpoint=True",
           *args]
    proc = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(m) for m in re.findall(r"^iter \d+: loss (\S+),", proc.stdout, re.M)]


def test_nanogpt_own_train_py_saves_repairs_and_resumes(tmp_path):
    """nanoGPT's own train.py (fixtures/nanogpt.py, pinned commit; skipped when not cached) trains 2 steps on
    a tiny dataset laid out as its prepare.py writes it (train.bin/val.bin uint16, meta.pkl with vocab_size)
    and saves out/ckpt.pt. inspect is clean with a tokenizer of its vocab and flags a wrong one; repair to a
    larger tokenizer; then train.py --init_from=resume (its own resume code: model_args['vocab_size'],
    load_state_dict, optimizer.load_state_dict) trains on with finite losses and Adam's steps carried on."""
    import pickle
    import shutil
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fixtures"))
    import nanogpt

    source = nanogpt.cached()
    if source is None:
        pytest.skip("nanoGPT not cached: run python fixtures/nanogpt.py <a clone of karpathy/nanoGPT>")
    work = tmp_path / "nanogpt"
    (work / "data" / "tiny").mkdir(parents=True)
    for name in nanogpt.FILES:
        shutil.copy(source / name, work / name)
    rng = np.random.default_rng(0)
    for split, n in (("train", 2000), ("val", 400)):
        rng.integers(0, VOCAB, n).astype(np.uint16).tofile(work / "data" / "tiny" / f"{split}.bin")
    stoi = {f"t{i}": i for i in range(VOCAB)}
    with open(work / "data" / "tiny" / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": VOCAB, "itos": {i: s for s, i in stoi.items()}, "stoi": stoi}, f)

    assert all(math.isfinite(x) for x in _nanogpt_train(work, "--max_iters=3", "--out_dir=run"))
    src = work / "run" / "ckpt.pt"
    saved = torch.load(src, weights_only=True)
    assert saved["iter_num"] == 2 and saved["model_args"]["vocab_size"] == VOCAB

    right = ckptfix.inspect(str(src), tokenizer=str(word_level_tokenizer(tmp_path / "right.json", VOCAB)))
    assert not [f.code for f in right.findings if f.severity == "error"]
    tok = word_level_tokenizer(tmp_path / "tok.json", NEW)
    wrong = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert "CKF101" in {f.code for f in wrong.findings if f.severity == "error"}
    assert {v.name for v in wrong.vocab} | {v.tied_to for v in wrong.vocab if v.tied_to} == {
        "transformer.wte.weight", "lm_head.weight"}
    (work / "fixed").mkdir()
    ckptfix.repair(str(src), str(tok), str(work / "fixed" / "ckpt.pt"))
    fixed = torch.load(work / "fixed" / "ckpt.pt", weights_only=True)
    assert fixed["model_args"]["vocab_size"] == NEW and fixed["model"]["lm_head.weight"].shape[0] == NEW
    assert torch.equal(fixed["model"]["lm_head.weight"][:VOCAB], saved["model"]["lm_head.weight"])
    for index, moments in saved["optimizer"]["state"].items():
        for key in ("exp_avg", "exp_avg_sq"):
            new = fixed["optimizer"]["state"][index][key]
            assert torch.equal(new[:moments[key].shape[0]], moments[key]), (index, key)
    assert any(s["exp_avg"].shape[0] == NEW for s in fixed["optimizer"]["state"].values())

    losses = _nanogpt_train(work, "--init_from=resume", "--max_iters=5", "--out_dir=fixed")
    assert losses and all(math.isfinite(x) for x in losses)
    again = torch.load(work / "fixed" / "ckpt.pt", weights_only=True)
    assert again["iter_num"] == 4 and again["model_args"]["vocab_size"] == NEW
    assert {float(s["step"]) for s in again["optimizer"]["state"].values()} == {4.0}  # 2 saved + 2 resumed


class _ComposerHF(torch.nn.Module):
    """composer.models.HuggingFaceModel keeps the transformers model as `self.model`: its state dict keys
    are the HF ones under "model."."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model


def test_composer_checkpoint_repairs_and_resumes(tmp_path):
    """Composer's layout (composer/core/state.py `State.state_dict`, saved as {'state': ..., 'rng': ...}):
    optimizers and schedulers under their class names, the HF config among the integrations. Composer cannot
    be imported beside torch 2.13.0+cpu: mosaicml 0.32.1 pins torch<2.7.1 and torchvision<0.22.1, and even
    installed --no-deps `import composer` imports torchvision (composer/core/data_spec.py), whose only build
    for torch 2.13.0 (0.28.0) is the CUDA one: its _C.so needs libtorch_cuda.so, so `import torchvision` raises
    "RuntimeError: operator torchvision::nms does not exist". Its layout and `State.load_state_dict` steps are
    written here from its source; Composer's own Trainer saves and resumes in its own venv in
    test_real_composer_checkpoint_inspects_and_repairs and test_real_composer_own_trainer_resumes_the_repair."""
    wrapped = _ComposerHF(_tiny_llama(VOCAB))
    opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    _step(wrapped.model, opt, VOCAB, 1)
    sched.step()
    hf_meta = {"model": {"config": {"file_extension": ".json", "content": wrapped.model.config.to_dict(),
                                    "class": "transformers.LlamaForCausalLM"}}}
    state = {"model": wrapped.state_dict(), "optimizers": {"AdamW": opt.state_dict()},
             "schedulers": {"LambdaLR": sched.state_dict()}, "algorithms": [], "callbacks": {},
             "timestamp": {"epoch": 0, "batch": 1, "sample": 2, "token": 20}, "rank_zero_seed": 17,
             "run_name": "tiny", "integrations": {"huggingface": hf_meta}, "metadata": {"world_size": 1}}
    src = tmp_path / "ep0-ba1-rank0.pt"
    # composer/utils/reproducibility.py `get_rng_state()`, one dict per rank (all_gather_object)
    rng = [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.random.get_rng_state()}]
    torch.save({"state": state, "rng": rng}, src)
    tok = word_level_tokenizer(tmp_path / "tok.json", NEW)

    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert report.ckpt.format == "composer" and report.ckpt.optimizer is not None
    assert {"model.model.embed_tokens.weight", "model.lm_head.weight"} <= {v.name for v in report.vocab}
    assert all(v.moments for v in report.vocab)
    out = tmp_path / "fixed.pt"
    ckptfix.repair(str(src), str(tok), str(out))

    # Composer loads with weights_only=False (its rng holds numpy arrays): the rng entries come back as saved
    saved = torch.load(out, weights_only=False)
    ck = saved["state"]
    rng_back = saved["rng"][0]
    assert rng_back["python"] == rng[0]["python"] and torch.equal(rng_back["torch"], rng[0]["torch"])
    assert rng_back["numpy"][0] == "MT19937" and rng_back["numpy"][2:] == rng[0]["numpy"][2:]
    assert rng_back["numpy"][1].dtype == rng[0]["numpy"][1].dtype and (rng_back["numpy"][1] == rng[0]["numpy"][1]).all()
    np.random.set_state(rng_back["numpy"])  # reproducibility.load_rng_state
    random.setstate(rng_back["python"])
    assert ck["integrations"]["huggingface"]["model"]["config"]["content"]["vocab_size"] == NEW
    resumed = _ComposerHF(_tiny_llama(NEW))
    resumed.load_state_dict(ck["model"], strict=True)  # State.load_model_state
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    sched2 = torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: min(1.0, (s + 1) / 10))
    opt2.load_state_dict(ck["optimizers"][type(opt2).__qualname__])  # State.load_optim_state
    sched2.load_state_dict(ck["schedulers"]["LambdaLR"])
    assert torch.equal(resumed.model.lm_head.weight[:VOCAB], wrapped.model.lm_head.weight)
    assert math.isfinite(_step(resumed.model, opt2, NEW, 2))


def _timm_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """timm's `param_groups_weight_decay` (timm/optim/_param_groups.py), what `create_optimizer_v2` builds
    AdamW from: the no-decay group (1-D or `.bias`) first. timm 1.0.31 cannot be imported beside torch
    2.13.0+cpu: `import timm` imports torchvision (timm/layers/create_norm.py), whose only build for torch
    2.13.0 (0.28.0) is the CUDA one ("RuntimeError: operator torchvision::nms does not exist": its _C.so needs
    libtorch_cuda.so). So its rule is written here from its source (a checkpoint timm's own code wrote, in
    its own venv, is tested in test_real_timm_checkpoint_maps_every_moment)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (no_decay if param.ndim <= 1 or name.endswith(".bias") else decay).append(param)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


def test_timm_group_order_maps_every_moment(tmp_path):
    """timm's checkpoint (timm/utils/checkpoint_saver.py: epoch, arch, state_dict, optimizer, version) with
    its [no_decay, decay] groups: every moment is mapped to its parameter by the groups, not 'weak'."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
                                torch.nn.Flatten(), torch.nn.Linear(8 * 6 * 6, 10), torch.nn.LayerNorm(10),
                                torch.nn.Linear(10, 10))
    opt = torch.optim.AdamW(_timm_param_groups(model, 0.05), lr=1e-3)
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    opt.step()
    src = tmp_path / "checkpoint-1.pth.tar"
    torch.save({"epoch": 1, "arch": "tiny", "state_dict": model.state_dict(), "optimizer": opt.state_dict(),
                "version": 2, "metric": 0.5}, src)
    report = ckptfix.inspect(str(src))
    assert report.mapping.method == "hf-groups"
    names = report.mapping.names
    state = dict(model.named_parameters())
    for index, name in names.items():
        assert opt.state_dict()["state"][index]["exp_avg"].shape == state[name].shape
    assert len(names) == len(state) and not [f for f in report.findings if f.code == "CKF204"]


def _frameworks_real():
    """fixtures/frameworks_real.py: the checkpoints timm's and Composer's own code wrote (committed), and
    where the venvs it builds them in are."""
    path = Path(__file__).resolve().parent.parent / "fixtures" / "frameworks_real.py"
    spec = importlib.util.spec_from_file_location("frameworks_real", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_real_timm_checkpoint_maps_every_moment():
    """timm 1.0.31's own code wrote this file (fixtures/frameworks_real.py, in its own venv): a ViT from
    `timm.create_model`, AdamW from `create_optimizer_v2` after 2 steps, saved by `CheckpointSaver`. Its
    no-decay group holds the 1-D and `.bias` parameters and the model's `no_weight_decay()` names
    (`pos_embed`, `cls_token`: not 1-D), so neither split rule gives the groups; the order-preserving split
    does, and every moment is mapped to its parameter, none by the weak shape method."""
    real = _frameworks_real()
    path = real.TIMM_CKPT
    assert real.sha256(path) == real.SHA256["timm/checkpoint-0.pth.tar"]
    report = ckptfix.inspect(str(path))
    assert report.mapping.method == "hf-groups" and not [f for f in report.findings if f.code == "CKF204"]
    saved = torch.load(path, weights_only=True)
    model, groups = saved["state_dict"], saved["optimizer"]["param_groups"]
    # timm/optim/_param_groups.py `param_groups_weight_decay`, with VisionTransformer.no_weight_decay()
    no_decay = [n for n, t in model.items() if t.ndim <= 1 or n.endswith(".bias") or n in ("pos_embed", "cls_token")]
    decay = [n for n in model if n not in no_decay]
    assert groups[0]["weight_decay"] == 0 and groups[1]["weight_decay"] == 0.05
    expected = {**dict(zip(groups[0]["params"], no_decay)), **dict(zip(groups[1]["params"], decay))}
    assert report.mapping.names == expected and len(expected) == len(saved["optimizer"]["state"])


def test_two_groups_split_two_ways_is_not_guessed(tmp_path):
    """Two groups built in model order by a rule ckptfix does not know, where two interleavings fit the
    shapes (a LayerNorm's weight and bias are both [4]): no decay-group mapping is claimed."""
    model = torch.nn.Sequential(torch.nn.LayerNorm(4), torch.nn.Linear(4, 4))
    opt = torch.optim.AdamW([{"params": [model[0].weight, model[1].weight, model[1].bias], "weight_decay": 0.1},
                             {"params": [model[0].bias], "weight_decay": 0.0}], lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    src = tmp_path / "ckpt.pt"
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, src)
    report = ckptfix.inspect(str(src))
    assert report.mapping.method not in ("hf-groups", "position")
    assert "0.weight" not in report.mapping.names.values()


# Composer's fixtures: the model class, its vocab tensors (the head tied to `wte` in GPT-2)
_COMPOSER_ARCHS = {"llama": ("model.model.embed_tokens.weight", "model.lm_head.weight"),
                   "gpt2": ("model.transformer.wte.weight", "model.lm_head.weight")}


def _repair_real_composer(tmp_path, arch: str, vocab: int = NEW):
    real = _frameworks_real()
    src = real.COMPOSER_CKPTS[arch]
    assert real.sha256(src) == real.SHA256[str(src.relative_to(real.HERE / "frameworks"))]
    new = word_level_tokenizer(tmp_path / "new.json", vocab)
    out = tmp_path / "ep0-ba2-rank0.fixed.pt"
    ckptfix.repair(str(src), str(new), str(out))
    return real, src, new, out


@pytest.mark.parametrize("arch", sorted(_COMPOSER_ARCHS))
def test_real_composer_checkpoint_inspects_and_repairs(tmp_path, arch):
    """Composer 0.32.1's own Trainer wrote these files (fixtures/frameworks_real.py, in its own venv):
    HuggingFaceModel around a tiny Llama (untied) or GPT-2 (head tied to wte), 2 batches of AdamW with a
    warmup schedule, optimizer state saved under parameter names. inspect is clean of vocab findings at its
    vocab and names the vocab tensors at a larger one (GPT-2's head as tied); repair keeps every old row and
    moment bit-identical and the tie one storage, and the torch.__version__ Composer stores (a TorchVersion
    object) is written back as read."""
    real = _frameworks_real()
    embedding, head = _COMPOSER_ARCHS[arch]
    right = word_level_tokenizer(tmp_path / "right.json", real.COMPOSER_VOCAB)
    report = ckptfix.inspect(str(real.COMPOSER_CKPTS[arch]), tokenizer=str(right))
    assert report.ckpt.format == "composer" and report.mapping.method == "fqn"
    assert not [f for f in report.findings if f.severity == "error" or f.code.startswith("CKF1")]
    assert {v.name: v.tied_to for v in report.vocab} == {embedding: None, head: embedding if arch == "gpt2" else None}
    _, src, new, out = _repair_real_composer(tmp_path, arch)
    wrong = ckptfix.inspect(str(src), tokenizer=str(new))
    finding = next(f for f in wrong.findings if f.code == "CKF101")
    assert set(finding.tensors) <= {embedding, head} and embedding in finding.tensors

    old = torch.load(src, weights_only=False)["state"]
    fixed = torch.load(out, weights_only=False)["state"]
    for name, t in old["model"].items():
        back = fixed["model"][name]
        assert back.dtype == t.dtype and torch.equal(back[:t.shape[0]], t), name
        assert back.shape[0] == (NEW if name in (embedding, head) else t.shape[0])
        moments = old["optimizers"]["AdamW"]["state"]
        assert (name in moments) != (arch == "gpt2" and name == head)  # a tied head has no optimizer entry
        for key, moment in moments.get(name, {}).items():
            back = fixed["optimizers"]["AdamW"]["state"][name][key]
            assert torch.equal(back[:t.shape[0]] if back.ndim else back, moment), (name, key)
    assert fixed["schedulers"] == old["schedulers"] and fixed["timestamp"] == old["timestamp"]
    version = fixed["metadata"]["torch_version"]
    assert type(version) is type(old["metadata"]["torch_version"]) and version == old["metadata"]["torch_version"]
    assert fixed["integrations"]["huggingface"]["model"]["config"]["content"]["vocab_size"] == NEW
    tied = fixed["model"][head].untyped_storage().data_ptr() == fixed["model"][embedding].untyped_storage().data_ptr()
    assert tied == (arch == "gpt2")


@pytest.mark.parametrize("arch, vocab", [("gpt2", NEW), ("llama", NEW), ("llama", 190)])
def test_real_composer_own_trainer_resumes_the_repair(tmp_path, arch, vocab):
    """Composer's own loading code: `Trainer(load_path=<repaired file>)` with the model built at the new vocab
    (run by fixtures/frameworks_real.py in the Composer venv; skipped where that venv is not built, as in CI).
    It loads every weight and Adam moment (old rows as saved; to 190 tokens, the rows kept), resumes at batch 2 and trains batch 3 with a
    finite loss, the Adam step count carried on (3)."""
    real = _frameworks_real()
    if not real.COMPOSER_PY.exists():
        pytest.skip(f"no Composer venv at {real.COMPOSER_PY} (fixtures/frameworks_real.py says how to build it)")
    _, src, _, out = _repair_real_composer(tmp_path, arch, vocab)
    run = subprocess.run([str(real.COMPOSER_PY), str(real.HERE / "frameworks_real.py"), "composer-resume", str(out),
                          str(vocab), str(src), arch], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["old_rows_equal"] and result["rows"] == vocab and result["batch"] == 3 and result["steps"] == [3]
    assert math.isfinite(result["loss"])


def test_torchtune_recipe_state_beside_the_model_folder(tmp_path):
    """torchtune's FullModelHFCheckpointer layout (torchtune/training/checkpointing/_checkpointer.py):
    <output_dir>/epoch_0/model-00001-of-00001.safetensors (+ index, config.json) and the optimizer in
    <output_dir>/recipe_state/recipe_state.pt under 'optimizer' with seed/epochs_run/total_epochs. inspect of
    the model folder checks those moments; repair writes the repaired recipe_state.pt into OUT. The layout
    and its resume steps (optimizer.load_state_dict(ckpt['optimizer'])) are written here from its source for
    CI, where torchtune is not installed; torchtune's own checkpointer runs in the test after this one."""
    from safetensors.torch import save_file

    model = _tiny_llama(VOCAB)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt, VOCAB, 1)
    epoch = tmp_path / "out" / "epoch_0"
    epoch.mkdir(parents=True)
    model.config.save_pretrained(epoch)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(state, epoch / "model-00001-of-00001.safetensors", metadata={"format": "pt"})
    (epoch / "model.safetensors.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": {k: "model-00001-of-00001.safetensors" for k in state}}))
    (tmp_path / "out" / "recipe_state").mkdir()
    torch.save({"optimizer": opt.state_dict(), "seed": 9, "epochs_run": 1, "total_epochs": 2,
                "max_steps_per_epoch": 5}, tmp_path / "out" / "recipe_state" / "recipe_state.pt")
    tok = word_level_tokenizer(tmp_path / "tokenizer.json", NEW)

    report = ckptfix.inspect(str(epoch), tokenizer=str(tok))
    assert report.ckpt.optimizer is not None and all(v.moments for v in report.vocab if v.tied_to is None)
    out = tmp_path / "fixed"
    ckptfix.repair(str(epoch), str(tok), str(out))
    recipe = torch.load(out / "recipe_state.pt", weights_only=True)
    assert recipe["epochs_run"] == 1
    transformers = pytest.importorskip("transformers")
    resumed = transformers.AutoModelForCausalLM.from_pretrained(out)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(recipe["optimizer"])
    assert math.isfinite(_step(resumed, opt2, NEW, 2))


def test_torchtune_own_checkpointer_saves_repairs_and_resumes(tmp_path):
    """torchtune's own FullModelHFCheckpointer (where torchtune is installed: it pins torchao/torchdata builds,
    so a venv with `pip install --no-deps torchtune==0.6.1 torchdata==0.11.0 torchao==0.14.1` plus its small
    needs; skipped without it). It loads an HF Llama folder into torchtune's own `llama3` model, which trains
    2 AdamW steps; save_checkpoint(intermediate_checkpoint=True) writes epoch_0/ and recipe_state/. inspect
    of epoch_0 is clean at the right vocab and names both vocab tensors with their moments at a wrong one;
    repair to a larger tokenizer; torchtune's resume (should_load_recipe_state, checkpoint_files and
    recipe_checkpoint under output_dir) loads model and optimizer, and every moment's old rows are
    bit-identical before one finite step."""
    pytest.importorskip("torchtune")
    transformers = pytest.importorskip("transformers")
    from torchtune.models.llama3 import llama3
    from torchtune.training import FullModelHFCheckpointer

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")

    def build(vocab: int):
        return llama3(vocab_size=vocab, num_layers=2, num_heads=2, num_kv_heads=2, embed_dim=32, max_seq_len=64,
                      intermediate_dim=40)

    def step(model, opt, vocab: int, seed: int) -> float:
        ids = torch.randint(0, vocab, (2, 10), generator=torch.Generator().manual_seed(seed))
        logits = model(ids[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return float(loss.detach())

    saver = FullModelHFCheckpointer(checkpoint_dir=str(tmp_path / "base"), checkpoint_files=["model.safetensors"],
                                    model_type="LLAMA3", output_dir=str(tmp_path / "out"))
    model = build(VOCAB)
    model.load_state_dict(saver.load_checkpoint()["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step(model, opt, VOCAB, 1)
    step(model, opt, VOCAB, 2)
    saver.save_checkpoint({"model": model.state_dict(), "optimizer": opt.state_dict(), "seed": 9, "epochs_run": 1,
                           "total_epochs": 2, "max_steps_per_epoch": 2}, epoch=0, intermediate_checkpoint=True)
    epoch = tmp_path / "out" / "epoch_0"

    right = ckptfix.inspect(str(epoch), tokenizer=str(word_level_tokenizer(tmp_path / "right.json", VOCAB)))
    assert not [f.code for f in right.findings if f.severity == "error"]
    tok = word_level_tokenizer(tmp_path / "tok.json", NEW)
    wrong = ckptfix.inspect(str(epoch), tokenizer=str(tok))
    assert "CKF101" in {f.code for f in wrong.findings if f.severity == "error"}
    assert {v.name: sorted(v.moments) for v in wrong.vocab} == {
        "model.embed_tokens.weight": ["exp_avg", "exp_avg_sq"], "lm_head.weight": ["exp_avg", "exp_avg_sq"]}
    (tmp_path / "resume").mkdir()
    ckptfix.repair(str(epoch), str(tok), str(tmp_path / "resume" / "epoch_0"))

    loader = FullModelHFCheckpointer(
        checkpoint_dir=str(tmp_path / "base"), checkpoint_files=["epoch_0/model-00001-of-00001.safetensors"],
        model_type="LLAMA3", output_dir=str(tmp_path / "resume"), should_load_recipe_state=True,
        recipe_checkpoint="epoch_0/recipe_state.pt")
    state = loader.load_checkpoint()
    resumed = build(NEW)
    resumed.load_state_dict(state["model"], strict=True)
    opt2 = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
    opt2.load_state_dict(state["optimizer"])
    assert state["epochs_run"] == 1
    assert torch.equal(resumed.output.weight[:VOCAB], model.output.weight)
    assert torch.equal(resumed.tok_embeddings.weight[:VOCAB], model.tok_embeddings.weight)
    for (name, p), q in zip(model.named_parameters(), resumed.parameters()):
        for key in ("exp_avg", "exp_avg_sq"):
            old = opt.state[p][key]
            assert torch.equal(opt2.state[q][key][:old.shape[0]], old), (name, key)
    assert math.isfinite(step(resumed, opt2, NEW, 3))


@pytest.mark.lightning
def test_lightning_hyper_parameters_follow_the_rows(tmp_path):
    """A LightningModule that records its vocab_size with save_hyperparameters(): after repair,
    Lightning's own `load_from_checkpoint` rebuilds it at the new size from hyper_parameters."""
    L = pytest.importorskip("lightning")

    class Lit(L.LightningModule):
        def __init__(self, vocab_size: int = VOCAB):
            super().__init__()
            self.save_hyperparameters()
            self.embed = torch.nn.Embedding(vocab_size, 16)
            self.head = torch.nn.Linear(16, vocab_size)

        def training_step(self, batch, batch_idx):
            (ids,) = batch
            logits = self.head(self.embed(ids[:, :-1]))
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, VOCAB, (8, 9))), batch_size=4)
    t = L.Trainer(max_steps=2, accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)
    t.fit(Lit(), data)
    src = tmp_path / "last.ckpt"
    t.save_checkpoint(src)
    tok = word_level_tokenizer(tmp_path / "tok.json", NEW)
    out = tmp_path / "fixed.ckpt"
    ckptfix.repair(str(src), str(tok), str(out))
    module = Lit.load_from_checkpoint(out, weights_only=True)
    assert module.hparams.vocab_size == NEW and module.head.weight.shape == (NEW, 16)


class _LitGPTVocab(torch.nn.Module):
    """litgpt.model.GPT's vocab modules under its names (`transformer.wte`, `lm_head`, both padded_vocab_size
    rows), for where litgpt is not installed (it pins a huggingface_hub older than transformers 5 needs)."""

    def __init__(self, padded_vocab_size: int, n_embd: int = 32, **_):
        super().__init__()
        self.lm_head = torch.nn.Linear(n_embd, padded_vocab_size, bias=False)
        self.transformer = torch.nn.ModuleDict({"wte": torch.nn.Embedding(padded_vocab_size, n_embd),
                                                "ln_f": torch.nn.LayerNorm(n_embd)})

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer["ln_f"](self.transformer["wte"](ids)))


def _litgpt_parts():
    """(build model from a model_config.yaml path, write model_config.yaml): litgpt's own `Config.from_file`,
    `GPT` and `save_config` when importable, else the same steps written from litgpt/config.py and utils.py
    (`yaml.dump(asdict(config))`; `Config(**yaml.safe_load(...))` sets padded_vocab_size from its multiple)."""
    try:
        from litgpt import GPT, Config
        from litgpt.utils import save_config
    except ImportError:
        import yaml

        def build(path):
            cfg = yaml.safe_load(path.read_text())
            return _LitGPTVocab(cfg["padded_vocab_size"], cfg["n_embd"]), cfg["vocab_size"]

        def write(folder, vocab_size, multiple):
            padded = -(-vocab_size // multiple) * multiple
            cfg = {"name": "tiny", "hf_config": {"name": "tiny", "org": "none"}, "n_embd": 32, "n_layer": 2,
                   "norm_eps": 1e-5, "padded_vocab_size": padded, "padding_multiple": multiple,
                   "rope_indices": None, "vocab_size": vocab_size}
            (folder / "model_config.yaml").write_text(yaml.dump(cfg))
            return _LitGPTVocab(padded)

        return build, write, False

    def build(path):
        cfg = Config.from_file(path)
        return GPT(cfg), cfg.vocab_size

    def write(folder, vocab_size, multiple):
        cfg = Config(name="tiny", block_size=32, vocab_size=vocab_size, padding_multiple=multiple, n_layer=2,
                     n_head=2, n_embd=32)
        save_config(cfg, folder)
        return GPT(cfg)

    return build, write, True


def _lit_step(fabric, model, opt, vocab: int, seed: int) -> float:
    ids = torch.randint(0, vocab, (2, 16), generator=torch.Generator().manual_seed(seed))
    loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    fabric.backward(loss)
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


def litgpt_checkpoint(tmp_path: Path):
    """(fabric, model, folder): litgpt's `step-000002/` after one real AdamW step, as `fabric.save` writes it
    (`lit_model.pth` with model, optimizer, iter_num, step_count) beside `model_config.yaml`."""
    from lightning.fabric import Fabric

    _, write, _ = _litgpt_parts()
    fabric = Fabric(accelerator="cpu", devices=1)
    src = tmp_path / "step-000002"
    src.mkdir()
    torch.manual_seed(0)
    model = fabric.setup(write(src, VOCAB, 64))
    opt = fabric.setup_optimizers(torch.optim.AdamW(model.parameters(), lr=1e-3))
    _lit_step(fabric, model, opt, VOCAB, 1)
    fabric.save(src / "lit_model.pth", {"model": model, "optimizer": opt, "iter_num": 2, "step_count": 2})
    return fabric, model, src


@pytest.mark.lightning
@pytest.mark.parametrize("new", [300, 216])
def test_litgpt_folder_model_config_follows_the_rows(tmp_path, new):
    """litgpt's training checkpoint (finetune/full.py, pretrain.py): `fabric.save(step-N/lit_model.pth,
    {"model", "optimizer", "iter_num", "step_count"})` and `model_config.yaml` beside it. Repair updates the
    recorded `padded_vocab_size` (the rows) and `vocab_size` (the tokenizer's); litgpt's resume rebuilds
    the model from model_config.yaml and `fabric.load`s the state, then trains a step."""
    build, _, real = _litgpt_parts()
    fabric, model, src = litgpt_checkpoint(tmp_path)
    before = (src / "model_config.yaml").read_text()
    tok = word_level_tokenizer(tmp_path / "tok.json", new)

    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert report.ckpt.format == "litgpt" and report.ckpt.optimizer is not None
    assert {"transformer.wte.weight", "lm_head.weight"} <= {v.name for v in report.vocab}
    file_fixes = [f.fix for f in ckptfix.inspect(str(src / "lit_model.pth"), tokenizer=str(tok)).findings if f.fix]
    assert all("repair the folder" in f for f in file_fixes if "ckptfix" in f)  # not a fix that leaves the yaml stale
    out = tmp_path / "fixed"
    ckptfix.repair(str(src), str(tok), str(out))
    after = (out / "model_config.yaml").read_text()
    rows = 256 if new <= 256 else -(-new // 64) * 64  # litgpt's padding_multiple, as Config.__post_init__ pads
    changed = {a: b for a, b in zip(before.splitlines(), after.splitlines()) if a != b}
    assert set(changed.values()) <= {f"padded_vocab_size: {rows}", f"vocab_size: {new}"} and changed
    assert len(before.splitlines()) == len(after.splitlines())

    resumed, vocab_size = build(out / "model_config.yaml")
    assert vocab_size == new
    resumed = fabric.setup(resumed)
    opt2 = fabric.setup_optimizers(torch.optim.AdamW(resumed.parameters(), lr=1e-3))
    state = {"model": resumed, "optimizer": opt2, "iter_num": 0, "step_count": 0}
    fabric.load(out / "lit_model.pth", state)  # strict: every key of state must be in the checkpoint
    assert state["iter_num"] == 2
    assert torch.equal(resumed.lm_head.weight[:256].detach(), model.lm_head.weight[:256].detach())
    assert math.isfinite(_lit_step(fabric, resumed, opt2, new, 2))
    assert not [f for f in ckptfix.inspect(str(out), tokenizer=str(tok)).findings if f.severity == "error"]
    if real:
        print("litgpt: its own Config/GPT/save_config")


@pytest.mark.lightning
def test_litgpt_wrong_padded_vocab_size_is_reported(tmp_path):
    _, write, _ = _litgpt_parts()
    torch.save({"model": write(tmp_path, VOCAB, 64).state_dict()}, tmp_path / "lit_model.pth")
    text = (tmp_path / "model_config.yaml").read_text()
    (tmp_path / "model_config.yaml").write_text(text.replace("padded_vocab_size: 256", "padded_vocab_size: 320"))
    report = ckptfix.inspect(str(tmp_path))
    assert [f.message for f in report.findings if f.code == "CKF115"] == [
        "the checkpoint records model_config.yaml.padded_vocab_size = 320, but its vocab tensors have 256 rows"]


def _word_level(path, tokens: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token=tokens[0]))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


@pytest.mark.peft
def test_peft_trainable_token_indices_are_tied_to_their_tokens(tmp_path):
    """PEFT >= 0.15 `LoraConfig(trainable_token_indices=[...])` trains only those rows of the embedding and
    saves them as `embed_tokens.token_adapter.trainable_tokens_delta` (one row per id). inspect reads them as
    rows of those token ids: clean while the tokenizer keeps the ids, CKF111 when it shrank below them,
    CKF112 when the old tokenizer is known and the tokens moved. Repair does not rewrite them: it refuses in
    one line, and inspect prints that reason, never a repair command."""
    peft = pytest.importorskip("peft")
    tokens = ["<unk>", *(f"t{i}" for i in range(1, VOCAB))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = peft.get_peft_model(_tiny_llama(VOCAB), peft.LoraConfig(
            r=4, target_modules=["q_proj", "v_proj"], trainable_token_indices=[200, 201, 202]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _step(model, opt, VOCAB, 1)
    src = tmp_path / "adapter"
    model.save_pretrained(src)
    old = _word_level(tmp_path / "old.json", tokens)
    grown = _word_level(tmp_path / "grown.json", tokens + [f"new{i}" for i in range(13)])
    shrunk = _word_level(tmp_path / "shrunk.json", tokens[:150])
    moved = tokens[:5] + ["t200"] + tokens[6:200] + ["t5"] + tokens[201:]  # t5 and t200 swap ids
    swapped = _word_level(tmp_path / "swapped.json", moved)

    def codes(tok, **kw):
        report = ckptfix.inspect(str(src), tokenizer=str(tok), **kw)
        assert not [f.fix for f in report.findings if " -o " in f.fix]  # no `ckptfix repair SRC ... -o OUT` command
        return {f.code: f for f in report.findings}

    assert not {"CKF111", "CKF112"} & set(codes(grown, from_tokenizer=str(old)))
    short = codes(shrunk)["CKF111"]
    assert "token ids 200, 201, 202" in short.message and "repair cannot fix this" in short.fix
    assert short.tensors == ["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"]
    assert "'t200' 200 -> 5" in codes(swapped, from_tokenizer=str(old))["CKF112"].message
    for tok in (grown, shrunk, swapped):
        with pytest.raises(ckptfix.CkptfixError, match="trainable_token_indices") as err:
            ckptfix.repair(str(src), str(tok), str(tmp_path / "out"))
        assert "\n" not in str(err.value) and not (tmp_path / "out").exists()

    # Read right: the adapter's rows are those ids' rows, and load onto the base grown for the new tokens.
    base = _tiny_llama(VOCAB)
    base.resize_token_embeddings(VOCAB + 13, mean_resizing=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = peft.PeftModel.from_pretrained(base, str(src), is_trainable=True)
    merged = resumed.get_input_embeddings()(torch.tensor([200, 201, 202]))
    assert torch.equal(merged.detach(), model.get_input_embeddings()(torch.tensor([200, 201, 202])).detach())


def _lightning_mp(*args: str) -> dict:
    return _run_factory("lightning_mp_factory.py", *args)


@pytest.mark.lightning
def test_lightning_model_parallel_checkpoint_repairs_and_resumes(tmp_path):
    """Lightning's own ModelParallelStrategy (FSDP2, one CPU rank) writes its DCP folder and meta.pt; ckptfix
    reads the optimizer and the schedule, repair grows the rows and moments and sets meta.pt's
    hyper_parameters.vocab_size, and `Trainer.fit(ckpt_path=...)` resumes from it for a finite step."""
    from ckptfix.formats import read_checkpoint

    src, out = tmp_path / "ckpt", tmp_path / "fixed"
    saved = _lightning_mp("save", str(src), str(VOCAB))
    tok = word_level_tokenizer(tmp_path / "tok.json", NEW)
    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert report.ckpt.format == "dcp" and report.ckpt.optimizer is not None and report.ckpt.scheduler is not None
    assert {v.name for v in report.vocab} == {"emb.weight", "head.weight", "head.bias"}
    assert all(set(v.moments) == {"exp_avg", "exp_avg_sq"} for v in report.vocab)
    assert "CKF101" in {f.code for f in report.findings}
    ckptfix.repair(str(src), str(tok), str(out))

    fixed = read_checkpoint(str(out))
    assert fixed.extras["meta.pt:hyper_parameters"]["vocab_size"] == NEW
    emb = fixed.model["emb.weight"].read()
    assert emb.shape == (NEW, 16) and emb[:VOCAB, :4].tolist() == saved["rows"]
    resumed = _lightning_mp("resume", str(out), str(NEW))
    assert resumed["global_step"] == saved["global_step"] + 1 and resumed["finite"]
    assert resumed["adam_steps"] == [saved["global_step"] + 1] * 3  # Adam's state came back, and stepped once
    assert resumed["lr"] == pytest.approx(1e-2 / (saved["global_step"] + 2))  # the schedule carried on


def _run_factory(script: str, *args: str) -> dict:
    import os
    import sys
    from pathlib import Path

    from procs import run

    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here.parent), os.environ.get("PYTHONPATH", "")])}
    proc = run([sys.executable, str(here / script), *args], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.long
def test_torchtitan_checkpoint_manager_saves_repairs_and_loads(tmp_path):
    """torchtitan's own CheckpointManager (where torchtitan is installed: see tests/torchtitan_factory.py)
    saves step-2, ckptfix finds the moments under `optimizer.state.<fqn>`, repairs, and `ckm.load(step=2)`
    of the repaired folder resumes Adam and the schedule for a finite step."""
    pytest.importorskip("torchtitan")
    from ckptfix.formats import read_checkpoint

    base, fixed = tmp_path / "run", tmp_path / "fixed"
    saved = _run_factory("torchtitan_factory.py", "save", str(base), str(VOCAB))
    src = base / "checkpoint" / "step-2"
    tok = word_level_tokenizer(tmp_path / "tok.json", NEW)
    report = ckptfix.inspect(str(src), tokenizer=str(tok))
    assert {v.name for v in report.vocab} == {"tok_embeddings.weight", "output.weight"}
    assert all(set(v.moments) == {"exp_avg", "exp_avg_sq"} for v in report.vocab)
    (fixed / "checkpoint").mkdir(parents=True)
    ckptfix.repair(str(src), str(tok), str(fixed / "checkpoint" / "step-2"))
    emb = read_checkpoint(str(fixed / "checkpoint" / "step-2")).model["tok_embeddings.weight"].read()
    assert emb.shape == (NEW, 16) and emb[:VOCAB, :3].tolist() == saved["rows"]
    resumed = _run_factory("torchtitan_factory.py", "resume", str(fixed), str(NEW), "2")
    assert resumed["loaded"] and resumed["step"] == 3 and resumed["finite"] and resumed["adam_steps"] == [3.0]
