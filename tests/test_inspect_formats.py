"""`ckptfix inspect` across the ways real code saves checkpoints: key spellings, bare state dicts,
schedulers and optimizers of every family, safetensors files, and a folder written by transformers.Trainer."""

from __future__ import annotations

import itertools
import json
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ckpt_factory import TinyLM, lm_loss, make_batches, new_run, save_checkpoint, train

import ckptfix
from ckptfix.render import render_report

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")]



@pytest.fixture(scope="module")
def run():
    return train(new_run(1000, dim=8), 5)


def inspect_json(path, **kw) -> dict:
    report = ckptfix.inspect(path, **kw)
    render_report(report)  # the text renderer copes with whatever the JSON holds
    return json.loads(json.dumps(report.to_json(), allow_nan=False))


# ------------------------------------------------------------------------------------ torch.save dicts


@pytest.mark.parametrize("model_key, optim_key, sched_key, scaler_key", list(itertools.product(
    ("model", "state_dict", "model_state_dict", "module"), ("optimizer", "optimizer_state_dict", "optim"),
    ("scheduler", "lr_scheduler"), ("scaler", "grad_scaler"))))
def test_key_spellings(tmp_path, run, model_key, optim_key, sched_key, scaler_key):
    keys = {"model": model_key, "optimizer": optim_key, "scheduler": sched_key, "scaler": scaler_key}
    data = inspect_json(save_checkpoint(run, tmp_path / "ckpt.pth", keys=keys))
    assert data["model"]["section"] == model_key and data["model"]["tensors"] == 16
    assert data["optimizer"]["section"] == optim_key and data["optimizer"]["type"] == "AdamW"
    assert data["optimizer"]["mapping"] == "position" and data["optimizer"]["step"] == 5
    assert data["scheduler"]["section"] == sched_key and data["scheduler"]["last_epoch"] == 5
    assert data["scaler"]["section"] == scaler_key and data["scaler"]["scale"] == 65536.0
    assert data["extras"] == {"epoch": 1, "step": 5}
    assert data["findings"] == []


def test_bare_state_dict(tmp_path, run):
    torch.save(run.model.state_dict(), tmp_path / "weights.pt")
    data = inspect_json(tmp_path / "weights.pt")
    assert data["format"] == "torch" and data["model"]["section"] == ""
    assert data["model"]["tensors"] == 16 and data["model"]["parameters"] == sum(
        p.numel() for p in run.model.parameters())
    assert data["optimizer"] is None and data["scheduler"] is None and data["scaler"] is None
    assert [t["name"] for t in data["vocab"]["tensors"]] == ["text_embedding.weight", "text_head.weight"]
    assert data["extras"] == {} and data["findings"] == []


def test_onecycle_scheduler(tmp_path):
    run = train(new_run(1000, dim=8, scheduler="onecycle", total_steps=50), 5)
    data = inspect_json(save_checkpoint(run, tmp_path / "ckpt.pth"))
    sched = data["scheduler"]
    assert sched["type"] == "OneCycleLR" and sched["total_steps"] == 50 and sched["last_epoch"] == 5
    assert sched["last_lr"] == pytest.approx(run.scheduler.get_last_lr())
    assert data["optimizer"]["param_groups"][0]["lr"] == pytest.approx(run.optimizer.param_groups[0]["lr"])
    assert data["findings"] == []


def _optimizer_checkpoint(tmp_path, make, steps: int = 2) -> Path:
    torch.manual_seed(0)
    model = TinyLM(100, 8)
    opt = make(model.parameters())
    for ids in make_batches(100, steps):
        opt.zero_grad()
        lm_loss(model, ids).backward()
        opt.step()
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "ckpt.pth")
    return tmp_path / "ckpt.pth"


@pytest.mark.parametrize("make, kind, state_keys", [
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "SGD (momentum)", {"momentum_buffer"}),
    (lambda p: torch.optim.SGD(p, lr=0.1), "SGD", set()),
    (lambda p: torch.optim.Adam(p, lr=1e-3), "Adam", {"exp_avg", "exp_avg_sq"}),
    (lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1), "Adam", {"exp_avg", "exp_avg_sq"}),  # L2, not AdamW
    (lambda p: torch.optim.AdamW(p, lr=1e-3), "AdamW", {"exp_avg", "exp_avg_sq"}),
    (lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.0), "AdamW", {"exp_avg", "exp_avg_sq"}),
    (lambda p: torch.optim.Adagrad(p), "Adagrad", {"sum"}),
    (lambda p: torch.optim.RMSprop(p), "RMSprop", {"square_avg"}),
], ids=["sgd-momentum", "sgd", "adam", "adam-l2", "adamw", "adamw-wd0", "adagrad", "rmsprop"])
def test_optimizer_kind(tmp_path, make, kind, state_keys):
    data = inspect_json(_optimizer_checkpoint(tmp_path, make))
    opt = data["optimizer"]
    assert opt["type"] == kind and set(opt["state_keys"]) == state_keys
    assert opt["mapping"] == "position" and data["findings"] == []


@pytest.mark.transformers
def test_optimizer_kind_hf_adafactor(tmp_path):
    optimization = pytest.importorskip("transformers.optimization")
    data = inspect_json(_optimizer_checkpoint(tmp_path, lambda p: optimization.Adafactor(p)))
    assert data["optimizer"]["type"] == "Adafactor (transformers)"
    assert {"exp_avg_sq_row", "exp_avg_sq_col", "exp_avg_sq"} <= set(data["optimizer"]["state_keys"])
    assert data["optimizer"]["mapping"] == "position" and data["findings"] == []


def test_optimizer_kind_torch_adafactor_state(tmp_path):
    """torch.optim.Adafactor (torch >= 2.5): row_var/col_var factors, not shaped like the parameter."""
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    data = inspect_json(_optimizer_checkpoint(tmp_path, lambda p: torch.optim.Adafactor(p, lr=1e-2)))
    assert set(data["optimizer"]["state_keys"]) == {"row_var", "col_var", "variance"}
    assert data["optimizer"]["mapping"] == "position" and data["findings"] == []


def test_optimizer_kind_torch_adafactor_is_adafactor(tmp_path):
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch >= 2.5")
    data = inspect_json(_optimizer_checkpoint(tmp_path, lambda p: torch.optim.Adafactor(p, lr=1e-2)))
    assert data["optimizer"]["type"] == "Adafactor (torch.optim)"


# ----------------------------------------------------------------------------------------- safetensors


def test_safetensors_file(tmp_path):
    import safetensors.torch

    torch.manual_seed(0)
    model = TinyLM(1000, 8)
    safetensors.torch.save_file(model.state_dict(), tmp_path / "model.safetensors")
    data = inspect_json(tmp_path / "model.safetensors")
    assert data["format"] == "safetensors" and data["model"]["section"] == "model.safetensors"
    assert data["model"]["tensors"] == 16 and data["optimizer"] is None
    assert {t["name"]: t["role"] for t in data["vocab"]["tensors"]} == {
        "text_embedding.weight": "embedding", "text_head.weight": "head"}
    assert data["vocab"]["tied_head_not_stored"] is False and data["findings"] == []


def test_safetensors_tied_head_dropped_by_hand(tmp_path):
    """save_file refuses shared tensors, so users drop the tied head; without a config nothing says it was tied."""
    import safetensors.torch

    model = TinyLM(1000, 8, tied=True)
    with pytest.raises(RuntimeError, match="share memory"):
        safetensors.torch.save_file(model.state_dict(), tmp_path / "x.safetensors")
    sd = {k: v for k, v in model.state_dict().items() if k != "text_head.weight"}
    safetensors.torch.save_file(sd, tmp_path / "model.safetensors")
    data = inspect_json(tmp_path / "model.safetensors")
    assert [t["name"] for t in data["vocab"]["tensors"]] == ["text_embedding.weight"]
    assert data["vocab"]["tied_head_not_stored"] is False and data["findings"] == []


def test_safetensors_save_model_records_the_dropped_tied_head(tmp_path):
    import safetensors.torch

    model = TinyLM(1000, 8, tied=True)
    safetensors.torch.save_model(model, tmp_path / "model.safetensors")
    report = ckptfix.inspect(tmp_path / "model.safetensors")
    data = report.to_json()
    assert data["extras"]["__metadata__"] == {"text_head.weight": "text_embedding.weight"}
    assert list(report.ckpt.model).count("text_head.weight") == 0
    assert data["vocab"]["tied_head_not_stored"] is True
    assert "lm_head tied to the input embedding (not stored" in render_report(report)


def _safetensors_with_header_length(path: Path, length: int) -> Path:
    """A real safetensors file whose 8-byte header length is `length` (padded through __metadata__)."""
    import safetensors.torch

    tensors = {"text_embedding.weight": torch.zeros(100, 8)}

    def header_length(pad: int) -> int:
        return struct.unpack("<Q", safetensors.torch.save(tensors, metadata={"pad": "x" * pad})[:8])[0]

    start = max(0, length - header_length(0) - 8)  # one pad character adds one byte (before 8-byte alignment)
    for pad in range(start, start + 24):
        if header_length(pad) == length:
            safetensors.torch.save_file(tensors, path, metadata={"pad": "x" * pad})
            return path
    pytest.skip(f"could not make a safetensors header of {length} bytes")


def test_safetensors_header_length_that_looks_like_a_pickle(tmp_path):
    path = _safetensors_with_header_length(tmp_path / "model.safetensors", 0x480)
    assert path.read_bytes()[:2] == b"\x80\x04"
    assert inspect_json(path)["format"] == "safetensors"


# ------------------------------------------------------------------------------- transformers.Trainer


@pytest.fixture(scope="module")
def trainer_checkpoint(tmp_path_factory):
    """checkpoint-2 of a real transformers.Trainer run on a tiny random-init GPT-2 (tied head, CPU)."""
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("hf")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    ids = torch.randint(0, 100, (8, 12), generator=torch.Generator().manual_seed(0))
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=3, save_strategy="steps", save_steps=2, warmup_steps=1, learning_rate=1e-3,
        weight_decay=0.01, per_device_train_batch_size=4, report_to=[], use_cpu=True, logging_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, seed=7)
    transformers.Trainer(model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]).train()
    return out / "checkpoint-2", model


@pytest.mark.transformers
def test_hf_trainer_checkpoint(trainer_checkpoint):
    folder, model = trainer_checkpoint
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json", "training_args.bin",
            "config.json"} <= {p.name for p in folder.iterdir()}
    assert list(folder.glob("rng_state*.pth"))
    report = ckptfix.inspect(folder)
    data = report.to_json()
    text = render_report(report)
    assert data["format"] == "hf-trainer"
    assert data["model"]["section"] == "model.safetensors" and data["model"]["tensors"] == 16

    opt = data["optimizer"]
    assert opt["section"] == "optimizer.pt" and opt["type"] == "AdamW" and opt["step"] == 2
    # The Trainer's two groups: weight decay, then no decay (biases and LayerNorm weights).
    assert [(g["params"], g["weight_decay"]) for g in opt["param_groups"]] == [(6, 0.01), (10, 0.0)]
    # safetensors stores tensors sorted by name, not in named_parameters() order, so neither the model
    # order nor the Trainer's groups line up with the file: parameters are matched by unique shape.
    assert opt["mapping"] == "shape"
    assert report.mapping.names[0] == "transformer.wte.weight"

    vocab = {t["name"]: t for t in data["vocab"]["tensors"]}
    assert list(vocab) == ["transformer.wte.weight"]
    assert vocab["transformer.wte.weight"]["role"] == "embedding" and vocab["transformer.wte.weight"]["rows"] == 100
    assert vocab["transformer.wte.weight"]["moments"] == {"exp_avg": [100, 16], "exp_avg_sq": [100, 16]}
    assert data["vocab"]["tied_head_not_stored"] is True  # config.json: tie_word_embeddings
    assert "lm_head tied to the input embedding (not stored" in text

    assert data["scheduler"]["section"] == "scheduler.pt" and data["scheduler"]["last_epoch"] == 2
    assert data["scheduler"]["type"] == "LambdaLR/MultiplicativeLR"
    assert data["scheduler"]["last_lr"][0] == pytest.approx(5e-4)  # linear decay: 1e-3 * (3 - 2) / (3 - 1)
    assert data["scaler"] is None  # no fp16 AMP on CPU: the Trainer writes no scaler.pt
    assert data["extras"]["trainer_state"]["global_step"] == 2
    assert data["extras"]["config"]["tie_word_embeddings"] is True
    assert data["extras"]["training_args"] == {
        "class": "transformers.training_args.TrainingArguments", "learning_rate": 1e-3, "warmup_steps": 1,
        "max_steps": 3, "num_train_epochs": 3.0, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
        "weight_decay": 0.01, "fp16": False, "bf16": False, "max_grad_norm": 1.0, "seed": 7,
        "lr_scheduler_type": "linear", "ignore_data_skip": False, "dataloader_drop_last": False,
        "auto_find_batch_size": False} | (
        {"optim": data["extras"]["training_args"]["optim"]} if "optim" in data["extras"]["training_args"] else {})
    assert "training_args.bin is a pickled class: read statically, never unpickled" in data["notes"]
    assert "1 rng_state file(s) read as data (RNG state only)" in data["notes"]
    assert [f["code"] for f in data["findings"]] == ["CKF204"]


@pytest.mark.transformers
def test_hf_trainer_checkpoint_has_no_false_error(trainer_checkpoint):
    data = ckptfix.inspect(trainer_checkpoint[0]).to_json()
    assert [f["code"] for f in data["findings"]] == ["CKF204"]


@pytest.mark.transformers
def test_hf_trainer_checkpoint_inspected_without_transformers_or_torch(trainer_checkpoint):
    """training_args.bin is never unpickled: inspecting imports neither transformers nor torch."""
    code = ("import sys, ckptfix\n"
            f"r = ckptfix.inspect({str(trainer_checkpoint[0])!r})\n"
            "assert r.to_json()['extras']['training_args']['learning_rate'] == 1e-3\n"
            "bad = sorted(m for m in ('transformers', 'torch', 'accelerate') if m in sys.modules)\n"
            "print('IMPORTED', bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert "IMPORTED []" in out.stdout


def test_dtypes_without_a_typed_storage_read_like_torch(tmp_path):
    """uint16 and float8 tensors are pickled with `torch.storage.UntypedStorage` and `_rebuild_tensor_v3`."""
    path = tmp_path / "u16.pth"
    u16 = torch.tensor([1, 2, 60000], dtype=torch.int32).to(torch.uint16)
    f8 = torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn)
    torch.save({"u16": u16, "f8": f8}, path)
    model = ckptfix.read_checkpoint(path).model
    assert (model["u16"].dtype, model["f8"].dtype) == ("uint16", "float8_e4m3fn")
    assert model["u16"].read().tolist() == [1, 2, 60000]
    assert model["f8"].read().tolist() == f8.view(torch.uint8).tolist()  # float8 is read as its raw bytes
