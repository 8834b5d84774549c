"""Every output repair writes loads through every path its users take: each HF folder layout
(`.bin`, sharded `.bin`, safetensors, sharded safetensors) with `from_pretrained`, each torch file in it
(weights and the Trainer's optimizer.pt) with `torch.load` under weights_only, mmap and meta, each
safetensors file with `safetensors.torch.load_file`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_torch_layout import LOAD_PATHS, _from_pretrained_and_check, _llama, word_level_tokenizer

import ckptfix

pytestmark = pytest.mark.transformers
LAYOUTS = ["bin", "bin-sharded", "safetensors", "safetensors-sharded"]


def _save(model, folder: Path, layout: str) -> None:
    """The folder as transformers writes it (5.x: safetensors, sharded by max_shard_size) or wrote it (4.x:
    `torch.save` of the state dict, or of each shard with a `pytorch_model.bin.index.json`)."""
    if layout.startswith("safetensors"):
        model.save_pretrained(folder, max_shard_size="40KB" if layout.endswith("sharded") else "1GB")
        return
    model.config.save_pretrained(folder)
    state = model.state_dict()
    if layout == "bin":
        torch.save(state, folder / "pytorch_model.bin")
        return
    names = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, folder / shard)
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_repaired_hf_folder_loads_through_every_path(tmp_path, layout):
    model = _llama(1000)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, 1000, (2, 8), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    src = tmp_path / "ckpt"
    _save(model, src, layout)
    torch.save(opt.state_dict(), src / "optimizer.pt")  # the Trainer's, beside the weights
    if layout.endswith("sharded"):
        assert len([p for p in src.iterdir() if p.suffix in (".bin", ".safetensors")]) > 1
    out = tmp_path / "fixed"
    ckptfix.repair(str(src), str(word_level_tokenizer(tmp_path / "tokenizer.json", 1004)), str(out))

    _from_pretrained_and_check(out, model, 1004)
    for path in sorted(out.glob("*.bin")) + [out / "optimizer.pt"]:
        full = torch.load(path, weights_only=True)
        for how in LOAD_PATHS[1:]:
            other = torch.load(path, **how)
            flat = _tensors(full)
            for key, t in _tensors(other).items():
                assert (t.shape, t.dtype) == (flat[key].shape, flat[key].dtype), (path.name, how, key)
                if how.get("map_location") != "meta":
                    assert torch.equal(t, flat[key]), (path.name, key)
    moments = torch.load(out / "optimizer.pt", weights_only=True)["state"]
    assert any(s["exp_avg"].shape == (1004, 16) for s in moments.values())
    from safetensors.torch import load_file

    for path in sorted(out.glob("*.safetensors")):
        loaded = load_file(str(path))
        assert loaded and all(isinstance(t, torch.Tensor) for t in loaded.values())
        if "model.embed_tokens.weight" in loaded:
            assert loaded["model.embed_tokens.weight"].shape == (1004, 16)


def _tensors(tree, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in _tensors(value, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in _tensors(value, f"{prefix}/{i}").items()}
    return {}
