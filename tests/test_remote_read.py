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
from dataclasses import dataclass
from pathlib import Path

import pytest

from ckptfix import remote
from ckptfix.cli import main

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
