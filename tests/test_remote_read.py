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
