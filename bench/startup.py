"""Start-up cost of the command line: `ckptfix --version` and `ckptfix inspect` of the seed fixture.

    python -m bench.startup [--repeats 21]

Each command is a fresh interpreter (`python -m ckptfix ...`, what the installed `ckptfix` script runs,
without a version manager's shim in front), timed from outside, round-robin with a bare `python -c pass`
so that a busy machine shifts all three alike. Prints the median and the 10th-90th percentiles of each,
and the medians net of the bare interpreter (site-packages `.pth` files and the machine's load are the
interpreter's cost, not ckptfix's). Also lists the modules each command imported (numpy and torch must not
be among them for these two commands).

Targets (issue 33): `--version` under 0.1 s, `inspect` of the seed fixture under 0.3 s, whole process.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SEED = ROOT / "fixtures" / "seed001"
COMMANDS = {
    "python -c pass": [sys.executable, "-c", "pass"],
    "ckptfix --version": [sys.executable, "-m", "ckptfix", "--version"],
    "ckptfix inspect seed001": [sys.executable, "-m", "ckptfix", "inspect", str(SEED / "ckpt.pth"),
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
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.repeats):
        for name, argv in COMMANDS.items():
            start = time.perf_counter()
            subprocess.run(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            times[name].append(time.perf_counter() - start)
    base = statistics.median(times["python -c pass"])
    print(f"{'command':<26} {'median':>8} {'p10-p90':>15} {'net of python':>14}  imports")
    for name, values in times.items():
        q = statistics.quantiles(values, n=10)
        heavy = "" if name.startswith("python") else ", ".join(heavy_imports(COMMANDS[name])) or "no numpy/torch"
        net = "" if name.startswith("python") else f"{statistics.median(values) - base:+.3f} s"
        print(f"{name:<26} {statistics.median(values):7.3f}s {q[0]:6.3f}-{q[-1]:.3f} s {net:>14}  {heavy}")


if __name__ == "__main__":
    main()
