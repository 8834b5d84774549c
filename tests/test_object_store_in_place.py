"""Checkpoints read from and written to object storage (issue 34): repair `s3://` -> `s3://` with server-side
copies, `--in-place` on an `s3://` prefix, and `ckptfix restore s3://...`, against the real S3 API server of
tests/s3_server.py. Each is compared with the same operation on a local copy: every object byte for byte,
except the record (`ckptfix.json`), whose source is the URL and whose source hash is not computed (hashing
would download what the copies leave in the store)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_factory import new_run, train
from test_repair_common import snapshot
from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not re-exported in torch 2.13
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptfix

OLD = 48
BIG = (3 << 20, 1)  # 12 MiB of float32 with no vocab axis: its records are copied, never re-uploaded
MEGATRON = Path(__file__).resolve().parent.parent / "fixtures" / "megatron" / "small-tp2-dp2-adam"


@pytest.fixture(autouse=True)
def reproducible(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")


@pytest.fixture(autouse=True)
def strict_reads(monkeypatch):
    """Unfetched bytes of a mirror read as 0xFF, not zeros, here and in a CLI child: a read that bypassed
    the fetch, or a recorded copy that publish failed to make, breaks the comparison with the local output."""
    from ckptfix import remote

    monkeypatch.setattr(remote, "strict_reads", True)
    monkeypatch.setenv("CKPTFIX_STRICT_READS", "1")


@pytest.fixture(scope="module")
def tok64(tmp_path_factory):
    return train_bpe_tokenizer_json(tmp_path_factory.mktemp("tok"), 64, name="bpe64.json")


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


@pytest.fixture(scope="module")
def big_dcp(tmp_path_factory):
    """A DCP folder of a trained run plus one 12 MiB tensor the repair leaves alone."""
    path = tmp_path_factory.mktemp("dcp") / "step2"
    run = train(new_run(OLD), 2)
    msd, osd = get_state_dict(run.model, run.optimizer)
    torch.manual_seed(0)
    msd["frozen.weight"] = torch.randn(*BIG)
    _quiet(dcp.save, {"model": msd, "optim": osd, "step": 2}, checkpoint_id=str(path))
    return path


def same_outputs(local: Path, back: Path, source_url: str) -> None:
    """Same files, same bytes; the record differs only in naming the URL as its source and no source hash."""
    assert sorted(snapshot(local)) == sorted(snapshot(back))
    for name in snapshot(local):
        a, b = (local / name).read_bytes(), (back / name).read_bytes()
        if os.path.basename(name) != "ckptfix.json":
            assert a == b, name
            continue
        ra, rb = json.loads(a), json.loads(b)
        assert rb["source"].startswith(source_url) and rb["source_sha256"] is None
        for r in (ra, rb):
            r["source"] = r["source_sha256"] = None
            # how a file was copied (reflink, copy_file_range, read/write) is the machine's, not the output's
            r["notes"] = [re.sub(r"((reflink|copy_file_range|read/write|recorded)( x\d+)?(, )?)+", "-", n) for n in r["notes"]]
        assert ra == rb


def load_dcp(url: str, vocab: int) -> dict:
    run = new_run(vocab, seed=123)
    msd, osd = get_state_dict(run.model, run.optimizer)
    msd["frozen.weight"] = torch.empty(*BIG)
    state = {"model": msd, "optim": osd, "step": 0}
    _quiet(dcp.load, state, storage_reader=FsspecReader(url))
    frozen = state["model"].pop("frozen.weight")
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"run": run, "frozen": frozen, "step": state["step"]}


def test_dcp_from_s3_to_s3_copies_unchanged_records_inside_the_store(s3, tmp_path, tok64, big_dcp):
    s3.upload(str(big_dcp), s3.url("in/step2/"))
    s3.counter.reset()
    result = ckptfix.repair(s3.url("in/step2"), tok64, s3.url("out/step2-fixed"))
    ops, uploaded = s3.counter.operations(), s3.counter.data_uploaded
    total = sum(size for size, _ in snapshot(big_dcp).values())
    assert ops["UploadPartCopy"] >= 1, s3.counter.summary()
    assert uploaded < total - (6 << 20), s3.counter.summary()  # the big tensor's bytes stayed in the store
    assert s3.counter.bytes_out < total - (6 << 20), s3.counter.summary()  # ... and were not downloaded
    assert "bytes copied inside the store" in result.notes[-1]

    ckptfix.repair(big_dcp, tok64, tmp_path / "local")
    s3.download(s3.url("out/step2-fixed/"), str(tmp_path / "back"))
    same_outputs(tmp_path / "local", tmp_path / "back", s3.url("in/step2"))
    loaded = load_dcp(s3.url("out/step2-fixed"), 64)
    assert loaded["step"] == 2 and loaded["run"].model.embedding.weight.shape[0] == 64
    torch.manual_seed(0)
    assert torch.equal(loaded["frozen"], torch.randn(*BIG))


def test_dcp_in_place_on_s3_uploads_only_the_change_and_restore_puts_it_back(s3, tmp_path, tok64, big_dcp):
    s3.upload(str(big_dcp), s3.url("run/step2/"))
    original = {k: s3.read(s3.url(f"run/step2/{k}")) for k in s3.keys(s3.url("run/step2/"))}
    s3.counter.reset()
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cli = [sys.executable, "-m", "ckptfix.cli"]
    done = subprocess.run([*cli, "repair", s3.url("run/step2"), "-t", str(tok64), "--in-place"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "undo: ckptfix restore s3://" in done.stdout and "ckptfix-remote-" not in done.stdout
    total = sum(len(v) for v in original.values())
    assert s3.counter.data_uploaded < 200_000 < total, s3.counter.summary()  # changed tensors + metadata
    assert s3.counter.bytes_out < 1_000_000, s3.counter.summary()
    puts = [r.path.rsplit("/", 1)[1] for r in s3.counter.snapshot() if r.operation in ("PutObject", "CopyObject")]
    assert puts[-1] == ".metadata", puts  # the switch object last

    local = tmp_path / "local"
    shutil.copytree(big_dcp, local)
    ckptfix.repair(local, tok64, in_place=True)
    s3.download(s3.url("run/step2/"), str(tmp_path / "back"))
    same_outputs(local, tmp_path / "back", s3.url("run/step2"))
    assert load_dcp(s3.url("run/step2"), 64)["run"].model.embedding.weight.shape[0] == 64

    done = subprocess.run([*cli, "restore", s3.url("run/step2")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert "restored .metadata" in done.stdout
    assert {k: s3.read(s3.url(f"run/step2/{k}")) for k in s3.keys(s3.url("run/step2/"))} == original


def test_in_place_with_a_data_object_listed_short_keeps_the_old_switch(s3, tmp_path, tok64, big_dcp, monkeypatch):
    """The in-place publish lists OUT once before the new `.metadata`: a new data object the store holds cut
    short stops it with exit 2's line; the old `.metadata` still stands, and restore removes what was added."""
    import ckptfix.publish as publish

    s3.upload(str(big_dcp), s3.url("run/cut/"))
    original = {k: s3.read(s3.url(f"run/cut/{k}")) for k in s3.keys(s3.url("run/cut/"))}
    real = publish._upload

    def upload_then_cut(fs, local, key, copies, done):
        real(fs, local, key, copies, done)
        if key.endswith(".distcp"):
            s3.client.put_object(Bucket=s3.name, Key=key.split("/", 1)[1], Body=b"short")

    monkeypatch.setattr(publish, "_upload", upload_then_cut)
    with pytest.raises(ckptfix.CkptfixError, match="the switch objects were not written"):
        ckptfix.repair(s3.url("run/cut"), tok64, in_place=True)
    assert s3.read(s3.url("run/cut/.metadata")) == original[".metadata"]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    done = subprocess.run([sys.executable, "-m", "ckptfix.cli", "restore", s3.url("run/cut")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert {k: s3.read(s3.url(f"run/cut/{k}")) for k in s3.keys(s3.url("run/cut/"))} == original


def test_sharded_safetensors_in_place_on_s3_and_restore(s3, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=4,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    folder = tmp_path / "llama"
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="8KB")
    tok = train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")
    s3.upload(str(folder), s3.url("hf/llama/"))
    original = {k: s3.read(s3.url(f"hf/llama/{k}")) for k in s3.keys(s3.url("hf/llama/"))}
    s3.counter.reset()
    ckptfix.repair(s3.url("hf/llama"), tok, in_place=True, keep_ids=True)
    puts = [r.path.rsplit("/", 1)[1] for r in s3.counter.snapshot() if r.operation in ("PutObject", "CopyObject")]
    assert puts[-1] == "model.safetensors.index.json", puts

    ckptfix.repair(folder, tok, in_place=True, keep_ids=True)
    s3.download(s3.url("hf/llama/"), str(tmp_path / "back"))
    same_outputs(folder, tmp_path / "back", s3.url("hf/llama"))
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "back")
    assert loaded.get_input_embeddings().weight.shape[0] >= 80

    from ckptfix.surgery.undo import restore

    assert any("model.safetensors.index.json" in line for line in restore(s3.url("hf/llama")))
    assert {k: s3.read(s3.url(f"hf/llama/{k}")) for k in s3.keys(s3.url("hf/llama/"))} == original


def test_megatron_in_place_on_s3_and_restore(s3, tmp_path):
    if not MEGATRON.is_dir():
        pytest.skip("fixtures/megatron is not there")
    old = train_bpe_tokenizer_json(tmp_path, 200, name="tok-200.json")
    new = extend_tokenizer_json(old, tmp_path / "tok-300.json", [f"new{i}" for i in range(100)])
    s3.upload(str(MEGATRON), s3.url("mg/save/"))
    original = {k: s3.read(s3.url(f"mg/save/{k}")) for k in s3.keys(s3.url("mg/save/"))}
    ckptfix.repair(s3.url("mg/save"), new, in_place=True)

    local = tmp_path / "save"
    shutil.copytree(MEGATRON, local)
    ckptfix.repair(local, new, in_place=True)
    s3.download(s3.url("mg/save/"), str(tmp_path / "back"))
    same_outputs(local, tmp_path / "back", s3.url("mg/save"))

    from ckptfix.surgery.undo import restore

    assert restore(s3.url("mg/save/iter_0000002"))
    assert {k: s3.read(s3.url(f"mg/save/{k}")) for k in s3.keys(s3.url("mg/save/"))} == original


def test_the_readme_block_runs(s3, tmp_path, tok64, big_dcp):
    """docs/object-storage.md's "Repairing into object storage" commands, as written (the bucket and tokenizer substituted)."""
    from test_docs import OBJECT_STORAGE, WRITE_BLOCK, _code_blocks

    block = next(b for _, b in _code_blocks(OBJECT_STORAGE.read_text(encoding="utf-8")) if b.startswith(WRITE_BLOCK))
    s3.upload(str(big_dcp), s3.url("run/step-100/"))
    original = {k: s3.read(s3.url(f"run/step-100/{k}")) for k in s3.keys(s3.url("run/step-100/"))}
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for line in block.strip().splitlines():
        command = line.split("#", 1)[0].replace("s3://bucket/", s3.url()).replace("tok.model", str(tok64))
        argv = shlex.split(command)
        assert argv[0] == "ckptfix"
        done = subprocess.run([sys.executable, "-m", "ckptfix.cli", *argv[1:]], env=env, capture_output=True,
                              text=True, timeout=300)
        assert done.returncode == 0, (line, done.stderr)
    assert ".metadata" in s3.keys(s3.url("run/step-100-fixed/"))
    assert {k: s3.read(s3.url(f"run/step-100/{k}")) for k in s3.keys(s3.url("run/step-100/"))} == original


def test_sharded_safetensors_from_s3_to_s3_copies_unchanged_shards_whole(s3, tmp_path):
    """Shards without a vocab tensor are whole-object copies inside the store (CopyObject), never downloaded."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=512, intermediate_size=2048, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=False)
    folder = tmp_path / "llama"  # shards of ~13 MB: copies of 5 MiB or more stay in the store
    transformers.LlamaForCausalLM(config).save_pretrained(folder, max_shard_size="14MB")
    tok = train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")
    s3.upload(str(folder), s3.url("hf/llama/"))
    s3.counter.reset()
    ckptfix.repair(s3.url("hf/llama"), tok, s3.url("hf/llama-fixed"), keep_ids=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    untouched = set(index.values()) - {index["model.embed_tokens.weight"], index["lm_head.weight"]}
    copies = {r.headers["x-amz-copy-source"].rsplit("/", 1)[1] for r in s3.counter.snapshot()
              if r.operation == "CopyObject"}
    assert untouched and untouched <= copies, (untouched, copies)

    ckptfix.repair(folder, tok, tmp_path / "local", keep_ids=True)
    s3.download(s3.url("hf/llama-fixed/"), str(tmp_path / "back"))
    same_outputs(tmp_path / "local", tmp_path / "back", s3.url("hf/llama"))


def test_sharded_safetensors_to_s3_copies_ranges_beside_a_grown_tensor(s3, tmp_path, monkeypatch):
    """A shard holding the grown embedding and, after it, unchanged tensors of 5 MiB or more: those ranges are
    copied inside the store (UploadPartCopy) and stay holes in the staged shard, which must still have its full
    length (the verify stage reads its header against its size: before, bench/object_storage.py's 2 GB
    safetensors folder failed there, exit 3)."""
    import bench.sharded as sharded

    monkeypatch.setattr(sharded, "ROWS", 1024)
    monkeypatch.setattr(sharded, "WIDTH", 1536)  # the embedding 6.3 MB, each layer 9.4 MB, in one shard
    folder = tmp_path / "hf"
    sharded.build_hf(str(folder), 0.03)
    tok = tmp_path / "tok.json"
    sharded.build_tokenizer(str(tok), 1024 + 64)
    s3.upload(str(folder), s3.url("hf/ranges/"))
    s3.counter.reset()
    ckptfix.repair(s3.url("hf/ranges"), tok, s3.url("hf/ranges-fixed"))
    assert any(r.operation == "UploadPartCopy" for r in s3.counter.snapshot())
    ckptfix.repair(folder, tok, tmp_path / "local")
    s3.download(s3.url("hf/ranges-fixed/"), str(tmp_path / "back"))
    same_outputs(tmp_path / "local", tmp_path / "back", s3.url("hf/ranges"))
