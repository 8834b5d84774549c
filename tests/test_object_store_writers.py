"""Issue 44 item 2: writers that race or die in object storage, against moto's server (tests/s3_server.py).

`repair -o s3://OUT` publishes under a claim (`publish.Claim`: one object created with `If-None-Match: *`,
then a listing that OUT holds nothing else): a second writer stops at the claim, with exit 2 and nothing of
its own in OUT; a rerun on this machine after a SIGKILL takes the dead writer's claim over, deletes its
partial objects, aborts its open multipart uploads, and publishes. An input replaced while it was read
(another save over it) is refused before anything is published (`Mirror.changed`: ETags as listed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from test_object_store_write import OLD, dcp_source, reproducible, tokenizers  # noqa: F401 (fixtures)

from ckptfix.publish import CLAIM_SUFFIX

_ = (dcp_source, reproducible, tokenizers)


def _cmd(source, tok, url) -> list[str]:
    return [sys.executable, "-m", "ckptfix.cli", "repair", str(source), "-t", str(tok), "-o", url]


def _env(tmp_path) -> dict[str, str]:
    scratch = tmp_path / "tmp"
    scratch.mkdir(exist_ok=True)
    return {**os.environ, "PYTHONPATH": os.getcwd(), "TMPDIR": str(scratch)}


def _data_upload(request) -> bool:
    """A data object's upload (not the claim)."""
    return request.operation in ("PutObject", "UploadPart", "CreateMultipartUpload", "CopyObject",
                                 "UploadPartCopy") and CLAIM_SUFFIX not in request.path


def _inspect(url) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ckptfix.cli", "inspect", url], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": os.getcwd()})


def test_a_second_writer_stops_at_the_claim(s3, tmp_path, tokenizers, dcp_source):  # noqa: F811
    url = s3.url("out/raced")
    cmd = _cmd(dcp_source, tokenizers[64], url)
    with s3.server.hold(_data_upload) as reached:
        first = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert reached.wait(120), "the first writer never started uploading"
            second = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
        except BaseException:
            first.kill()
            raise
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert second.returncode == 2 and len(second.stderr.splitlines()) == 1, second.stderr
    assert "another ckptfix is publishing here (host " in second.stderr
    keys = s3.keys(url + "/")
    assert CLAIM_SUFFIX not in keys and ".metadata" in keys
    assert _inspect(url).returncode in (0, 1)


def test_a_killed_writer_is_taken_over_by_the_rerun(s3, tmp_path, tokenizers, dcp_source):  # noqa: F811
    url = s3.url("out/killed")
    cmd = _cmd(dcp_source, tokenizers[64], url)
    with s3.server.hold(_data_upload) as reached:
        proc = subprocess.Popen(cmd, env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            assert reached.wait(120), "the repair never started uploading"
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    assert CLAIM_SUFFIX in s3.keys(url + "/")  # the dead writer's claim
    rerun = subprocess.run(cmd, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    keys = s3.keys(url + "/")
    assert CLAIM_SUFFIX not in keys and ".metadata" in keys
    assert not s3.client.list_multipart_uploads(Bucket=s3.name).get("Uploads")
    assert _inspect(url).returncode in (0, 1)


def test_a_claim_of_another_machine_is_refused_and_left(s3, tmp_path, tokenizers, dcp_source):  # noqa: F811
    url = s3.url("out/theirs")
    claim = f"out/theirs/{CLAIM_SUFFIX}"
    s3.client.put_object(Bucket=s3.name, Key=claim, Body=b'{"host": "elsewhere", "pid": 1}')
    done = subprocess.run(_cmd(dcp_source, tokenizers[64], url), env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "another ckptfix is publishing here (host elsewhere, pid 1)" in done.stderr
    assert s3.keys(url + "/") == [CLAIM_SUFFIX]


def test_a_finished_publish_whose_claim_was_left_is_not_replaced(s3, tmp_path, tokenizers, dcp_source):  # noqa: F811
    """Killed after its last upload, before it removed its claim: OUT is whole; the rerun removes the claim and
    refuses (OUT exists), never deleting the checkpoint."""
    url = s3.url("out/finished")
    assert subprocess.run(_cmd(dcp_source, tokenizers[64], url), env=_env(tmp_path), capture_output=True,
                          timeout=120).returncode == 0
    before = s3.keys(url + "/")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    body = f'{{"host": "{socket.gethostname()}", "pid": {dead.pid}}}'.encode()
    s3.client.put_object(Bucket=s3.name, Key=f"out/finished/{CLAIM_SUFFIX}", Body=body)
    done = subprocess.run(_cmd(dcp_source, tokenizers[64], url), env=_env(tmp_path), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "already exists in the object store" in done.stderr, done.stderr
    assert s3.keys(url + "/") == before


def test_an_input_replaced_while_it_is_read_is_not_published(s3, tmp_path, tokenizers):  # noqa: F811
    from ckpt_factory import trained_checkpoint

    source = trained_checkpoint(tmp_path / "ckpt.pth", OLD, steps=1)
    other = trained_checkpoint(tmp_path / "other.pth", OLD, steps=2)
    s3.upload(str(source), s3.url("in/ckpt.pth"))
    url = s3.url("out/mixed.pth")
    ranged = lambda r: r.operation == "GetObject" and "in/ckpt.pth" in r.path  # noqa: E731
    with s3.server.hold(ranged) as reached:
        proc = subprocess.Popen(_cmd(s3.url("in/ckpt.pth"), tokenizers[64], url), env=_env(tmp_path),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            assert reached.wait(120), "the repair never read its input"
            s3.upload(str(other), s3.url("in/ckpt.pth"))  # the next save lands over the input
        except BaseException:
            proc.kill()
            raise
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and len(err.splitlines()) == 1, err
    assert "in/ckpt.pth changed in the object store while ckptfix read it (a new save over it?)" in err
    assert s3.keys(s3.url("out/")) == []
