"""A real S3 API server for the object-storage tests (issue 34): moto's server mode on 127.0.0.1.

`ThreadedMotoServer` serves moto's WSGI app over real HTTP on a free port, in a thread of the test process;
ckptfix talks to it through its whole client stack (fsspec -> s3fs -> aiobotocore -> aiohttp), as s3fs's own
test suite does. Nothing of ckptfix is mocked. A WSGI middleware around moto's app counts, at the server,
every request and the body bytes each way, so a test can assert what a command cost ("inspect read < 1 MB in
a handful of requests"; "in-place repair uploaded only the changed tensors").

Fixtures (imported by conftest.py):
- `s3_server` (session): the running server, its endpoint and its `Counter`.
- `s3` (function): a fresh bucket, the environment pointed at the server with fake credentials (so a
  subprocess `ckptfix ...` reaches it too), fsspec's cached s3 filesystems dropped, and helpers:
  `upload(local_path, url)` (a file or a whole folder, with boto3, not ckptfix's stack), `download`,
  `keys(prefix)`, `read(url)`, `url(key)`, and `counter` (reset when the test starts).

moto, boto3 and s3fs come from the `s3` extra (`pip install -e '.[test,s3]'`); a test that needs them skips
with the reason when one is missing.
"""

from __future__ import annotations

import contextlib
import os
import threading
import uuid
from collections import Counter as _Tally
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import pytest

FAKE_ENV = {
    # Fake credentials: moto accepts any; a real key must never be needed (or found) by a test.
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    # No shared config/credentials file of the machine's user, no instance-metadata probe (a 1 s timeout each).
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "AWS_EC2_METADATA_DISABLED": "true",
    # The server is local: a proxy of the environment must not see its requests.
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}


def missing_packages() -> str | None:
    """Why the S3 tests cannot run here, or None."""
    for module, package in (("moto.server", "moto[server]"), ("boto3", "boto3"), ("s3fs", "s3fs")):
        try:
            __import__(module)
        except ImportError:
            return f"needs {package} (pip install -e '.[test,s3]')"
    return None


@dataclass
class Request:
    """One request as the server saw it."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    bytes_in: int = 0  # request body
    bytes_out: int = 0  # response body
    copied: int = 0  # bytes a CopyObject or UploadPartCopy copied inside the server

    @property
    def operation(self) -> str:
        """The S3 operation, told as the server tells it (method, query keys, copy header)."""
        keys = {part.split("=", 1)[0] for part in self.query.split("&") if part}
        copy = "x-amz-copy-source" in self.headers
        if self.method == "PUT" and "partNumber" in keys:
            return "UploadPartCopy" if copy else "UploadPart"
        if self.method == "PUT":
            return "CopyObject" if copy else "PutObject"
        if self.method == "POST":
            if "uploads" in keys:
                return "CreateMultipartUpload"
            if "uploadId" in keys:
                return "CompleteMultipartUpload"
            if "delete" in keys:
                return "DeleteObjects"
        if self.method == "DELETE":
            return "AbortMultipartUpload" if "uploadId" in keys else "DeleteObject"
        if self.method == "GET" and ("list-type" in keys or self.path.strip("/").count("/") == 0):
            return "ListObjects"
        return {"GET": "GetObject", "HEAD": "HeadObject"}.get(self.method, self.method)


@dataclass
class Counter:
    """Every request the server answered since the last `reset()` (thread-safe: the server is threaded)."""

    requests: list[Request] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()

    def snapshot(self) -> list[Request]:
        with self.lock:
            return list(self.requests)

    @property
    def count(self) -> int:
        return len(self.snapshot())

    @property
    def bytes_out(self) -> int:
        """Body bytes the server sent (what clients downloaded)."""
        return sum(r.bytes_out for r in self.snapshot())

    @property
    def bytes_in(self) -> int:
        """Body bytes the server received (object data and request XML; a server-side copy sends no data)."""
        return sum(r.bytes_in for r in self.snapshot())

    @property
    def data_uploaded(self) -> int:
        """Object bytes clients sent (PutObject and UploadPart bodies; not the XML of other requests)."""
        return sum(r.bytes_in for r in self.snapshot() if r.operation in ("PutObject", "UploadPart"))

    @property
    def copied(self) -> int:
        """Bytes copied inside the server (CopyObject, UploadPartCopy): what never crossed the network."""
        return sum(r.copied for r in self.snapshot())

    def operations(self) -> _Tally[str]:
        return _Tally(r.operation for r in self.snapshot())

    def summary(self) -> str:
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.operations().items()))
        return (
            f"{self.count} requests, {self.bytes_out} bytes down, {self.bytes_in} bytes up "
            f"({self.data_uploaded} of object data), {self.copied} copied in the server ({ops})"
        )


@dataclass
class _Rule:
    """What the server does to a request matching `matches`: hold it until `release` is set (after setting
    `reached`), or answer it with an S3 error instead of serving it."""

    matches: Callable[[Request], bool]
    error: tuple[int, str] | None = None
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    times: int | None = None  # applied to the first `times` matching requests only (None: all)
    cut: bool = False  # serve the request but send only half of its body, then stop (a connection dropped)
    applied: int = 0

    def take(self, request: Request) -> bool:
        """Whether the rule applies to `request` (counting it against `times`)."""
        if (self.times is not None and self.applied >= self.times) or not self.matches(request):
            return False
        self.applied += 1
        return True


class _CountingApp:
    """WSGI middleware: records each request and counts its body bytes in and out; applies the rules."""

    def __init__(self, app: Any, counter: Counter):
        self.app = app
        self.counter = counter
        self.rules: list[_Rule] = []

    def __call__(self, environ: dict, start_response: Any) -> Iterator[bytes]:
        path = environ.get("PATH_INFO", "")
        if path.startswith("/moto-api"):
            return self.app(environ, start_response)
        headers = {k[5:].lower().replace("_", "-"): v for k, v in environ.items() if k.startswith("HTTP_")}
        request = Request(environ["REQUEST_METHOD"], path, environ.get("QUERY_STRING", ""), headers)
        request.bytes_in = int(environ.get("CONTENT_LENGTH") or 0)
        with self.counter.lock:
            self.counter.requests.append(request)
        cut = False
        for rule in list(self.rules):
            if rule.take(request):
                rule.reached.set()
                if rule.error is not None:
                    return self._error(rule.error, environ, start_response)
                if rule.cut:
                    cut = True
                    continue
                rule.release.wait(60)
        request.copied = _copy_size(request)
        body = self.app(environ, start_response)
        return self._cut(body, request) if cut else self._counted(body, request)

    @staticmethod
    def _cut(body: Any, request: Request) -> Iterator[bytes]:
        """Half the body, then an exception: the server closes the connection short of its Content-Length."""
        data = b"".join(body)
        getattr(body, "close", lambda: None)()
        request.bytes_out += len(data) // 2
        yield data[: len(data) // 2]
        raise ConnectionAbortedError("cut by the test")

    @staticmethod
    def _error(error: tuple[int, str], environ: dict, start_response: Any) -> list[bytes]:
        environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))  # the client is sending it
        status, code = error
        body = (f'<?xml version="1.0" encoding="UTF-8"?><Error><Code>{code}</Code><Message>refused by the '
                f"test</Message></Error>").encode()
        start_response(f"{status} Refused", [("Content-Type", "application/xml"), ("Content-Length", str(len(body)))])
        return [body]

    @staticmethod
    def _counted(body: Any, request: Request) -> Iterator[bytes]:
        try:
            for chunk in body:
                request.bytes_out += len(chunk)
                yield chunk
        finally:
            close = getattr(body, "close", None)
            if close is not None:
                close()


def _copy_size(request: Request) -> int:
    """The bytes a server-side copy request copies: its CopySourceRange, or the whole source object's size
    (asked of moto's own backend, before the request runs: the source may be deleted later)."""
    if request.operation == "UploadPartCopy" and "x-amz-copy-source-range" in request.headers:
        lo, _, hi = request.headers["x-amz-copy-source-range"].removeprefix("bytes=").partition("-")
        return int(hi) - int(lo) + 1
    if request.operation not in ("CopyObject", "UploadPartCopy"):
        return 0
    from urllib.parse import unquote

    from moto.core import DEFAULT_ACCOUNT_ID
    from moto.s3.models import s3_backends

    bucket, _, key = unquote(request.headers["x-amz-copy-source"]).lstrip("/").partition("/")
    try:
        return s3_backends[DEFAULT_ACCOUNT_ID]["global"].get_object(bucket, key.split("?")[0]).size
    except Exception:  # noqa: BLE001 - a copy of a missing object: the server answers it with its error
        return 0


class S3Server:
    """moto's ThreadedMotoServer with the counting middleware, on a free port of 127.0.0.1."""

    def __init__(self) -> None:
        import logging

        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise

        counter = Counter()
        self.counter = counter
        self.app: _CountingApp | None = None
        outer = self

        class _Counted(ThreadedMotoServer):
            def _server_entry(self) -> None:  # moto's own entry, the app wrapped
                from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
                from werkzeug.serving import make_server

                app = outer.app = _CountingApp(DomainDispatcherApplication(create_backend_app), counter)
                self._server = make_server(self._ip_address, self._port, app, True)
                self._server_ready_event.set()
                self._server.serve_forever()

        self._moto = _Counted(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: the OS picks a free one
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def env(self) -> dict[str, str]:
        """The environment a client (this process or a subprocess) needs to reach the server."""
        # AWS_ENDPOINT_URL is read by botocore (boto3, aiobotocore under s3fs) when a client is made;
        # FSSPEC_S3_ENDPOINT_URL by fsspec's config when fsspec is first imported (a subprocess).
        return {**FAKE_ENV, "AWS_ENDPOINT_URL": self.endpoint, "FSSPEC_S3_ENDPOINT_URL": self.endpoint}

    @contextlib.contextmanager
    def hold(self, matches: Callable[[Request], bool]) -> Iterator[threading.Event]:
        """Requests matching `matches` wait (up to 60 s) until the block ends; yields the event set when the
        first one arrives (a test kills a client mid-upload there)."""
        rule = _Rule(matches)
        assert self.app is not None
        self.app.rules.append(rule)
        try:
            yield rule.reached
        finally:
            rule.release.set()
            self.app.rules.remove(rule)

    @contextlib.contextmanager
    def refuse(self, matches: Callable[[Request], bool], status: int = 403,
               code: str = "AccessDenied") -> Iterator[threading.Event]:
        """Requests matching `matches` are answered with an S3 error while the block runs."""
        rule = _Rule(matches, error=(status, code))
        assert self.app is not None
        self.app.rules.append(rule)
        try:
            yield rule.reached
        finally:
            self.app.rules.remove(rule)

    @contextlib.contextmanager
    def fail(self, matches: Callable[[Request], bool], status: int = 503, code: str = "SlowDown",
             times: int | None = None, cut: bool = False) -> Iterator[_Rule]:
        """A fault schedule while the block runs: the first `times` requests matching `matches` (all when
        None) are answered with an S3 error, or (`cut`) served with half their body before the connection
        drops. Yields the rule (`applied`: how many requests it hit)."""
        rule = _Rule(matches, error=None if cut else (status, code), times=times, cut=cut)
        assert self.app is not None
        self.app.rules.append(rule)
        try:
            yield rule
        finally:
            self.app.rules.remove(rule)

    def stop(self) -> None:
        self._moto.stop()


class Bucket:
    """One fresh bucket of the server, and helpers that use boto3 directly (never ckptfix's stack)."""

    def __init__(self, server: S3Server, name: str):
        import boto3

        self.server = server
        self.name = name
        self.counter = server.counter
        self.client = boto3.client("s3", endpoint_url=server.endpoint, region_name="us-east-1")
        self.client.create_bucket(Bucket=name)

    def url(self, key: str = "") -> str:
        return f"s3://{self.name}/{key}"

    def _key(self, url: str) -> str:
        prefix = f"s3://{self.name}/"
        assert url.startswith(prefix), f"{url} is not in bucket {self.name}"
        return url[len(prefix) :]

    def upload(self, local_path: str, url: str) -> list[str]:
        """Upload a file to `url`, or a folder's files under the prefix `url` (relative names kept);
        returns the keys written."""
        key = self._key(url)
        if os.path.isfile(local_path):
            self.client.upload_file(local_path, self.name, key)
            return [key]
        keys = []
        for root, _dirs, files in os.walk(local_path):
            for name in sorted(files):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, local_path).replace(os.sep, "/")
                full = f"{key.rstrip('/')}/{rel}" if key else rel
                self.client.upload_file(path, self.name, full)
                keys.append(full)
        return keys

    def keys(self, prefix_url: str = "") -> list[str]:
        """Every key under the prefix (sorted), relative to it."""
        prefix = self._key(prefix_url) if prefix_url else ""
        out = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix):
            out.extend(obj["Key"][len(prefix) :] for obj in page.get("Contents", []))
        return sorted(out)

    def read(self, url: str) -> bytes:
        return self.client.get_object(Bucket=self.name, Key=self._key(url))["Body"].read()

    def download(self, prefix_url: str, local_dir: str) -> list[str]:
        """Every object under the prefix into `local_dir` (relative names kept); returns the names."""
        names = self.keys(prefix_url)
        base = self._key(prefix_url)
        for name in names:
            path = os.path.join(local_dir, *name.lstrip("/").split("/"))
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self.client.download_file(self.name, base + name, path)
        return names


def _drop_fsspec_caches() -> None:
    """fsspec caches filesystem instances and s3fs caches listings: a test must not see another's."""
    try:
        import s3fs
    except ImportError:
        return
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    reason = missing_packages()
    if reason:
        pytest.skip(reason)
    server = S3Server()
    yield server
    server.stop()


@pytest.fixture
def s3(s3_server: S3Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Bucket]:
    for name, value in s3_server.env().items():
        monkeypatch.setenv(name, value)
    try:  # fsspec read FSSPEC_S3_* when it was imported; the in-process client needs the endpoint too
        import fsspec.config

        monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_server.endpoint})
    except ImportError:
        pass
    _drop_fsspec_caches()
    bucket = Bucket(s3_server, f"ckptfix-{uuid.uuid4().hex[:12]}")
    s3_server.counter.reset()
    yield bucket
    _drop_fsspec_caches()
