"""Checkpoints that `torch.load(weights_only=True)` refuses, written by the real libraries' own saving code.

For each: torch's default load fails on the input; `ckptfix inspect` names the globals and where they sit
(CKF704) without importing or calling anything; `ckptfix convert` writes a copy that loads with
weights_only=True, every tensor bit-identical; the framework resumes from the copy where it can; and the
`add_safe_globals` line CKF704 prints is exact (torch then loads the original).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from procs import NO_SHM_BUILD, run
from torch import nn

import ckptfix
from ckptfix.errors import RepairError, UnsafePickle
from ckptfix.formats.data_globals import TORCH_WEIGHTS_ONLY_GLOBALS, torch_refuses

REPO = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}


# --- helpers ---------------------------------------------------------------------------------------

def tensors_in(obj, path="", out=None, seen=None):
    """Every tensor (and numpy array, as bytes) in a fully loaded object, by path: dicts, sequences, and the
    `__dict__` of objects (a Namespace, a LossScaler), as ckptfix converts them."""
    out = {} if out is None else out
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return out
    seen.add(id(obj))

    def join(k):
        return f"{path}.{k}" if path else str(k)

    if isinstance(obj, torch.Tensor):
        out[path] = obj
    elif isinstance(obj, np.ndarray) and obj.dtype.name in ("float32", "float64", "int64", "uint8"):
        out[path] = torch.from_numpy(np.ascontiguousarray(obj))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensors_in(v, join(k), out, seen)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensors_in(v, join(i), out, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for k, v in vars(obj).items():
            tensors_in(v, join(k), out, seen)
    return out


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().reshape(-1).contiguous().view(torch.uint8), b.detach().reshape(-1).contiguous().view(torch.uint8))


def roundtrip(src, out, expect_paths: dict[str, str]) -> tuple[ckptfix.Report, object]:
    """The contract of issue 21 on one real file; returns the inspect report and the converted checkpoint."""
    src, out = str(src), str(out)
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        torch.load(src, weights_only=True)
    report = ckptfix.inspect(src)
    codes = [f.code for f in report.findings]
    assert "CKF704" in codes and "CKF705" not in codes, codes
    objects = {o["path"]: o for o in report.to_json()["weights_only"]["objects"]}
    for path, cls in expect_paths.items():  # ckptfix names each global and where it sits
        assert objects[path]["class"] == cls and objects[path]["torch_weights_only_refuses"], objects.get(path)
    finding = next(f for f in report.findings if f.code == "CKF704")
    assert "torch.load(weights_only=True) refuses this file because of" in finding.message
    assert f"ckptfix convert {src} -o" in finding.fix

    result = ckptfix.convert(src, out)
    assert result.output == out and result.conversions
    converted = torch.load(out, weights_only=True)
    original = torch.load(src, weights_only=False)
    before, after = tensors_in(original), tensors_in(converted)
    assert before and set(before) <= set(after)
    for path, tensor in before.items():
        assert same_bits(tensor, after[path]), path
    assert converted["ckptfix"]["weights_only_conversions"] == [c.to_json() for c in result.conversions]
    assert [f.code for f in ckptfix.inspect(out).findings if f.code in ("CKF704", "CKF705")] == []

    line = finding.fix.split("if you trust the file: ", 1)[1]
    try:
        exec(line, {})  # noqa: S102 - the exact fix CKF704 prints: torch then loads the original
        torch.load(src, weights_only=True)
    finally:
        torch.serialization.clear_safe_globals()
    return report, converted


# --- torch's allowlist -----------------------------------------------------------------------------

def test_the_encoded_allowlist_is_the_installed_torchs():
    from torch._weights_only_unpickler import _get_allowed_globals

    assert set(_get_allowed_globals()) == TORCH_WEIGHTS_ONLY_GLOBALS


def test_refusal_agrees_with_torchs_own_scan(tmp_path):
    obj = {"model": {"w": torch.ones(2)}, "args": argparse.Namespace(p=pathlib.PurePosixPath("/a")), "od": {1: {2}},
           "n": np.float32(1.0)}
    torch.save(obj, tmp_path / "x.pth")
    theirs = set(torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "x.pth"))
    ours = set(ckptfix.inspect(tmp_path / "x.pth").to_json()["weights_only"]["refused_globals"])
    # torch's scan lists the GLOBAL opcodes; ckptfix adds the dtype class BUILD needs (numpy.dtypes.Float32DType)
    assert theirs <= ours and ours - theirs == {"numpy.dtypes.Float32DType"}
    assert not torch_refuses("collections.OrderedDict") and torch_refuses("argparse.Namespace")


# --- timm: CheckpointSaver ---------------------------------------------------------------------------

def timm_args() -> argparse.Namespace:
    """A real argparse.Namespace shaped like timm's train.py arguments."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="resnet18")
    parser.add_argument("--lr", type=float, default=None)
    parser.add_argument("--epochs", type=int, default=300)
    parser.add_argument("--mean", type=float, nargs="+", default=None)
    parser.add_argument("--output", type=pathlib.Path, default=pathlib.Path("/runs/out"))
    parser.add_argument("--amp", action="store_true")
    return parser.parse_args(["--lr", "0.05", "--mean", "0.5", "0.5", "0.5", "--amp"])


def test_timm_checkpoint_saver_layout(tmp_path):
    """timm needs torchvision, which would replace this torch (`pip install --dry-run timm`), so the dict is
    built as timm/utils/checkpoint_saver.py `CheckpointSaver._save` builds it (epoch, arch = args.model,
    optimizer, version 2, args, the amp scaler under its `state_dict_key`, state_dict, metric), with a
    real argparse.Namespace, and saved with torch.save as timm does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    args = timm_args()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    save_state = {"epoch": 3, "arch": args.model, "optimizer": opt.state_dict(), "version": 2, "args": args,
                  "amp_scaler": scaler.state_dict(), "state_dict": model.state_dict(), "metric": 71.25}
    torch.save(save_state, tmp_path / "last.pth.tar")
    _, out = roundtrip(tmp_path / "last.pth.tar", tmp_path / "last.wo.pth.tar",
                       {"args": "argparse.Namespace"})
    assert out["args"] == {**vars(args), "output": "/runs/out"}  # a Namespace becomes a dict of its fields
    # timm's resume_checkpoint (timm/models/_helpers.py), on the converted file loaded with weights_only=True
    fresh = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05, momentum=0.9)
    fresh.load_state_dict(out["state_dict"])
    fresh_opt.load_state_dict(out["optimizer"])
    scaler2 = torch.amp.GradScaler("cpu")
    scaler2.load_state_dict(out["amp_scaler"])
    resume_epoch = out["epoch"] + 1 if out.get("version", 1) > 1 else out["epoch"]
    assert resume_epoch == 4 and scaler2.get_scale() == 1024.0
    assert argparse.Namespace(**out["args"]).lr == 0.05  # what a loop doing ckpt['args'].lr changes to


# --- Lightning: a numpy metric in a callback's state ------------------------------------------------

try:
    import lightning.pytorch as L
except ImportError:  # the Lightning test skips
    L = None

if L is not None:
    class BestScore(L.Callback):
        """A user callback that keeps its best metric as numpy (np.mean of a history), as many do."""

        def __init__(self):
            self.best_model_score, self.history = None, np.zeros(0)

        def on_train_epoch_end(self, trainer, module):
            self.history = np.append(self.history, float(trainer.callback_metrics["loss"]))
            self.best_model_score = np.float64(self.history.min())

        def state_dict(self):
            return {"best_model_score": self.best_model_score, "history": self.history}

        def load_state_dict(self, state):
            self.best_model_score, self.history = state["best_model_score"], np.asarray(state["history"])

    class Tiny(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, _):
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            data = torch.utils.data.TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(0)))
            return torch.utils.data.DataLoader(data, batch_size=4)


def test_lightning_numpy_metric_in_a_callback_state(tmp_path):
    if L is None:
        pytest.skip("lightning is not installed")

    def trainer(epochs, cb):
        return L.Trainer(max_epochs=epochs, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, callbacks=[cb])

    torch.manual_seed(0)
    t = trainer(2, BestScore())
    t.fit(Tiny())
    t.save_checkpoint(tmp_path / "epoch=1.ckpt")
    _, out = roundtrip(tmp_path / "epoch=1.ckpt", tmp_path / "epoch=1.wo.ckpt",
                       {"callbacks.BestScore.best_model_score": "numpy._core.multiarray.scalar",
                        "callbacks.BestScore.history": "numpy._core.multiarray._reconstruct"})
    state = out["callbacks"]["BestScore"]
    assert isinstance(state["best_model_score"], float) and isinstance(state["history"], torch.Tensor)
    cb = BestScore()
    t2 = trainer(3, cb)
    t2.fit(Tiny(), ckpt_path=str(tmp_path / "epoch=1.wo.ckpt"))  # Lightning resumes from the converted file
    assert t2.current_epoch == 3 and len(cb.history) == 3


# --- HF Trainer: rng_state.pth ------------------------------------------------------------------------

def test_hf_trainer_rng_state(tmp_path):
    hf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = hf.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32)
    ids = torch.randint(0, 64, (8, 12), generator=torch.Generator().manual_seed(0))
    args = hf.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, save_steps=2, report_to=[],
                                use_cpu=True, per_device_train_batch_size=4, logging_strategy="no",
                                disable_tqdm=True, dataloader_num_workers=0)
    trainer = hf.Trainer(model=hf.GPT2LMHeadModel(cfg), args=args,
                         train_dataset=[{"input_ids": r, "labels": r} for r in ids])
    trainer.train()
    folder = tmp_path / "run" / "checkpoint-2"
    src = folder / "rng_state.pth"
    _, out = roundtrip(src, tmp_path / "rng_state.pth", {"numpy.1": "numpy._core.multiarray._reconstruct"})
    assert isinstance(out["numpy"][1], list) and len(out["numpy"][1]) == 624  # uint32: torch.save has no storage
    truth = torch.load(src, weights_only=False)
    os.replace(tmp_path / "rng_state.pth", src)  # the converted file in the checkpoint folder
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    trainer._load_rng_state(str(folder))  # the Trainer's own resume code, weights_only=True
    assert random.getstate() == truth["python"]
    assert np.random.get_state()[1].tolist() == truth["numpy"][1].tolist()
    assert np.random.get_state()[2:] == truth["numpy"][2:]
    assert same_bits(torch.get_rng_state(), truth["cpu"])


# --- accelerate: save_state's random states --------------------------------------------------------

def test_accelerate_random_states(tmp_path):
    accelerate = pytest.importorskip("accelerate")
    acc = accelerate.Accelerator(cpu=True)
    model = acc.prepare(nn.Linear(4, 2))
    acc.save_state(str(tmp_path / "state"))
    src = tmp_path / "state" / "random_states_0.pkl"
    roundtrip(src, tmp_path / "random_states_0.pkl", {"numpy_random_seed.1": "numpy._core.multiarray._reconstruct"})
    truth = torch.load(src, weights_only=False)
    os.replace(tmp_path / "random_states_0.pkl", src)
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    acc.load_state(str(tmp_path / "state"))  # accelerate's own loader restores every generator from the copy
    assert random.getstate() == truth["random_state"]
    assert np.random.get_state()[1].tolist() == truth["numpy_random_seed"][1].tolist()
    assert same_bits(torch.get_rng_state(), truth["torch_manual_seed"])
    assert model is not None


# --- omegaconf -------------------------------------------------------------------------------------

def test_omegaconf_config_in_a_checkpoint(tmp_path):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"model": {"dim": 8, "act": "gelu"}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
                                      "run": {"name": "x", "lr_copy": "${optim.lr}", "missing": "???"}})
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    torch.save({"state_dict": model.state_dict(), "cfg": cfg}, tmp_path / "last.pt")  # NeMo / Lightning-Hydra style
    _, out = roundtrip(tmp_path / "last.pt", tmp_path / "last.wo.pt", {"cfg": "omegaconf.dictconfig.DictConfig"})
    assert out["cfg"] == {"model": {"dim": 8, "act": "gelu"}, "optim": {"lr": 3e-4, "betas": [0.9, 0.95]},
                          "run": {"name": "x", "lr_copy": "${optim.lr}", "missing": "???"}}
    again = omegaconf.OmegaConf.create(out["cfg"])  # interpolations still resolve
    assert again.run.lr_copy == 3e-4 and omegaconf.OmegaConf.is_missing(again.run, "missing")


# --- DeepSpeed: LossScaler in a ZeRO optimizer state -----------------------------------------------

_DS = NO_SHM_BUILD + textwrap.dedent("""
    import os, sys, torch, deepspeed
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    for _ in range(2):
        engine.backward(engine(torch.randn(2, 4)).pow(2).mean())
        engine.step()
    engine.save_checkpoint(sys.argv[1], tag="step2")
""")


@pytest.mark.deepspeed
def test_deepspeed_loss_scaler(tmp_path):
    pytest.importorskip("deepspeed")
    env = {**ENV, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000), "RANK": "0",
           "LOCAL_RANK": "0", "WORLD_SIZE": "1", "DS_ACCELERATOR": "cpu"}
    proc = run([sys.executable, "-c", _DS, str(tmp_path / "ds")], env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    src = tmp_path / "ds" / "step2" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    report, out = roundtrip(src, tmp_path / "optim_states.pt",
                            {"optimizer_state_dict.loss_scaler": "deepspeed.runtime.fp16.loss_scaler.LossScaler"})
    scaler = out["optimizer_state_dict"]["loss_scaler"]
    truth = vars(torch.load(src, weights_only=False)["optimizer_state_dict"]["loss_scaler"])
    assert scaler == truth  # every field of the LossScaler kept (cur_scale, dynamic, ...)
    # DeepSpeed's engine.load_checkpoint loads with weights_only=False and restores the LossScaler object
    # itself (stage_1_and_2: `self.loss_scaler = sd.get('loss_scaler', ...)`): the copy is for readers
    # that use torch.load(weights_only=True), not for the engine, which keeps the original.


# --- what is never converted ------------------------------------------------------------------------

class _Payload:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_code_is_never_converted(tmp_path):
    torch.save({"w": torch.ones(2), "args": argparse.Namespace(lr=1.0), "hook": _Payload()}, tmp_path / "evil.pth")
    with pytest.raises(UnsafePickle, match=r"would call posix\.system\('echo pwned'\)"):
        ckptfix.inspect(tmp_path / "evil.pth")
    with pytest.raises(UnsafePickle):
        ckptfix.convert(tmp_path / "evil.pth", tmp_path / "out.pth")
    assert sorted(os.listdir(tmp_path)) == ["evil.pth"]
    r = subprocess.run([sys.executable, "-m", "ckptfix.cli", "convert", str(tmp_path / "evil.pth"), "-o",
                        str(tmp_path / "o.pth")], env=ENV, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "posix.system('echo pwned')" in r.stderr and r.stderr.count("\n") == 1
    assert sorted(os.listdir(tmp_path)) == ["evil.pth"]


def test_malicious_corpus_is_never_converted(tmp_path):
    """Every corpus file with a code-running global: convert exits 2 (in-process: UnsafePickle or another
    CkptfixError) and writes nothing; the sentinel a payload would create never appears."""
    sys.path.insert(0, str(REPO / "tests"))
    from malicious_corpus import generate

    sentinel = tmp_path / "SENTINEL"
    cases = [c for c in generate(tmp_path / "corpus", sentinel) if c.evil and c.tokenizer is None]
    assert len(cases) >= 10
    for case in cases:
        out = tmp_path / "out.pth"
        with pytest.raises(ckptfix.CkptfixError):
            ckptfix.convert(case.path, out)
        assert not out.exists() and not sentinel.exists(), case.name


class Custom:
    """A class whose pickled state only it can interpret (a list, through __getstate__)."""

    def __init__(self):
        self.x = 1

    def __getstate__(self):
        return [self.x]

    def __setstate__(self, state):
        self.x = state[0]


def test_object_arrays_and_custom_state_are_not_guessed(tmp_path):
    torch.save({"model": {"w": torch.ones(1)}, "objs": np.array([{"a": 1}], dtype=object), "c": Custom()}, tmp_path / "x.pth")
    report = ckptfix.inspect(tmp_path / "x.pth")
    assert {f.code for f in report.findings} >= {"CKF704", "CKF705"}
    with pytest.raises(RepairError, match="not convertible"):
        ckptfix.convert(tmp_path / "x.pth", tmp_path / "o.pth")
    assert not (tmp_path / "o.pth").exists()


def test_cli_convert_and_inspect(tmp_path):
    torch.save({"w": torch.arange(3.0), "args": timm_args()}, tmp_path / "a.pth")
    run = lambda *a: subprocess.run([sys.executable, "-m", "ckptfix.cli", *map(str, a)], env=ENV,  # noqa: E731
                                    capture_output=True, text=True, timeout=60)
    r = run("inspect", tmp_path / "a.pth")
    assert r.returncode == 0 and "CKF704" in r.stdout and "argparse.Namespace" in r.stdout
    r = run("convert", tmp_path / "a.pth", "--dry-run")
    assert r.returncode == 0 and "args  argparse.Namespace -> dict" in r.stdout and "would write" not in r.stdout
    r = run("convert", tmp_path / "a.pth", "-o", tmp_path / "b.pth")
    assert r.returncode == 0 and "loads with torch.load(weights_only=True)" in r.stdout
    assert torch.load(tmp_path / "b.pth", weights_only=True)["args"]["lr"] == 0.05
    r = run("convert", tmp_path / "a.pth", "-o", tmp_path / "b.pth")
    assert r.returncode == 2 and "already exists" in r.stderr
    r = run("convert", tmp_path / "b.pth", "-o", tmp_path / "c.pth")
    assert r.returncode == 0 and "nothing to convert" in r.stdout and not (tmp_path / "c.pth").exists()
