"""Issue 42: a `save_pretrained` model folder (one model.safetensors, or two shards and their index) and a lone
`.safetensors` file missing or tearing a file that `from_pretrained` / `safetensors.torch.load_file` reads.

Module-scoped saves of a tiny GPT-2 by transformers' own `save_pretrained`; each file is removed, halved and emptied in
a copy, `from_pretrained` is run on it, and ckptfix's finding (CKF320) or one-line refusal must name the file and say
what from_pretrained did. Measured (transformers 5.24, safetensors 0.8):

    file                              removed                                  halved / empty
    config.json                       AutoModel: ValueError 'Unrecognized      OSError '... is not a valid JSON file'
                                      model'; GPT2LMHeadModel: RuntimeError
    model.safetensors                 OSError 'Error no file named ...'        SafetensorError 'Error while
    model-0000N-of-00002.safetensors  FileNotFoundError                        deserializing header: ...'
    model.safetensors.index.json      OSError 'Error no file named ...'        json.JSONDecodeError
    generation_config.json            loads (not needed for the weights)
"""

from __future__ import annotations

import shutil
import warnings

import pytest
from damage import cut, damage

from ckptfix.errors import CkptfixError
from ckptfix.inspect import inspect

transformers = pytest.importorskip("transformers")

SINGLE = ("config.json", "model.safetensors")
SHARDED = ("config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
           "model.safetensors.index.json")
# the exception from_pretrained raises, by (file kind, how), as measured; the refusal or finding must name it
RAISES = {("config.json", "removed"): "ValueError", ("config.json", "half"): "OSError",
          ("config.json", "zero"): "OSError", ("weights", "removed"): "OSError",
          ("shard", "removed"): "FileNotFoundError", ("index.json", "removed"): "OSError",
          ("index.json", "half"): "JSONDecodeError", ("index.json", "zero"): "JSONDecodeError"}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("hf_model")
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=64,
                                                                 n_positions=32))
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


def _from_pretrained(folder):
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    except Exception as exc:  # noqa: BLE001 (what from_pretrained raises is the measurement)
        return type(exc).__name__, str(exc)
    return "ok", ""


def _kind(name):
    if name.startswith("model-"):
        return "shard"
    return {"model.safetensors": "weights"}.get(name, name.replace("model.safetensors.", ""))


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_healthy_folder_has_no_new_finding(saved, layout):
    assert sorted(p.name for p in (saved / layout).iterdir()) == sorted(
        (SINGLE if layout == "single" else SHARDED) + ("generation_config.json",))
    assert not [f for f in inspect(str(saved / layout)).findings if f.code == "CKF320"]
    assert _from_pretrained(saved / layout) == ("ok", "")


@pytest.mark.parametrize("layout,name", [("single", n) for n in SINGLE] + [("sharded", n) for n in SHARDED[1:]])
@pytest.mark.parametrize("how", ["removed", "half", "zero"])
def test_damaged_file_is_named_with_what_from_pretrained_does(saved, tmp_path, layout, name, how):
    d = tmp_path / layout
    shutil.copytree(saved / layout, d)
    damage(d / name, how)
    outcome, detail = _from_pretrained(d)
    expected = RAISES.get((_kind(name), how), "SafetensorError")
    assert outcome == expected, (outcome, detail)
    try:
        report = inspect(str(d))
    except CkptfixError as exc:
        text = str(exc)
        assert "\n" not in text and "from_pretrained" in text and outcome in text
        assert name in text or (name == "model.safetensors.index.json" and "without their index.json" in text) or (
            name == "model.safetensors" and "no weight file (model.safetensors" in text)
        return
    (hit,) = [f for f in report.findings if f.code == "CKF320"]
    assert (name, how) == ("config.json", "removed") and "config.json" in hit.message
    assert outcome in hit.pytorch and "Should have a `model_type` key" in detail


@pytest.mark.parametrize("how", ["half", "zero"])
def test_lone_safetensors_file_torn(saved, tmp_path, how):
    from safetensors.torch import load_file

    path = tmp_path / "model.safetensors"
    path.write_bytes(cut((saved / "single" / "model.safetensors").read_bytes(), how))
    with pytest.raises(Exception) as raised:
        load_file(str(path))
    assert type(raised.value).__name__ == "SafetensorError" and "deserializing header" in str(raised.value)
    with pytest.raises(CkptfixError) as refused:
        inspect(str(path))
    text = str(refused.value)
    assert "\n" not in text and "model.safetensors" in text
    assert "SafetensorError 'Error while deserializing header" in text


# --- a PEFT adapter folder (PeftModel.save_pretrained), loaded with PeftModel.from_pretrained -------------------------

ADAPTER = ("adapter_config.json", "adapter_model.safetensors")
# measured (peft 0.21): what PeftModel.from_pretrained raises, by (file, how); a torn safetensors: SafetensorError
ADAPTER_RAISES = {("adapter_config.json", "removed"): "ValueError", ("adapter_config.json", "half"): "JSONDecodeError",
                  ("adapter_config.json", "zero"): "JSONDecodeError",
                  ("adapter_model.safetensors", "removed"): "HFValidationError"}


def _base():
    import torch

    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64,
                                                                n_positions=32))


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    peft = pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("adapter") / "lora"
    peft.get_peft_model(_base(), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_attn"], fan_in_fan_out=True,
                                                 task_type="CAUSAL_LM")).save_pretrained(folder)
    return folder


def _peft_load(folder):
    import peft

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peft.PeftModel.from_pretrained(_base(), str(folder))
    except Exception as exc:  # noqa: BLE001 (what PeftModel.from_pretrained raises is the measurement)
        return type(exc).__name__, str(exc)
    return "ok", ""


@pytest.mark.peft
@pytest.mark.parametrize("name", ADAPTER)
@pytest.mark.parametrize("how", ["removed", "half", "zero"])
def test_adapter_damaged_file_is_refused_with_what_peft_does(adapter, tmp_path, name, how):
    assert _peft_load(adapter) == ("ok", "")
    assert not [f for f in inspect(str(adapter)).findings if f.code.startswith("CKF31") or f.code == "CKF320"]
    d = tmp_path / "lora"
    shutil.copytree(adapter, d)
    damage(d / name, how)
    outcome, _ = _peft_load(d)
    assert outcome == ADAPTER_RAISES.get((name, how), "SafetensorError")
    with pytest.raises(CkptfixError) as refused:
        inspect(str(d))
    text = str(refused.value)
    assert "\n" not in text and name in text and outcome in text
