"""Sharded Hugging Face weights (`*.index.json` + shards) written by the real libraries.

transformers 5 `save_pretrained(max_shard_size=...)` always writes safetensors shards; the
`pytorch_model.bin.index.json` layout is written with huggingface_hub's `save_torch_state_dict`
(`safe_serialization=False`), the code transformers 4 used for it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ckptfix.formats import read_checkpoint
from ckptfix.inspect import inspect

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharded") / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    model.save_pretrained(path, max_shard_size="10KB")
    return path, model


def test_safetensors_shards(gpt2):
    path, model = gpt2
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) > 1
    ckpt = read_checkpoint(path)
    assert ckpt.format == "hf-model"
    assert set(ckpt.model) == set(index["weight_map"])  # the tied lm_head is not stored
    state = model.state_dict()
    for name, info in ckpt.model.items():
        assert info.shape == tuple(state[name].shape)
        np.testing.assert_array_equal(info.read(), state[name].numpy())
    assert all(s in ckpt.sections["model"] for s in shards)


def test_inspect_sees_the_tied_head(gpt2):
    data = inspect(gpt2[0]).to_json()
    assert data["vocab"]["tied_head_not_stored"] is True
    assert data["model"]["tensors"] == len(json.loads((gpt2[0] / "model.safetensors.index.json").read_text())["weight_map"])


def test_pytorch_bin_shards(tmp_path):
    from huggingface_hub import save_torch_state_dict

    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
    save_torch_state_dict(model.state_dict(), str(tmp_path), safe_serialization=False, max_shard_size="3KB")
    index = json.loads((tmp_path / "pytorch_model.bin.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ckpt = read_checkpoint(tmp_path)
    for name, tensor in model.state_dict().items():
        np.testing.assert_array_equal(ckpt.model[name].read(), tensor.numpy())
