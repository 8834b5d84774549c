"""Checkpoints in object storage, the read side (issue 34): inspect, diff and repair take `s3://` URLs.

Every test talks HTTP to a real S3 API server (moto's server mode, `tests/s3_server.py`) through ckptfix's
whole client stack (fsspec -> s3fs -> aiobotocore); nothing of ckptfix is mocked. Each format ckptfix reads
is written by its own framework, uploaded with boto3, and inspected from `s3://` with `--scan` (every tensor
byte read): the text and `--json` reports must equal the local copy's, with `remote.strict_reads` on (an
unfetched byte reads as 0xFF, so a reader that bypassed `remote.ensure` would report NaNs or a broken
header instead). Inspect's cost is counted at the server: bounded by the metadata, the same for a
checkpoint ten times larger.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptfix import remote
from ckptfix.cli import main

try:  # the DeepSpeed universal folder of the repair tests (a real 2-rank run: -m long)
    from test_repair_deepspeed_universal import universal  # noqa: F401
except (ImportError, pytest.skip.Exception):  # no deepspeed here
    @pytest.fixture
    def universal():
        pytest.skip("needs deepspeed")

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "fixtures" / "seed001"


@dataclass
class Result:
    exit_code: int
    stdout: str
    stderr: str


def run(*args: object) -> Result:
    """The CLI in this process (its mirrors removed after each command, as at a process's exit)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        finally:
            remote.close_all()
    return Result(code, out.getvalue(), err.getvalue())


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setattr(remote, "strict_reads", True)


def _same_report(s3, local: Path, url: str, *extra: object, scan: bool = True) -> tuple[Result, Result]:
    """inspect LOCAL and URL (text and --json, --scan unless told): equal once each names its input alike."""
    flags = ["--scan"] if scan else []
    results = []
    for as_json in ([], ["--json"]):
        here = run("inspect", local, *extra, *flags, *as_json)
        there = run("inspect", url, *extra, *flags, *as_json)
        assert here.exit_code == there.exit_code, (here, there)
        assert there.stderr == here.stderr.replace(str(local), url.rstrip("/"))
        assert there.stdout == _as_url(here.stdout, local, url), there.stdout
        results.append(there)
    return results[0], results[1]


def _as_url(text: str, local: Path, url: str) -> str:
    """The local report as the remote one spells it: the input's path as its URL, and a name beside the
    input (the `-o` a fix suggests) as a name beside the URL."""
    url = url.rstrip("/")
    text = text.replace(str(local), url)
    return text.replace(f"-o {local.parent}/", f"-o {url.rpartition('/')[0]}/")


# --- torch.save files ---------------------------------------------------------------------------------

def test_torch_zip_file_inspects_as_the_local_copy(s3):
    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    _same_report(s3, SEED / "ckpt.pth", s3.url("run/ckpt.pth"), "--tokenizer", SEED / "tokenizer.model")
    _same_report(s3, SEED / "ckpt.pth", s3.url("run/ckpt.pth"), "--verify", scan=False)  # every record's CRC-32


def _cost(s3, *args: object) -> tuple[int, int, Result]:
    """(requests, bytes sent by the server, result) of one command, counted at the server."""
    s3.counter.reset()
    result = run(*args)
    return s3.counter.count, s3.counter.bytes_out, result


def _torch_run(vocab: int, dim: int):
    from ckpt_factory import new_run, train

    return train(new_run(vocab, dim=dim), 3)


def test_torch_legacy_stream_inspects_as_the_local_copy(s3, tmp_path):
    import torch
    from ckpt_factory import save_checkpoint

    run_ = _torch_run(300, 16)
    path = tmp_path / "legacy.pt"
    save_checkpoint(run_, tmp_path / "zip.pt")
    torch.save(torch.load(tmp_path / "zip.pt", weights_only=True), path, _use_new_zipfile_serialization=False)
    s3.upload(str(path), s3.url("old/legacy.pt"))
    _same_report(s3, path, s3.url("old/legacy.pt"))


def test_safetensors_file_inspects_as_the_local_copy(s3, tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(_torch_run(300, 16).model.state_dict(), str(path))
    s3.upload(str(path), s3.url("w/model.safetensors"))
    _same_report(s3, path, s3.url("w/model.safetensors"))


def _dcp_save(state: dict, path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... assuming a single process"
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=str(path))


def _dcp_checkpoint(path: Path, vocab: int, dim: int) -> Path:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    run_ = _torch_run(vocab, dim)
    msd, osd = get_state_dict(run_.model, run_.optimizer)
    _dcp_save({"model": msd, "optim": osd, "sched": run_.scheduler.state_dict(), "step": run_.step}, path)
    return path


def test_dcp_folder_inspects_as_the_local_copy(s3, tmp_path):
    path = _dcp_checkpoint(tmp_path / "step-3", 300, 16)
    s3.upload(str(path), s3.url("run/step-3"))
    _same_report(s3, path, s3.url("run/step-3/"))


@pytest.mark.parametrize("name", ["small-tp2-dp2-adam", "small-tp1-dp2-dist-fully"])
def test_megatron_folder_inspects_as_the_local_copy(s3, name):
    path = ROOT / "fixtures" / "megatron" / name
    s3.upload(str(path), s3.url(f"megatron/{name}"))
    _same_report(s3, path, s3.url(f"megatron/{name}"))
    iteration = path / "iter_0000002"
    _same_report(s3, iteration, s3.url(f"megatron/{name}/iter_0000002"))


@pytest.mark.lightning
def test_lightning_ckpt_inspects_as_the_local_copy(s3, tmp_path):
    pytest.importorskip("lightning")
    from test_formats_lightning import TinyModule, _fit

    trainer, _ = _fit(tmp_path / "root", TinyModule())
    path = tmp_path / "last.ckpt"
    trainer.save_checkpoint(path)
    s3.upload(str(path), s3.url("lightning/last.ckpt"))
    _same_report(s3, path, s3.url("lightning/last.ckpt"))


@pytest.fixture(scope="module")
def trainer_folder(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_inspect_formats import trainer_checkpoint

    return trainer_checkpoint.__wrapped__(tmp_path_factory)[0]


@pytest.mark.transformers
def test_hf_trainer_folder_inspects_as_the_local_copy(s3, trainer_folder):
    s3.upload(str(trainer_folder), s3.url("out/checkpoint-2"))
    _same_report(s3, trainer_folder, s3.url("out/checkpoint-2"))


@pytest.mark.transformers
def test_sharded_safetensors_index_inspects_as_the_local_copy(s3, tmp_path):
    transformers = pytest.importorskip("transformers")
    import torch

    torch.manual_seed(0)
    path = tmp_path / "gpt2"
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="10KB")
    assert (path / "model.safetensors.index.json").exists()
    s3.upload(str(path), s3.url("hf/gpt2"))
    _same_report(s3, path, s3.url("hf/gpt2"))


@pytest.mark.long
@pytest.mark.deepspeed
def test_deepspeed_universal_folder_inspects_as_the_local_copy(s3, universal):
    """A real 2-rank ZeRO run converted by DeepSpeed's ds_to_universal (the repair tests' fixture)."""
    folder = universal[1]
    s3.upload(str(folder), s3.url("ds/global_step3_universal"))
    _same_report(s3, folder, s3.url("ds/global_step3_universal"))


def test_file_urls_go_through_the_same_mirror(tmp_path):
    """`file://` (fsspec's local store): the same ranged reads, no server."""
    from tokenizer_factory import train_bpe_tokenizer_json

    path = _dcp_checkpoint(tmp_path / "step-3", 300, 16)
    tok = train_bpe_tokenizer_json(tmp_path, 320, name="bpe320.json")
    here = run("inspect", path, "-t", tok, "--json")
    there = run("inspect", f"file://{path}", "-t", f"file://{tok}", "--json")
    assert here.exit_code == there.exit_code == 1
    assert there.stdout == here.stdout.replace(str(path), f"file://{path}").replace(str(tok), f"file://{tok}")


# --- tokenizers from URLs -----------------------------------------------------------------------------

def test_tokenizer_urls_read_as_local_files(s3, tmp_path):
    from tokenizer_factory import train_bpe_tokenizer_json

    s3.upload(str(SEED / "tokenizer.model"), s3.url("tok/tokenizer.model"))
    ckpt = SEED / "ckpt.pth"
    for local, url in ((SEED / "tokenizer.model", s3.url("tok/tokenizer.model")),):
        here = run("inspect", ckpt, "--tokenizer", local, "--json")
        there = run("inspect", ckpt, "--tokenizer", url, "--json")
        assert here.exit_code == there.exit_code == 1
        assert there.stdout == here.stdout.replace(str(local), url)
    folder = tmp_path / "tokfolder"
    folder.mkdir()
    train_bpe_tokenizer_json(folder, 300, name="tokenizer.json")
    s3.upload(str(folder), s3.url("tok/folder"))
    here = run("inspect", ckpt, "--tokenizer", folder, "--json")
    there = run("inspect", ckpt, "--tokenizer", s3.url("tok/folder"), "--json")
    assert here.exit_code == there.exit_code
    assert there.stdout == here.stdout.replace(str(folder), s3.url("tok/folder")), there.stdout


# --- what inspect costs ------------------------------------------------------------------------------

MAX_BYTES = 1 << 20


def _sizes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", ["torch", "safetensors", "dcp"])
def test_inspect_cost_is_bounded_by_the_metadata(s3, tmp_path, kind):
    """A checkpoint and one with the same tensors ten times larger: inspect (no --scan) asks the server the
    same number of requests, under 1 MB, whatever the tensor bytes."""
    from ckpt_factory import save_checkpoint
    from safetensors.torch import save_file

    costs = []
    for scale, (vocab, dim) in enumerate(((2000, 32), (20000, 32))):
        folder = tmp_path / f"s{scale}"
        folder.mkdir()
        if kind == "torch":
            path = save_checkpoint(_torch_run(vocab, dim), folder / "ckpt.pth")
        elif kind == "safetensors":
            path = folder / "model.safetensors"
            save_file(_torch_run(vocab, dim).model.state_dict(), str(path))
        else:
            path = _dcp_checkpoint(folder / "step-3", vocab, dim)
        url = s3.url(f"cost/{scale}/{path.name}")
        s3.upload(str(path), url)
        requests, nbytes, result = _cost(s3, "inspect", url)
        assert result.exit_code in (0, 1), result
        costs.append((_sizes(path), requests, nbytes))
    (small, req_small, bytes_small), (large, req_large, bytes_large) = costs
    print(f"{kind}: {small:,} B -> {req_small} requests, {bytes_small:,} B; "
          f"{large:,} B -> {req_large} requests, {bytes_large:,} B")
    assert large > 8 * small
    assert req_large == req_small, costs
    assert bytes_large < MAX_BYTES and bytes_small < MAX_BYTES, costs


def _deep_run(layers: int, vocab: int = 300, width: int = 160):
    """An embedding, `layers` square matrices and a head, after 2 real AdamW steps: each parameter's state
    (its moments, then its step) lies apart from the next one's by more than `remote.PREFETCH_GAP`."""
    from collections import OrderedDict

    import torch

    torch.manual_seed(0)
    blocks = OrderedDict(embed=torch.nn.Embedding(vocab, width))
    blocks.update((f"layer{i}", torch.nn.Linear(width, width, bias=False)) for i in range(layers))
    blocks["head"] = torch.nn.Linear(width, vocab, bias=False)
    model = torch.nn.Sequential(blocks)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, vocab, (4, 8))
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model, optimizer


def _deep_checkpoint(folder: Path, kind: str, layers: int) -> Path:
    model, optimizer = _deep_run(layers)
    folder.mkdir(parents=True)
    if kind == "torch":
        import torch

        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, folder / "ckpt.pth")
        return folder / "ckpt.pth"
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    _dcp_save({"model": msd, "optim": osd}, folder / "step-2")
    return folder / "step-2"


@pytest.mark.parametrize("kind", ["torch", "dcp"])
def test_inspect_requests_do_not_grow_with_the_parameter_count(s3, tmp_path, kind):
    """torch.save and DCP write each parameter's state together: its moments, then its `step`. Its step, its
    records' zip headers (and each DCP record's own zip) then lie apart from the next parameter's, a request
    each: 913 requests for 300 parameters of a torch file, 1,034 for a DCP folder, before. Past
    `remote.PREFETCH_BUDGET` requests inspect leaves them for when they are read and says so (the steps
    read from both ends of the state: the embedding's and the head's); the same number of requests for 10
    and 40 parameters. `--scan` reads every one and equals the local report; repair equals the local one."""
    from bench.sharded import build_tokenizer

    costs = []
    for layers in (10, 40):
        path = _deep_checkpoint(tmp_path / f"l{layers}", kind, layers)
        url = s3.url(f"deep/{layers}/{path.name}")
        s3.upload(str(path), url)
        requests, nbytes, there = _cost(s3, "inspect", url)
        assert there.exit_code == 0, there
        notes = [line for line in there.stdout.splitlines() if "object storage:" in line]
        assert f"the step of {layers + 2 - 8} of {layers + 2} parameters was not read" in notes[-1], notes
        assert "tensor record(s) were not opened" in notes[0], notes
        here = run("inspect", path)
        assert [x for x in there.stdout.splitlines() if x not in notes] == _as_url(here.stdout, path, url).splitlines()
        costs.append((requests, nbytes))
    print(f"{kind}: 12 parameters -> {costs[0][0]} requests, {costs[0][1]:,} B; "
          f"42 -> {costs[1][0]} requests, {costs[1][1]:,} B")
    assert costs[0][0] == costs[1][0] <= remote.PREFETCH_BUDGET + 6, costs
    assert max(nbytes for _, nbytes in costs) < MAX_BYTES, costs
    _same_report(s3, path, url, scan=True)
    tok = tmp_path / "tok.json"
    build_tokenizer(str(tok), 308)
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    _repairs_alike(s3, path, url, tok, tmp_path)


def test_a_zip_record_read_later_is_checked_for_overlap_then(s3, tmp_path, monkeypatch):
    """With no request to spare (`PREFETCH_BUDGET` 0) the zip's local headers are read with their records:
    a central directory pointing one record at another's header is refused when that record is read, with
    the line the local check gives when the archive is opened."""
    import struct
    import zipfile

    path = _deep_checkpoint(tmp_path / "d", "torch", 2)
    data = bytearray(path.read_bytes())
    infos = {i.filename: i for i in zipfile.ZipFile(path).infolist()}
    prefix = next(iter(infos)).split("/")[0]
    at = data.find(b"PK\x01\x02") - 1
    while (at := data.find(b"PK\x01\x02", at + 1)) >= 0:
        name_len = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46:at + 46 + name_len] == f"{prefix}/data/1".encode():
            struct.pack_into("<I", data, at + 42, infos[f"{prefix}/data/0"].header_offset)
    path.write_bytes(bytes(data))
    s3.upload(str(path), s3.url("bad/ckpt.pth"))
    monkeypatch.setattr(remote, "PREFETCH_BUDGET", 0)
    line = (f"ckptfix: error: {s3.url('bad/ckpt.pth')}: zip members '{prefix}/data/0' and '{prefix}/data/1' overlap in the file "
            "(one's bytes would be read as the other's); not an archive torch.save writes")
    local = run("inspect", path)
    assert local.exit_code == 2 and local.stderr.strip() == line.replace(s3.url("bad/ckpt.pth"), str(path)), local
    lazy = run("inspect", s3.url("bad/ckpt.pth"))
    assert lazy.exit_code == 0 and "tensor record(s) were not opened" in lazy.stdout, lazy
    for args in (["inspect", "--scan"], ["repair", "-t", SEED / "tokenizer.model", "-o", tmp_path / "o.pth"]):
        result = run(args[0], s3.url("bad/ckpt.pth"), *args[1:])
        assert (result.exit_code, result.stderr.strip()) == (2, line), result
    assert not (tmp_path / "o.pth").exists()


def _sharded_dcp(folder: Path, monkeypatch, rows: int, width: int) -> Path:
    """bench/sharded.py's 8-rank FSDP save (model + AdamW moments, each tensor in 8 pieces), small."""
    import bench.sharded as sharded

    monkeypatch.setattr(sharded, "ROWS", rows)
    monkeypatch.setattr(sharded, "WIDTH", width)
    sharded.build_dcp(str(folder), 0.01)
    return folder


def test_sharded_dcp_inspect_opens_no_piece_and_repairs_alike(s3, tmp_path, monkeypatch):
    """An 8-rank save with pieces past 8 KB: inspect from s3:// reads .metadata and the small records (the
    steps), never a piece (a request each: 200 for the 2 GB bench, before), and says so; otherwise the report
    is the local one. Repair reads the pieces it needs and writes what the local repair writes."""
    from bench.sharded import build_tokenizer

    path = _sharded_dcp(tmp_path / "step-9", monkeypatch, 1024, 256)  # pieces of 32 and 128 KB
    items = len([k for k in __import__("pickle").load(open(path / ".metadata", "rb")).storage_data])
    s3.upload(str(path), s3.url("fsdp/step-9"))
    requests, nbytes, there = _cost(s3, "inspect", s3.url("fsdp/step-9"))
    here = run("inspect", path)
    note = [line for line in there.stdout.splitlines() if "object storage:" in line]
    assert len(note) == 1 and "were not opened" in note[0]
    assert [x for x in there.stdout.splitlines() if x not in note] == \
        _as_url(here.stdout, path, s3.url("fsdp/step-9")).splitlines()
    print(f"inspect: {requests} requests, {nbytes:,} B for {items} records")
    assert requests < 20 < items and nbytes < 256 * 1024, (requests, nbytes, items)  # the steps: one each
    tok = tmp_path / "tok.json"
    build_tokenizer(str(tok), 1024 + 8)
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    _repairs_alike(s3, path, s3.url("fsdp/step-9"), tok, tmp_path)


# --- repair from s3:// into a local OUT ----------------------------------------------------------------

def _normal_record(record: dict, unhashed: bool = False) -> dict:
    """A record without what names the run rather than the result: when it was made, and the input's
    spelling (a path here, a URL there). `unhashed`: one side's input was not hashed (an `s3://` to `s3://`
    repair leaves the copied bytes in the store), so its hash is not compared."""
    record = json.loads(json.dumps(record, default=str))
    for part in (record, record.get("provenance") or {}):
        part.pop("created", None)
        part.pop("source", None)
        if unhashed:
            part.pop("source_sha256", None)
    for key in ("tokenizer", "from_tokenizer"):
        if isinstance(record.get(key), dict):
            record[key].pop("path", None)
    return record


def _same_tree(a, b, where: str, unhashed: bool = False) -> None:
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        bits_a, bits_b = (t.reshape(-1).contiguous().view(torch.uint8) for t in (a, b))
        assert torch.equal(bits_a, bits_b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), where
        for key in a:
            if key == "ckptfix":
                assert _normal_record(a[key], unhashed) == _normal_record(b[key], unhashed), where
            else:
                _same_tree(a[key], b[key], f"{where}/{key}", unhashed)
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same_tree(x, y, f"{where}[{i}]", unhashed)
    elif type(a).__name__ == "ndarray":  # an rng state's numpy arrays (Composer's, loaded with weights_only=False)
        assert type(b) is type(a) and a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    elif type(a).__eq__ is object.__eq__ and hasattr(a, "__dict__"):  # a framework's object (DeepSpeed's loss scaler)
        assert type(b) is type(a), where
        _same_tree(vars(a), vars(b), f"{where}.", unhashed)
    else:
        assert a == b or (a != a and b != b), where


def _same_output(a: Path, b: Path, *, weights_only: bool = True, unhashed: bool = False) -> None:
    """Two repair outputs: every file byte for byte, except where the record (its time and the input's
    name) lives: a JSON record equal without those, a torch.save file equal value by value (tensors bit
    for bit, dtypes included) and in every zip record but data.pkl. `weights_only=False` for a framework's
    file that torch's weights-only loader refuses (Composer's timedelta and TorchVersion)."""
    import zipfile

    import torch

    files_a = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file()) if a.is_dir() else [Path()]
    files_b = sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file()) if b.is_dir() else [Path()]
    assert files_a == files_b
    for rel in files_a:
        fa, fb = a / rel, b / rel
        if fa.read_bytes() == fb.read_bytes():
            continue
        if fa.name.endswith(".json"):
            assert _normal_record(json.loads(fa.read_text()), unhashed) == \
                _normal_record(json.loads(fb.read_text()), unhashed), rel
            continue
        with zipfile.ZipFile(fa) as za, zipfile.ZipFile(fb) as zb:
            assert za.namelist() == zb.namelist(), rel
            for name in za.namelist():
                # data.pkl holds the record; serialization_id is new at each save (torch.save's too)
                if not name.endswith(("/data.pkl", "/.data/serialization_id")):
                    assert za.read(name) == zb.read(name), f"{rel}: {name}"
        _same_tree(torch.load(fa, weights_only=weights_only), torch.load(fb, weights_only=weights_only), str(rel),
                   unhashed)


def _repairs_alike(s3, local: Path, url: str, tokenizer: object, tmp_path: Path, *extra: object,
                   weights_only: bool = True) -> None:
    name = local.name if local.is_dir() else f"fixed{local.suffix}"
    here = run("repair", local, "-t", tokenizer, "-o", tmp_path / "here" / name, *extra)
    assert here.exit_code == 0, here
    s3.counter.reset()
    there = run("repair", url, "-t", tokenizer, "-o", tmp_path / "there" / name, *extra)
    assert there.exit_code == 0, there
    assert there.stdout == here.stdout.replace(str(local), url.rstrip("/")).replace(
        str(tmp_path / "here"), str(tmp_path / "there"))
    _same_output(tmp_path / "here" / name, tmp_path / "there" / name, weights_only=weights_only)
    # the input was read once: every byte at most once over the wire (plus listings and request XML)
    assert s3.counter.bytes_out < _sizes(local) + 64 * 1024, s3.counter.summary()


@pytest.fixture
def out_dirs(tmp_path):
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    return tmp_path


def test_repair_of_a_torch_file_from_s3_equals_the_local_repair(s3, out_dirs):
    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    _repairs_alike(s3, SEED / "ckpt.pth", s3.url("run/ckpt.pth"), SEED / "tokenizer.model", out_dirs)


def test_repair_of_a_safetensors_file_from_s3_equals_the_local_repair(s3, out_dirs):
    from safetensors.torch import save_file
    from tokenizer_factory import train_bpe_tokenizer_json

    path = out_dirs / "model.safetensors"
    save_file(_torch_run(300, 16).model.state_dict(), str(path))
    tok = train_bpe_tokenizer_json(out_dirs, 320, name="bpe320.json")
    s3.upload(str(path), s3.url("w/model.safetensors"))
    _repairs_alike(s3, path, s3.url("w/model.safetensors"), tok, out_dirs)


def test_repair_of_a_dcp_folder_from_s3_equals_the_local_repair(s3, out_dirs):
    from tokenizer_factory import train_bpe_tokenizer_json

    path = _dcp_checkpoint(out_dirs / "step-3", 300, 16)
    tok = train_bpe_tokenizer_json(out_dirs, 320, name="bpe320.json")
    s3.upload(str(path), s3.url("run/step-3"))
    _repairs_alike(s3, path, s3.url("run/step-3"), tok, out_dirs)


def test_repair_of_a_megatron_folder_from_s3_equals_the_local_repair(s3, out_dirs):
    from test_formats_megatron import OLD_TOKENS
    from tokenizer_factory import extend_tokenizer_json, train_bpe_tokenizer_json

    old = train_bpe_tokenizer_json(out_dirs, OLD_TOKENS, name="tok-200.json")
    new = extend_tokenizer_json(old, out_dirs / "tok-300.json", [f"new{i}" for i in range(100)])
    path = ROOT / "fixtures" / "megatron" / "small-tp2-dp2-adam"
    s3.upload(str(path), s3.url("megatron/adam"))
    _repairs_alike(s3, path, s3.url("megatron/adam"), new, out_dirs)


@pytest.mark.transformers
def test_repair_of_a_sharded_hf_folder_from_s3_equals_the_local_repair(s3, out_dirs):
    transformers = pytest.importorskip("transformers")
    import torch
    from tokenizer_factory import train_bpe_tokenizer_json

    torch.manual_seed(0)
    path = out_dirs / "gpt2"
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2)
    transformers.GPT2LMHeadModel(config).save_pretrained(path, max_shard_size="10KB")
    tok = train_bpe_tokenizer_json(out_dirs, 80, name="bpe80.json")
    s3.upload(str(path), s3.url("hf/gpt2"))
    _repairs_alike(s3, path, s3.url("hf/gpt2"), tok, out_dirs)


def test_diff_of_two_urls_equals_the_local_diff(s3, tmp_path):
    from ckpt_factory import save_checkpoint, train

    run_ = _torch_run(300, 16)
    a = save_checkpoint(run_, tmp_path / "a.pth")
    b = save_checkpoint(train(run_, 2), tmp_path / "b.pth")
    s3.upload(str(a), s3.url("d/a.pth"))
    s3.upload(str(b), s3.url("d/b.pth"))
    for as_json in ([], ["--json"]):
        here = run("diff", a, b, *as_json)
        there = run("diff", s3.url("d/a.pth"), s3.url("d/b.pth"), *as_json)
        assert here.exit_code == there.exit_code == 0
        assert there.stdout == here.stdout.replace(str(a), s3.url("d/a.pth")).replace(str(b), s3.url("d/b.pth"))


# --- errors: one line, exit 2, nothing secret ----------------------------------------------------------

SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


def _one_line(result: Result, *words: str) -> str:
    assert result.exit_code == 2, result
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert SECRET not in result.stderr + result.stdout
    return result.stderr


def test_a_missing_object_or_bucket_is_one_line(s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    _one_line(run("inspect", s3.url("nothing/here.pth")), s3.url("nothing/here.pth"), "no such object or prefix")
    _one_line(run("inspect", "s3://no-such-bucket-ckptfix/x.pth"), "no such object or prefix")
    result = run("inspect", s3.url("nothing/here.pth"), "--json")
    assert json.loads(result.stdout)["error"]["kind"] == "bad_input"
    _one_line(run("inspect", SEED / "ckpt.pth", "-t", s3.url("tok/none.model")), "no such")


def test_missing_credentials_are_one_line(s3, monkeypatch):
    import s3fs

    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    s3fs.S3FileSystem.clear_instance_cache()
    _one_line(run("inspect", s3.url("run/ckpt.pth")), "no usable credentials")


def test_access_denied_is_one_line_without_the_key(s3, monkeypatch):
    """A user of the server's own IAM allowed to list the bucket but not to read its objects."""
    import boto3
    import s3fs
    from moto import settings

    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    iam = boto3.client("iam", endpoint_url=s3.server.endpoint, region_name="us-east-1")
    iam.create_user(UserName="lister")
    policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:ListBucket", "Resource": "*"}]}
    iam.put_user_policy(UserName="lister", PolicyName="list", PolicyDocument=json.dumps(policy))
    key = iam.create_access_key(UserName="lister")["AccessKey"]
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks IAM from now on
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        line = _one_line(run("inspect", s3.url("run/ckpt.pth")), "access denied")
    finally:
        monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", float("inf"))
        s3fs.S3FileSystem.clear_instance_cache()
    assert key["SecretAccessKey"] not in line and key["AccessKeyId"] not in line


def test_a_missing_backend_names_its_pip_line():
    pytest.importorskip("fsspec")
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        _one_line(run("inspect", "gs://bucket/run/ckpt.pth"), "gcsfs", "pip install 'ckptfix[gcs]'")
    else:
        pytest.skip("gcsfs is installed here")


def test_signed_url_parts_are_not_printed():
    assert remote.storage_error("s3://user:pw@bucket/key?X-Amz-Signature=abc123", PermissionError()).args[0] == \
        "s3://bucket/key: access denied by the object store (the credentials lack read permission)"


def test_listing_is_bounded_and_keys_stay_inside_the_prefix(s3, tmp_path, monkeypatch):
    folder = tmp_path / "many"
    folder.mkdir()
    for i in range(5):
        (folder / f"f{i}.json").write_text("{}")
    s3.upload(str(folder), s3.url("many"))
    monkeypatch.setattr(remote, "MAX_OBJECTS", 3)
    _one_line(run("inspect", s3.url("many")), "more than 3 objects")
    monkeypatch.setattr(remote, "MAX_OBJECTS", 100)
    s3.client.put_object(Bucket=s3.name, Key="evil/a/../../../escape.json", Body=b"{}")
    s3.client.put_object(Bucket=s3.name, Key="evil/model.safetensors", Body=b"x")
    _one_line(run("inspect", s3.url("evil")), "refusing a prefix whose keys would climb out of it")
    import tempfile

    assert not (Path(tempfile.gettempdir()) / "escape.json").exists()  # where the key would have led


def test_an_object_that_is_also_a_prefix_is_one_line(s3):
    """S3 holds `run/a` and `run/a/b` side by side; files cannot (was FileExistsError, exit 3)."""
    s3.client.put_object(Bucket=s3.name, Key="both/model.safetensors", Body=b"x")
    s3.client.put_object(Bucket=s3.name, Key="both/a", Body=b"1")
    s3.client.put_object(Bucket=s3.name, Key="both/a/b", Body=b"2")
    _one_line(run("inspect", s3.url("both")), "both an object and a prefix")


def test_readme_object_storage_block_runs(s3, tmp_path, monkeypatch):
    """The object-storage page's block (docs/object-storage.md): each extra it names exists, and its commands run against the server
    (`bucket` standing for the test's bucket)."""
    import shlex

    from test_docs import OBJECT_STORAGE, _code_blocks
    from tokenizer_factory import train_bpe_tokenizer_json

    block = next(body for _, body in _code_blocks(OBJECT_STORAGE.read_text(encoding="utf-8")) if "ckptfix[s3]" in body)
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras = set(re.findall(r"(?m)^(\w+) = \[", pyproject.split("[project.optional-dependencies]")[1].split("\n[")[0]))
    assert set(re.findall(r"\[(\w+)\]", block)) <= extras, extras
    s3.upload(str(_dcp_checkpoint(tmp_path / "step-100", 300, 16)), s3.url("run/step-100"))
    s3.upload(train_bpe_tokenizer_json(tmp_path, 320, name="tokenizer.json"), s3.url("tokenizer.json"))
    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    (tmp_path / "tok.model").write_bytes((SEED / "tokenizer.model").read_bytes())
    monkeypatch.chdir(tmp_path)
    commands = [line.split("#")[0] for line in block.splitlines() if line.startswith("ckptfix ")]
    assert len(commands) == 2
    for line in commands:
        args = shlex.split(line.replace("s3://bucket/", s3.url("")))[1:]
        result = run(*args)
        assert result.exit_code in (0, 1) and not result.stderr, result
    assert (tmp_path / "ckpt.fixed.pth").is_file()


def test_cli_process_reads_s3_without_torch_and_leaves_no_mirror(s3, tmp_path):
    """`ckptfix inspect s3://...` as a user runs it: a process of its own (the endpoint and fake credentials
    from the environment, strict reads from CKPTFIX_STRICT_READS), torch never imported, and the private
    mirror folder gone when it exits, after a report and after an error alike."""
    import subprocess
    import sys

    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "TMPDIR": str(tmp), "CKPTFIX_STRICT_READS": "1", "PYTHONPATH": str(ROOT)}
    probe = ("import sys; from ckptfix.cli import main\n"
             "try:\n    main(sys.argv[1:])\n"
             "finally:\n    print('torch imported' if 'torch' in sys.modules else 'no torch', file=sys.stderr)")
    for url, code in ((s3.url("run/ckpt.pth"), 1), (s3.url("run/missing.pth"), 2)):
        result = subprocess.run([sys.executable, "-c", probe, "inspect", url, "--scan", "-t", SEED / "tokenizer.model"],
                                capture_output=True, text=True, env=env, timeout=120)
        assert result.returncode == code, result.stderr
        assert result.stderr.endswith("no torch\n"), result.stderr
        assert list(tmp.iterdir()) == []
    assert "CKF102" in subprocess.run([sys.executable, "-m", "ckptfix.cli", "inspect", s3.url("run/ckpt.pth"),
                                       "-t", SEED / "tokenizer.model"], capture_output=True, text=True, env=env,
                                      timeout=120).stdout


def test_python_api_reports_name_the_url(s3):
    import ckptfix

    s3.upload(str(SEED / "ckpt.pth"), s3.url("run/ckpt.pth"))
    try:
        report = ckptfix.inspect(s3.url("run/ckpt.pth"), SEED / "tokenizer.model")
        data = report.to_json()
        assert data["path"] == s3.url("run/ckpt.pth")
        assert remote.stats().requests > 0
        assert "ckptfix-remote-" not in json.dumps(data)
    finally:
        remote.close_all()
