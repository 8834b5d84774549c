"""Inspect of an optimizer state with many entries, each with its own `step`: is it linear?

    python -m bench.many_steps [--sizes 37500 75000 150000] [--repeats 3]

Writes one torch.save file per size (a tiny model's weights and an optimizer state dict of N parameters, entry i
with step float(i)), times `python -m ckptfix inspect FILE` (a fresh interpreter, whole process, median of
`--repeats`) and prints seconds per size and the ratio of successive sizes' net times (about 2 for a linear
inspect when the sizes double; the bare interpreter's start-up, `python -m ckptfix --version`, is subtracted).
This is the timing `tests/test_hostile_inputs.py::test_many_distinct_steps` once asserted; the tests keep
correctness only (timings on a shared 2-core CI machine are noise).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _write(path: Path, n: int) -> None:
    import torch

    model = {"embed.weight": torch.zeros(16, 8), "head.weight": torch.zeros(8, 16)}
    optimizer = {"state": {i: {"step": float(i)} for i in range(n)},
                 "param_groups": [{"lr": 1e-3, "params": list(range(n))}]}
    torch.save({"model": model, "optimizer": optimizer}, path)


def _time(argv: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        subprocess.run(argv, capture_output=True, check=False)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[37_500, 75_000, 150_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    base = _time([sys.executable, "-m", "ckptfix", "--version"], args.repeats)
    print(f"interpreter + ckptfix start-up: {base:.2f} s")
    previous = None
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.sizes:
            path = Path(tmp) / f"steps{n}.pth"
            _write(path, n)
            s = _time([sys.executable, "-m", "ckptfix", "inspect", str(path)], args.repeats)
            net = max(s - base, 1e-9)
            ratio = f"  x{net / previous:.2f} of the previous size" if previous else ""
            print(f"{n:>8} entries: {s:6.2f} s ({net:6.2f} s net){ratio}")
            previous = net


if __name__ == "__main__":
    main()
