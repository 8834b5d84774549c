"""Kill a ckptfix command at every mutating system call it makes in a folder, and check what is left.

`strace -f -e inject=CALL:signal=KILL:when=N` kills the process at the N-th CALL it makes (counted per
traced thread: ckptfix makes its structural calls in its main thread). The points are found by a clean run
traced with the same calls: each call whose path lies in the folder is one kill point. After each kill the
caller checks the folder (restorable to bit-identical, a rerun equal to the clean run).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# The calls that change a folder: names, links, creation, data, durability. `openat` creates files too, but
# every created file is then written or renamed: its writes are points.
MUTATING = ("rename", "renameat", "renameat2", "link", "linkat", "unlink", "unlinkat", "mkdir", "mkdirat",
            "write", "pwrite64", "fsync", "fdatasync", "ftruncate")
TIMEOUT = 120


def strace() -> str | None:
    return shutil.which("strace")


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "SOURCE_DATE_EPOCH": "1700000000",
            "CKPTFIX_NO_PROGRESS": "1", "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}


def ckptfix(*args: str, check: bool = False) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "ckptfix", *args], env=env(), capture_output=True, text=True,
                          timeout=TIMEOUT, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise AssertionError(f"ckptfix {' '.join(args)}: exit {proc.returncode}: {proc.stderr[-2000:]}")
    return proc


@dataclass(frozen=True)
class KillPoint:
    call: str
    when: int  # the N-th `call` of the main thread
    path: str  # what the clean run's call touched (for the report)


def kill_points(args: list[str], folder: Path, log: Path) -> list[KillPoint]:
    """Every mutating call of a clean traced run whose arguments name a path inside `folder`, or whose file
    descriptor was opened there (writes, fsyncs), numbered per call as strace's `when` counts them."""
    subprocess.run(["strace", "-f", "-y", "-qq", "-o", str(log), "-e", f"trace={','.join(MUTATING)}",
                    sys.executable, "-m", "ckptfix", *args], env=env(), capture_output=True, timeout=TIMEOUT,
                   stdin=subprocess.DEVNULL, check=True)
    lines = log.read_text(errors="replace").splitlines()
    main = lines[0].split()[0] if lines else ""
    where = str(folder.resolve())
    counts: dict[str, int] = {}
    points = []
    for line in lines:
        m = re.match(r"(\d+)\s+(\w+)\((.*)", line)
        if not m or m.group(1) != main or m.group(2) not in MUTATING:
            continue
        call = m.group(2)
        counts[call] = counts.get(call, 0) + 1
        if where in m.group(3):
            points.append(KillPoint(call, counts[call], m.group(3)[:160]))
    return points


def run_killed(args: list[str], point: KillPoint, fault: str = "signal=KILL") -> subprocess.CompletedProcess:
    """The run killed at `point` (or given `fault` there instead: `error=EIO`, `error=ENOSPC`)."""
    return subprocess.run(["strace", "-f", "-qq", "-o", "/dev/null", "-e", f"trace={point.call}", "-e",
                           f"inject={point.call}:{fault}:when={point.when}", sys.executable, "-m", "ckptfix",
                           *args], env=env(), capture_output=True, text=True, timeout=TIMEOUT,
                          stdin=subprocess.DEVNULL)


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every entry under `folder` by relative path: a file's bytes, a folder as b'<dir>'."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        out[rel] = b"<dir>" if path.is_dir() and not path.is_symlink() else path.read_bytes()
    return out


def spread(points: list[KillPoint], most: int) -> list[KillPoint]:
    """At most `most` points evenly spread over the run, its first and last included (all of them when there
    are fewer); every call that is not a data write is kept first: names and links are where protocols break."""
    structural = [p for p in points if p.call not in ("write", "pwrite64")]
    writes = [p for p in points if p.call in ("write", "pwrite64")]
    if len(structural) >= most:  # the first and the last always: the undo record's first write, the cleanup
        last = len(structural) - 1
        return [structural[round(i * last / (most - 1))] for i in range(most)] if most > 1 else structural[:1]
    room = most - len(structural)
    step = max(1, len(writes) / room) if room else 1
    return structural + [writes[int(i * step)] for i in range(min(room, len(writes)))]
