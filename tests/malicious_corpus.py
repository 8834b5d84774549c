"""Generate the hostile-input corpus for the read side (no binary blobs are committed).

Every input here is built from scratch into a directory:

* pickles whose `__reduce__` runs os.system / subprocess.Popen / eval / exec / a
  `getattr(__import__('os'), 'system')` chain / a nested `torch.load` (torch.storage._load_from_bytes),
  each of which, if executed, creates the sentinel file. Written as raw pickles (.pth/.pt/.bin), hidden
  in `torch.save`d dicts (zip and legacy format), and in Hugging Face folders;
* pickles that attack the allowlist unpickler itself: BUILD on allowlisted singletons and records,
  attributes that shadow dict methods, memo-shared DAGs (lists, dicts, tuples used as dict keys),
  persistent ids / devices / slices built from DAGs, huge integers, terminal escapes in names;
* damaged zips: path traversal names, lying central-directory sizes, truncations, duplicate members,
  a DEFLATE-compressed tensor record (small file, large inflated size), a flipped byte (CRC mismatch),
  a record shorter than its storage, a TorchScript archive;
* damaged safetensors headers, non-files (empty, directory, FIFO, /dev/zero), random bytes, text;
* tokenizer paths that are not tokenizers; HF folders with missing, hostile or non-regular files.

`generate(outdir)` returns a list of `Case`s (name, path, expectation); tests iterate over them.
Run `python tests/malicious_corpus.py OUTDIR` to write the corpus and print the cases.

`python tests/malicious_corpus.py --batch` is the batch runner the tests use: it reads a JSON list of
jobs (argv lists) on stdin and calls `ckptfix.cli.main` for each in this one process, printing one JSON
line per job with the exit code and the job's stdout/stderr captured at the file-descriptor level.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import random
import shlex
import stat
import struct
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

SENTINEL_NAME = "SENTINEL_CODE_WAS_EXECUTED"
EXIT = {"clean": 0, "findings": 1, "error": 2}


class Case(NamedTuple):
    """One hostile input and what `ckptfix inspect` must do with it.

    `expect` is "error" (exit 2, one `ckptfix: error:` line matching `match`), "clean" (exit 0) or
    "findings" (exit 1, reporting every code in `codes`). `scan` / `trusted` override `expect` under
    `--scan` / `--trust-pickle`; `verify_codes` are extra codes only `--verify` reports (exit 1).
    `tokenizer`, when set, is passed as `--tokenizer` (and `path` is then a good checkpoint).
    `evil` marks inputs holding a payload that would create the sentinel if executed.
    """

    name: str
    path: Path
    expect: str
    match: str = ""
    codes: tuple[str, ...] = ()
    verify_codes: tuple[str, ...] = ()
    tokenizer: Path | None = None
    scan: tuple[str, str] | None = None  # (expect, match) under --scan
    trusted: tuple[str, str] | None = None  # (expect, match) under --trust-pickle
    evil: bool = False
    note: str = ""

    def argv(self, *flags: str) -> list[str]:
        argv = ["inspect", str(self.path), *flags]
        if self.tokenizer is not None:
            argv += ["--tokenizer", str(self.tokenizer)]
        return argv

    def expectation(self, flags: tuple[str, ...] | list[str]) -> tuple[int, str, tuple[str, ...]]:
        """(exit code, regex for the error line, finding codes) for a run with these flags."""
        kind, match, codes = self.expect, self.match, self.codes
        if "--trust-pickle" in flags and self.trusted is not None:
            kind, match = self.trusted
        elif "--scan" in flags and self.scan is not None:
            kind, match = self.scan
        if "--verify" in flags and self.verify_codes and kind != "error":
            kind, codes = "findings", codes + self.verify_codes
        return EXIT[kind], (match if kind == "error" else ""), (codes if kind != "error" else ())


# --------------------------------------------------------------------------------------------------
# Payloads: objects whose unpickling runs code that creates `sentinel`.


class _Call:
    """Pickles as `func(*args)`: the building block of every payload (func may itself be a _Call)."""

    def __init__(self, func: Any, *args: Any):
        self.func, self.args = func, args

    def __reduce__(self):
        return (self.func, self.args)

    def __call__(self, *args: Any) -> Any:  # pickle insists the reduce callable is callable
        raise RuntimeError("a payload, not a function")


def payloads(sentinel: str | os.PathLike) -> dict[str, Any]:
    """Objects that create `sentinel` when unpickled by pickle.load / torch.load(weights_only=False)."""
    import builtins

    s = os.fspath(sentinel)
    touch = f"touch {shlex.quote(s)}"
    out = {
        "os_system": _Call(os.system, touch),  # pickles as posix.system
        "popen": _Call(subprocess.Popen, ["touch", s]),
        "eval": _Call(eval, f"open({s!r}, 'w').close()"),
        "exec": _Call(exec, f"import pathlib; pathlib.Path({s!r}).touch()"),
        "getattr_chain": _Call(_Call(getattr, _Call(builtins.__import__, "os"), "system"), touch),
    }
    try:
        import torch

        inner = io.BytesIO()
        torch.save({"x": out["os_system"]}, inner)
        out["nested_torch_load"] = _Call(torch.storage._load_from_bytes, inner.getvalue())
    except ImportError:  # pragma: no cover - the test environment has torch
        pass
    return out


def inst_payload(sentinel: str | os.PathLike) -> bytes:
    """Protocol 0 INST opcode: `os.system(...)` with no GLOBAL opcode at all."""
    arg = f"touch {shlex.quote(os.fspath(sentinel))}"
    return b"(V" + arg.encode() + b"\nios\nsystem\n."


# --------------------------------------------------------------------------------------------------
# A tiny pickle assembler (protocol 2 opcodes) for inputs no Python object pickles to.


def _s(text: str) -> bytes:
    b = text.encode("utf-8", "surrogatepass")
    return b"X" + struct.pack("<I", len(b)) + b


def _i(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(1 << 31) <= n < (1 << 31):
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8b" + struct.pack("<i", len(raw)) + raw  # LONG4


def _g(module: str, name: str) -> bytes:
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def _tensor(key: str, numel: int, storage: str = "FloatStorage", key_ops: bytes | None = None) -> bytes:
    """`_rebuild_tensor_v2(storage('key', numel), 0, (numel,), (1,), False, OrderedDict())`."""
    pid = b"(" + _s("storage") + _g("torch", storage) + (key_ops or _s(key)) + _s("cpu") + _i(numel) + b"tQ"
    return (_g("torch._utils", "_rebuild_tensor_v2") + b"(" + pid + _i(0) + _i(numel) + b"\x85" + _i(1)
            + b"\x85" + b"\x89" + _g("collections", "OrderedDict") + b")R" + b"tR")


def _dict(*items: bytes) -> bytes:
    """A dict from alternating key/value opcode strings."""
    return b"}(" + b"".join(items) + b"u"


def _dag(levels: int, kind: str = "list", base: int = 100) -> bytes:
    """A memo-shared DAG: x0 = 0; x(k+1) = [xk, xk] (or a tuple). 2**levels leaves if walked naively."""
    close = {"list": b"l", "tuple": b"t"}[kind]
    ops = _i(0) + b"r" + struct.pack("<I", base) + b"0"
    for k in range(levels):
        get = b"j" + struct.pack("<I", base + k)
        ops += b"(" + get + get + close + b"r" + struct.pack("<I", base + k + 1) + b"0"
    return ops + b"j" + struct.pack("<I", base + levels)


def _dag_no_pop(levels: int, base: int = 100) -> bytes:
    """The same tuple DAG without POP (torch's weights-only unpickler has no POP); leaves every level on the
    stack, so build it first, then the dict that uses it."""
    ops = _i(0) + b"r" + struct.pack("<I", base)
    for k in range(levels):
        get = b"j" + struct.pack("<I", base + k)
        ops += b"(" + get + get + b"t" + b"r" + struct.pack("<I", base + k + 1)
    return ops


def tuple_dag_key_pickle(levels: int) -> bytes:
    """{dag: 1} where hashing the key takes 2**levels steps."""
    return b"\x80\x02" + _dag_no_pop(levels) + b"}" + b"j" + struct.pack("<I", 100 + levels) + _i(1) + b"s."


def deep_tuple_key_pickle(depth: int) -> bytes:
    """{((((...)))): 1}: hashing a tuple nested this deep overflows the C stack (SIGSEGV)."""
    return b"\x80\x02}" + b")" + b"\x85" * depth + _i(1) + b"s."


def _pickle(body: bytes) -> bytes:
    return b"\x80\x02" + body + b"."


# --------------------------------------------------------------------------------------------------
# Zip surgery.


def torch_zip(path: Path, pkl: bytes, records: dict[str, bytes], *, prefix: str = "archive",
              extra: list[tuple[str, bytes]] = (), compress: tuple[str, ...] = (), align: int = 64) -> Path:
    """Write a torch.save-style zip: PREFIX/data.pkl, PREFIX/data/KEY records aligned like torch."""
    members = [(f"{prefix}/data.pkl", pkl), (f"{prefix}/byteorder", b"little")]
    members += [(f"{prefix}/data/{k}", v) for k, v in records.items()]
    members += [(f"{prefix}/version", b"3\n"), *extra]
    write_zip(path, members, compress=compress, align=align)
    return path


def write_zip(path: Path, members: list[tuple[str, bytes]], *, compress: tuple[str, ...] = (),
              align: int = 64) -> Path:
    """Members in order (duplicates allowed), STORED and 64-byte aligned like torch unless compressed."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Duplicate name"
        with open(path, "wb") as f, zipfile.ZipFile(f, "w") as zf:
            for name, data in members:
                info = zipfile.ZipInfo(name, date_time=(2024, 1, 1, 0, 0, 0))
                if name in compress:
                    info.compress_type = zipfile.ZIP_DEFLATED
                else:
                    info.compress_type = zipfile.ZIP_STORED
                    start = f.tell() + 30 + len(name.encode()) + 4
                    pad = (-start) % align if align else 0
                    info.extra = struct.pack("<HH", 0x4246, pad) + b"Z" * pad  # torch's "FB" padding field
                zf.writestr(info, data)
    return path


def zip_members(path: Path) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(path) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def record_span(path: Path, name: str) -> tuple[int, int]:
    """(data start, size) of a STORED member, from its local header."""
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def central_directory(path: Path) -> tuple[int, int]:
    """(offset, size) of the central directory, from the end-of-central-directory record."""
    data = Path(path).read_bytes()
    eocd = data.rindex(b"PK\x05\x06")
    size, offset = struct.unpack("<II", data[eocd + 12:eocd + 20])
    return offset, size


def patch_cd_size(path: Path, name: str, delta: int) -> None:
    """Make the central directory lie about one member's size (local header and data untouched)."""
    data = bytearray(Path(path).read_bytes())
    pos, _ = central_directory(path)
    while data[pos:pos + 4] == b"PK\x01\x02":
        n, m, k = struct.unpack("<HHH", data[pos + 28:pos + 34])
        if data[pos + 46:pos + 46 + n].decode() == name:
            csize, usize = struct.unpack("<II", data[pos + 20:pos + 28])
            data[pos + 20:pos + 28] = struct.pack("<II", csize + delta, usize + delta)
            Path(path).write_bytes(bytes(data))
            return
        pos += 46 + n + m + k
    raise KeyError(name)


def data_records(path: Path) -> list[str]:
    with zipfile.ZipFile(path) as zf:
        return [n for n in zf.namelist() if "/data/" in n]


# --------------------------------------------------------------------------------------------------
# Building blocks: small real checkpoints.


def _state_dict():
    import torch

    torch.manual_seed(0)
    return {"embed.weight": torch.randn(8, 4), "head.weight": torch.randn(8, 4), "norm.bias": torch.zeros(4)}


def _good_checkpoint(path: Path, *, legacy: bool = False, **extra) -> Path:
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from ckpt_factory import new_run, train

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = train(new_run(32, dim=8, layers=1), 2)
    obj = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict(),
           "scheduler": run.scheduler.state_dict(), "scaler": run.scaler.state_dict(), "step": 2, **extra}
    kw = {"_use_new_zipfile_serialization": False} if legacy else {}
    torch.save(obj, path, **kw)
    return path


def _safetensors(path: Path, header: dict | bytes, data: bytes, n: int | None = None) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if n is None else n) + raw + data)
    return path


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


# --------------------------------------------------------------------------------------------------


def generate(outdir: str | os.PathLike, sentinel: str | os.PathLike | None = None) -> list[Case]:
    """Write the corpus into `outdir` (created) and return its cases. Needs torch and safetensors."""
    import torch

    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    sentinel = Path(sentinel) if sentinel is not None else out / SENTINEL_NAME
    cases: list[Case] = []
    add = cases.append
    evil = payloads(sentinel)
    sd = _state_dict()

    good = _good_checkpoint(out / "good.pth")
    add(Case("good_checkpoint", good, "clean", note="control: a real checkpoint"))

    # -- 1. code-execution payloads ------------------------------------------------------------------
    refused = r"refusing to unpickle"
    for i, (name, obj) in enumerate(evil.items()):
        ext = (".pth", ".pt", ".bin")[i % 3]
        for proto in (2, 4):
            p = out / f"raw_{name}_p{proto}{ext}"
            p.write_bytes(pickle.dumps(obj, protocol=proto))
            # Under --trust-pickle the payload becomes an inert record; a bare pickle is still no torch file.
            add(Case(f"raw_pickle_{name}_p{proto}", p, "error", refused, evil=True,
                     trusted=("error", r"not a torch\.save file|corrupt pickle"),
                     note="torch.load(weights_only=False) runs it; weights_only=True refuses it"))
        # Inert records are not callable: a chain that calls a call's result stops at the second call. Read as
        # inert records (--trust-pickle), the call is an error finding (CKF706), never data.
        trusted = ("error", r"corrupt pickle") if name == "getattr_chain" else ("findings", "")
        p = out / f"saved_{name}.pth"
        torch.save({"model": sd, "extra": {"x": [obj]}}, p)
        add(Case(f"torch_save_nested_{name}", p, "error", refused, codes=("CKF706",), evil=True, trusted=trusted,
                 note="the payload hides in extras; --trust-pickle reports the call it would make"))
        p = out / f"legacy_{name}.pt"
        torch.save({"model": sd, "extra": {"x": [obj]}}, p, _use_new_zipfile_serialization=False)
        add(Case(f"torch_legacy_nested_{name}", p, "error", refused, codes=("CKF706",), evil=True, trusted=trusted))
    p = out / "raw_inst_p0.pth"
    p.write_bytes(inst_payload(sentinel))
    add(Case("raw_pickle_inst_opcode", p, "error", r"not a checkpoint", evil=True,
             note="protocol 0 has no \\x80 header: not even sniffed as a pickle"))
    p = torch_zip(out / "zip_inst_payload.pth", inst_payload(sentinel), {})
    add(Case("torch_zip_inst_payload", p, "error", refused, evil=True, trusted=("error", r"holds a|corrupt pickle")))
    # STACK_GLOBAL names built from memo'd strings (the static global listing must still name them).
    body = (_s("os") + b"q\x01" + _s("system") + b"q\x02" + b"h\x01h\x02\x93"
            + b"(" + _s(f"touch {shlex.quote(str(sentinel))}") + b"tR")
    p = out / "raw_stack_global_memo.pth"
    p.write_bytes(b"\x80\x04" + body + b".")
    add(Case("raw_pickle_stack_global_from_memo", p, "error", r"refusing to unpickle.*os\.system", evil=True,
             trusted=("error", r"not a torch\.save file|corrupt pickle")))

    # -- 2. attacks on the allowlist unpickler ---------------------------------------------------------
    w = bytes(range(16))
    # BUILD on the shared FloatStorage stand-in: would change the dtype of every later tensor.
    pkl = _pickle(_dict(_s("poison"), _g("torch", "FloatStorage") + _dict(_s("dtype"), _s("bad")) + b"b",
                        _s("model"), _dict(_s("w"), _tensor("0", 4))))
    p = torch_zip(out / "poison_storage_type.pth", pkl, {"0": w})
    add(Case("build_on_allowlisted_storage_type", p, "error", r"corrupt pickle|BUILD"))
    pkl = _pickle(_dict(_s("poison"), _g("torch", "float32") + b"N" + _dict(_s("name"), _s("int8")) + b"\x86b",
                        _s("model"), _dict(_s("w"), _tensor("0", 4))))
    p = torch_zip(out / "poison_dtype.pth", pkl, {"0": w})
    add(Case("build_on_allowlisted_dtype", p, "error", r"corrupt pickle|BUILD"))
    pkl = _pickle(_dict(_s("poison"), _g("torch._utils", "_rebuild_tensor_v2") + b"N"
                        + _dict(_s("__defaults__"), b"(" + _i(7) + b"t") + b"\x86b",
                        _s("model"), _dict(_s("w"), _tensor("0", 4))))
    p = torch_zip(out / "poison_function.pth", pkl, {"0": w})
    add(Case("build_on_allowlisted_function", p, "error", r"corrupt pickle|BUILD"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4) + _dict(_s("shape"), _s("xyz")) + b"b")))
    p = torch_zip(out / "build_on_tensor.pth", pkl, {"0": w})
    add(Case("build_rewrites_tensor_record", p, "error", r"corrupt pickle|BUILD"))
    od = _g("collections", "OrderedDict") + b")R" + _dict(_s("values"), _g("builtins", "complex")) + b"b"
    pkl = _pickle(_dict(_s("model"), od + b"(" + _s("w") + _tensor("0", 4) + b"u"))
    p = torch_zip(out / "shadowed_dict_method.pth", pkl, {"0": w})
    add(Case("build_shadows_dict_method", p, "error", r"shadow|corrupt pickle"))
    # Memo DAGs: 2**60 nodes if anything walks, hashes, str()s or repr()s them naively.
    p = out / "dag_list.pth"
    x: Any = 0
    for _ in range(60):
        x = [x, x]
    torch.save({"model": sd, "extra": {"dag": x}}, p)
    add(Case("memo_dag_list_60", p, "clean", note="torch.save writes it in ~1 KB (memo)"))
    p = out / "dag_dict.pth"
    d: Any = 0
    for _ in range(30):
        d = {f"k{j}": d for j in range(50)}
    torch.save({"model": sd, **{f"extra{j}": d for j in range(40)}}, p)
    add(Case("memo_dag_dict_50x30", p, "clean", note="50**30 leaves if walked naively"))
    p = out / "raw_dag_tuple_key.pth"
    p.write_bytes(tuple_dag_key_pickle(60))
    add(Case("raw_pickle_tuple_dag_dict_key", p, "error", r"expands|memo",
             note="pickle.loads and torch.load(weights_only=True) hang hashing the key"))
    p = out / "raw_memo_index_huge.pth"
    p.write_bytes(b"\x80\x02" + _i(1) + b"r\xff\xff\xff\x7f" + b".")
    add(Case("raw_pickle_memo_index_16GB", p, "error", r"memo index",
             note="pickle.loads grows and zero-fills its memo array to 2**31 entries (16 GB) for these 9 bytes"))
    p = out / "raw_binbytes8_huge.pth"
    p.write_bytes(b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"abc.")
    add(Case("raw_pickle_declared_length_1TB", p, "error", r"runs past the end|corrupt pickle"))
    p = torch_zip(out / "zip_binbytes8_huge.pth", b"\x80\x04\x8e" + struct.pack("<Q", 1 << 40) + b"abc.", {})
    add(Case("zip_pickle_declared_length_1TB", p, "error", r"runs past the end"))
    p = out / "raw_deep_tuple_key.pth"
    p.write_bytes(deep_tuple_key_pickle(300_000))
    add(Case("raw_pickle_deep_tuple_dict_key", p, "error", r"nested",
             note="pickle.loads and torch.load(weights_only=True) die of SIGSEGV hashing the key"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4)), _s("extra"),
                        b"}" + _dag(60, "tuple") + _i(1) + b"s"))
    p = torch_zip(out / "dag_tuple_dict_key.pth", pkl, {"0": w})
    add(Case("memo_dag_tuple_as_dict_key", p, "error", r"expands|memo",
             note="hashing the key takes 2**60 steps: pickle.loads and torch.load(weights_only=True) hang"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4)), _s("extra"),
                        _g("builtins", "frozenset") + b"(" + b"(" + _dag(60, "tuple") + b"l" + b"tR"))
    p = torch_zip(out / "dag_tuple_frozenset.pth", pkl, {"0": w})
    add(Case("memo_dag_tuple_in_frozenset", p, "error", r"expands|memo"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4, key_ops=_dag(60)))))
    p = torch_zip(out / "dag_persistent_id.pth", pkl, {"0": w})
    add(Case("memo_dag_persistent_id_key", p, "error", r"corrupt pickle|storage"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4)), _s("extra"),
                        _g("torch", "device") + b"(" + _dag(60) + _i(0) + b"tR"))
    p = torch_zip(out / "dag_device.pth", pkl, {"0": w})
    add(Case("memo_dag_device_spec", p, "error", r"corrupt pickle|device"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4)), _s("extra"),
                        _g("builtins", "slice") + b"(" + _dag(60) + b"NNtR"))
    p = torch_zip(out / "dag_slice.pth", pkl, {"0": w})
    add(Case("memo_dag_slice", p, "error", r"corrupt pickle|slice"))
    # Cyclic and deeply nested state dicts.
    pkl = _pickle(b"}q\x01(" + _s("w") + _tensor("0", 4) + _s("self") + b"h\x01u")
    p = torch_zip(out / "cyclic_state_dict.pth", pkl, {"0": w})
    add(Case("cyclic_state_dict", p, "clean"))
    deep = b"".join(b"}(" + _s("w") + b"h\x05" + _s("sub") for _ in range(5000)) + b"}" + b"u" * 5000
    pkl = _pickle(_dict(_s("model"), _tensor("0", 4) + b"q\x05" + b"0" + deep))
    p = torch_zip(out / "deep_state_dict.pth", pkl, {"0": w})
    add(Case("deeply_nested_state_dict", p, "error", r"nested too deeply|no model weights"))
    pkl = _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("0", 4)), _s("extra"),
                        b"(" * 200_000 + _i(0) + b"l" * 200_000))
    p = torch_zip(out / "deep_list.pth", pkl, {"0": w})
    add(Case("deeply_nested_list_200k", p, "clean", note="torch.save itself cannot write it (RecursionError)"))
    # Integers no checkpoint holds: too wide for a float, or too long to print.
    p = out / "huge_int.pth"
    torch.save({"model": sd, "epoch": 10 ** 5000}, p)
    add(Case("integer_5000_digits", p, "error", r"integer"))
    p = out / "overflow_lr.pth"
    opt = {"state": {}, "param_groups": [{"params": [0], "lr": 10 ** 400}]}
    torch.save({"model": sd, "optimizer": opt}, p)
    add(Case("integer_lr_overflows_float", p, "error", r"integer"))
    # Terminal escape sequences in names the error message quotes.
    p = out / "ansi_global.pth"
    p.write_bytes(_pickle(_g("os\x1b[2J\x1b]0;pwned\x07", "system") + b"(" + _s("true") + b"tR"))
    add(Case("terminal_escape_in_global_name", p, "error", r"refusing to unpickle",
             trusted=("error", r"not a torch\.save file")))
    p = out / "ansi_tensor_name.pth"
    torch.save({"model": {"\x1b[2J\x1b]0;pwned\x07.embed_tokens.weight": torch.zeros(32, 4)}}, p)
    add(Case("terminal_escape_in_tensor_name", p, "clean"))
    p = out / "ansi_key.pth"
    torch.save({"\x1b[31mred\x1b[0m": 1}, p)
    add(Case("terminal_escape_in_key", p, "error", r"no model weights"))
    # Tensor records the torch API would never write.
    for name, size, stride, offset in (("negative_dim", (-4,), (1,), 0), ("negative_stride", (4,), (-1,), 3),
                                       ("huge_dim", (1 << 70,), (0,), 0), ("rank_mismatch", (2, 2), (1,), 0),
                                       ("negative_offset", (4,), (1,), -2)):
        rebuild = (_g("torch._utils", "_rebuild_tensor_v2") + b"(" + b"(" + _s("storage") + _g("torch", "FloatStorage")
                   + _s("0") + _s("cpu") + _i(4) + b"tQ" + _i(offset) + b"(" + b"".join(map(_i, size)) + b"t("
                   + b"".join(map(_i, stride)) + b"t\x89" + _g("collections", "OrderedDict") + b")RtR")
        p = torch_zip(out / f"tensor_{name}.pth", _pickle(_dict(_s("model"), _dict(_s("w"), rebuild))), {"0": w})
        add(Case(f"tensor_{name}", p, "error", r"corrupt pickle|tensor"))

    # -- 3. zip archives ---------------------------------------------------------------------------------
    members = zip_members(good)
    prefix = members[0][0].split("/", 1)[0]
    p = write_zip(out / "zip_traversal.pth", members + [("../../evil", b"x"), ("/tmp/abs_evil", b"x"),
                                                        (f"{prefix}/../../../evil2", b"x")])
    add(Case("zip_path_traversal_members", p, "error", r"outside the archive folder",
             note="ckptfix never extracts; torch.load refuses members outside the archive folder, and so does ckptfix"))
    p = write_zip(out / "zip_traversal_prefix.pth", [("../data.pkl" if n.endswith("/data.pkl") else
                                                      n.replace(prefix + "/", "../", 1), d) for n, d in members])
    add(Case("zip_traversal_as_prefix", p, "clean"))
    p = write_zip(out / "zip_absolute_names.pth", [("/" + n, d) for n, d in members])
    add(Case("zip_absolute_member_names", p, "error", r"without data\.pkl"))
    records = data_records(good)
    big = max(records, key=lambda n: record_span(good, n)[1])
    p = out / "zip_cd_size_bigger.pth"
    p.write_bytes(good.read_bytes())
    patch_cd_size(p, big, +8)
    add(Case("zip_central_dir_size_bigger", p, "findings", codes=("CKF730",), verify_codes=("CKF703",)))
    p = out / "zip_cd_size_smaller.pth"
    p.write_bytes(good.read_bytes())
    patch_cd_size(p, big, -8)
    add(Case("zip_central_dir_size_smaller", p, "findings", codes=("CKF701",), scan=("error", r"outside|short")))
    p = out / "zip_cd_size_pkl.pth"
    p.write_bytes(good.read_bytes())
    patch_cd_size(p, f"{prefix}/data.pkl", -5)
    add(Case("zip_central_dir_size_data_pkl", p, "error", r"CRC|data\.pkl|corrupt"))
    raw = good.read_bytes()
    cd_off, cd_size = central_directory(good)
    pkl_start, pkl_size = record_span(good, f"{prefix}/data.pkl")
    rec_start, rec_size = record_span(good, big)
    for label, cut in (("10_bytes", 10), ("in_data_pkl", pkl_start + pkl_size // 2), ("in_record", rec_start + rec_size // 2),
                       ("half", len(raw) // 2), ("in_central_dir", cd_off + cd_size // 2), ("before_eocd_end", len(raw) - 4)):
        p = out / f"truncated_{label}.pth"
        p.write_bytes(raw[:cut])
        add(Case(f"truncated_zip_{label}", p, "error", r"zip|truncated|corrupt"))
    p = out / "flipped_byte.pth"
    flipped = bytearray(raw)
    flipped[rec_start] ^= 0x01  # lowest mantissa bit of one float32: a silent, plausible corruption
    p.write_bytes(bytes(flipped))
    add(Case("crc_mismatch_flipped_byte", p, "clean", verify_codes=("CKF703",),
             note="torch.load(weights_only=True) loads it without error"))
    short = [(n, d[: len(d) // 2] if n == big else d) for n, d in members]
    p = write_zip(out / "short_record.pth", short)
    add(Case("record_shorter_than_storage", p, "findings", codes=("CKF701",), scan=("error", r"outside|short")))
    zeros = bytes(len(dict(members)[big]))
    p = write_zip(out / "duplicate_record.pth", members + [(big, zeros)])
    add(Case("duplicate_member_names", p, "clean", codes=("CKF702",),
             note="which copy torch.load reads depends on the layout (miniz binary search)"))
    adjacent = [m for n, d in members for m in ([(n, zeros), (n, d)] if n == big else [(n, d)])]
    p = write_zip(out / "duplicate_record_zeros_first.pth", adjacent)
    add(Case("duplicate_member_names_zeros_first", p, "clean", codes=("CKF702",)))
    benign = pickle.dumps({"model": {}}, protocol=2)
    evil_pkl = pickle.dumps({"x": evil["os_system"]}, protocol=2)
    dup = [(n, d) for n, d in members]
    p = write_zip(out / "duplicate_data_pkl_evil_first.pth", [(f"{prefix}/data.pkl", evil_pkl)] + dup)
    add(Case("duplicate_data_pkl_evil_first", p, "error", r"data\.pkl|refusing", evil=True,
             trusted=("error", r"data\.pkl")))
    p = write_zip(out / "duplicate_data_pkl_evil_last.pth", dup + [(f"{prefix}/data.pkl", evil_pkl)])
    add(Case("duplicate_data_pkl_evil_last", p, "error", r"data\.pkl|refusing", evil=True,
             trusted=("error", r"data\.pkl")))
    del benign
    # A DEFLATE-compressed record: 64 MiB of zeros in ~64 KB.
    big_sd = {"w": torch.zeros(1 << 24)}
    buf = io.BytesIO()
    torch.save(big_sd, buf)
    del big_sd
    with zipfile.ZipFile(io.BytesIO(buf.getvalue())) as zf:
        bomb = [(i.filename, zf.read(i)) for i in zf.infolist()]
    del buf
    rec = next(n for n, _ in bomb if "/data/" in n)
    p = write_zip(out / "deflated_record.pth", bomb, compress=(rec,))
    del bomb
    add(Case("deflate_compressed_record_64MiB", p, "clean", scan=("error", r"compressed"),
             note="torch.load inflates it; ckptfix never inflates records"))
    p = out / "torchscript.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(p))
    add(Case("torchscript_archive", p, "error", r"TorchScript"))
    p = write_zip(out / "zip_no_data_pkl.pth", [("archive/data/0", b"x" * 16)])
    add(Case("zip_without_data_pkl", p, "error", r"without data\.pkl"))
    p = write_zip(out / "zip_data_pkl_is_text.pth", [("archive/data.pkl", b"hello world\n")])
    add(Case("zip_data_pkl_is_text", p, "error", r"corrupt pickle"))
    p = torch_zip(out / "zip_missing_record.pth", _pickle(_dict(_s("model"), _dict(_s("w"), _tensor("7", 4)))), {})
    add(Case("zip_missing_record", p, "findings", codes=("CKF701",), scan=("error", r"missing")))

    # -- 4. files that are not checkpoints ----------------------------------------------------------------
    p = out / "empty.pth"
    p.write_bytes(b"")
    add(Case("zero_byte_file", p, "error", r"empty file", note="torch.load: EOFError with an empty message"))
    p = _mkdir(out / "a_directory.pth")
    add(Case("directory_as_file", p, "error", r"folder holds no checkpoint"))
    rng = random.Random(1234)
    for label, head in (("random", b""), ("random_zip_magic", b"PK\x03\x04"), ("random_pickle_magic", b"\x80\x02"),
                        ("random_legacy_magic", b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19.")):
        p = out / f"{label}.pth"
        p.write_bytes(head + bytes(rng.getrandbits(8) for _ in range(4096)))
        add(Case(f"bytes_{label}", p, "error", r"."))
    p = out / "text.pth"
    p.write_text("hello world\nthis is a text file, not a checkpoint\n")
    add(Case("text_file", p, "error", r"not a checkpoint"))
    p = out / "fifo.pth"
    os.mkfifo(p)
    add(Case("fifo_as_file", p, "error", r"not a regular file"))
    p = out / "dev_zero.safetensors"
    os.symlink("/dev/zero", p)
    add(Case("symlink_to_dev_zero", p, "error", r"not a regular file|not a checkpoint"))
    p = out / "missing.pth"
    add(Case("missing_file", p, "error", r"no such file"))
    p = out / "legacy_truncated.pt"
    legacy = _good_checkpoint(out / "legacy_good.pt", legacy=True)
    add(Case("legacy_good", legacy, "clean"))
    p.write_bytes(legacy.read_bytes()[: legacy.stat().st_size * 3 // 4])
    add(Case("legacy_truncated", p, "error", r"truncated|corrupt"))
    p = out / "legacy_negative_numel.pt"
    data = bytearray(legacy.read_bytes())
    # the first storage's numel (int64) follows the storage-key list pickle
    import pickletools

    pos = 0
    for _ in range(5):
        for op, _arg, at in pickletools.genops(io.BytesIO(bytes(data[pos:]))):
            if op.name == "STOP":
                pos += at + 1
                break
    data[pos:pos + 8] = struct.pack("<q", -5)
    p.write_bytes(bytes(data))
    add(Case("legacy_negative_storage_size", p, "error", r"corrupt|truncated|negative"))

    # -- 5. safetensors headers -------------------------------------------------------------------------
    from safetensors.torch import save_file

    st = out / "good.safetensors"
    save_file({"embed.weight": torch.randn(8, 4), "norm.bias": torch.zeros(4)}, str(st))
    add(Case("safetensors_good", st, "clean"))
    n = struct.unpack("<Q", st.read_bytes()[:8])[0]
    header = json.loads(st.read_bytes()[8:8 + n])
    body = st.read_bytes()[8 + n:]
    meta = header.pop("__metadata__", None)

    def variant(label: str, hdr: Any, match: str, *, data: bytes = body, n: int | None = None) -> None:
        add(Case(f"safetensors_{label}", _safetensors(out / f"st_{label}.safetensors", hdr, data, n), "error",
                 match))

    variant("header_len_exceeds_file", header, r"exceeds the file", n=len(json.dumps(header)) + len(body) + 100)
    a, b = header["embed.weight"], header["norm.bias"]
    variant("overlapping_offsets", {**header, "norm.bias": {**b, "data_offsets": [0, 16]}}, r"overlap")
    variant("offsets_out_of_range", {**header, "norm.bias": {**b, "data_offsets": [len(body), len(body) + 16]}},
            r"outside the data")
    variant("offsets_reversed", {**header, "norm.bias": {**b, "data_offsets": [16, 0]}}, r"outside the data")
    variant("unknown_dtype", {**header, "norm.bias": {**b, "dtype": "F128"}}, r"unknown dtype")
    variant("dtype_not_a_string", {**header, "norm.bias": {**b, "dtype": ["F32"]}}, r"dtype")
    variant("non_utf8_header", b'{"\xff\xfe": 1}', r"not UTF-8")
    variant("invalid_json", b'{"a": ', r"not valid JSON")
    variant("header_unterminated", b'{"a": 1', r"not valid JSON")
    variant("entry_not_object", {**header, "norm.bias": 5}, r"lacks dtype")
    variant("negative_shape", {**header, "norm.bias": {**b, "shape": [-4]}}, r"invalid shape")
    variant("shape_wider_than_int64", {**header, "norm.bias": {**b, "shape": [0, 10 ** 30]}}, r"invalid shape")
    variant("byte_count_mismatch", {**header, "norm.bias": {**b, "shape": [5]}}, r"bytes for shape")
    variant("deeply_nested_json", b'{"__metadata__": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"JSON")
    variant("integer_5000_digits", b'{"__metadata__": {"x": ' + b"9" * 5000 + b"}}", r"JSON")
    variant("header_len_huge", header, r"not a checkpoint|exceeds", n=1 << 62)
    variant("truncated_data", header, r"outside the data", data=body[:-3])
    del a, meta

    # -- 6. tokenizers that are not tokenizers --------------------------------------------------------
    tok_dir = _mkdir(out / "tokenizers")
    (tok_dir / "random").mkdir(exist_ok=True)
    (tok_dir / "random" / "tokenizer.json").write_bytes(bytes(rng.getrandbits(8) for _ in range(2048)))
    (tok_dir / "notatok").mkdir(exist_ok=True)
    (tok_dir / "notatok" / "tokenizer.json").write_text(json.dumps({"hello": "world", "model": [1, 2, 3]}))
    (tok_dir / "fake.model").write_bytes(bytes(rng.getrandbits(8) for _ in range(2048)))
    (tok_dir / "empty.json").write_bytes(b"")
    _mkdir(tok_dir / "emptydir")
    for label, tok in (("checkpoint_as_tokenizer", good), ("random_tokenizer_json", tok_dir / "random" / "tokenizer.json"),
                       ("random_tokenizer_folder", tok_dir / "random"), ("json_not_a_tokenizer", tok_dir / "notatok" / "tokenizer.json"),
                       ("random_sentencepiece_model", tok_dir / "fake.model"), ("empty_json_tokenizer", tok_dir / "empty.json"),
                       ("empty_tokenizer_folder", tok_dir / "emptydir"), ("evil_pickle_as_tokenizer", out / "raw_os_system_p2.pth"),
                       ("missing_tokenizer", tok_dir / "missing.json")):
        add(Case(f"tokenizer_{label}", good, "error", r"tokenizer|not a|no such", tokenizer=tok,
                 evil=label.startswith("evil")))

    # -- 7. Hugging Face folders ------------------------------------------------------------------------
    hf = _mkdir(out / "hf")
    st_bytes = st.read_bytes()
    optim = io.BytesIO()
    torch.save({"state": {}, "param_groups": [{"params": [0, 1], "lr": 1e-3}]}, optim)
    sched = _torch_save_bytes({"base_lrs": [1e-3], "last_epoch": 2, "_step_count": 3, "_last_lr": [1e-3]})
    rng = _torch_save_bytes({"python": random.getstate(), "cpu": torch.random.get_rng_state()})

    def folder(label: str, files: dict[str, bytes | str | None], expect: str, match: str = "", **kw) -> Path:
        root = _mkdir(hf / label)
        for rel, content in files.items():
            target = root / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if content is None:
                target.mkdir(exist_ok=True)
            elif content == "FIFO":
                os.mkfifo(target)
            else:
                target.write_bytes(content.encode() if isinstance(content, str) else content)
        add(Case(f"hf_{label}", root, expect, match, **kw))
        return root

    def index(*shards: str) -> str:
        return json.dumps({"metadata": {}, "weight_map": {f"t{i}": s for i, s in enumerate(shards)}})

    state = json.dumps({"global_step": 2, "log_history": []})
    folder("good_model", {"model.safetensors": st_bytes, "config.json": "{}"}, "clean")
    # what Trainer._save_checkpoint writes and its resume loads (no finding); without them: CKF310/CKF312
    trainer = {"model.safetensors": st_bytes, "optimizer.pt": optim.getvalue(), "scheduler.pt": sched,
               "rng_state.pth": rng, "trainer_state.json": state}
    folder("good_trainer", trainer, "clean")
    folder("index_missing_shard", {"model-00001-of-00002.safetensors": st_bytes,
                                   "model.safetensors.index.json": index("model-00001-of-00002.safetensors",
                                                                         "model-00002-of-00002.safetensors")},
           "error", r"shard files missing")
    (hf / "outside.safetensors").write_bytes(st_bytes)
    folder("index_shard_escapes_folder", {"model.safetensors.index.json": index("../outside.safetensors")},
           "error", r"outside the folder")
    folder("index_absolute_shard", {"model.safetensors.index.json": index(str(st))}, "error", r"outside the folder")
    folder("index_shard_not_a_string", {"model.safetensors.index.json": json.dumps({"weight_map": {"a": ["x"]}})},
           "error", r"weight_map|shard")
    folder("index_not_json", {"model.safetensors.index.json": "{not json"}, "error", r"not valid JSON")
    folder("index_without_weight_map", {"model.safetensors.index.json": "[]"}, "error", r"weight_map")
    folder("trainer_state_without_optimizer", {"model.safetensors": st_bytes, "trainer_state.json": state},
           "findings", codes=("CKF310",), note="the Trainer would resume with a fresh optimizer and schedule")
    folder("trainer_state_only", {"trainer_state.json": state}, "error", r"no weight file")
    folder("optimizer_evil", {"model.safetensors": st_bytes, "trainer_state.json": state,
                              "optimizer.pt": _torch_save_bytes({"state": {}, "param_groups": [], "x": evil["exec"]})},
           "error", refused, codes=("CKF706",), evil=True, trusted=("findings", ""))
    folder("weights_evil_bin", {"pytorch_model.bin": _torch_save_bytes({"w": torch.zeros(2), "x": evil["eval"]})},
           "error", refused, codes=("CKF706",), evil=True, trusted=("findings", ""))
    folder("training_args_evil", {**trainer, "training_args.bin": _torch_save_bytes(evil["os_system"])}, "clean",
           evil=True,
           note="training_args.bin is always read as inert records")
    folder("scheduler_evil", {"model.safetensors": st_bytes, "scheduler.pt": _torch_save_bytes({"x": evil["popen"]})},
           "error", refused, codes=("CKF706",), evil=True, trusted=("findings", ""))
    folder("optimizer_is_directory", {"model.safetensors": st_bytes, "optimizer.pt": None}, "error", r"optimizer\.pt")
    folder("weights_is_directory", {"model.safetensors": None, "config.json": "{}"}, "error", r"model\.safetensors")
    folder("optimizer_is_fifo", {"model.safetensors": st_bytes, "optimizer.pt": "FIFO"}, "error", r"not a regular file")
    folder("optimizer_truncated", {"model.safetensors": st_bytes, "optimizer.pt": optim.getvalue()[:100]}, "error",
           r"zip|truncated|corrupt")
    folder("optimizer_not_optimizer", {"model.safetensors": st_bytes, "optimizer.pt": _torch_save_bytes({"a": 1})},
           "error", r"not an optimizer")
    folder("config_not_json", {"model.safetensors": st_bytes, "config.json": b"\xff\xfe"}, "error", r"not valid JSON")
    folder("config_deeply_nested", {"model.safetensors": st_bytes, "config.json": "[" * 100_000 + "]" * 100_000},
           "error", r"JSON")
    folder("record_not_a_dict", {"model.safetensors": st_bytes, "optimizer.pt": optim.getvalue(), "ckptfix.json": "[1]"},
           "error", r"ckptfix\.json")
    folder("empty_folder", {}, "error", r"folder holds no checkpoint")
    folder("dcp_metadata_is_fifo", {".metadata": "FIFO"}, "error", r"not a regular file")
    return cases


def _torch_save_bytes(obj: Any) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


# --------------------------------------------------------------------------------------------------
# Snapshots: prove inputs are not modified and nothing is written.


def snapshot(root: str | os.PathLike) -> dict[str, str]:
    """Relative path -> content digest (or the kind of non-regular file) for everything under root."""
    root = Path(root)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = "link:" + os.readlink(p)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = "dir"
            elif stat.S_ISFIFO(st.st_mode):
                out[rel] = "fifo"
            else:
                h = hashlib.sha256()
                with open(p, "rb") as f:
                    for chunk in iter(lambda: f.read(1 << 20), b""):
                        h.update(chunk)
                out[rel] = f"{st.st_size}:{h.hexdigest()}"
    return out


# --------------------------------------------------------------------------------------------------
# The batch runner: many CLI invocations in one separate process.


def _run_batch(jobs: list[dict], result_fd: int, timeout: float) -> None:
    import faulthandler
    import signal
    import tempfile

    from ckptfix.checkpoint import release_maps
    from ckptfix.cli import main

    results = os.fdopen(result_fd, "w", buffering=1)
    hang_log = open(os.devnull, "w")

    class _Hang(BaseException):
        pass

    def on_alarm(signum, frame):
        raise _Hang()

    signal.signal(signal.SIGALRM, on_alarm)
    for job in jobs:
        results.write(json.dumps({"start": job["id"]}) + "\n")
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            sys.stdout.flush(), sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            code: Any = None
            # A hang in Python code raises _Hang; a hang inside C code ends this process (the caller then
            # records the started job as hung and restarts the batch after it).
            faulthandler.dump_traceback_later(timeout + 5, exit=True, file=hang_log)
            signal.setitimer(signal.ITIMER_REAL, timeout)
            try:
                main(job["argv"])
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except _Hang:
                code = "hang"
            except BaseException as exc:  # noqa: BLE001 - report, never die
                code = f"escaped:{type(exc).__name__}"
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
                faulthandler.cancel_dump_traceback_later()
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
            release_maps()
            out.seek(0), err.seek(0)
            results.write(json.dumps({"id": job["id"], "code": code,
                                      "stdout": out.read().decode("utf-8", "replace"),
                                      "stderr": err.read().decode("utf-8", "replace")}) + "\n")


def run_batch(jobs: list[dict], *, cwd: str | os.PathLike, timeout: float = 20.0,
              env: dict | None = None) -> dict[Any, dict]:
    """Run `jobs` ([{"id", "argv"}]) through `ckptfix.cli.main` in a separate Python process.

    Returns id -> {"code", "stdout", "stderr"}; code is the exit status, "hang" for a job that ran past
    `timeout` seconds, or "died" when the whole process ended inside a job.
    """
    results: dict[Any, dict] = {}
    pending = list(jobs)
    repo = str(Path(__file__).resolve().parent.parent)
    env = {**os.environ, **(env or {}), "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("CKPTFIX_DEBUG", None)
    while pending:
        r, w = os.pipe()
        proc = subprocess.Popen([sys.executable, __file__, "--batch", str(w), str(timeout)], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=cwd, env=env, pass_fds=(w,))
        os.close(w)
        proc.stdin.write(json.dumps(pending).encode())
        proc.stdin.close()
        started = None
        with os.fdopen(r) as lines:
            for line in lines:
                msg = json.loads(line)
                if "start" in msg:
                    started = msg["start"]
                else:
                    results[msg["id"]] = msg
        stderr = proc.stderr.read().decode(errors="replace")
        proc.wait()
        pending = [j for j in pending if j["id"] not in results]
        if pending:
            if started is None or started in results:
                raise RuntimeError(f"batch runner failed (exit {proc.returncode}): {stderr[-2000:]}")
            results[started] = {"id": started, "code": "died", "stdout": "", "stderr": stderr[-2000:]}
            pending = [j for j in pending if j["id"] != started]
    return results


def _main(argv: list[str]) -> int:
    if argv[:1] == ["--batch"]:
        _run_batch(json.load(sys.stdin), int(argv[1]), float(argv[2]))
        return 0
    if len(argv) != 1:
        print(__doc__)
        print("usage: python tests/malicious_corpus.py OUTDIR", file=sys.stderr)
        return 2
    for case in generate(argv[0]):
        print(f"{case.name:45} {case.expect:9} {case.path}")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))


def inspect_everything(path: str | os.PathLike, *, trust: bool = False, scan: bool = False) -> None:
    """The read-side contract in-process: inspect, the JSON document and the text report all come back,
    or a CkptfixError is raised (callers decide what else to assert). Warnings are not the point here."""
    from ckptfix import inspect
    from ckptfix.render import render_report

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = inspect(path, trust_pickle=trust, scan=scan, verify=scan)
        json.dumps(report.to_json(), default=str)
        render_report(report)
