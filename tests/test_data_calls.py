"""The data-call list is safe by construction (issue 28, item 1): every entry, with every kind of argument.

For each global ckptfix accepts as a data call (`data_globals.DATA_CALLS`), pickles calling it with every
combination of up to three arguments from a set of kinds (strings, ints, bytes, None, classes that run code,
functions, records) are read by ckptfix's unpickler. Each call ckptfix accepts is then really loaded with
`pickle.load` in a child process under an audit hook (PEP 578): no accepted call may start a process, open,
remove or rename a file, compile or exec code, or load a library. The classes ckptfix names as constructed data
are imported here (never by ckptfix) and checked to run no `__new__`/`__setstate__` of their own, or a vetted one.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import struct
import subprocess
import sys
from dataclasses import dataclass

import pytest

from ckptfix.errors import CkptfixError
from ckptfix.formats.data_globals import DATA_CALLS, DATA_CLASSES, KNOWN_ENUMS, is_data_call, safe_to_allowlist
from ckptfix.formats.pickle_records import OpaqueObject
from ckptfix.formats.pickle_safe import _SafeUnpickler


@dataclass(frozen=True)
class G:
    """A global, pickled by name (GLOBAL opcode)."""

    name: str


@dataclass(frozen=True)
class Call:
    """`func(*args)`, pickled as GLOBAL + args tuple + REDUCE."""

    func: str
    args: tuple


def encode(x) -> bytes:
    """Protocol 4 opcodes for `x` (no memo: each pickle is small and the readers must not rely on one)."""
    if isinstance(x, G):
        module, attr = x.name.rsplit(".", 1)
        return b"c" + module.encode() + b"\n" + attr.encode() + b"\n"
    if isinstance(x, Call):
        return encode(G(x.func)) + encode(tuple(x.args)) + b"R"
    if x is None:
        return b"N"
    if x is True or x is False:
        return b"\x88" if x else b"\x89"
    if isinstance(x, int):
        return b"J" + struct.pack("<i", x)
    if isinstance(x, str):
        data = x.encode()
        return b"X" + struct.pack("<I", len(data)) + data
    if isinstance(x, bytes):
        return b"C" + bytes([len(x)]) + x
    if isinstance(x, tuple):
        return b"(" + b"".join(map(encode, x)) + b"t"
    if isinstance(x, list):
        return b"](" + b"".join(map(encode, x)) + b"e"
    raise TypeError(x)


def pickle_of(call: Call) -> bytes:
    return b"\x80\x04" + encode(call) + b"."


KINDS = ["f8", 7, b"\x00" * 10, None, G("subprocess.Popen"), G("builtins.object"), G("posix.system"),
         ("touch", "/nonexistent/RAN"), Call("numpy.dtype", ("f8", False, True)), G("builtins.list")]


def accepted(data: bytes) -> bool:
    """Whether ckptfix's strict reader accepts this pickle (every call in it a data call)."""
    unpickler = _SafeUnpickler(data, False, "case")
    try:
        unpickler.load()
    except (CkptfixError, Exception):  # noqa: BLE001 - a refusal or a malformed call: not accepted
        return False
    return not unpickler.code_calls()


def _cases() -> list[tuple[str, tuple]]:
    cases = []
    for name in sorted(DATA_CALLS):
        for n in range(4):
            cases.extend((name, args) for args in itertools.product(KINDS, repeat=n))
    return cases


# Audit events no data call may raise (PEP 578 names). Modules are imported before the hook is installed.
_DENY = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.kill", "open",
         "os.remove", "os.unlink", "os.rename", "os.rmdir", "os.mkdir", "os.truncate", "os.chmod", "shutil.",
         "socket.", "exec", "compile", "ctypes.", "mmap.__new__", "code.__new__", "builtins.input")
_LOADER = r"""
import importlib, json, pickle, sys
names = json.loads(sys.argv[1])
for module in sorted({n.rsplit(".", 1)[0] for n in names} | {"numpy", "pathlib", "datetime", "collections"}):
    try:
        importlib.import_module(module)
    except Exception:
        pass
events = []
sys.addaudithook(lambda event, args: events.append(event) if event.startswith(tuple(json.loads(sys.argv[2])))
                 else None)
out = []
for line in sys.stdin.buffer.read().split(b"\n---\n"):
    del events[:]
    try:
        pickle.loads(bytes.fromhex(line.decode()))
    except Exception:
        pass  # a call that fails on its arguments ran nothing worth reporting; the hook says what did
    out.append(sorted(set(events)))
print(json.dumps(out))
"""


@pytest.mark.slow
def test_no_accepted_data_call_runs_code():
    cases = _cases()
    ok = [(name, args) for name, args in cases if accepted(pickle_of(Call(name, args)))]
    assert len(cases) > 30_000 and ok
    # the call that started issue 28 is refused, its safe form accepted
    assert ("copyreg._reconstructor", (G("subprocess.Popen"), G("subprocess.Popen"), ("touch", "/nonexistent/RAN"))) \
        not in ok
    assert ("copyreg._reconstructor", (G("subprocess.Popen"), G("builtins.object"), None)) in ok
    importable = [(n, a) for n, a in ok if n not in KNOWN_ENUMS or importlib.util.find_spec(n.split(".")[0])]
    # a control the hook must catch: the refused call itself (`touch` in a folder that does not exist)
    control = ("copyreg._reconstructor", (G("subprocess.Popen"), G("subprocess.Popen"), ("touch", "/nonexistent/x")))
    payload = b"\n---\n".join(pickle_of(Call(n, a)).hex().encode() for n, a in [*importable, control])
    proc = subprocess.run([sys.executable, "-c", _LOADER, json.dumps(sorted({n for n, _ in importable})),
                           json.dumps(_DENY)], input=payload, capture_output=True, timeout=600,
                          env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    *events, caught = json.loads(proc.stdout.decode().strip().splitlines()[-1])
    assert "subprocess.Popen" in caught  # the hook sees what a payload runs
    ran = [(n, a, e) for (n, a), e in zip(importable, events) if e]
    assert ran == [], ran[:5]
    print(f"\n{len(cases)} calls over {len(DATA_CALLS)} data-call globals; {len(ok)} accepted as data, "
          f"{len(importable)} of those loaded for real under the audit hook: none ran code")


def test_every_data_call_has_an_argument_rule_and_refuses_a_class_that_runs_code():
    for name in DATA_CALLS:
        rec = OpaqueObject(name, args=(OpaqueObject("subprocess.Popen"),), called=True)
        assert not is_data_call(rec), name


VETTED_SETSTATE = {"BaseContainer.__setstate__", "Node.__setstate__"}  # omegaconf: assigns its own fields
NOT_CONSTRUCTED = {"numpy.ndarray", "builtins.frozenset", "builtins.slice"}  # named or built by ckptfix's allowlist
BUILTIN_NEW = {"torch.torch_version.TorchVersion": str.__new__}  # a str subclass built from its text


def test_constructed_data_classes_run_nothing_of_their_own():
    """What torch.load runs for a constructed object: `cls.__new__(cls)` and `__setstate__(state)`."""
    checked = 0
    for name, entry in DATA_CLASSES.items():
        if entry.call or name in NOT_CONSTRUCTED:
            continue
        module, attr = name.rsplit(".", 1)
        try:
            cls = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError):  # not installed here, or a node class of another omegaconf version
            continue
        setstate = getattr(cls, "__setstate__", None)
        assert cls.__new__ is BUILTIN_NEW.get(name, object.__new__), name
        assert setstate is None or setstate.__qualname__ in VETTED_SETSTATE, (name, setstate)
        checked += 1
    assert checked >= 8


def test_an_allowlist_line_names_only_what_the_data_list_vouches_for():
    assert safe_to_allowlist("argparse.Namespace") and safe_to_allowlist("numpy.dtypes.Float32DType")
    for name in ("copyreg._reconstructor", "subprocess.Popen", "posix.system", "builtins.eval", "__main__.Cfg",
                 "numpy.memmap", "numpy.dtypes.ObjectDType", "builtins.getattr"):
        assert not safe_to_allowlist(name), name


def test_an_empty_bytes_value_is_data_and_is_written_as_torch_accepts(tmp_path):
    """torch.save spells b"" `bytes()` (protocol 2), which its own weights-only loader refuses; found by the fuzzer
    once the verify stage read OUT back. ckptfix reads it as data and writes every bytes value as
    `_codecs.encode(text, 'latin1')`, which torch accepts."""
    import torch

    import ckptfix

    torch.save({"model": {"w": torch.zeros(2)}, "x": b"", "y": b"ab"}, tmp_path / "b.pth")
    report = ckptfix.inspect(tmp_path / "b.pth")
    assert [f.code for f in report.findings] == ["CKF704"]
    ckptfix.convert(str(tmp_path / "b.pth"), str(tmp_path / "wo.pth"))
    loaded = torch.load(tmp_path / "wo.pth", weights_only=True)
    assert (loaded["x"], loaded["y"]) == (b"", b"ab")
