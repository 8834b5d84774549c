"""Property tests: damaged checkpoints make `ckptfix.inspect` return a Report or raise CkptfixError.

Hypothesis mutates real files (a small `torch.save` checkpoint from tests/ckpt_factory.py, the same
checkpoint with a code-execution payload in it, a `safetensors.torch.save_file` file): byte flips,
inserts, deletes and truncations of the whole file; mutations of data.pkl alone (the zip rebuilt
around it); random programs of pickle opcodes over the allowlisted globals; mutations of the
safetensors header JSON. For each example: no exception other than CkptfixError (from reading,
checking, `to_json()` and the text report — everything the CLI does), no example over its time bound
(SIGALRM), and the sentinel a payload would create never appears. Bounded by `max_examples` so the
file runs in well under a minute.
"""

from __future__ import annotations

import io
import itertools
import json
import signal
import struct
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")
import malicious_corpus as mc  # noqa: E402
from hypothesis import HealthCheck, assume, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from ckptfix import inspect  # noqa: E402
from ckptfix.checkpoint import release_maps  # noqa: E402
from ckptfix.errors import CkptfixError  # noqa: E402

TIME_BOUND_S = 5
SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Hang(Exception):
    pass


@pytest.fixture(scope="module")
def seeds(tmp_path_factory):
    root = tmp_path_factory.mktemp("seeds")
    from safetensors.torch import save_file

    good = mc._good_checkpoint(root / "good.pth")
    evil = root / "evil.pth"
    torch.save({"model": mc._state_dict(), "extra": [mc.payloads(root / mc.SENTINEL_NAME)["os_system"]]}, evil)
    st_path = root / "good.safetensors"
    save_file({"embed.weight": torch.randn(8, 4), "norm.bias": torch.zeros(4), "step": torch.ones(())}, str(st_path))
    work = root / "work"
    work.mkdir()
    return Seeds(root=root, good=good.read_bytes(), evil=evil.read_bytes(), st=st_path.read_bytes(),
                 work=work, counter=itertools.count())


class Seeds(dict):
    """The seed files (a dict with a short repr, so a falsifying example does not print megabytes)."""

    def __init__(self, **kw):
        super().__init__(**kw)

    def __repr__(self) -> str:
        return f"<seeds in {self['root']}>"


def check(seeds, data: bytes, suffix: str = ".pth", *, trust: bool = False, scan: bool = False) -> None:
    """The contract for one input: Report or CkptfixError, within the time bound, nothing executed."""
    path = seeds["work"] / f"x{next(seeds['counter'])}{suffix}"  # a new name: no stale memory map reused
    path.write_bytes(data)

    def on_alarm(signum, frame):
        raise Hang(f"inspect took more than {TIME_BOUND_S}s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(TIME_BOUND_S)
    try:
        mc.inspect_everything(path, trust=trust, scan=scan)
    except CkptfixError as exc:
        assert str(exc)  # a message naming the problem (the CLI prints it on one line)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        release_maps()
        path.unlink()
    assert not (seeds["root"] / mc.SENTINEL_NAME).exists(), "a payload ran"


# ----------------------------------------------------------------------------------------------------
# Byte-level damage to whole files.

mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 1 << 30), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 30), st.binary(min_size=1, max_size=16)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 30), st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 30), st.just(0)),
    st.tuples(st.just("overwrite"), st.integers(0, 1 << 30), st.binary(min_size=1, max_size=8)),
)


def mutate(data: bytes, ops) -> bytes:
    buf = bytearray(data)
    for op, pos, arg in ops:
        if not buf:
            break
        pos %= len(buf)
        if op == "flip":
            buf[pos] ^= arg
        elif op == "insert":
            buf[pos:pos] = arg
        elif op == "delete":
            del buf[pos:pos + arg]
        elif op == "truncate":
            del buf[pos:]
        else:
            buf[pos:pos + len(arg)] = arg
    return bytes(buf)


@settings(max_examples=250, **SETTINGS)
@given(ops=st.lists(mutation, min_size=1, max_size=4), which=st.sampled_from(["good", "evil"]),
       trust=st.booleans(), scan=st.booleans())
def test_damaged_torch_file(seeds, ops, which, trust, scan):
    check(seeds, mutate(seeds[which], ops), trust=trust, scan=scan)


@settings(max_examples=150, **SETTINGS)
@given(ops=st.lists(mutation, min_size=1, max_size=4), scan=st.booleans())
def test_damaged_safetensors_file(seeds, ops, scan):
    check(seeds, mutate(seeds["st"], ops), ".safetensors", scan=scan)


# ----------------------------------------------------------------------------------------------------
# data.pkl alone, the zip kept valid around it.


def with_pickle(seed: bytes, pkl: bytes) -> bytes:
    """`seed` (a torch zip) with its data.pkl replaced; every other member, and the zip, stay valid."""
    with zipfile.ZipFile(io.BytesIO(seed)) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "x.pth"
        mc.write_zip(path, [(n, pkl if n.endswith("/data.pkl") else d) for n, d in members])
        return path.read_bytes()


def data_pkl(seed: bytes) -> bytes:
    with zipfile.ZipFile(io.BytesIO(seed)) as zf:
        return zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))


@settings(max_examples=250, **SETTINGS)
@given(ops=st.lists(mutation, min_size=1, max_size=3), which=st.sampled_from(["good", "evil"]),
       trust=st.booleans(), scan=st.booleans())
def test_damaged_pickle_in_a_valid_zip(seeds, ops, which, trust, scan):
    check(seeds, with_pickle(seeds[which], mutate(data_pkl(seeds[which]), ops)), trust=trust, scan=scan)


# Random programs over the opcodes and globals the allowlist answers: they reach the stand-ins
# (_rebuild_tensor, torch.device, torch.Size, OrderedDict, set, slice, ...) with arbitrary arguments.
GLOBALS = [("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
           ("torch._utils", "_rebuild_parameter"), ("torch._tensor", "_rebuild_from_type_v2"),
           ("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "slice"),
           ("builtins", "complex"), ("torch", "device"), ("torch", "Size"), ("torch", "FloatStorage"),
           ("torch", "float32"), ("torch", "bfloat16"), ("torch", "Tensor"), ("os", "system"), ("builtins", "eval")]
fragment = st.one_of(
    st.sampled_from([b"(", b"t", b"\x85", b"\x86", b"\x87", b")", b"]", b"}", b"e", b"u", b"s", b"a", b"l", b"d",
                     b"R", b"b", b"Q", b"N", b"\x88", b"\x89", b"0", b"2", b"\x81", b"\x8f", b"\x90", b"\x91",
                     b"\x94", b"\x93", b"1"]),
    st.sampled_from(GLOBALS).map(lambda g: mc._g(*g)),
    st.integers(-(1 << 70), 1 << 70).map(mc._i),
    st.sampled_from(["storage", "0", "1", "cpu", "model", "optimizer", "state", "param_groups", "params", "w",
                     "lr", "step", "_metadata", "values", "items", "get", "name", "dtype", "shape"]).map(mc._s),
    st.integers(0, 8).map(lambda k: b"q" + bytes([k])),
    st.integers(0, 8).map(lambda k: b"h" + bytes([k])),
    st.floats(allow_nan=True).map(lambda f: b"G" + struct.pack(">d", f)),
)


@settings(max_examples=400, **SETTINGS)
@given(body=st.lists(fragment, max_size=40), trust=st.booleans(), scan=st.booleans(), wrap=st.booleans())
def test_random_pickle_programs(seeds, body, trust, scan, wrap):
    program = b"".join(body)
    if wrap:  # inside a real checkpoint dict, where the model section must still be found
        program = mc._dict(mc._s("model"), mc._dict(mc._s("w"), mc._tensor("0", 4)), mc._s("extra"), b"N" + program)
    pkl = mc._pickle(program)
    check(seeds, with_pickle(seeds["good"], pkl), trust=trust, scan=scan)


# ----------------------------------------------------------------------------------------------------
# The safetensors header, as JSON.

json_value = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | st.text(max_size=8),
                          lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
                          max_leaves=12)


def st_parts(seed: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", seed[:8])
    return json.loads(seed[8:8 + n]), seed[8 + n:]


@settings(max_examples=300, **SETTINGS)
@given(edits=st.lists(st.tuples(st.sampled_from(["embed.weight", "norm.bias", "step", "__metadata__", "new"]),
                                st.sampled_from(["dtype", "shape", "data_offsets", None]), json_value),
                      min_size=1, max_size=3),
       length_delta=st.sampled_from([0, 0, 0, 1, -1, 1 << 20, -5]), scan=st.booleans())
def test_mutated_safetensors_header(seeds, edits, length_delta, scan):
    header, body = st_parts(seeds["st"])
    for name, field, value in edits:
        if field is None or not isinstance(header.get(name), dict):
            header[name] = value
        else:
            header[name][field] = value
    raw = json.dumps(header).encode()
    assume(len(raw) + length_delta >= 0)
    check(seeds, struct.pack("<Q", len(raw) + length_delta) + raw + body, ".safetensors", scan=scan)


@settings(max_examples=100, **SETTINGS)
@given(offsets=st.lists(st.tuples(st.integers(-4, 200), st.integers(-4, 200)), min_size=3, max_size=3),
       dtypes=st.lists(st.sampled_from(["F32", "F16", "BF16", "I64", "BOOL", "F8_E4M3", "U8"]), min_size=3, max_size=3),
       shapes=st.lists(st.lists(st.integers(0, 20), max_size=3), min_size=3, max_size=3))
def test_safetensors_layout_lies(seeds, offsets, dtypes, shapes):
    header, body = st_parts(seeds["st"])
    header.pop("__metadata__", None)
    for (_name, entry), (b, e), dt, shape in zip(header.items(), offsets, dtypes, shapes):
        entry.update(data_offsets=[b, e], dtype=dt, shape=shape)
    raw = json.dumps(header).encode()
    check(seeds, struct.pack("<Q", len(raw)) + raw + body, ".safetensors", scan=True)


def test_seeds_are_valid(seeds):
    """The unmutated seeds read cleanly (so the properties test damage, not a broken seed)."""
    for name, suffix in (("good", ".pth"), ("st", ".safetensors")):
        path = seeds["work"] / f"seed{suffix}"
        path.write_bytes(seeds[name])
        assert inspect(path, scan=True, verify=True).exit_code == 0
        release_maps()
    evil = seeds["work"] / "evil.pth"
    evil.write_bytes(seeds["evil"])
    with pytest.raises(CkptfixError, match="refusing to unpickle"):
        inspect(evil)
    assert [f.code for f in inspect(evil, trust_pickle=True).findings if f.severity == "error"] == ["CKF706"]
    assert not (seeds["root"] / mc.SENTINEL_NAME).exists()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
