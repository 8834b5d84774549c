"""What repair writes is what `torch.save` writes: every loading path users take accepts it, and every
tensor repair does not resize comes back bit-identical (dtype, shape, strides, storage sharing).

`transformers` 5 reads `.bin` weights with `torch.load(map_location="meta")` first, which computes
record offsets instead of looking them up: it accepts only torch.save's exact record layout.
"""

from __future__ import annotations

import json
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import ckptfix
from ckptfix.inspect import inspect

LOAD_PATHS = [dict(weights_only=True), dict(weights_only=True, mmap=True),
              dict(weights_only=True, map_location="meta")]

# every dtype torch.save writes (typed storages, and untyped ones through _rebuild_tensor_v3)
DTYPES = ["float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool",
          "complex64", "complex128", "chalf", "uint16", "uint32", "uint64",
          "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
          "float4_e2m1fn_x2", "bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"]


def word_level_tokenizer(path: Path, size: int) -> Path:
    """A tokenizer.json with exactly `size` ids (the `tokenizers` library's own writer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"<unk>": 0, **{f"t{i}": i for i in range(1, size)}}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return path


def _random_of(dtype: torch.dtype, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """Random bits of any dtype (even those torch cannot fill): bytes reinterpreted."""
    size = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * size), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        return raw % 2 == 1
    return raw.view(dtype)


def _bits(t: torch.Tensor) -> list[int]:
    return t.contiguous().view(-1).view(torch.uint8).tolist() if t.dtype != torch.bool else t.view(-1).tolist()


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dtypes")
    gen = torch.Generator().manual_seed(0)
    model = {"embed_tokens.weight": torch.randn(100, 8, generator=gen)}
    for name in DTYPES:
        model[f"x.{name}"] = _random_of(getattr(torch, name), (3, 4), gen)
    base = torch.randn(4, 6, generator=gen)
    model.update({"x.base": base, "x.transposed": base.t(), "x.row": base[1], "x.narrow": base[:, 2:5]})
    src = folder / "ckpt.pt"
    torch.save({"model": model, "step": 7}, src)
    out = folder / "fixed.pt"
    ckptfix.repair(str(src), str(word_level_tokenizer(folder / "tok.json", 104)), str(out))
    return src, out


@pytest.mark.parametrize("how", LOAD_PATHS, ids=["weights_only", "mmap", "meta"])
def test_every_dtype_round_trips_bit_identical(every_dtype, how):
    src, out = every_dtype
    before = torch.load(src, weights_only=True)["model"]
    after = torch.load(out, **how)["model"]
    assert after.keys() == before.keys()
    assert after["embed_tokens.weight"].shape == (104, 8)
    for name, t in before.items():
        if name == "embed_tokens.weight":
            continue
        new = after[name]
        assert (new.dtype, new.shape, new.stride(), new.storage_offset()) == \
               (t.dtype, t.shape, t.stride(), t.storage_offset()), name
        if how.get("map_location") != "meta":
            assert _bits(new) == _bits(t), name
    if how.get("map_location") != "meta":
        views = [after[n].untyped_storage().data_ptr() for n in ("x.base", "x.transposed", "x.row", "x.narrow")]
        assert len(set(views)) == 1  # still one storage
        assert torch.equal(after["embed_tokens.weight"][:100], before["embed_tokens.weight"])


def _layout(path: Path) -> tuple[list[str], list[tuple[int, int, int]]]:
    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
    names = [i.filename.split("/", 1)[1] for i in infos]
    records = [i for i in infos if i.filename.split("/", 1)[1].startswith("data/")]
    start = records[0].header_offset  # data.pkl (first) is pickled by another pickler: count from data/0
    return names, [(i.header_offset - start, i.file_size, i.CRC) for i in records]


def _assert_torch_save_layout(out: Path, tmp_path: Path) -> None:
    """The same members in the same order at the same offsets as torch.save gives the same tensors."""
    again = tmp_path / out.name  # torch.save names the archive folder after the file, as the source's
    loaded = torch.load(out, weights_only=True)
    loaded.pop("ckptfix")
    torch.save(loaded, again)
    names, records = _layout(out)
    assert names[:4] == ["data.pkl", ".format_version", ".storage_alignment", "byteorder"]
    assert names[-2:] == ["version", ".data/serialization_id"]
    theirs = _layout(again)
    assert names == theirs[0]
    assert records == theirs[1]


def test_record_layout_is_torch_saves(every_dtype, tmp_path):
    _assert_torch_save_layout(every_dtype[1], tmp_path)


# --- quantized tensors (torch.ao): the integers are the storage, scale/zero point/axis live in the pickle ---

def _quantized_model(gen: torch.Generator) -> dict[str, torch.Tensor]:
    import torch.ao.nn.quantized as nnq

    x = torch.randn(6, 5, generator=gen) * 3
    per_tensor = {f"q.{d}": torch.quantize_per_tensor(x, 0.037, 3 if d == "quint8" else 0, getattr(torch, d))
                  for d in ("qint8", "quint8", "qint32")}
    ch0 = torch.quantize_per_channel(x, torch.rand(6, generator=gen, dtype=torch.float64) / 10 + 0.01,
                                     torch.randint(0, 9, (6,), generator=gen), 0, torch.quint8)
    ch1 = torch.quantize_per_channel(x, torch.rand(5, generator=gen, dtype=torch.float64) / 10 + 0.01,
                                     torch.zeros(5, dtype=torch.long), 1, torch.qint8)
    # what a torch.ao quantized nn.Embedding saves: per_channel_affine_float_qparams (float zero points).
    # Its constructor leaves the weight and scales uninitialised (NaN scales fail torch.equal): set them.
    embedding = nnq.Embedding(12, 5)
    w = torch.randn(12, 5, generator=gen)
    embedding.set_weight(torch.quantize_per_channel(w, w.abs().amax(1).double() / 127 + 0.01, torch.zeros(12), 0,
                                                    torch.quint8))
    table = embedding.state_dict()["_packed_params._packed_weight"]
    return {**per_tensor, "q.channel0": ch0, "q.channel1": ch1, "q.qint8_t": per_tensor["q.qint8"].t(), "q.table": table}


def _quantized_same(a: torch.Tensor, b: torch.Tensor) -> bool:
    same = (a.dtype, a.shape, a.stride(), a.storage_offset(), a.qscheme()) == \
           (b.dtype, b.shape, b.stride(), b.storage_offset(), b.qscheme()) and torch.equal(a.int_repr(), b.int_repr())
    if a.qscheme() == torch.per_tensor_affine:
        return same and (a.q_scale(), a.q_zero_point()) == (b.q_scale(), b.q_zero_point())
    return same and a.q_per_channel_axis() == b.q_per_channel_axis() and \
        _same_bits(a.q_per_channel_scales(), b.q_per_channel_scales()) and \
        _same_bits(a.q_per_channel_zero_points(), b.q_per_channel_zero_points())


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # bitwise: an embedding's packed weight can carry uninitialised scales, NaN among them (NaN != NaN)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                      b.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    folder = tmp_path_factory.mktemp("quantized")
    gen = torch.Generator().manual_seed(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch 2.13 deprecates creating quantized tensors; it still saves them
        model = {"embed_tokens.weight": torch.randn(100, 8, generator=gen), **_quantized_model(gen)}
    src = folder / "ckpt.pt"
    torch.save({"model": model, "step": 7}, src)
    out = folder / "fixed.pt"
    ckptfix.repair(str(src), str(word_level_tokenizer(folder / "tok.json", 104)), str(out))
    return src, out


@pytest.mark.parametrize("how", LOAD_PATHS[:2], ids=["weights_only", "mmap"])
def test_quantized_tensors_round_trip_bit_identical(quantized, how):
    src, out = quantized
    before = torch.load(src, weights_only=True)["model"]
    after = torch.load(out, **how)["model"]
    assert after["embed_tokens.weight"].shape == (104, 8)
    for name, t in before.items():
        if t.is_quantized:
            assert _quantized_same(after[name], t), name
    views = {after[n].untyped_storage().data_ptr() for n in ("q.qint8", "q.qint8_t")}
    assert len(views) == 1  # a transposed view still shares its storage


def test_quantized_tensors_under_meta_fail_as_torch_saves_do(quantized):
    """torch itself cannot build a quantized tensor on the meta device: its own file fails the same way."""
    src, out = quantized
    for path in (src, out):
        with pytest.raises(NotImplementedError, match="_empty_affine_quantized"):
            torch.load(path, weights_only=True, map_location="meta")


def test_quantized_record_layout_is_torch_saves(quantized, tmp_path):
    _assert_torch_save_layout(quantized[1], tmp_path)


def test_quantized_vocab_tensor_is_refused_and_inspect_says_so(tmp_path):
    import torch.ao.nn.quantized as nnq

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sd = nnq.Embedding(100, 8).state_dict()
    src = tmp_path / "ckpt.pt"
    torch.save({"model": {"embed.weight": torch.randn(100, 8), "head._packed_weight": sd["_packed_params._packed_weight"]}}, src)
    tok = word_level_tokenizer(tmp_path / "tok.json", 104)
    fixes = [f.fix for f in inspect(str(src), tokenizer=str(tok)).findings if f.code == "CKF101"]
    assert fixes and all("ckptfix repair cannot fix this: head._packed_weight is a quantized" in f for f in fixes)
    with pytest.raises(ckptfix.CkptfixError, match="does not resize quantized tensors") as err:
        ckptfix.repair(str(src), str(tok), str(tmp_path / "out.pt"))
    assert "\n" not in str(err.value) and not (tmp_path / "out.pt").exists()


def test_packed_quantized_tensors_are_refused_in_one_line(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        packed = torch.quantize_per_tensor(torch.randn(4, 4), 0.1, 0, torch.quint4x2)
    src = tmp_path / "ckpt.pt"
    torch.save({"model": {"embed.weight": torch.randn(100, 8), "w": packed}}, src)
    with pytest.raises(ckptfix.CkptfixError, match="quint4x2 tensor .quantized values packed") as err:
        inspect(str(src))
    assert "\n" not in str(err.value)


def _llama(vocab: int, tied: bool = False):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=tied)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _from_pretrained_and_check(folder: Path, model: torch.nn.Module, rows: int) -> None:
    transformers = pytest.importorskip("transformers")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(folder)
    assert loaded.get_input_embeddings().weight.shape[0] == rows
    old = model.state_dict()
    for name, t in loaded.state_dict().items():
        keep = min(t.shape[0], old[name].shape[0]) if t.dim() and t.shape != old[name].shape else None
        if keep is None:
            assert torch.equal(t, old[name]), name
        else:
            assert torch.equal(t[:keep], old[name][:keep]), name
    out = loaded(torch.tensor([[1, 2, rows - 1]]))
    assert out.logits.shape[-1] == rows and torch.isfinite(out.logits).all()


@pytest.mark.transformers
def test_repaired_bin_folder_loads_with_from_pretrained(tmp_path):
    model = _llama(1000)
    src = tmp_path / "llama"
    model.config.save_pretrained(src)
    torch.save(model.state_dict(), src / "pytorch_model.bin")  # what transformers 4 wrote
    tok = word_level_tokenizer(tmp_path / "tokenizer.json", 1004)
    out = tmp_path / "fixed"
    ckptfix.repair(str(src), str(tok), str(out))
    assert json.loads((out / "config.json").read_text())["vocab_size"] == 1004
    _from_pretrained_and_check(out, model, 1004)


@pytest.mark.transformers
def test_two_shard_bin_folder_has_no_false_ties_and_repairs(tmp_path):
    model = _llama(1000)
    src = tmp_path / "llama"
    model.config.save_pretrained(src)
    state = model.state_dict()
    # transformers 4's layout: torch.save of each shard dict, an index naming each tensor's shard
    names = list(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[:len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, src / shard)
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in state.values())},
        "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) == 2 and index["weight_map"]["lm_head.weight"] == shards[1]
    assert index["weight_map"]["model.embed_tokens.weight"] == shards[0]

    report = inspect(str(src), tokenizer=str(word_level_tokenizer(tmp_path / "tokenizer.json", 1004))).to_json()
    assert report["model"]["tied"] == {}
    vocab = {v["name"] for v in report["vocab"]["tensors"]}
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= vocab

    out = tmp_path / "fixed"
    ckptfix.repair(str(src), str(tmp_path / "tokenizer.json"), str(out))
    for shard in shards:
        torch.load(out / shard, weights_only=True, map_location="meta")
    _from_pretrained_and_check(out, model, 1004)
