"""Checkpoints in object storage (issue 34): what ckptfix asks of an S3 store, for a multi-GB checkpoint.

Builds under --root (default /tmp/ckptfix-bench-s3) the DCP folder of bench/sharded.py (8 FSDP ranks'
`__<rank>_0.distcp`, model + AdamW moments, about --gb GB; the vocab tensors and their moments are
6144 x 4096 fp32 each) and, with `--formats dcp,hf`, its sharded safetensors folder; uploads each into a
local S3 API server (moto's server mode on 127.0.0.1, tests/s3_server.py, counting every request and its
bytes at the server), deletes the local copy, and measures, each `ckptfix` a fresh process talking HTTP
to the server:

- `ckptfix inspect s3://...` (alone, then with the tokenizer, which adds the checks that read the vocab
  rows): requests and bytes downloaded (the target: under 1 MB, a handful of requests);
- `ckptfix repair s3://... -o s3://...-fixed`: downloaded, uploaded, copied inside the store (UploadPartCopy
  and CopyObject ranges), requests, time; then the OUT deleted;
- `aws s3 cp --recursive`-style copy of the prefix (boto3's managed copy of every object: server-side
  CopyObject/UploadPartCopy, as the CLI does between two s3:// URLs): time;
- `ckptfix repair s3://... --in-place` (then `ckptfix restore s3://...`): the same counts.

The server keeps objects in memory and temporary files: about 2-3x --gb of disk and memory at the peak.
It prints each measurement and a markdown table (the README's). Everything is deleted at the end.

    python bench/object_storage.py --gb 2 [--inspect-only] [--layers 290]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"),
                os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]

from s3_server import Bucket, S3Server  # noqa: E402

from bench.sharded import GROW, ROWS, build_dcp, build_hf, build_tokenizer, folder_bytes  # noqa: E402


def measure(bucket: Bucket, name: str, fn) -> dict:
    bucket.counter.reset()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    c = bucket.counter
    row = {"step": name, "seconds": seconds, "requests": c.count, "down": c.bytes_out, "up": c.data_uploaded,
           "copied": c.copied, "ops": dict(c.operations())}
    print(f"  {name}: {seconds:.1f} s, {c.count} requests, {c.bytes_out:,} B down, {c.data_uploaded:,} B up, "
          f"{row['copied']:,} B copied in the store ({', '.join(f'{k} x{v}' for k, v in sorted(row['ops'].items()))})",
          flush=True)
    return row


def ckptfix(*args: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ckptfix.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.path.join(os.path.dirname(__file__), "..")})
    if done.returncode not in (0, 1):  # inspect: 1 is "error findings", expected (the vocab does not fit)
        raise SystemExit(f"ckptfix {' '.join(args)} failed ({done.returncode}):\n{done.stderr}")


def copy_prefix(bucket: Bucket, src: str, dst: str) -> None:
    """What `aws s3 cp --recursive s3://B/src s3://B/dst` does: a managed server-side copy of every object."""
    for key in bucket.keys(bucket.url(src)):
        bucket.client.copy({"Bucket": bucket.name, "Key": src + key}, bucket.name, dst + key)


def delete_prefix(bucket: Bucket, prefix: str) -> None:
    for key in bucket.keys(bucket.url(prefix)):
        bucket.client.delete_object(Bucket=bucket.name, Key=prefix + key)


def bench_one(bucket: Bucket, fmt: str, local: str, tok: str, only_inspect: bool = False) -> list[dict]:
    size = folder_bytes(local)
    prefix = f"{fmt}/step/"
    start = time.perf_counter()
    bucket.upload(local, bucket.url(prefix))
    print(f"{fmt}: {size / 1e9:.2f} GB in {len(bucket.keys(bucket.url(prefix)))} objects, uploaded in "
          f"{time.perf_counter() - start:.0f} s", flush=True)
    shutil.rmtree(local)
    url = bucket.url(prefix.rstrip("/"))
    rows = [measure(bucket, "inspect", lambda: ckptfix("inspect", url)),
            measure(bucket, "inspect -t TOK", lambda: ckptfix("inspect", url, "-t", tok))]
    if only_inspect:
        delete_prefix(bucket, prefix)
        for row in rows:
            row["format"], row["size"] = fmt, size
        return rows
    rows.append(measure(bucket, "repair -o s3://", lambda: ckptfix("repair", url, "-t", tok, "-o", url + "-fixed")))
    delete_prefix(bucket, f"{fmt}/step-fixed/")
    rows.append(measure(bucket, "copy every object", lambda: copy_prefix(bucket, prefix, f"{fmt}/copy/")))
    delete_prefix(bucket, f"{fmt}/copy/")
    rows.append(measure(bucket, "repair --in-place", lambda: ckptfix("repair", url, "-t", tok, "--in-place")))
    rows.append(measure(bucket, "restore", lambda: ckptfix("restore", url)))
    delete_prefix(bucket, prefix)
    for row in rows:
        row["format"], row["size"] = fmt, size
    return rows


def table(rows: list[dict]) -> str:
    out = ["| checkpoint | step | time | requests | downloaded | uploaded | copied in the store |",
           "|---|---|---:|---:|---:|---:|---:|"]

    def mb(n: int) -> str:
        return f"{n / 1e6:,.2f} MB" if n < 1e8 else f"{n / 1e9:,.2f} GB"

    for r in rows:
        out.append(f"| {r['format']} {r['size'] / 1e9:.1f} GB | {r['step']} | {r['seconds']:.1f} s | {r['requests']} | "
                   f"{mb(r['down'])} | {mb(r['up'])} | {mb(r['copied'])} |")
    return "\n".join(out)


def width_for(gb: float, layers: int) -> int:
    """The hidden width that makes bench/sharded's model (2 vocab tensors of ROWS rows, `layers` square ones)
    and its AdamW moments about `gb` GB in fp32: 12 bytes an element."""
    a, b = 12 * layers, 2 * 12 * ROWS
    return max(8, int((-b + (b * b + 4 * a * gb * 1e9) ** 0.5) / (2 * a)) // 8 * 8)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=2.0)
    parser.add_argument("--formats", default="dcp")
    parser.add_argument("--root", default="/tmp/ckptfix-bench-s3")
    parser.add_argument("--inspect-only", action="store_true", help="measure the two inspect rows only")
    parser.add_argument("--layers", type=int, help="that many square layers (a narrower width keeps --gb): "
                        "a 7B model's 290 parameters, where the default is a few wide ones")
    args = parser.parse_args()
    if args.layers:
        import bench.sharded as sharded

        sharded.WIDTH = width_for(args.gb, args.layers)
    if os.path.exists(args.root):
        raise SystemExit(f"{args.root} exists; remove it or pass --root")
    os.makedirs(args.root)
    server = S3Server()
    os.environ.update(server.env())
    # moto assembles a completed multipart upload in memory, slowly for GB objects: a client timing out and
    # retrying CompleteMultipartUpload would find the upload gone (moto answers 500), so wait instead
    os.environ["FSSPEC_S3"] = json.dumps({"endpoint_url": server.endpoint,
                                          "config_kwargs": {"read_timeout": 900, "retries": {"max_attempts": 1}}})
    try:
        bucket = Bucket(server, "ckptfix-bench")
        tok = os.path.join(args.root, "tokenizer.json")
        build_tokenizer(tok, ROWS + GROW)
        rows = []
        for fmt in args.formats.split(","):
            local = os.path.join(args.root, fmt)
            (build_dcp if fmt == "dcp" else build_hf)(local, args.gb)
            measured = bench_one(bucket, fmt, local, tok, args.inspect_only)
            for row in measured:
                row["format"] += f" ({args.layers + 2} parameters)" if args.layers else ""
            rows += measured
            print()
            print(table(rows), flush=True)
    finally:
        shutil.rmtree(args.root, ignore_errors=True)
        server.stop()


if __name__ == "__main__":
    main()
