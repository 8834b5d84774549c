"""Coverage-guided fuzzing of the read side with atheris (libFuzzer). Not collected by pytest.

    pip install atheris
    python tests/fuzz_inspect.py -max_total_time=600 -timeout=10 -rss_limit_mb=4096 [CORPUS_DIR ...]

With no CORPUS_DIR the harness seeds a fresh directory from tests/malicious_corpus.py (plus valid
checkpoints) under $TMPDIR, where crashing inputs are written too (-artifact_prefix). Each input's first byte picks how the rest is presented to ckptfix:
a whole file (.pth or .safetensors), a data.pkl inside an otherwise valid torch zip, or a safetensors
header; flags (--trust-pickle, --scan/--verify) come from the same byte. Everything the CLI does
runs: read, checks, `to_json()`, the text report. Any exception that is not a CkptfixError is a
crash; libFuzzer's -timeout catches hangs (also inside C code) and -rss_limit_mb memory blow-ups.
The sentinel a corpus payload would create is checked after every input.
"""

from __future__ import annotations

import io
import struct
import sys
import tempfile
import zipfile
from pathlib import Path

import atheris

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

with atheris.instrument_imports(include=["ckptfix"]):  # imported here so atheris instruments them
    import ckptfix.inspect  # noqa: F401
    import ckptfix.render  # noqa: F401
    from ckptfix.checkpoint import release_maps
    from ckptfix.errors import CkptfixError

import malicious_corpus as mc  # noqa: E402

WORK = Path(tempfile.mkdtemp(prefix="ckptfix-fuzz-"))
SENTINEL = WORK / "SENTINEL_CODE_WAS_EXECUTED"
_ZIP_TEMPLATE: list[tuple[str, bytes]] = []


def _template() -> list[tuple[str, bytes]]:
    """The members of a small valid torch.save zip, built once (data.pkl is replaced per input)."""
    if not _ZIP_TEMPLATE:

        path = mc._good_checkpoint(WORK / "template.pth")
        _ZIP_TEMPLATE.extend(mc.zip_members(path))
        path.unlink()
    return _ZIP_TEMPLATE


def _present(data: bytes) -> tuple[bytes, str, bool, bool]:
    """(file bytes, suffix, trust_pickle, scan) for one fuzz input."""
    if not data:
        return b"", ".pth", False, False
    mode, rest = data[0], data[1:]
    trust, scan, kind = bool(mode & 1), bool(mode & 2), (mode >> 2) % 4
    if kind == 1:  # rest is data.pkl inside a valid zip

        path = WORK / "zip.tmp"
        mc.write_zip(path, [(n, rest if n.endswith("/data.pkl") else d) for n, d in _template()])
        return path.read_bytes(), ".pth", trust, scan
    if kind == 2:  # rest is a safetensors header; a small data section follows
        return struct.pack("<Q", len(rest)) + rest + bytes(256), ".safetensors", trust, scan
    return rest, ".safetensors" if kind == 3 else ".pth", trust, scan


def TestOneInput(data: bytes) -> None:  # noqa: N802 - atheris' name
    content, suffix, trust, scan = _present(data)
    path = WORK / f"input{suffix}"
    path.write_bytes(content)
    try:
        mc.inspect_everything(path, trust=trust, scan=scan)
    except CkptfixError:
        pass
    finally:
        release_maps()  # the next input rewrites the file: drop the old map first
        path.unlink()
    if SENTINEL.exists():
        raise RuntimeError("a pickle payload was executed")


def _seed_dir() -> str:

    seeds = WORK / "seeds"
    seeds.mkdir()
    corpus = WORK / "corpus"
    for i, case in enumerate(mc.generate(corpus, sentinel=SENTINEL)):
        if case.path.is_file() and not case.path.is_symlink() and case.path.stat().st_size < 1 << 20:
            raw = case.path.read_bytes()
            kind = 3 if case.path.suffix == ".safetensors" else 0
            (seeds / f"{i:03}-{case.name}").write_bytes(bytes([kind << 2]) + raw)
            if raw.startswith(b"PK"):
                try:
                    with zipfile.ZipFile(io.BytesIO(raw)) as zf:
                        pkl = next(n for n in zf.namelist() if n.endswith("/data.pkl"))
                        (seeds / f"{i:03}-{case.name}-pkl").write_bytes(bytes([1 << 2]) + zf.read(pkl))
                except (zipfile.BadZipFile, StopIteration, OSError, ValueError):
                    pass
            if case.path.suffix == ".safetensors" and len(raw) > 8:
                (n,) = struct.unpack("<Q", raw[:8])
                if n < len(raw):
                    (seeds / f"{i:03}-{case.name}-hdr").write_bytes(bytes([2 << 2]) + raw[8:8 + n])
    return str(seeds)


def main() -> None:
    argv = list(sys.argv)
    if not any(a.startswith("-artifact_prefix=") for a in argv):
        argv.insert(1, f"-artifact_prefix={WORK}/")  # crash/timeout inputs go here, not into the cwd
        print(f"fuzz_inspect: crashing inputs will be written under {WORK}/", file=sys.stderr)
    if not any(not a.startswith("-") for a in argv[1:]):
        argv.append(_seed_dir())
    atheris.Setup(argv, TestOneInput)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
