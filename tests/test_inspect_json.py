"""The `ckptfix inspect --json` schema (ckptfix.inspect/1): keys, types, nulls, findings, summary.

The schema is a promise to scripts and CI jobs: keys are only ever added under a new schema string.
`SCHEMA` below is the reference; the README documents the same table.
"""

from __future__ import annotations

import json

import pytest
import torch
from ckpt_factory import make_batches, new_run, save_checkpoint, train
from tokenizer_factory import train_sentencepiece

import ckptfix
from ckptfix.checks import SEVERITIES, registry
from ckptfix.cli import main

pytestmark = [pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")]

NUMBER = (int, float)
OPT_STR = (str, type(None))

TOP_LEVEL = {"schema": str, "path": str, "format": str, "model": dict, "optimizer": (dict, type(None)),
             "scheduler": (dict, type(None)), "scaler": (dict, type(None)), "vocab": dict, "extras": dict,
             "weights_only": dict,  # issue 21: what torch.load(weights_only=True) refuses, per pickled object
             "record": (dict, type(None)), "notes": list, "findings": list, "summary": dict,
             "audit": (dict, type(None))}  # issue 27: every value with the old vocab size, and what happens to it
MODEL = {"tensors": int, "parameters": int, "bytes": int, "dtypes": dict, "tied": dict, "section": OPT_STR}
OPTIMIZER = {"type": str, "param_groups": list, "params": int, "params_with_state": int, "state_keys": dict,
             "step": (int, float, list), "mapping": str, "state_bytes": int, "section": OPT_STR}
GROUP_REQUIRED = {"params": int, "lr": (int, float, type(None))}
GROUP_OPTIONAL = {"initial_lr", "betas", "eps", "weight_decay", "momentum", "amsgrad"}
SCHEDULER_REQUIRED = {"type": str, "section": OPT_STR}
SCHEDULER_OPTIONAL = {"last_epoch", "step_count", "base_lrs", "last_lr", "total_steps", "T_max", "step_size",
                      "warmup_steps"}
SCALER_REQUIRED = {"enabled": bool, "section": OPT_STR}
VOCAB = {"tokenizer": (dict, type(None)), "tensors": list, "tied_head_not_stored": bool}
TOKENIZER = {"path": str, "kind": str, "source": str, "base_size": int, "added": int, "special_tokens": list,
             "size": int}
VOCAB_TENSOR = {"name": str, "role": str, "rows": int, "shape": list, "tied_to": OPT_STR, "offset": int,
                "optimizer_index": (int, str, type(None)), "moments": dict, "parts": list}
FINDING = {"code": str, "severity": str, "title": str, "message": str, "pytorch": str, "fix": str, "tensors": list}
SUMMARY = {"error": int, "warning": int, "info": int}


def assert_keys(obj: dict, required: dict, optional: set = frozenset(), where: str = "",
                open_ended: bool = False) -> None:
    """`required` keys present with their types; no keys beyond `optional` unless `open_ended`."""
    assert set(required) <= set(obj), f"{where}: missing {set(required) - set(obj)}"
    extra = set(obj) - set(required) - set(optional)
    assert open_ended or not extra, f"{where}: unexpected keys {extra}"
    for key, types in required.items():
        assert isinstance(obj[key], types), f"{where}.{key} is {type(obj[key]).__name__}"
        assert not (types in (int, NUMBER) and isinstance(obj[key], bool)), f"{where}.{key} is a bool"


def assert_schema(data: dict) -> None:
    assert set(data) == set(TOP_LEVEL)
    assert_keys(data, TOP_LEVEL, where="top")
    assert data["schema"] == "ckptfix.inspect/1"
    assert_keys(data["model"], MODEL, set(), "model")
    assert set(data["model"]) == set(MODEL)
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in data["model"]["dtypes"].items())
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in data["model"]["tied"].items())
    if data["optimizer"] is not None:
        opt = data["optimizer"]
        assert set(opt) == set(OPTIMIZER)
        assert_keys(opt, OPTIMIZER, where="optimizer")
        if isinstance(opt["step"], list):
            assert all(isinstance(s, NUMBER) for s in opt["step"]) and len(opt["step"]) != 1
        for g in opt["param_groups"]:
            assert_keys(g, GROUP_REQUIRED, GROUP_OPTIONAL, "param_group")
        assert all(isinstance(v, int) for v in opt["state_keys"].values())
    if data["scheduler"] is not None:
        assert_keys(data["scheduler"], SCHEDULER_REQUIRED, SCHEDULER_OPTIONAL, "scheduler")
    if data["scaler"] is not None:
        # plus the keys GradScaler.state_dict() saved, leading "_" stripped
        assert_keys(data["scaler"], SCALER_REQUIRED, where="scaler", open_ended=True)
        assert not any(k.startswith("_") for k in data["scaler"])
    assert set(data["vocab"]) == set(VOCAB)
    assert_keys(data["vocab"], VOCAB, where="vocab")
    if data["vocab"]["tokenizer"] is not None:
        assert set(data["vocab"]["tokenizer"]) == set(TOKENIZER)
        assert_keys(data["vocab"]["tokenizer"], TOKENIZER, where="tokenizer")
    for t in data["vocab"]["tensors"]:
        assert set(t) == set(VOCAB_TENSOR)
        assert_keys(t, VOCAB_TENSOR, where="vocab.tensors")
        assert t["role"] in ("embedding", "head", "head-bias", "vocab-sized")
        assert all(isinstance(d, int) for d in t["shape"]) and all(isinstance(s, list) for s in t["moments"].values())
    assert all(isinstance(n, str) for n in data["notes"])
    codes = registry()
    for f in data["findings"]:
        assert set(f) == set(FINDING)
        assert_keys(f, FINDING, where="finding")
        assert f["code"] in codes and f["title"] == codes[f["code"]].title
        assert f["severity"] in SEVERITIES
        assert all(isinstance(t, str) for t in f["tensors"])
    assert set(data["summary"]) == set(SUMMARY)
    for severity in SEVERITIES:
        assert data["summary"][severity] == sum(f["severity"] == severity for f in data["findings"])
    order = {s: i for i, s in enumerate(SEVERITIES)}
    keys = [(order[f["severity"]], f["code"]) for f in data["findings"]]
    assert keys == sorted(keys), "findings are sorted: errors, warnings, info; by code within each"
    json.dumps(data, allow_nan=False)  # strict JSON: no NaN/Infinity literals, no objects



@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return train_sentencepiece(tmp_path_factory.mktemp("tok"), 1000, normalization_rule_name="identity")


@pytest.fixture(scope="module")
def three_severities(tmp_path_factory):
    """1001 rows (error CKF102), the embedding frozen for 3 steps (warning CKF203), one NaN step that
    GradScaler skipped while the scheduler stepped on (info CKF301)."""
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.pth"
    torch.manual_seed(0)
    run = new_run(1001, dim=8)
    emb = run.model.text_embedding.weight
    for i, ids in enumerate(make_batches(1001, 10)):
        emb.requires_grad_(i >= 3)
        run.optimizer.zero_grad(set_to_none=True)
        loss = run.model(ids[:, :-1]).log_softmax(-1).mean() * (float("nan") if i == 6 else 1.0)
        run.scaler.scale(-loss).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
        run.scheduler.step()
        run.step += 1
    return save_checkpoint(run, path)


def test_schema_with_every_section(three_severities, tokenizer, capsys):
    report = ckptfix.inspect(three_severities, tokenizer)
    data = report.to_json()
    assert_schema(data)
    assert [(f["code"], f["severity"]) for f in data["findings"]] == [
        ("CKF102", "error"), ("CKF203", "warning"), ("CKF301", "info")]
    assert data["summary"] == {"error": 1, "warning": 1, "info": 1}
    assert data["path"] == str(three_severities) and data["format"] == "torch"
    assert data["optimizer"]["step"] == [6.0, 9.0]  # distinct per-parameter steps when they disagree
    assert data["scaler"]["scale"] == 32768.0 and data["scaler"]["section"] == "scaler"
    assert data["vocab"]["tokenizer"]["size"] == 1000
    assert data["vocab"]["tensors"][0]["optimizer_index"] == 0
    assert data["extras"] == {"epoch": 1, "step": 10}
    assert data["record"] is None
    # issue 18: with no record and no folder tokenizer, inspect says rows are matched by id (and when that is right)
    assert len(data["notes"]) == 1 and "keeps rows by id" in data["notes"][0] and "--from-tokenizer" in data["notes"][0]
    assert report.exit_code == 1

    # The CLI prints exactly this document.
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["inspect", str(three_severities), "--tokenizer", str(tokenizer), "--json"])
    assert exc.value.code == 1
    assert json.loads(capsys.readouterr().out) == json.loads(json.dumps(data))


def test_schema_nulls_for_a_bare_state_dict(tmp_path):
    torch.manual_seed(0)
    torch.save(new_run(100, dim=8).model.state_dict(), tmp_path / "w.pt")
    data = ckptfix.inspect(tmp_path / "w.pt").to_json()
    assert_schema(data)
    assert data["optimizer"] is None and data["scheduler"] is None and data["scaler"] is None
    assert data["vocab"]["tokenizer"] is None and data["record"] is None
    assert data["findings"] == [] and data["summary"] == {"error": 0, "warning": 0, "info": 0}
    assert data["model"]["section"] == ""


def test_schema_with_a_single_step_and_non_finite_values(tmp_path):
    """A scalar step is a number; inf/NaN values are strings ("inf", "nan"), so the output stays strict JSON."""
    run = new_run(100, dim=8)
    run.scaler = torch.amp.GradScaler("cpu", init_scale=float("inf"))
    for ids in make_batches(100, 2):
        run.optimizer.zero_grad()
        run.scaler.scale(run.model(ids).mean()).backward()
        run.scaler.step(run.optimizer)
        run.scaler.update()
    torch.save({"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
                "scaler": run.scaler.state_dict(), "loss": float("nan")}, tmp_path / "ckpt.pth")
    data = ckptfix.inspect(tmp_path / "ckpt.pth").to_json()
    assert_schema(data)
    assert data["scaler"]["scale"] == "inf" and data["extras"]["loss"] == "nan"
    assert data["optimizer"]["step"] == [] and data["optimizer"]["params_with_state"] == 0


def test_step_is_a_number_when_all_parameters_agree(tmp_path):
    run = train(new_run(100, dim=8), 3)
    data = ckptfix.inspect(save_checkpoint(run, tmp_path / "ckpt.pth")).to_json()
    assert_schema(data)
    assert data["optimizer"]["step"] == 3 and isinstance(data["optimizer"]["step"], float)
