"""The write promises of `ckptfix repair` (SECURITY.md, "Writes"), proven on the real CLI.

* Interrupted writes: `python -m ckptfix.cli repair` is SIGKILLed at many points of its write, for a
  48 MB `.pth` and a 32 MB HF folder, each as a fresh output, over an existing output (--force) and
  in place (30 runs). Kill points come from watching the output folder while the child runs in 1 ms steps
  (SIGSTOP/SIGCONT): the kill lands while the child is stopped in exactly the observed state (temp
  file just created, first records written, 1/3, 2/3, complete, renamed into place). The few points
  between two system calls (after the temp file's fsync and before the rename, after the rename,
  between the backup link and the rename, after the folder swap) are hit exactly by a wrapper that
  runs the same CLI with `os.fsync`/`os.replace`/`os.link`/`ckptfix.io._exchange` made to SIGKILL the process
  itself: a test-side hook, nothing in the product. After every kill: OUT is absent or a complete
  checkpoint equal to a reference repair (or, where it existed, the complete old one), the input is
  byte-identical, and what is left over has the recognisable `.NAME.ckptfix-tmp-*` name.
* Full disk: a 2 MB tmpfs (skipped where it cannot be mounted) and RLIMIT_FSIZE (EFBIG, always).
* Modes, in-place with a live mmap, temp cleanup on late errors, fsync of file and folder.

Totals over the kill tests are printed by `test_zz_kill_totals` (pytest -s shows them).
"""

from __future__ import annotations

import errno
import hashlib
import json
import mmap
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from ckpt_factory import new_run, save_checkpoint, train
from tokenizer_factory import train_bpe_tokenizer_json

import ckptfix
import ckptfix.io as ckio
from ckptfix.errors import RepairError

REPO = Path(__file__).resolve().parents[1]
OLD_ROWS, NEW_ROWS = 1000, 1020
TMP = ckio.TMP_MARK
VOLATILE = {"created", "source"}  # record fields that differ between two repairs of the same input
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="kills are placed through /proc; Linux only")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
TALLY = {"inputs": set(), "runs": 0, "kills": 0, "missed": 0, "partial_outputs": 0, "inputs_modified": 0,
         "temp_left": 0, "kills_with_partial_temp": 0, "kills_leaving_the_new_output": 0, "missed_points": []}



# ---------------------------------------------------------------------------------------------- inputs

def sha256(path) -> str:
    return ckio.sha256_file(str(path))


def snapshot(folder) -> dict[str, str]:
    """relative path -> sha256 of every file (symlinks as their target) under `folder`."""
    return {rel: sha256(os.path.join(folder, rel)) for rel in ckio.folder_files(str(folder))}


def record_view(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in VOLATILE}


def folder_view(folder) -> dict[str, object]:
    """A folder's content for comparison: file hashes, ckptfix.json without its volatile fields."""
    view: dict[str, object] = {}
    for rel in ckio.folder_files(str(folder)):
        path = os.path.join(folder, rel)
        if rel == "ckptfix.json":
            view[rel] = record_view(json.loads(Path(path).read_text()))
        else:
            view[rel] = sha256(path)
    return view


def same_tree(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8) if a.numel() else a,
                                                       b.reshape(-1).view(torch.uint8) if b.numel() else b))
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - VOLATILE
        return keys == set(b) - VOLATILE and all(same_tree(a[k], b[k]) for k in keys)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_tree(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def load_pth(path):
    return torch.load(path, weights_only=True, mmap=True)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """A 48 MB `.pth` (vocab 1000 x 2048, AdamW moments), an HF folder with 32 MB in it, a 1.5 MB
    `.pth`, a 1020-token tokenizer, and reference repairs (new: --init zeros; old: --init mean)."""
    d = tmp_path_factory.mktemp("write_safety")
    src = d / "src"
    src.mkdir()
    run = train(new_run(OLD_ROWS, dim=2048, layers=0), 1)
    big = save_checkpoint(run, src / "big.pth")
    os.chmod(big, 0o640)
    hf = src / "hf"
    hf.mkdir()
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in run.model.state_dict().items()}, str(hf / "model.safetensors"))
    (hf / "config.json").write_text(json.dumps({"vocab_size": OLD_ROWS, "model_type": "tiny"}))
    (hf / "extra.bin").write_bytes(os.urandom(16 << 20))  # copied as bytes: more to write
    (hf / "logs").mkdir()
    (hf / "logs" / "notes.txt").write_text("a sub-folder is copied too\n")
    small = save_checkpoint(train(new_run(OLD_ROWS, dim=64, layers=0), 1), src / "small.pth")
    tok = train_bpe_tokenizer_json(d, NEW_ROWS)
    ref = d / "ref"
    ref.mkdir()
    for name, init in (("new", "zeros"), ("old", "mean")):
        ckptfix.repair(big, tok, ref / f"{name}.pth", init=init)
        ckptfix.repair(hf, tok, ref / f"hf_{name}", init=init)
    assert not same_tree(load_pth(ref / "new.pth"), load_pth(ref / "old.pth"))
    assert folder_view(ref / "hf_new") != folder_view(ref / "hf_old")
    return {
        "dir": d, "big": big, "hf": hf, "small": small, "tok": tok, "ref": ref,
        "big_sha": sha256(big), "small_sha": sha256(small), "hf_snap": snapshot(hf),
        "pth": {name: load_pth(ref / f"{name}.pth") for name in ("new", "old")},
        "hf_view": {name: folder_view(ref / f"hf_{name}") for name in ("new", "old")},
        "pth_size": os.path.getsize(ref / "new.pth"),
        "hf_bytes": sum(os.path.getsize(ref / "hf_new" / f) for f in ckio.folder_files(str(ref / "hf_new"))),
    }


# ------------------------------------------------------------------------- running and killing the CLI

def cli(*args) -> list[str]:
    return [sys.executable, "-m", "ckptfix.cli", "repair", *map(str, args)]


# The same CLI, with one system call made to SIGKILL the process right before or after it (a test-side
# hook: the points between two system calls that no outside observer can stop at).
WRAPPER = r"""
import os, signal, sys
point, target = sys.argv[1], os.path.abspath(sys.argv[2])
import ckptfix.io as io

def die():
    os.kill(os.getpid(), signal.SIGKILL)

def hook(obj, name, when, match=lambda *a: True):
    real = getattr(obj, name)
    def hooked(*args, **kw):
        hit = match(*args)
        if hit and when == "before":
            die()
        out = real(*args, **kw)
        if hit and when == "after":
            die()
        return out
    setattr(obj, name, hooked)

to_target = lambda src, dst, *a: os.path.abspath(dst) == target
if point == "before-replace":
    hook(os, "replace", "before", to_target)
elif point == "after-replace":
    hook(os, "replace", "after", to_target)
elif point == "after-fsync":   # the temp file's fsync done, chmod/link/replace not yet
    hook(os, "fsync", "after", lambda fd: os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith("."))
elif point == "after-backup-link":
    hook(os, "link", "after")
elif point == "after-swap":
    hook(io, "_exchange", "after")
elif point == "no-exchange-between-renames":  # a file system without RENAME_EXCHANGE
    io._exchange = lambda a, b: False
    hook(os, "rename", "after", lambda src, dst: os.path.abspath(src) == target)
else:
    raise SystemExit(f"unknown point {point}")
from ckptfix.cli import main
main(sys.argv[3:])
"""


def wrapped(point: str, target, *args) -> list[str]:
    return [sys.executable, "-c", WRAPPER, point, str(target), "repair", *map(str, args)]


@dataclass
class Seen:
    t: float = 0.0
    tmp_names: tuple = ()
    tmp_bytes: int = 0
    out_ino: int | None = None


def _tree_bytes(path: str) -> int:
    try:
        if not os.path.isdir(path):
            return os.lstat(path).st_size
        total = 0
        for root, _, names in os.walk(path):
            for n in names:
                total += os.lstat(os.path.join(root, n)).st_size
        return total
    except FileNotFoundError:
        return 0


def observe(out: Path, t0: float) -> Seen:
    prefix = f".{out.name}{TMP}"
    try:
        names = tuple(sorted(n for n in os.listdir(out.parent) if n.startswith(prefix)))
    except FileNotFoundError:
        names = ()
    try:
        ino = os.lstat(out).st_ino
    except FileNotFoundError:
        ino = None
    return Seen(time.monotonic() - t0, names, sum(_tree_bytes(str(out.parent / n)) for n in names), ino)


def _wait_stopped(pid: int, limit: float = 5.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return
        if state in ("T", "t", "Z", "X"):
            return
        time.sleep(0.0001)


def kill_when(argv: list[str], out: Path, trigger, *, step: float = 0.001, timeout: float = 60.0,
              sig: int = signal.SIGKILL) -> tuple[bool, Seen, subprocess.CompletedProcess]:
    """Run `argv`; once its temp output appears, let it run in `step`-second slices (SIGCONT .. SIGSTOP)
    and send `sig` the first time `trigger(Seen)` holds while it is stopped (before that, while it runs).
    Returns (signalled, what was seen then, the finished process)."""
    err = tempfile.TemporaryFile()
    p = subprocess.Popen(argv, cwd=out.parent, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
    t0, stepping, fired, seen = time.monotonic(), False, False, Seen()
    try:
        while time.monotonic() - t0 < timeout:
            if p.poll() is not None:
                break
            seen = observe(out, t0)
            if trigger(seen):
                p.send_signal(sig)
                if stepping:
                    os.kill(p.pid, signal.SIGCONT)  # SIGKILL needs none; SIGINT is handled only when running
                fired = True
                break
            stepping = stepping or bool(seen.tmp_names)
            if stepping:
                os.kill(p.pid, signal.SIGCONT)
                time.sleep(step)
                os.kill(p.pid, signal.SIGSTOP)
                _wait_stopped(p.pid)
            else:
                time.sleep(0.0005)
        else:
            pytest.fail(f"{argv}: no result within {timeout} s")
    finally:
        if not fired and p.poll() is None:  # only on a failure above
            p.kill()
        p.wait(timeout=60)
        err.seek(0)
        stderr = err.read().decode(errors="replace")
        err.close()
    return fired, seen, subprocess.CompletedProcess(argv, p.returncode, "", stderr)


def leftovers(folder: Path, keep: set[str]) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n not in keep)


def settle_kill(label: str, fired: bool, proc, seen: Seen, out: Path, *, matches, input_ok, keep: set[str],
                expect_final: int | None = None) -> str:
    """The checks after one kill. Returns which complete output OUT is ('absent', 'new', 'old', ...)."""
    TALLY["runs"] += 1
    if fired:
        assert proc.returncode == -signal.SIGKILL, f"{label}: {proc.returncode} {proc.stderr}"
        TALLY["kills"] += 1
    else:
        assert proc.returncode == 0, f"{label}: the run failed: {proc.stderr}"
        TALLY["missed"] += 1  # the run finished before the point: counted, not a kill
        TALLY["missed_points"].append(label)
    if not input_ok():
        TALLY["inputs_modified"] += 1
        pytest.fail(f"{label}: the input changed")
    state = "absent" if not os.path.lexists(out) else matches(out)
    if state is None:
        TALLY["partial_outputs"] += 1
        pytest.fail(f"{label}: {out} is neither absent nor a complete checkpoint")
    extra = leftovers(out.parent, keep | {out.name})
    pattern = re.compile(rf"^\.{re.escape(out.name)}{re.escape(TMP)}[A-Za-z0-9_]+(-old)?$")
    assert all(pattern.match(n) for n in extra), f"{label}: unexpected files left {extra}"
    if fired:
        TALLY["temp_left"] += len(extra)
        if expect_final and 0 < seen.tmp_bytes < expect_final:
            TALLY["kills_with_partial_temp"] += 1
        if state == "new":
            TALLY["kills_leaving_the_new_output"] += 1
    if not fired:
        assert not extra, f"{label}: a finished run left {extra}"
    for n in extra:  # what a SIGKILL leaves; the next run in this folder starts clean
        ckio._discard(str(out.parent / n))
    return state


def pth_matcher(inputs, *names):
    def matches(path):
        try:
            sd = load_pth(path)
        except Exception as exc:  # not loadable: a partial file
            print(f"{path}: {type(exc).__name__}: {exc}")
            return None
        return next((n for n in names if same_tree(sd, inputs["pth"][n])), None)
    return matches


def hf_matcher(inputs, *names):
    def matches(path):
        view = folder_view(path)
        return next((n for n in names if view == inputs["hf_view"][n]), None)
    return matches


def size_at_least(fraction: float, total: int):
    return lambda s: bool(s.tmp_names) and s.tmp_bytes >= fraction * total


# ------------------------------------------------------------------------------ 1. interrupted writes

@pytest.mark.slow
def test_sigkill_during_pth_write(inputs, tmp_path):
    """A fresh `.pth` output: OUT never exists partially; the input never changes."""
    final, work = inputs["pth_size"], tmp_path
    out = work / "out.pth"
    big_ok = lambda: sha256(inputs["big"]) == inputs["big_sha"]  # noqa: E731
    points = [
        ("startup, nothing written", lambda s: s.t >= 0.12),
        ("temp file just created", lambda s: bool(s.tmp_names)),
        ("first records written", lambda s: s.tmp_bytes > 0),
        ("a third written", size_at_least(1 / 3, final)),
        ("two thirds written", size_at_least(2 / 3, final)),
        ("temp file complete", size_at_least(1.0, final)),
        ("output renamed into place", lambda s: s.out_ino is not None),
    ]
    states = {}
    TALLY["inputs"].add("pth")
    for label, trigger in points:
        fired, seen, proc = kill_when(cli(inputs["big"], "-t", inputs["tok"], "-o", out, "--init", "zeros"),
                                      out, trigger)
        states[label] = (fired, seen.tmp_bytes, settle_kill(label, fired, proc, seen, out,
                                                            matches=pth_matcher(inputs, "new"), input_ok=big_ok,
                                                            keep=set(), expect_final=final))
        if os.path.lexists(out):
            os.unlink(out)
    for point in ("after-fsync", "before-replace", "after-replace"):
        fired, seen, proc = kill_when(wrapped(point, out, inputs["big"], "-t", inputs["tok"], "-o", out,
                                              "--init", "zeros"), out, lambda s: False)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        state = settle_kill(point, True, proc, seen, out, matches=pth_matcher(inputs, "new"),
                            input_ok=big_ok, keep=set())
        states[point] = (True, None, state)
        assert state == ("new" if point == "after-replace" else "absent"), point
        if os.path.lexists(out):
            os.unlink(out)
    print("\n.pth kill points:", json.dumps(states, indent=1))
    assert states["first records written"][0] and states["output renamed into place"][2] == "new"


@pytest.mark.slow
def test_sigkill_during_pth_replace_with_force(inputs, tmp_path):
    """An existing OUT replaced with --force: after any kill OUT is the complete old file or the new one."""
    final, out = inputs["pth_size"], tmp_path / "out.pth"
    big_ok = lambda: sha256(inputs["big"]) == inputs["big_sha"]  # noqa: E731
    old_ino = None

    def reset():
        nonlocal old_ino
        if os.path.lexists(out):
            os.unlink(out)
        shutil.copyfile(inputs["ref"] / "old.pth", out)
        old_ino = os.stat(out).st_ino

    seen_states = []
    TALLY["inputs"].add("pth --force over an existing output")
    points = [("temp file just created", lambda s: bool(s.tmp_names)),
              ("half written", size_at_least(0.5, final)),
              ("temp file complete", size_at_least(1.0, final)),
              ("new output renamed into place", lambda s: s.out_ino not in (None, old_ino))]
    args = (inputs["big"], "-t", inputs["tok"], "-o", out, "--init", "zeros", "--force")
    for label, trigger in points:
        reset()
        fired, seen, proc = kill_when(cli(*args), out, trigger)
        seen_states.append(settle_kill(label, fired, proc, seen, out, matches=pth_matcher(inputs, "new", "old"),
                                       input_ok=big_ok, keep=set(), expect_final=final))
    for point in ("before-replace", "after-replace"):
        reset()
        fired, seen, proc = kill_when(wrapped(point, out, *args), out, lambda s: False)
        state = settle_kill(point, True, proc, seen, out, matches=pth_matcher(inputs, "new", "old"),
                            input_ok=big_ok, keep=set())
        assert state == ("new" if point == "after-replace" else "old"), point
        seen_states.append(state)
    assert "absent" not in seen_states  # OUT existed before: it never disappears
    print("\n--force kill states:", seen_states)


@pytest.mark.slow
def test_sigkill_during_in_place_repair(inputs, tmp_path):
    """`repair SRC -o SRC --force` killed: SRC is the intact original or the complete new file, and a
    SRC.bak that exists is the original itself (same inode, same bytes)."""
    src = tmp_path / "ckpt.pth"
    orig = {}

    def reset():
        for n in os.listdir(tmp_path):
            os.unlink(tmp_path / n)
        shutil.copyfile(inputs["big"], src)
        orig.update(ino=os.stat(src).st_ino)

    def matches(path):
        if os.stat(path).st_ino == orig["ino"]:
            return "old" if sha256(path) == inputs["big_sha"] else None
        return pth_matcher(inputs, "new")(path)

    def backup_ok():
        bak = tmp_path / "ckpt.pth.bak"
        return not bak.exists() or (os.stat(bak).st_ino == orig["ino"] and sha256(bak) == inputs["big_sha"])

    TALLY["inputs"].add("pth in place")
    args = (src, "-t", inputs["tok"], "-o", src, "--init", "zeros", "--force")
    states = []
    for label, trigger in (("half written", size_at_least(0.5, inputs["pth_size"])),
                           ("renamed into place", lambda s: s.out_ino not in (None, orig["ino"]))):
        reset()
        fired, seen, proc = kill_when(cli(*args), src, trigger)
        states.append(settle_kill(label, fired, proc, seen, src, matches=matches, input_ok=backup_ok,
                                  keep={"ckpt.pth.bak"}, expect_final=inputs["pth_size"]))
    for point in ("after-backup-link", "after-replace"):
        reset()
        fired, seen, proc = kill_when(wrapped(point, src, *args), src, lambda s: False)
        state = settle_kill(point, True, proc, seen, src, matches=matches, input_ok=backup_ok,
                            keep={"ckpt.pth.bak"})
        assert state == ("new" if point == "after-replace" else "old")
        assert (tmp_path / "ckpt.pth.bak").exists()  # the link is made before the replace
        states.append(state)
    print("\nin-place kill states:", states)


@pytest.mark.slow
def test_sigkill_during_folder_write(inputs, tmp_path):
    """An HF folder output (atomic_folder): OUT is absent or complete, never a folder being filled."""
    total, out = inputs["hf_bytes"], tmp_path / "fixed"
    hf_ok = lambda: snapshot(inputs["hf"]) == inputs["hf_snap"]  # noqa: E731
    TALLY["inputs"].add("HF folder")
    states = {}
    for label, trigger in (("temp folder just created", lambda s: bool(s.tmp_names)),
                           ("first files written", lambda s: s.out_ino is None and s.tmp_bytes > 0),
                           ("half written", size_at_least(0.5, total)),
                           ("all files written", size_at_least(1.0, total)),
                           ("folder renamed into place", lambda s: s.out_ino is not None)):
        fired, seen, proc = kill_when(cli(inputs["hf"], "-t", inputs["tok"], "-o", out, "--init", "zeros"),
                                      out, trigger, step=0.002)
        states[label] = (fired, seen.tmp_bytes, settle_kill(label, fired, proc, seen, out,
                                                            matches=hf_matcher(inputs, "new"), input_ok=hf_ok,
                                                            keep=set(), expect_final=total))
        if os.path.lexists(out):
            shutil.rmtree(out)
    print("\nfolder kill points:", json.dumps(states, indent=1))
    assert states["half written"][0]


@pytest.mark.slow
def test_sigkill_during_folder_replace_with_force(inputs, tmp_path):
    """An existing OUT folder replaced with --force: the old and new folders are swapped in one step
    (renameat2 RENAME_EXCHANGE), so a kill leaves OUT the complete old or the complete new folder; the
    old one may be left under the temp name. Without RENAME_EXCHANGE (other systems) the swap is two
    renames, and a kill between them leaves OUT absent with the old folder at `.OUT.ckptfix-tmp-*-old`."""
    out = tmp_path / "fixed"
    hf_ok = lambda: snapshot(inputs["hf"]) == inputs["hf_snap"]  # noqa: E731
    TALLY["inputs"].add("HF folder --force over an existing output")
    args = (inputs["hf"], "-t", inputs["tok"], "-o", out, "--init", "zeros", "--force")

    def reset():
        for n in os.listdir(tmp_path):
            ckio._discard(str(tmp_path / n))
        shutil.copytree(inputs["ref"] / "hf_old", out)

    reset()
    fired, seen, proc = kill_when(cli(*args), out, size_at_least(0.5, inputs["hf_bytes"]), step=0.002)
    assert settle_kill("half written", fired, proc, seen, out, matches=hf_matcher(inputs, "new", "old"),
                       input_ok=hf_ok, keep=set(), expect_final=inputs["hf_bytes"]) in ("old", "new")
    reset()
    fired, seen, proc = kill_when(wrapped("after-swap", out, *args), out, lambda s: False)
    left = [n for n in os.listdir(tmp_path) if n != "fixed"]
    assert len(left) == 1 and folder_view(tmp_path / left[0]) == inputs["hf_view"]["old"]  # the old one, whole
    assert settle_kill("after-swap", True, proc, seen, out, matches=hf_matcher(inputs, "new", "old"),
                       input_ok=hf_ok, keep=set()) == "new"
    reset()
    fired, seen, proc = kill_when(wrapped("no-exchange-between-renames", out, *args), out, lambda s: False)
    aside = [n for n in os.listdir(tmp_path) if n.endswith("-old")]
    assert len(aside) == 1 and folder_view(tmp_path / aside[0]) == inputs["hf_view"]["old"]
    assert settle_kill("between renames", True, proc, seen, out, matches=hf_matcher(inputs, "new", "old"),
                       input_ok=hf_ok, keep=set()) == "absent"


@pytest.mark.slow
def test_sigkill_during_in_place_folder_repair(inputs, tmp_path):
    """`repair DIR -o DIR --force` killed: DIR is the original or the complete new folder, and the
    original is whole somewhere (DIR, DIR.bak, or, right after the swap, the temp name)."""
    src = tmp_path / "hf"
    TALLY["inputs"].add("HF folder in place")
    args = (src, "-t", inputs["tok"], "-o", src, "--init", "zeros", "--force")

    def reset():
        for n in os.listdir(tmp_path):
            ckio._discard(str(tmp_path / n))
        shutil.copytree(inputs["hf"], src)

    def matches(path):
        if snapshot(path) == inputs["hf_snap"]:
            return "old"
        return "new" if folder_view(path) == inputs["hf_view"]["new"] else None

    def original_whole():
        return any(snapshot(tmp_path / n) == inputs["hf_snap"] for n in os.listdir(tmp_path))

    for label, trigger, argv, expect in (
            ("half written", size_at_least(0.5, inputs["hf_bytes"]), cli(*args), "old"),
            ("after-swap", lambda s: False, wrapped("after-swap", src, *args), "new")):
        reset()
        fired, seen, proc = kill_when(argv, src, trigger, step=0.002)
        assert settle_kill(label, fired or label == "after-swap", proc, seen, src, matches=matches,
                           input_ok=original_whole, keep={"hf.bak"}, expect_final=inputs["hf_bytes"]) == expect


# ------------------------------------------------------------------------------------- 2. full disk

@pytest.fixture
def tiny_fs(tmp_path):
    """A 2 MB tmpfs, or a skip where mounting is not allowed (RLIMIT_FSIZE below covers that case)."""
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0755", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def one_error_line(proc) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("ckptfix: error: "), proc.stderr
    assert "Traceback" not in proc.stderr
    return lines[0]


def test_full_disk_tmpfs(inputs, tiny_fs):
    """ENOSPC on a real file system: one line naming the problem, nothing left on the disk."""
    tok = inputs["tok"]
    for src, name in ((inputs["big"], "out.pth"), (inputs["hf"], "fixed")):
        proc = subprocess.run(cli(src, "-t", tok, "-o", tiny_fs / name, "--init", "zeros"), env=ENV,
                              capture_output=True, text=True, timeout=120)
        line = one_error_line(proc)
        assert "no space left on device" in line and name in line, line
        assert os.listdir(tiny_fs) == [], os.listdir(tiny_fs)  # no partial OUT, no temp file
    # An existing output stays whole when its replacement does not fit.
    shutil.copyfile(inputs["small"], tiny_fs / "out.pth")
    before = sha256(tiny_fs / "out.pth")
    proc = subprocess.run(cli(inputs["big"], "-t", tok, "-o", tiny_fs / "out.pth", "--force", "--init", "zeros"),
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert "no space left on device" in one_error_line(proc)
    assert os.listdir(tiny_fs) == ["out.pth"] and sha256(tiny_fs / "out.pth") == before
    # In place on a full disk: the source is intact and no .bak or temp file is left.
    proc = subprocess.run(cli(tiny_fs / "out.pth", "-t", tok, "-o", tiny_fs / "out.pth", "--force", "--init", "zeros"),
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert "no space left on device" in one_error_line(proc)
    assert os.listdir(tiny_fs) == ["out.pth"] and sha256(tiny_fs / "out.pth") == before
    assert sha256(inputs["big"]) == inputs["big_sha"] and snapshot(inputs["hf"]) == inputs["hf_snap"]


def test_file_size_limit(inputs, tmp_path):
    """RLIMIT_FSIZE (SIGXFSZ ignored: writes fail with EFBIG), the same path as a full disk, no root needed."""
    def limit():
        resource.setrlimit(resource.RLIMIT_FSIZE, (2 << 20, 2 << 20))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    for src, name in ((inputs["big"], "out.pth"), (inputs["hf"], "fixed")):
        proc = subprocess.run(cli(src, "-t", inputs["tok"], "-o", tmp_path / name, "--init", "zeros"), env=ENV,
                              capture_output=True, text=True, timeout=120, preexec_fn=limit)
        line = one_error_line(proc)
        assert "File too large" in line and "nothing was written" in line, line
        assert os.listdir(tmp_path) == []
    assert sha256(inputs["big"]) == inputs["big_sha"] and snapshot(inputs["hf"]) == inputs["hf_snap"]


def test_no_space_message():
    assert "no space left on device" in ckio._describe(OSError(errno.ENOSPC, "No space left on device"), "x")
    assert "quota" in ckio._describe(OSError(errno.EDQUOT, "Disk quota exceeded"), "x")


# ------------------------------------------------------------------------------------------- 3. modes

class umask:
    def __init__(self, mask: int):
        self.mask = mask

    def __enter__(self):
        self.before = os.umask(self.mask)

    def __exit__(self, *exc):
        os.umask(self.before)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_output_file_takes_the_source_mode(inputs, tmp_path):
    src = tmp_path / "ckpt.pth"
    shutil.copyfile(inputs["small"], src)
    for src_mode, mask in ((0o644, 0o022), (0o640, 0o022), (0o600, 0o022), (0o644, 0o077)):
        os.chmod(src, src_mode)
        out = tmp_path / f"out-{src_mode:o}-{mask:o}.pth"
        with umask(mask):
            ckptfix.repair(src, inputs["tok"], out, init="zeros")
        assert mode(out) == src_mode, (oct(mode(out)), oct(src_mode))  # not mkstemp's 0600
    # A .safetensors file likewise; its record goes to a sidecar, a new file: 0666 & ~umask.
    st = tmp_path / "model.safetensors"
    shutil.copyfile(inputs["hf"] / "model.safetensors", st)
    os.chmod(st, 0o600)
    with umask(0o027):
        ckptfix.repair(st, inputs["tok"], tmp_path / "fixed.safetensors", init="zeros")
    assert mode(tmp_path / "fixed.safetensors") == 0o600 and mode(tmp_path / "fixed.safetensors.ckptfix.json") == 0o640
    # The CLI too: the 0640 source gives a 0640 output.
    assert mode(inputs["big"]) == 0o640
    out = tmp_path / "cli.pth"
    subprocess.run(cli(inputs["big"], "-t", inputs["tok"], "-o", out, "--init", "zeros"), env=ENV, check=True,
                   capture_output=True)
    assert mode(out) == 0o640


def test_output_folder_modes_follow_the_umask(inputs, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(inputs["hf"], src)
    os.chmod(src / "config.json", 0o644)
    for file_mode in (0o600, 0o644):
        os.chmod(src / "model.safetensors", file_mode)
        for mask in (0o022, 0o027, 0o077):
            out = tmp_path / f"fixed-{file_mode:o}-{mask:o}"
            with umask(mask):
                ckptfix.repair(src, inputs["tok"], out, init="zeros")
            assert mode(out) == 0o777 & ~mask, (oct(mode(out)), oct(mask))  # what mkdir gives, not mkdtemp's 0700
            assert mode(out / "logs") == mode(src / "logs")  # copied sub-folder
            assert mode(out / "model.safetensors") == file_mode  # rewritten: keeps the source file's mode
            assert mode(out / "config.json") == 0o644  # rewritten
            assert mode(out / "extra.bin") == mode(src / "extra.bin")  # copied
            assert mode(out / "ckptfix.json") == 0o666 & ~mask  # new: like any new file


# ------------------------------------------------------------------------------------------- 4. in place

def test_in_place_keeps_a_backup_and_live_maps(inputs, tmp_path):
    src = tmp_path / "ckpt.pth"
    shutil.copyfile(inputs["big"], src)
    ino, digest = os.stat(src).st_ino, sha256(src)
    live = torch.load(src, weights_only=True, mmap=True)  # a training process holding the old file mapped
    expected = {k: v.clone() for k, v in live["model"].items()}
    with open(src, "rb") as f:
        raw = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    proc = subprocess.run(cli(src, "-t", inputs["tok"], "-o", src, "--init", "zeros"), env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert "--force" in one_error_line(proc) and os.listdir(tmp_path) == ["ckpt.pth"]  # without --force: nothing
    assert sha256(src) == digest

    proc = subprocess.run(cli(src, "-t", inputs["tok"], "-o", src, "--init", "zeros", "--force", "--json"),
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    bak = tmp_path / "ckpt.pth.bak"
    assert json.loads(proc.stdout)["backup"] == str(bak)
    assert sorted(os.listdir(tmp_path)) == ["ckpt.pth", "ckpt.pth.bak"]  # no temp file
    assert os.stat(bak).st_ino == ino and sha256(bak) == digest  # the original itself, a hard link
    new = load_pth(src)
    assert os.stat(src).st_ino != ino and same_tree(new, inputs["pth"]["new"])
    assert new["ckptfix"]["source_sha256"] == digest  # hashed from the original while it was replaced
    # The old inode was never written: the live maps still read the original bytes (no SIGBUS).
    assert hashlib.sha256(raw).hexdigest() == digest
    assert all(torch.equal(live["model"][k], v) for k, v in expected.items())
    raw.close()

    # Again (1020 rows padded to 1024): the first backup is kept, the next one is .bak1.
    subprocess.run(cli(src, "-t", inputs["tok"], "-o", src, "--init", "zeros", "--force", "--pad-to-multiple-of",
                       "64"), env=ENV, check=True, capture_output=True, timeout=120)
    assert sha256(bak) == digest and (tmp_path / "ckpt.pth.bak1").exists()


def test_in_place_folder_keeps_a_backup(inputs, tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(inputs["hf"], src)
    with pytest.raises(RepairError, match="force=True"):  # a Python caller is told the keyword argument
        ckptfix.repair(src, inputs["tok"], src, init="zeros")
    assert snapshot(src) == inputs["hf_snap"]
    result = ckptfix.repair(src, inputs["tok"], src, init="zeros", force=True)
    assert result.backup == str(src) + ".bak"
    assert sorted(os.listdir(tmp_path)) == ["hf", "hf.bak"]
    assert snapshot(tmp_path / "hf.bak") == inputs["hf_snap"]
    assert folder_view(src) == inputs["hf_view"]["new"]


# ------------------------------------------------------------------------------- 5. cleanup on errors

class UserConfig:
    """A training script's own class: read as an inert record under --trust-pickle, which repair cannot write."""

    def __init__(self) -> None:
        self.lr = 3e-3


@pytest.fixture
def spy_temp(monkeypatch):
    """Record the temp files/folders ckptfix.io creates, to prove an error came after they existed."""
    made = []
    real_file, real_dir = tempfile.mkstemp, tempfile.mkdtemp

    def mkstemp(*a, **kw):
        fd, path = real_file(*a, **kw)
        made.append(path)
        return fd, path

    def mkdtemp(*a, **kw):
        made.append(real_dir(*a, **kw))
        return made[-1]

    monkeypatch.setattr(ckio.tempfile, "mkstemp", mkstemp)
    monkeypatch.setattr(ckio.tempfile, "mkdtemp", mkdtemp)
    return made


def test_writer_error_leaves_nothing(inputs, tmp_path, spy_temp):
    """A RepairError raised inside the writer: an object read as an inert record (--trust-pickle) cannot
    be written back; it is found while the temp file is open."""
    sd = torch.load(inputs["small"], weights_only=True)
    sd["args"] = UserConfig()  # a training script's own config object (an argparse.Namespace is written back)
    src = tmp_path / "src" / "ckpt.pth"
    src.parent.mkdir()
    torch.save(sd, src)
    digest = sha256(src)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(RepairError, match="cannot be written back"):
        ckptfix.repair(src, inputs["tok"], out_dir / "fixed.pth", trust_pickle=True)
    assert spy_temp and os.listdir(out_dir) == [] and sha256(src) == digest


def test_late_replace_error_leaves_nothing(inputs, tmp_path, spy_temp):
    """The whole file is written, then `os.replace` fails (OUT is a folder): no temp file, the folder intact."""
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(RepairError, match="Is a directory"):
        ckptfix.repair(inputs["small"], inputs["tok"], out, force=True, init="zeros")
    assert any(TMP in p for p in spy_temp) and not any(os.path.exists(p) for p in spy_temp)
    assert sorted(os.listdir(tmp_path)) == ["taken"] and os.listdir(out) == ["keep.txt"]
    proc = subprocess.run(cli(inputs["small"], "-t", inputs["tok"], "-o", out, "--force", "--init", "zeros"), env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert "Is a directory" in one_error_line(proc)
    assert sorted(os.listdir(tmp_path)) == ["taken"] and os.listdir(out) == ["keep.txt"]


def test_folder_error_midway_leaves_nothing(inputs, tmp_path, spy_temp):
    """A file that cannot be copied (a FIFO) half-way through filling the output folder."""
    src = tmp_path / "hf"
    shutil.copytree(inputs["hf"], src)
    os.mkfifo(src / "zz.fifo")  # sorted last: the other files are already copied
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    with pytest.raises(RepairError, match="named pipe"):
        ckptfix.repair(src, inputs["tok"], out_dir / "fixed", init="zeros")
    assert any(TMP in p for p in spy_temp) and not any(os.path.exists(p) for p in spy_temp)
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("sig, code, message", [(signal.SIGINT, 130, "ckptfix: interrupted"),
                                                  (signal.SIGTERM, 143, "ckptfix: terminated")])
def test_sigint_or_sigterm_during_write_cleans_up(inputs, tmp_path, sig, code, message):
    """Ctrl-C (exit 130, the shell's convention) or SIGTERM (a scheduler's kill, `timeout`: exit 143)
    while the records are written: the temp file is removed on the way out."""
    out = tmp_path / "out.pth"
    fired, seen, proc = kill_when(cli(inputs["big"], "-t", inputs["tok"], "-o", out, "--init", "zeros"), out,
                                  lambda s: s.tmp_bytes > 0, sig=sig)
    assert fired and seen.tmp_bytes > 0
    if proc.returncode == 0 and not proc.stderr:
        # The signal was taken after the last record was written and the temp file renamed (seen once on a
        # quiet CI machine: the writer finished within the slice it was let run): the output is whole.
        assert os.listdir(tmp_path) == ["out.pth"] and sha256(inputs["big"]) == inputs["big_sha"]
        assert torch.load(out, weights_only=True, mmap=True) is not None
        return
    assert proc.returncode == code and proc.stderr.strip() == message, (proc.returncode, proc.stderr)
    assert os.listdir(tmp_path) == [] and sha256(inputs["big"]) == inputs["big_sha"]


# ------------------------------------------------------------------------------------------- 6. fsync

@pytest.fixture
def fsyncs(monkeypatch):
    """Every os.fsync: (inode, is a folder), in order, with the renames interleaved."""
    events = []
    real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

    def fsync(fd):
        st = os.fstat(fd)
        events.append(("fsync", st.st_ino, stat.S_ISDIR(st.st_mode)))
        return real_fsync(fd)

    def replace(a, b):
        events.append(("rename", os.path.abspath(b)))
        return real_replace(a, b)

    def rename(a, b):
        events.append(("rename", os.path.abspath(b)))
        return real_rename(a, b)

    real_exchange = ckio._exchange

    def exchange(a, b):
        events.append(("rename", os.path.abspath(b)))
        return real_exchange(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(ckio, "_exchange", exchange)
    return events


def test_file_and_folder_are_fsynced(inputs, tmp_path, fsyncs):
    out = tmp_path / "out.pth"
    ckptfix.repair(inputs["small"], inputs["tok"], out, init="zeros")
    renames = [i for i, e in enumerate(fsyncs) if e == ("rename", str(out))]
    assert len(renames) == 1
    file_syncs = [i for i, e in enumerate(fsyncs) if e == ("fsync", os.stat(out).st_ino, False)]
    dir_syncs = [i for i, e in enumerate(fsyncs) if e == ("fsync", os.stat(tmp_path).st_ino, True)]
    assert file_syncs and file_syncs[-1] < renames[0]  # the data is on disk before the name points at it
    assert dir_syncs and dir_syncs[-1] > renames[0]  # and the new name is on disk before repair returns


def test_folder_output_is_fsynced(inputs, tmp_path, fsyncs):
    out = tmp_path / "fixed"
    for force in (False, True):  # a new folder, then one swapped with the existing folder
        fsyncs.clear()
        ckptfix.repair(inputs["hf"], inputs["tok"], out, init="zeros", force=force)
        synced = {e[1] for e in fsyncs if e[0] == "fsync"}
        inodes = {os.stat(os.path.join(out, f)).st_ino for f in ckio.folder_files(str(out))}
        folders = {os.stat(out).st_ino, os.stat(out / "logs").st_ino}
        assert inodes | folders <= synced, "a file or folder of the output was not fsynced"
        rename = max(i for i, e in enumerate(fsyncs) if e[0] == "rename")
        parent = [i for i, e in enumerate(fsyncs) if e == ("fsync", os.stat(tmp_path).st_ino, True)]
        assert parent and parent[-1] > rename


# ------------------------------------------------------------------------------------------- totals

def test_zz_kill_totals():
    """Printed for SECURITY.md; runs last in this module (alphabetical within the file is not
    guaranteed, so the totals only hold when the kill tests ran before it)."""
    if not TALLY["runs"]:
        pytest.skip("no kill test ran")
    totals = {k: (sorted(v) if isinstance(v, set) else v) for k, v in TALLY.items()}
    print("\nkill totals:", json.dumps(totals))
    assert TALLY["partial_outputs"] == 0 and TALLY["inputs_modified"] == 0
