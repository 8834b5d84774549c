"""Issue 44 item 2: an object store that fails the way S3 does, against moto's server (tests/s3_server.py)
with a deterministic fault schedule at the server: the first k matching requests answered 503 SlowDown or
500 InternalError, or served with half their body before the connection drops; or every one of them.

ckptfix's retry policy is explicit and bounded (`remote.S3_ATTEMPTS` botocore attempts in its "standard"
mode, inside `remote.S3FS_RETRIES` + 1 rounds of s3fs's own read path: `remote.MAX_TRIES`): transient faults are ridden out with a
report equal to the clean one; a persistent one ends in one line after a bounded number of requests."""

from __future__ import annotations

import pytest
from test_remote_read import SEED, run

from ckptfix import remote


@pytest.fixture(autouse=True)
def strict(monkeypatch):
    monkeypatch.setattr(remote, "strict_reads", True)  # a byte read past the mirror's fetches shows as 0xFF


def _get(request) -> bool:
    return request.operation == "GetObject"


def _upload(s3) -> str:
    url = s3.url("run/ckpt.pth")
    s3.upload(str(SEED / "ckpt.pth"), url)
    return url


@pytest.mark.parametrize("status,code,cut", [(503, "SlowDown", False), (500, "InternalError", False),
                                             (200, "", True)], ids=["slowdown", "internal", "cut-body"])
def test_transient_faults_are_ridden_out(s3, status, code, cut):
    url = _upload(s3)
    clean = run("inspect", url, "--scan", "-t", SEED / "tokenizer.model")
    with s3.server.fail(_get, status, code, times=2, cut=cut) as rule:
        faulty = run("inspect", url, "--scan", "-t", SEED / "tokenizer.model")
    assert rule.applied == 2
    assert (faulty.exit_code, faulty.stdout, faulty.stderr) == (clean.exit_code, clean.stdout, clean.stderr)


def test_a_transient_listing_fault_is_ridden_out(s3):
    url = _upload(s3)
    clean = run("inspect", url)
    with s3.server.fail(lambda r: r.operation == "ListObjects", 503, "SlowDown", times=2) as rule:
        faulty = run("inspect", url)
    assert rule.applied == 2 and (faulty.exit_code, faulty.stdout) == (clean.exit_code, clean.stdout)


def test_a_persistent_fault_is_one_line_after_a_bounded_number_of_requests(s3):
    url = _upload(s3)
    with s3.server.fail(_get, 503, "SlowDown") as rule:
        result = run("inspect", url, "--scan")
    assert result.exit_code == 2 and result.stdout == ""
    (line,) = result.stderr.splitlines()
    assert line == (f"ckptfix: error: {url}: the object store kept refusing the request (SlowDown; retried, at "
                    f"most {remote.MAX_TRIES} tries)")
    assert rule.applied == remote.MAX_TRIES == 12  # one ranged GET, tried 12 times, then it stops asking
