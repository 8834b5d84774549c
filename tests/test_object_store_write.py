"""repair into object storage (issue 34, the write side) against a real S3 API server (tests/s3_server.py).

Each format is repaired twice, into a local folder and into `s3://`, and the objects published are the
local output's files byte for byte (SOURCE_DATE_EPOCH fixes the record's time); the framework's own fsspec
path loads them back (`dcp.load` with `FsspecReader`, Lightning's `ckpt_path="s3://..."`, `torch.load` of an
`fsspec.open` file). The switch object (DCP `.metadata`, a safetensors index) is written last, a refusal by
the store mid-publish takes back what was uploaded, and a process killed mid-upload leaves no object a
loader takes for a checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from ckpt_factory import new_run, train, trained_checkpoint
from test_repair_common import snapshot
from tokenizer_factory import train_bpe_tokenizer_json
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import ckptfix
from ckptfix.errors import CkptfixError

OLD = 48
EPOCH = "1700000000"


@pytest.fixture(autouse=True)
def reproducible(monkeypatch):
    monkeypatch.setenv("SOURCE_DATE_EPOCH", EPOCH)  # the record's `created`: both repairs write the same bytes


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    return {n: train_bpe_tokenizer_json(folder, n, name=f"bpe{n}.json") for n in (40, 64)}


def _quiet(fn, *args, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kw)


@pytest.fixture(scope="module")
def dcp_source(tmp_path_factory):
    path = tmp_path_factory.mktemp("dcp") / "step6"
    run = train(new_run(OLD), 6)
    msd, osd = get_state_dict(run.model, run.optimizer)
    _quiet(dcp.save, {"model": msd, "optim": osd, "sched": run.scheduler.state_dict(), "step": run.step},
           checkpoint_id=str(path))
    return path


def both(s3, tmp_path, source, tok, name: str, **options):
    """The repair into a local OUT and into s3://.../out/NAME; returns (local OUT, URL, the s3 result)."""
    local = tmp_path / "local" / name
    local.parent.mkdir()
    ckptfix.repair(source, tok, local, **options)
    url = s3.url(f"out/{name}")
    result = ckptfix.repair(source, tok, url, **options)
    assert result.output == url
    return local, url, result


def assert_same_objects(s3, tmp_path, local, url) -> None:
    """What was published under the URL is the local OUT, file for file and byte for byte."""
    if local.is_dir():
        back = tmp_path / "back"
        s3.download(url + "/", str(back))
        assert snapshot(back) == snapshot(local)
    else:
        published = s3.keys(s3.url("out/"))
        local_names = sorted(p.name for p in local.parent.iterdir())
        assert published == local_names
        for name in local_names:
            assert s3.read(s3.url(f"out/{name}")) == (local.parent / name).read_bytes(), name


def test_torch_file_published_matches_local_and_loads_through_fsspec(s3, tmp_path, tokenizers):
    import fsspec

    source = trained_checkpoint(tmp_path / "ckpt.pth", OLD, steps=3)
    before = source.read_bytes()
    local, url, result = both(s3, tmp_path, source, tokenizers[64], "fixed.pth")
    assert_same_objects(s3, tmp_path, local, url)
    assert any(n.startswith("published 1 object(s)") for n in result.notes)
    with fsspec.open(url, "rb") as f:
        sd = torch.load(f, weights_only=True)
    assert sd["model"]["text_embedding.weight"].shape[0] == 64
    assert source.read_bytes() == before


def test_safetensors_file_and_its_record_are_published(s3, tmp_path, tokenizers):
    from safetensors.torch import save_file

    model = train(new_run(OLD), 1).model
    source = tmp_path / "model.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(source))
    local, url, _ = both(s3, tmp_path, source, tokenizers[40], "fixed.safetensors")
    assert (local.parent / "fixed.safetensors.ckptfix.json").exists()
    assert_same_objects(s3, tmp_path, local, url)


def test_dcp_published_matches_local_metadata_last_and_loads_with_fsspec_reader(s3, tmp_path, tokenizers,
                                                                                dcp_source):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # not re-exported in torch 2.13

    before = snapshot(dcp_source)
    local, url, _ = both(s3, tmp_path, dcp_source, tokenizers[64], "step6-fixed")
    assert_same_objects(s3, tmp_path, local, url)
    assert snapshot(dcp_source) == before, "the input was modified"
    puts = [r.path.rsplit("/", 1)[1] for r in s3.counter.snapshot() if r.operation == "PutObject"]
    assert puts[-1] == ".metadata" and puts.count(".metadata") == 1, puts  # the switch object last

    run = new_run(64, seed=123)
    msd, osd = get_state_dict(run.model, run.optimizer)
    state = {"model": msd, "optim": osd, "sched": run.scheduler.state_dict(), "step": 0}
    _quiet(dcp.load, state, storage_reader=FsspecReader(url))
    set_state_dict(run.model, run.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 6 and run.model.embedding.weight.shape[0] == 64


def test_sharded_safetensors_folder_index_and_config_last(s3, tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    folder = tmp_path / "llama"
    model.save_pretrained(folder, max_shard_size="8KB")
    tok = train_bpe_tokenizer_json(tmp_path, 80, name="bpe80.json")
    local, url, _ = both(s3, tmp_path, folder, tok, "llama-fixed", keep_ids=True)
    assert_same_objects(s3, tmp_path, local, url)
    puts = [r.path.rsplit("/", 1)[1] for r in s3.counter.snapshot() if r.operation == "PutObject"]
    assert puts[-2:] == ["config.json", "model.safetensors.index.json"], puts
    back = tmp_path / "back"
    loaded = transformers.LlamaForCausalLM.from_pretrained(back)
    assert loaded.get_input_embeddings().weight.shape[0] >= 80


def test_lightning_resumes_from_the_published_checkpoint(s3, tmp_path, tokenizers):
    lit = pytest.importorskip("test_repair_lightning")
    root = tmp_path / "lit"
    torch.manual_seed(0)
    module = lit.LitLM(lit.OLD)
    trainer = lit.trainer(root, lit.STEPS)
    trainer.fit(module, lit.loader(lit.OLD, 16, seed=1))
    source = root / "last.ckpt"
    trainer.save_checkpoint(source)
    local, url, _ = both(s3, tmp_path, source, tokenizers[64], "last-fixed.ckpt")
    assert_same_objects(s3, tmp_path, local, url)

    resumed = lit.LitLM(64)
    lit.trainer(tmp_path / "resume", lit.STEPS + 2).fit(resumed, lit.loader(64, 8, seed=7), ckpt_path=url,
                                                        weights_only=True)
    assert resumed.at_start["global_step"] == lit.STEPS
    assert resumed.at_start["embedding"].shape[0] == 64


def test_a_refusal_mid_publish_takes_back_what_was_uploaded(s3, tmp_path, tokenizers, dcp_source):
    before = snapshot(dcp_source)
    url = s3.url("out/refused")
    at_switch = lambda r: r.operation == "PutObject" and r.path.endswith("/refused/.metadata")  # noqa: E731
    with s3.server.refuse(at_switch) as reached, pytest.raises(CkptfixError) as err:
        ckptfix.repair(dcp_source, tokenizers[64], url)
    assert reached.is_set()
    assert "access denied" in str(err.value) and "testing" not in str(err.value)
    assert s3.keys(url + "/") == []  # the data objects already uploaded were deleted
    assert snapshot(dcp_source) == before


def test_a_data_object_the_store_lists_short_stops_the_switch(s3, tmp_path, tokenizers, dcp_source, monkeypatch):
    """One listing before the first switch object: a data object the store holds at another size than staged
    (cut by a proxy, overwritten by another writer) stops the publish before `.metadata` is written, and what
    was uploaded is deleted."""
    import ckptfix.publish as publish

    url = s3.url("out/short")
    real = publish._upload

    def upload_then_cut(fs, local, key, copies, done):
        real(fs, local, key, copies, done)
        if key.endswith(".distcp") and not done.objects:  # the first data object, cut after its upload
            s3.client.put_object(Bucket=s3.name, Key=key.split("/", 1)[1], Body=b"short")

    monkeypatch.setattr(publish, "_upload", upload_then_cut)
    with pytest.raises(CkptfixError, match=r"the store lists 5 bytes after the upload of .*nothing is published"):
        ckptfix.repair(dcp_source, tokenizers[64], url)
    assert s3.keys(url + "/") == []


@pytest.mark.parametrize("what", ["dcp", "file"])
def test_a_process_killed_mid_upload_leaves_no_checkpoint(s3, tmp_path, tokenizers, dcp_source, what):
    """The server holds the first object upload; the CLI process is killed there (SIGKILL: no cleanup). A
    single-file OUT is then absent, or whole when its body had been sent before the kill (one PUT: S3 never
    shows part of an object)."""
    if what == "dcp":
        source, url = dcp_source, s3.url("out/killed")
    else:
        source, url = trained_checkpoint(tmp_path / "ckpt.pth", OLD, steps=1), s3.url("out/killed.pth")
    before = snapshot(source) if source.is_dir() else source.read_bytes()
    scratch = tmp_path / "tmp"  # the child's TMPDIR: a SIGKILL leaves its staging folder (SECURITY.md)
    scratch.mkdir()
    env = {**os.environ, "PYTHONPATH": os.getcwd(), "TMPDIR": str(scratch)}
    cmd = [sys.executable, "-m", "ckptfix.cli", "repair", str(source), "-t", str(tokenizers[64]), "-o", url]
    first_upload = lambda r: r.operation in ("PutObject", "UploadPart", "CreateMultipartUpload")  # noqa: E731
    with s3.server.hold(first_upload) as reached:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert reached.wait(120), "the repair never started uploading"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    assert [p.name[:12] for p in scratch.iterdir()] == ["ckptfix-out-"]
    keys = s3.keys(s3.url("out/"))
    assert ".metadata" not in [k.rsplit("/", 1)[-1] for k in keys], keys  # the data objects alone load nothing
    if "killed.pth" in keys:  # the whole body had reached the held request before the kill: S3 stores it whole
        import fsspec

        with fsspec.open(url, "rb") as f:
            assert torch.load(f, weights_only=True)["model"]["text_embedding.weight"].shape[0] == 64
    assert (snapshot(source) if source.is_dir() else source.read_bytes()) == before


def test_an_existing_out_and_force_are_refused_with_exit_2(s3, tmp_path, tokenizers):
    source = trained_checkpoint(tmp_path / "ckpt.pth", OLD, steps=1)
    s3.client.put_object(Bucket=s3.name, Key="out/taken.pth", Body=b"x")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    for extra in ([], ["--force"]):
        cmd = [sys.executable, "-m", "ckptfix.cli", "repair", str(source), "-t", str(tokenizers[64]),
               "-o", s3.url("out/taken.pth"), *extra]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert s3.read(s3.url("out/taken.pth")) == b"x"


def test_json_names_the_url(s3, tmp_path, tokenizers):
    source = trained_checkpoint(tmp_path / "ckpt.pth", OLD, steps=1)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "ckptfix.cli", "repair", str(source), "-t", str(tokenizers[64]),
           "-o", s3.url("out/j.pth"), "--json"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert data["output"] == s3.url("out/j.pth") and "ckptfix-out-" not in done.stdout
