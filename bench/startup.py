"""Start-up cost of the command line: `ckptfix --version` and `ckptfix inspect` of the seed fixture.

    python -m bench.startup [--repeats 21]

Each command is a fresh interpreter (`python -m ckptfix ...`, what the installed `ckptfix` script runs,
without a version manager's shim in front), timed from outside, round-robin with a bare `python -c pass`
so that a busy machine shifts all three alike. Prints the median wall time and the 10th-90th percentiles
of each, the median CPU time (user + sys of the child: less sensitive than wall time to other processes
on a shared machine), and the medians net of the bare interpreter (site-packages `.pth` files and the machine's load are the
interpreter's cost, not ckptfix's). Also lists which of numpy and torch each command imported: neither for
`--version` and inspect without a tokenizer; with one, inspect's plan audit (the surgery modules) loads numpy.

Bytecode: the commands run as an installed ckptfix does, from compiled `.pyc` files. A development shell
with PYTHONDONTWRITEBYTECODE=1 recompiles every module in every process (~0.1 s of CPU for inspect's
modules, more under load), which is not what a user's `pip install` pays; the children get
PYTHONDONTWRITEBYTECODE unset and PYTHONPYCACHEPREFIX pointing at a temporary folder (nothing is written
into the checkout), and one untimed run of each command fills it.

Targets (issue 33): `--version` under 0.1 s, `inspect` of the seed fixture under 0.3 s, whole process.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "fixtures" / "seed001"
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "ckptfix --version": [sys.executable, "-m", "ckptfix", "--version"],
    "ckptfix inspect seed001": [sys.executable, "-m", "ckptfix", "inspect", str(SEED / "ckpt.pth")],
    "ckptfix inspect seed001 --tokenizer": [sys.executable, "-m", "ckptfix", "inspect", str(SEED / "ckpt.pth"),
                                            "--tokenizer", str(SEED / "tokenizer.model")],
}
HEAVY = ("numpy", "torch")


def heavy_imports(argv: list[str]) -> list[str]:
    """Which of numpy/torch the command imports (run in-process under the same arguments)."""
    code = ("import sys; from ckptfix.cli import main\n"
            f"try: main({argv[3:]!r})\nexcept SystemExit: pass\n"
            f"print([m for m in {HEAVY!r} if m in sys.modules], file=sys.stderr)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    return eval(res.stderr.strip().splitlines()[-1])  # noqa: S307 - our own print of a list of names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=21)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as pycache:
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        env["PYTHONPYCACHEPREFIX"] = pycache
        measure(args.repeats, env)


def measure(repeats: int, env: dict[str, str]) -> None:
    for argv in COMMANDS.values():  # untimed: compiles the bytecode
        subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    cpu: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(repeats):
        for name, argv in COMMANDS.items():
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            start = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
            after = resource.getrusage(resource.RUSAGE_CHILDREN)
            cpu[name].append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    base, base_cpu = statistics.median(times["python -c pass"]), statistics.median(cpu["python -c pass"])
    print(f"{'command':<26} {'wall':>7} {'p10-p90':>13} {'cpu':>7} {'net of python (wall/cpu)':>25}  imports")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        heavy = "" if name.startswith("python") else ", ".join(heavy_imports(COMMANDS[name])) or "no numpy/torch"
        c = statistics.median(cpu[name])
        net = "" if name.startswith("python") else f"{statistics.median(values) - base:+.3f} / {c - base_cpu:+.3f} s"
        print(f"{name:<26} {statistics.median(values):6.3f}s {q[0]:5.3f}-{q[-1]:.3f}s {c:6.3f}s {net:>25}  {heavy}")


if __name__ == "__main__":
    main()
