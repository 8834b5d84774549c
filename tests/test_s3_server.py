"""The S3 test server itself (tests/s3_server.py): real HTTP, counted at the server, reachable from fsspec in
this process and from a subprocess, and speaking the copy operations the write side relies on."""

from __future__ import annotations

import os
import subprocess
import sys


def test_ranged_read_through_fsspec_is_counted_at_the_server(s3, tmp_path):
    data = os.urandom(3 << 20)
    (tmp_path / "blob.bin").write_bytes(data)
    assert s3.upload(str(tmp_path / "blob.bin"), s3.url("run/blob.bin")) == ["run/blob.bin"]
    s3.counter.reset()

    import fsspec

    fs, path = fsspec.core.url_to_fs(s3.url("run/blob.bin"))
    assert fs.cat_file(path, start=1000, end=1100) == data[1000:1100]

    gets = [r for r in s3.counter.snapshot() if r.operation == "GetObject"]
    assert len(gets) == 1 and gets[0].headers["range"] == "bytes=1000-1099"
    assert s3.counter.bytes_out < 4096, s3.counter.summary()  # the range (and any XML), never the object


def test_folder_upload_keys_and_download(s3, tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / ".metadata").write_bytes(b"m")
    (src / "sub" / "__0_0.distcp").write_bytes(b"x" * 10)
    s3.upload(str(src), s3.url("ckpt/"))
    assert s3.keys(s3.url("ckpt/")) == [".metadata", "sub/__0_0.distcp"]
    assert s3.counter.bytes_in == 11 and s3.counter.operations()["PutObject"] == 2
    names = s3.download(s3.url("ckpt/"), str(tmp_path / "back"))
    assert names == [".metadata", "sub/__0_0.distcp"]
    assert (tmp_path / "back" / "sub" / "__0_0.distcp").read_bytes() == b"x" * 10


def test_server_side_copies_send_no_body(s3):
    """CopyObject and UploadPartCopy (with CopySourceRange) move bytes inside the server: the counter sees
    the requests but no uploaded bytes, which is how the write side's tests prove a copy stayed remote."""
    part = 5 << 20
    data = os.urandom(2 * part + 123)
    s3.client.put_object(Bucket=s3.name, Key="a", Body=data)
    s3.counter.reset()

    s3.client.copy_object(Bucket=s3.name, Key="b", CopySource={"Bucket": s3.name, "Key": "a"})
    upload = s3.client.create_multipart_upload(Bucket=s3.name, Key="c")["UploadId"]
    copied = s3.client.upload_part_copy(
        Bucket=s3.name, Key="c", UploadId=upload, PartNumber=1,
        CopySource={"Bucket": s3.name, "Key": "a"}, CopySourceRange=f"bytes={part}-{2 * part - 1}",
    )
    tail = s3.client.upload_part(Bucket=s3.name, Key="c", UploadId=upload, PartNumber=2, Body=b"new")
    s3.client.complete_multipart_upload(
        Bucket=s3.name, Key="c", UploadId=upload,
        MultipartUpload={"Parts": [
            {"PartNumber": 1, "ETag": copied["CopyPartResult"]["ETag"]},
            {"PartNumber": 2, "ETag": tail["ETag"]},
        ]},
    )

    ops = s3.counter.operations()
    assert ops["CopyObject"] == 1 and ops["UploadPartCopy"] == 1 and ops["UploadPart"] == 1, ops
    assert s3.counter.data_uploaded == 3, s3.counter.summary()  # only b"new" crossed the wire
    assert s3.read(s3.url("b")) == data
    assert s3.read(s3.url("c")) == data[part : 2 * part] + b"new"


def test_a_subprocess_reaches_the_server_through_the_environment(s3):
    s3.client.put_object(Bucket=s3.name, Key="k", Body=b"hello")
    code = "import fsspec,sys; sys.stdout.write(fsspec.open(sys.argv[1]).open().read().decode())"
    out = subprocess.run([sys.executable, "-c", code, s3.url("k")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "hello"
