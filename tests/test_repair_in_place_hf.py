"""`repair --in-place` of a sharded safetensors folder written by transformers' own `save_pretrained`.

Only the shards holding a vocab tensor are written (under new names), the index is swapped, config.json and
the tokenizer files are replaced with backups kept; `from_pretrained` loads the result at the new vocab with
the old rows, and `ckptfix restore` gives back the exact folder.
"""

from __future__ import annotations

import json

import pytest
import torch
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix
from ckptfix.surgery.undo import restore

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.transformers

OLD = 64


def files(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_in_place_rewrites_only_the_vocab_shards(tmp_path):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=OLD, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path / "llama"
    model.save_pretrained(folder, max_shard_size="8KB")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    vocab_shards = {index["model.embed_tokens.weight"], index["lm_head.weight"]}
    assert len(set(index.values())) > len(vocab_shards)  # some shards hold no vocab tensor
    tok = train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")
    before = files(folder)

    result = ckptfix.repair(folder, tok, in_place=True, keep_ids=True)  # a synthetic tokenizer: ids as trained
    after = files(folder)
    assert result.backup and result.backup.endswith("model.safetensors.index.json.ckptfix-bak")
    for name, data in before.items():
        if name.endswith(".safetensors"):
            assert after[name] == data, f"{name} was rewritten"  # old shards stay, untouched
    new_shards = sorted(n for n in set(after) - set(before) if n.endswith(".safetensors"))
    assert len(new_shards) == len(vocab_shards)
    assert sum(len(after[n]) for n in new_shards) == pytest.approx(
        sum(len(before[n]) for n in vocab_shards), rel=0.5)

    loaded = transformers.LlamaForCausalLM.from_pretrained(folder)
    rows = loaded.get_input_embeddings().weight.shape[0]
    assert rows >= 80 and loaded.config.vocab_size == rows
    assert torch.equal(loaded.get_input_embeddings().weight[:OLD], model.get_input_embeddings().weight)
    assert torch.equal(loaded.lm_head.weight[:OLD], model.lm_head.weight)

    done = restore(str(folder))
    assert any("model.safetensors.index.json" in line for line in done)
    assert files(folder) == before


def test_an_error_at_the_switch_puts_the_folder_back(tmp_path, monkeypatch):
    """The index write fails (after the new shards, the backups and the restore list): the folder is exactly
    as it was (the restore list committed before the switch removed too), and a new in-place repair runs."""
    from ckptfix.surgery import write_hf_inplace

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=OLD, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="8KB")
    tok = train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")
    before = files(folder)
    real = write_hf_inplace.atomic_write

    def failing(path, data):
        if path.endswith(".index.json"):
            raise OSError("disk full")
        real(path, data)

    monkeypatch.setattr(write_hf_inplace, "atomic_write", failing)
    with pytest.raises(Exception, match="disk full"):
        ckptfix.repair(folder, tok, in_place=True, keep_ids=True)
    assert files(folder) == before
    monkeypatch.setattr(write_hf_inplace, "atomic_write", real)
    ckptfix.repair(folder, tok, in_place=True, keep_ids=True)
    assert restore(str(folder)) and files(folder) == before
